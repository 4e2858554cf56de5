"""Probe (leaves with its answer): why the bf16 grouped training step is slower in a
`lax.scan` over microbatches than unrolled (BENCHMARKS.md, "The grouped GEMMs of a training
step in float8"): one trace of each, 4 microbatches of M 8192 (K 4096, N 1792), 8 and 64
groups, the GPU's time per kernel name, the HBM traffic that accumulating dW through the
scan's carry predicts. Writes OUT/probe_scan_step.json.

    PYTHONPATH=. python benchmarks/probe_scan_step.py --out DIR
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from grouped_gemm import uneven_sizes  # noqa: E402
from grouped_step import step  # noqa: E402

from commgemm.bench.spans import _gpu_events, _trace  # noqa: E402


def by_name(fn, args, calls: int = 3) -> dict:
    jax.block_until_ready(fn(*args))

    def work():
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)

    totals, counts = collections.Counter(), collections.Counter()
    for start, end, name in _gpu_events(_trace(work))[0]:
        totals[name[:60]] += (end - start) / 1e6 / calls
        counts[name[:60]] += 1
    return {n: [round(t, 4), counts[n] // calls] for n, t in totals.most_common(14)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    m, k, n, mb = 8192, 4096, 1792, 4
    rows = []
    for groups in (8, 64):
        keys = jax.random.split(jax.random.key(groups), 3)
        xs = jax.random.normal(keys[0], (mb, m, k), jnp.bfloat16)
        gs = jax.random.normal(keys[1], (mb, m, n), jnp.bfloat16)
        w = (jax.random.normal(keys[2], (groups, k, n), jnp.float32) / k**0.5).astype(jnp.bfloat16)
        sizes = jnp.asarray(uneven_sizes(groups, m, groups))
        row = {"groups": groups, "w_mb": w.size * 2 / 2**20}
        for loop in ("unrolled", "scan"):
            kernels = by_name(step("bf16", sizes, loop == "scan"), (w, xs, gs))
            row[loop] = {"total_ms": round(sum(t for t, _ in kernels.values()), 4),
                         "kernels": kernels}  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)
    meta = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": rows}
    (args.out / "probe_scan_step.json").write_text(json.dumps(meta, indent=1))


if __name__ == "__main__":
    main()
