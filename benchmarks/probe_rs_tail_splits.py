"""Probe (one H200): the RS core's tail split into s K-ranges (split_tail s; 0: the plan's
model, `scatter_add_gemm.tail_plan`), in the plan's tiling, on the RS shapes at P = 2 and
llama70b at P = 4. Device periods, medians of 6 interleaved rounds, against XLA's dot.
    PYTHONPATH=. python3 benchmarks/probe_rs_tail_splits.py --out DIR"""

import argparse
import dataclasses
import json
import pathlib
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from fused_core import core, core_tilings, local_shapes  # noqa: E402

from commgemm.bench.spans import device_periods_interleaved  # noqa: E402
from commgemm.mosaic_gpu import scatter_add_gemm  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--out", type=pathlib.Path, required=True)
args = parser.parse_args()
args.out.mkdir(parents=True, exist_ok=True)
rows = []
for preset, op, size, (m, k, n) in local_shapes([2, 4]):
    if op != "rs" or (size == 4 and preset != "llama70b_mlp"):
        continue
    plan = core_tilings(op, size, (m, k, n))["plan"]
    k_iters = k // plan.tile_k
    ctas = 132 // plan.cluster_size
    tiles = (m // plan.cluster_m) * (n // plan.cluster_n)
    auto = scatter_add_gemm.tail_plan(tiles, tiles, ctas, k_iters, plan)
    ka, kb = jax.random.split(jax.random.key(m + k + n))
    a = jax.random.normal(ka, (m, k), jnp.bfloat16)
    b = (jax.random.normal(kb, (k, n), jnp.float32) / k**0.5).astype(jnp.bfloat16)
    variants = {"xla": (jax.jit(jnp.dot), (a, b))}
    for s in (1, 2, 4, 5, 8):
        if s == 1 or (k_iters % s == 0 and k_iters // s >= plan.stages):
            t = dataclasses.replace(plan, split_tail=s)
            variants[f"split {s}"] = (core(op, t, float8=False), (a, b))
    found = device_periods_interleaved(variants, rounds=6)
    ms = {name: f["median"] for name, f in found.items() if "median" in f}
    row = dict(preset=preset, P=size, shape=[m, k, n], tail=tiles % ctas, auto=auto, ms=ms,
               vs_xla={kk: v / ms["xla"] for kk, v in ms.items()})  # fmt: skip
    rows.append(row)
    print(json.dumps(row), flush=True)
(args.out / "probe_rs_tail_splits.json").write_text(json.dumps(rows, indent=1))
