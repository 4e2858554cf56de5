"""Probe in one run: the grouped kernel with CTAs alone or in 2-CTA clusters along M (w's
blocks multicast), forward and dX, against jax's kernel, for G in {8, 16, 32, 64, 128} uneven
groups (M 8192, K 4096, N 1792); errors against the float32 ragged dot on -x, then x.
    PYTHONPATH=. python3 benchmarks/ab_grouped_cluster.py --out DIR"""

import argparse
import json
import pathlib
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from grouped_gemm import KERNELS, timed, uneven_sizes  # noqa: E402

from commgemm.mosaic_gpu import grouped as hopper  # noqa: E402
from commgemm.mosaic_gpu import grouped_kernel as gk  # noqa: E402
from commgemm.mosaic_gpu.configs import GroupedConfig  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--out", type=pathlib.Path, required=True)
parser.add_argument("--groups", default="8,16,32,64,128")
parser.add_argument("--seeds", type=int, default=1)
parser.add_argument("--forward-only", action="store_true")
args = parser.parse_args()
args.out.mkdir(parents=True, exist_ok=True)
m, k, n = 8192, 4096, 1792
f32 = lambda t: t.astype(jnp.float32)  # noqa: E731
rows = []
for groups, seed in [(g, s) for g in map(int, args.groups.split(",")) for s in range(args.seeds)]:
    kx, kw = jax.random.split(jax.random.key(groups + 1000 * seed), 2)
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w = (jax.random.normal(kw, (groups, k, n), jnp.float32) / k**0.5).astype(jnp.bfloat16)
    sizes = jnp.asarray(uneven_sizes(groups, m, groups + 1000 * seed))
    dy = x[:, :n]
    variants, errs = {}, {}
    for name, cluster in (("alone", None), ("cluster m", "m")):
        t = GroupedConfig(cluster=cluster)
        fwd = jax.jit(lambda a, b, s, t=t: gk.grouped_matmul(a, b, s, t))
        dx = jax.jit(lambda a, b, s, t=t: gk.grouped_matmul(a, b, s, t, w_nk=True))
        variants[f"fwd {name}"] = (fwd, (x, w, sizes))
        if not args.forward_only:
            variants[f"dX {name}"] = (dx, (dy, w, sizes))
    for name, lhs, t in (("fwd jax", x, False), ("dX jax", dy, True))[
        : 1 + (not args.forward_only)
    ]:
        fn = jax.jit(lambda a, b, s, t=t: hopper.product(a, b, s, KERNELS["jax kernel"], t))
        variants[name] = (fn, (lhs, w, sizes))
    variants["dense XLA"] = (jax.jit(lambda a, b: a @ b), (x, w[0]))
    ref = jax.lax.ragged_dot(f32(x), f32(w), sizes, precision="highest")
    refx = jax.lax.ragged_dot(f32(dy), jnp.swapaxes(f32(w), 1, 2), sizes, precision="highest")
    for name, (fn, fargs) in variants.items():
        if name.startswith(("fwd", "dX")) and "jax" not in name:
            r = ref if name.startswith("fwd") else refx
            for sign in (-1, 1):
                got = f32(fn(sign * fargs[0], *fargs[1:]))
                errs[f"{name} {sign}"] = float(jnp.abs(got - sign * r).max() / jnp.abs(r).max())
    times, timing = timed(variants)
    row = dict(groups=groups, seed=seed, timing=timing, ms=times, errs=errs,
               vs_dense={kk: v / times["dense XLA"] for kk, v in times.items()})  # fmt: skip
    rows.append(row)
    print(json.dumps(row), flush=True)
(args.out / "ab_grouped_cluster.json").write_text(
    json.dumps(dict(device=jax.devices()[0].device_kind, rows=rows), indent=1)
)
