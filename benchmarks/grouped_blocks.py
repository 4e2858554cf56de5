"""A probe for the collective grouped ops: is a grouped GEMM over P blocks of rows (the blocks an
all-gather or a dispatch brings, each with its own group sizes) faster in one launch than in
P? On one GPU, bf16, the same rows and experts: P launches of `cg.grouped_matmul` (what the ops
run), one launch over P x G virtual groups (the experts' weights repeated P times, prepared
outside the timed call: the work of a kernel that maps virtual groups to experts), the blocks
regrouped into one GEMM of G groups (`grouped.blocks.merged_matmul`, what the ops' methods
other than the ring run since), one launch of G groups over all rows (that GEMM without the
regrouping's gathers), and XLA's dense GEMM of the same FLOPs. Writes OUT/grouped_blocks.json.

    PYTHONPATH=. python benchmarks/grouped_blocks.py --out DIR [--blocks 2,4] [--n 7168]
"""

from __future__ import annotations

import argparse
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from grouped_gemm import timed, uneven_sizes

import commgemm as cg
from commgemm.grouped.blocks import merged_matmul
from commgemm.mosaic_gpu import grouped as hopper
from commgemm.mosaic_gpu.configs import GroupedConfig


def variants_for(blocks: int, groups: int, m: int, k: int, n: int) -> tuple[dict, dict]:
    """{name: (fn, args)} for `blocks` blocks of m // blocks rows, and the kernels picked."""
    rows = m // blocks
    keys = jax.random.split(jax.random.key(0), 2)
    x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
    w = (jax.random.normal(keys[1], (groups, k, n), jnp.float32) / k**0.5).astype(jnp.bfloat16)
    sizes = np.stack([uneven_sizes(groups, rows, seed) for seed in range(blocks)])
    sizes_d = jnp.asarray(sizes)
    w_virtual = jnp.concatenate([w] * blocks)
    flat = jnp.asarray(sizes.reshape(-1))
    total = jnp.asarray(sizes.sum(0))

    def launches(a, b, s, tiles=None):
        parts = [a[i * rows : (i + 1) * rows] for i in range(blocks)]
        return jnp.concatenate(
            [cg.grouped_matmul(part, b, s[i], hopper_tiles=tiles) for i, part in enumerate(parts)]
        )

    variants = {
        f"{blocks} launches": (jax.jit(launches), (x, w, sizes_d)),
        f"{blocks} launches, commgemm kernel": (
            jax.jit(lambda a, b, s: launches(a, b, s, GroupedConfig())), (x, w, sizes_d)),
        f"{blocks} blocks regrouped (merged_matmul)": (
            jax.jit(lambda a, b, s: merged_matmul(a.reshape(blocks, rows, k), b, s, None, None)),
            (x, w, sizes_d)),
        f"one launch, {blocks * groups} virtual groups": (
            jax.jit(cg.grouped_matmul), (x, w_virtual, flat)),
        f"one launch, {groups} groups": (jax.jit(cg.grouped_matmul), (x, w, total)),
        "dense GEMM, same FLOPs": (jax.jit(jnp.dot), (x, w[0])),
    }  # fmt: skip
    picks = {
        "block": repr(hopper.pick_tiles(rows, k, n, groups, jnp.bfloat16)),
        "virtual": repr(hopper.pick_tiles(m, k, n, blocks * groups, jnp.bfloat16)),
        "whole": repr(hopper.pick_tiles(m, k, n, groups, jnp.bfloat16)),
    }
    ref = variants[f"{blocks} launches"][0](x, w, sizes_d).astype(jnp.float32)
    one = variants[f"one launch, {blocks * groups} virtual groups"][0](x, w_virtual, flat)
    picks["virtual vs launches, max abs diff"] = float(jnp.abs(one.astype(jnp.float32) - ref).max())
    return variants, picks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--m", type=int, default=8192)
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--n", type=int, default=14336 // 2)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--blocks", default="2,4")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for blocks in (int(b) for b in args.blocks.split(",")):
        variants, picks = variants_for(blocks, args.groups, args.m, args.k, args.n)
        times, timing = timed(variants)
        flops = 2.0 * args.m * args.k * args.n
        tflops = {name: flops / (t * 1e-3) / 1e12 for name, t in times.items()}
        rows.append({"blocks": blocks, "timing": timing, "ms": times, "picks": picks,
                     "tflops": tflops})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    (args.out / "grouped_blocks.json").write_text(json.dumps(
        {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "m": args.m,
         "k": args.k, "n": args.n, "groups": args.groups, "rows": rows}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
