"""Promoted (split) against fast accumulation for a float8 op's dgrad, on one GPU: the GEMM of
dX (e5m2 dY [M, n] times e4m3 W [K, n], K-major) of each preset's AG and RS op at P = 2, by
XLA's FP8 GEMM (promoted, fast) and by the fused kernels' GEMM core (`direct_ag` with no
peers): fast, the split form as the library runs it (each K-step's product awaited, then added
into a float32 total, 64 x 128 warpgroup tiles), and three benchmark-side variants of the split
form: 256-element K-steps (a promotion every 256 products instead of 128), and each K-step's
add issued under the next wgmma ("overlap": the previous step's product added while this one's
wgmma runs; the library's `tiles.accumulate` patched here, not a product option).

Errors: max |out - ref| / max |ref| against the float32 (HIGHEST) product of the same quantized
operands ("accumulation"), and against the product of the bf16 operands before quantizing
("total"). Times: device periods, interleaved, medians of 6 rounds. Writes OUT/fp8_split.json.

    PYTHONPATH=. python benchmarks/fp8_split.py --out DIR
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import pathlib
import unittest.mock

import jax
import jax.numpy as jnp

import commgemm as cg
from commgemm import quantized_gemm
from commgemm.bench.problems import PRESETS
from commgemm.bench.record import record
from commgemm.bench.spans import device_periods_interleaved
from commgemm.mosaic_gpu import direct_ag, fused, gemm_core
from commgemm.mosaic_gpu import tiles as mt


def dx_shapes(size: int = 2):
    """(preset, op, (M, n, K)) of each preset's dX GEMM at P = size: dY [M, n] @ W^T -> [M, K]
    (AG op: dY [M, N/P], K out; RS op: the gathered dY [M, N], K/P out)."""
    for preset, (m, k, n) in PRESETS.items():
        if preset != "notebook":
            yield preset, "ag", (m, n // size, k)
            yield preset, "rs", (m, n, k // size)


def accumulated_overlap(tiles, eval_pipeline, finish, *, split):
    """`tiles.accumulated` whose split form carries (total, the last K-step's product)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if not split:
        return ORIGINAL[0](tiles, eval_pipeline, finish, split=split)
    zeros = plgpu.layout_cast(jnp.zeros((tiles.tile_m, tiles.tile_n), jnp.float32),
                              plgpu.Layout.WGMMA)  # fmt: skip
    total, last = eval_pipeline((zeros, zeros))
    finish(lambda: total + last)


def accumulate_overlap(tiles, acc, lhs, rhs, *, split, in_flight=1, last=None):
    """`tiles.accumulate` whose split form issues this K-step's wgmma, adds the previous step's
    product into the total while it runs, then reads this step's."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if not split:
        return ORIGINAL[1](tiles, acc, lhs, rhs, split=split, in_flight=in_flight, last=last)
    total, previous = acc

    def step(part_ref):
        plgpu.wgmma(part_ref, lhs, rhs)
        return total + previous, part_ref[...]

    return pl.run_scoped(step, plgpu.ACC((tiles.tile_m, tiles.tile_n), jnp.float32))


ORIGINAL = (mt.accumulated, mt.accumulate)


def overlap_patch():
    stack = contextlib.ExitStack()
    stack.enter_context(unittest.mock.patch.object(mt, "accumulated", accumulated_overlap))
    stack.enter_context(unittest.mock.patch.object(mt, "accumulate", accumulate_overlap))
    return stack


def kernel_variant(columns: int, contract: int, split: bool, tile_k: int | None, overlap: bool,
                   args, lower=None):  # fmt: skip
    """The GEMM core on (dy8, w8, scale) compiled (`lower`: a function of the jitted function
    and the arguments that lowers it instead), `columns` out and `contract` the K of the
    product."""
    tiles = fused.float8_tiling(gemm_core.tiling(columns, float8=True), contract, split=split)
    if tile_k is not None:
        tiles = dataclasses.replace(tiles, tile_k=tile_k, stages=3)

    def run(dy8, w8, scale):
        return direct_ag.all_gather_matmul(dy8, w8, None, tiles, w_nk=True,
                                                  out_dtype=jnp.bfloat16, scale=scale,
                                                  split_accumulator=split)  # fmt: skip

    with overlap_patch() if overlap else contextlib.nullcontext():
        if lower is not None:
            return lower(jax.jit(run), args)
        return jax.jit(run).lower(*args).compile()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--presets", help="comma-separated presets (default: all)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    wanted = args.presets.split(",") if args.presets else None
    rows = []
    for preset, op, (m, n, k) in dx_shapes():
        if wanted and preset not in wanted:
            continue
        kd, kw = jax.random.split(jax.random.key(m + n + k))
        dy = jax.random.normal(kd, (m, n), jnp.bfloat16)
        w = (jax.random.normal(kw, (k, n), jnp.float32) / n**0.5).astype(jnp.bfloat16)
        qdy = cg.quantize(dy, "current_tensor_scaling", dtype="float8_e5m2")
        qw = cg.quantize(w, "current_tensor_scaling")
        scale = (qdy.scale_inv * qw.scale_inv).astype(jnp.float32).reshape(1)
        operands = (qdy.data, qw.data, scale)
        ref = jnp.dot(cg.dequantize(qdy, jnp.float32), cg.dequantize(qw, jnp.float32).T,
                      precision="highest")  # fmt: skip
        exact = jnp.dot(dy.astype(jnp.float32), w.astype(jnp.float32).T, precision="highest")
        variants = {}
        for split in (True, False):
            name = f"xla {'promoted' if split else 'fast'}"
            fn = jax.jit(lambda a, b, s, split=split: quantized_gemm.scaled_dot(
                a, b, ((1,), (1,)), s[0], "float32", jnp.bfloat16, split))  # fmt: skip
            variants[name] = (fn, operands)
        kernels = {"kernel fast": (False, None, False), "kernel split": (True, None, False),
                   "kernel split k256": (True, 256, False),
                   "kernel split overlap": (True, None, True),
                   "kernel split overlap k256": (True, 256, True)}  # fmt: skip
        failures = {}
        for name, (split, tile_k, overlap) in kernels.items():
            try:
                variants[name] = (kernel_variant(k, n, split, tile_k, overlap, operands), operands)
            except Exception as err:  # noqa: BLE001 - a row says what did not build
                failures[name] = f"{type(err).__name__}: {err}"[:300]
        errors = {}
        for name, (fn, ops) in variants.items():
            out = fn(*ops).astype(jnp.float32)
            errors[name] = {
                "accumulation": float(jnp.abs(out - ref).max() / jnp.abs(ref).max()),
                "total": float(jnp.abs(out - exact).max() / jnp.abs(exact).max()),
            }
        found = device_periods_interleaved(variants, rounds=6)
        ms = {name: f.get("median") for name, f in found.items()}
        tflops = {nm: 2.0 * m * n * k / (t * 1e-3) / 1e12 for nm, t in ms.items() if t}
        row = {"preset": preset, "op": op, "shape": [m, n, k], "ms": ms, "errors": errors,
               "failures": failures, "tflops": tflops}  # fmt: skip
        record(args.out / "fp8_split.json", rows, row)


if __name__ == "__main__":
    main()
