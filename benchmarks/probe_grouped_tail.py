"""Probe (leaves with its answer): which tiles of commgemm's grouped kernel should run in the
narrowed last wave. Variants of the forward (M 8192, K 4096, N 1792), bf16, device periods:
the last wave whole; narrowed with the cheapest tiles in it (the kernel's order); narrowed with
the cheapest in it and the costliest main tiles dealt first to the CTAs that run no half;
narrowed with the costliest tiles in it. Zipf-like and multinomial (even) group sizes. Also a
model's makespan for each (a tile's time: its warpgroups' K loops / 2 tile-times; a half: a
quarter of them). Writes OUT/probe_grouped_tail.json.

    PYTHONPATH=. python benchmarks/probe_grouped_tail.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from grouped_gemm import timed, uneven_sizes  # noqa: E402

from commgemm.mosaic_gpu import grouped_kernel as gk  # noqa: E402
from commgemm.mosaic_gpu import tiles as mt  # noqa: E402
from commgemm.mosaic_gpu.configs import GroupedConfig  # noqa: E402

ORIGINAL = gk.balanced_slots


def rotated(units, ctas, tail=0):
    """Main tiles dealt from CTA 2 * tail on (the CTAs that run no half first)."""
    if not tail:
        return ORIGINAL(units, ctas)
    main = ORIGINAL(units - tail, ctas)
    main = (main // ctas) * ctas + (main % ctas + 2 * tail) % ctas
    return np.concatenate([main, np.arange(units - tail, units)])


def costly_tail(units, ctas, tail=0):
    """The `tail` costliest tiles in the narrowed wave, the rest dealt as before."""
    if not tail:
        return ORIGINAL(units, ctas)
    return np.concatenate([np.arange(units - tail, units), ORIGINAL(units - tail, ctas)])


POLICIES = {"whole": None, "narrow-cheap": ORIGINAL, "narrow-cheap-rotated": rotated,
            "narrow-costly": costly_tail}  # fmt: skip


def model(sizes, m, n, policy, ctas=132):
    """Makespan in tile-times of `policy`'s order."""
    tiles = GroupedConfig(narrow_tail=policy != "whole")
    tm, tn = m // tiles.cta_m, n // tiles.cta_n
    ends = np.minimum(np.cumsum(sizes), m)
    starts = ends - sizes
    blocks = np.array([sum(int(np.sum((starts < b + 64) & (ends > b) & (ends > starts)))
                           for b in (r * 128, r * 128 + 64)) for r in range(tm)])  # fmt: skip
    walk = jnp.arange(tm * tn, dtype=jnp.int32)
    m_idx = np.asarray(jax.vmap(lambda t: mt.cluster_tile(tiles, t, tm, tn))(walk)[0])
    cost = blocks[m_idx] / 2.0
    rank = np.argsort(-cost, kind="stable")
    units = tm * tn
    tail = mt.narrow_tail_units(tiles, units, ctas)
    slots = (POLICIES[policy] or ORIGINAL)(units, ctas, tail) if tail else ORIGINAL(units, ctas)
    load = np.zeros(ctas)
    for r, s in enumerate(slots):
        if s < units - tail:
            load[s % ctas] += cost[rank[r]]
        else:
            for half in range(2):
                load[(2 * (s - units + tail) + half) % ctas] += cost[rank[r]] / 2
    return float(load.max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    m, k, n = 8192, 4096, 1792
    rows = []
    for dist in ("zipf", "even"):
        for groups in (8, 16, 32, 64):
            if dist == "zipf":
                sizes = uneven_sizes(groups, m, groups)
            else:
                sizes = np.random.default_rng(groups).multinomial(m, np.ones(groups) / groups)
            sizes = jnp.asarray(sizes, jnp.int32)
            keys = jax.random.split(jax.random.key(groups), 2)
            x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
            w = (jax.random.normal(keys[1], (groups, k, n), jnp.float32) / k**0.5).astype(
                jnp.bfloat16
            )
            ref = jax.lax.ragged_dot(x.astype(jnp.float32), w.astype(jnp.float32), sizes)
            variants, errors = {}, {}
            for name, slots in POLICIES.items():
                gk.balanced_slots = slots or ORIGINAL
                tiles = GroupedConfig(narrow_tail=slots is not None)
                fn = jax.jit(lambda a, b, s, t=tiles: gk.grouped_matmul(a, b, s, t))
                got = fn(x, w, sizes).astype(jnp.float32)  # traced under the policy
                errors[name] = float(jnp.abs(got - ref).max() / jnp.abs(ref).max())
                variants[name] = (fn, (x, w, sizes))
            gk.balanced_slots = ORIGINAL
            variants["dense XLA"] = (jax.jit(lambda a, b: a @ b), (x, w[0]))
            times, timing = timed(variants)
            row = {"dist": dist, "groups": groups, "sizes": np.asarray(sizes).tolist(),
                   "timing": timing, "ms": times, "errors": errors,
                   "model": {p: model(np.asarray(sizes), m, n, p) for p in POLICIES}}  # fmt: skip
            rows.append(row)
            print(json.dumps({key: row[key] for key in ("dist", "groups", "ms", "model")}),
                  flush=True)  # fmt: skip
    (args.out / "probe_grouped_tail.json").write_text(
        json.dumps({"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                    "rows": rows}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
