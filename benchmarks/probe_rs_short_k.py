"""Probe (one H200): RS core tilings for short K per device (the P = 4, 8 RS shapes), bf16:
the plan, 2 stages chained, 32-wide K-steps in 4 to 8 stages (chained where whole rounds), 3
stages. Device periods, medians of 6 interleaved rounds; XLA's dot and jax's Mosaic matmul.
    PYTHONPATH=. python3 benchmarks/probe_rs_short_k.py --out DIR"""

import argparse
import dataclasses
import json
import pathlib
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from fused_core import core, core_tilings, local_shapes  # noqa: E402
from gemm_table import mosaic  # noqa: E402

from commgemm.bench.spans import device_periods_interleaved  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--out", type=pathlib.Path, required=True)
parser.add_argument("--sizes", default="4,8")
args = parser.parse_args()
args.out.mkdir(parents=True, exist_ok=True)
rows = []
for preset, op, size, (m, k, n) in local_shapes([int(s) for s in args.sizes.split(",")]):
    if op != "rs":
        continue
    plan = core_tilings(op, size, (m, k, n))["plan"]
    tilings = {"plan": plan}
    for tile_k, stages in ((64, 2), (64, 3), (32, 4), (32, 5), (32, 6), (32, 8)):
        steps = k // tile_k
        chain = steps % stages == 0 and steps >= stages
        tilings[f"k{tile_k}-s{stages}{'-ct' if chain else ''}"] = dataclasses.replace(
            plan, tile_k=tile_k, stages=stages, chain_tiles=chain
        )
    ka, kb = jax.random.split(jax.random.key(m + k + n))
    a = jax.random.normal(ka, (m, k), jnp.bfloat16)
    b = (jax.random.normal(kb, (k, n), jnp.float32) / k**0.5).astype(jnp.bfloat16)
    ref = jnp.dot(a, b, preferred_element_type=jnp.float32)
    variants = {"xla": (jax.jit(jnp.dot), (a, b)), "mosaic": (mosaic((128, 128, 64, 4)), (a, b))}
    for kk, t in tilings.items():
        variants[f"core {kk}"] = (core(op, t, float8=False), (a, b))
    errors, failed = {}, {}
    for name in list(variants):
        fn, ops = variants[name]
        try:
            out = fn(*ops).astype(jnp.float32)
        except Exception as e:  # noqa: BLE001 - recorded
            failed[name] = str(e)[:200]
            del variants[name]
            continue
        errors[name] = float(jnp.abs(out - ref).max() / jnp.abs(ref).max())
    found = device_periods_interleaved(variants, rounds=6)
    ms = {name: f["median"] for name, f in found.items() if "median" in f}
    best = min(ms["xla"], ms.get("mosaic", 1e9))
    row = dict(preset=preset, P=size, shape=[m, k, n], ms=ms, errors=errors, failed=failed,
               vs_best={kk: v / best for kk, v in ms.items()})  # fmt: skip
    rows.append(row)
    print(json.dumps(row), flush=True)
(args.out / "probe_rs_short_k.json").write_text(json.dumps(rows, indent=1))
