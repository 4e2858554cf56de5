"""Probe (one GPU): dX of the float8 grouped GEMM on the float8 tensor cores.

1. dX alone (M tokens, K, N per expert, uneven groups): commgemm's grouped kernel on bf16
   dY [M, N] x w [G, K, N] (what the float8 op's backward ran before), on e5m2 dY x e4m3 w
   with fast and with split accumulation; errors against the float32 ragged dot of the same
   quantized values.
2. The training step of benchmarks/grouped_step.py (4 microbatches sharing w, unrolled):
   bf16; float8 with the default recipe (dX float8, split); float8 with a fast dX; float8 with
   dX in 16 bits as before (the kernel refused e5m2 for this variant only: a benchmark-side
   patch); float8 with w quantized once.
3. torch._grouped_mm (CUTLASS, bf16) on the forward's shape, CUDA events, beside the forward
   on commgemm's kernel and XLA's dense GEMM of the same FLOPs (device periods).

    PYTHONPATH=. python benchmarks/grouped_fp8_dx.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
from unittest import mock

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")  # room for torch beside jax

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from gemm_table import events_ms  # noqa: E402
from grouped_gemm import timed, uneven_sizes  # noqa: E402
from grouped_step import _loss  # noqa: E402

import commgemm as cg  # noqa: E402
from commgemm.mosaic_gpu import grouped_kernel  # noqa: E402

MODE = "current_tensor_scaling"
RECIPES = {
    "fp8 default (dX float8 split)": cg.ScalingRecipe(MODE),
    "fp8 fast dX": cg.ScalingRecipe(MODE, split_accumulator=(False, False, True)),
    "fp8 dX 16-bit (before)": cg.ScalingRecipe(MODE),
}


def dx_16bit(fn):
    """fn run with the grouped kernel refusing e5m2 operands: the float8 op's dX then takes the
    16-bit path on the dequantized operands (as before this change)."""
    shape_reason = grouped_kernel.shape_reason

    def refusing(tiles, m, k, n, dtype, **kw):
        if jnp.dtype(dtype) == jnp.float8_e5m2:
            return "benchmark: dX in 16 bits"
        return shape_reason(tiles, m, k, n, dtype, **kw)

    def run(*args):
        with mock.patch.object(grouped_kernel, "shape_reason", refusing):
            return fn(*args)

    return run


def step(recipe, sizes, once: bool = False):
    def loss(w, xs, gs):
        qw = cg.quantize_weight(w, recipe, axis=1) if once else w
        return sum(
            _loss(cg.grouped_matmul(xs[i], qw, sizes, scaling=recipe), gs[i])
            for i in range(xs.shape[0])
        )

    return jax.jit(jax.grad(loss, argnums=(0, 1)))


def dx_alone(groups, m, k, n):
    keys = jax.random.split(jax.random.key(groups + 7), 2)
    dy = jax.random.normal(keys[0], (m, n), jnp.bfloat16)
    w = (jax.random.normal(keys[1], (groups, k, n), jnp.float32) / n**0.5).astype(jnp.bfloat16)
    sizes = jnp.asarray(uneven_sizes(groups, m, groups))
    qdy = cg.quantize(dy, MODE, dtype="float8_e5m2")
    qw = cg.quantize(w, MODE, axis=1)
    scale = (qdy.scale_inv * qw.scale_inv).astype(jnp.float32).reshape(1)
    dy16, w16 = cg.dequantize(qdy, jnp.bfloat16), cg.dequantize(qw, jnp.bfloat16)

    def f8(split):
        return jax.jit(
            lambda a, b, c: grouped_kernel.grouped_matmul(
                a, b, sizes, w_nk=True, scale=c, out_dtype=jnp.bfloat16, split_accumulator=split
            )
        )

    variants = {
        "dX bf16 kernel (dequantized)": (
            jax.jit(lambda a, b: grouped_kernel.grouped_matmul(a, b, sizes, w_nk=True)),
            (dy16, w16),
        ),
        "dX float8 fast": (f8(False), (qdy.data, qw.data, scale)),
        "dX float8 split": (f8(True), (qdy.data, qw.data, scale)),
    }
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    want = jax.lax.ragged_dot(f32(dy16), jnp.swapaxes(f32(w16), 1, 2), sizes,
                              precision="highest")  # fmt: skip
    errors = {
        name: float(jnp.abs(f32(fn(*a)) - want).max() / jnp.abs(want).max())
        for name, (fn, a) in variants.items()
    }
    return variants, errors


def torch_grouped_ms(sizes, m, k, n, groups):
    try:
        import torch
    except ImportError:
        return None
    if not hasattr(torch, "_grouped_mm"):
        return None
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(groups, n, k, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    offs = torch.tensor(sizes.tolist(), device="cuda", dtype=torch.int32).cumsum(0).to(torch.int32)
    return events_ms(lambda: torch._grouped_mm(a, b, offs=offs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--m", type=int, default=8192)
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--n", type=int, default=14336 // 8)
    parser.add_argument("--microbatches", type=int, default=4)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    m, k, n = args.m, args.k, args.n
    rows = []
    for groups in (8, 64):
        row = {"groups": groups}
        variants, row["dx_errors"] = dx_alone(groups, m, k, n)
        row["dx_ms"], row["dx_timing"] = timed(variants)
        print(json.dumps(row), flush=True)

        keys = jax.random.split(jax.random.key(groups), 3)
        xs = jax.random.normal(keys[0], (args.microbatches, m, k), jnp.bfloat16)
        gs = jax.random.normal(keys[1], (args.microbatches, m, n), jnp.bfloat16)
        w = (jax.random.normal(keys[2], (groups, k, n), jnp.float32) / k**0.5).astype(jnp.bfloat16)
        sizes = jnp.asarray(uneven_sizes(groups, m, groups))
        steps = {"bf16": (step(None, sizes), (w, xs, gs))}
        for name, recipe in RECIPES.items():
            fn = step(recipe, sizes)
            steps[name] = (dx_16bit(fn) if "before" in name else fn, (w, xs, gs))
        steps["fp8 w quantized once (default)"] = (step(RECIPES[next(iter(RECIPES))], sizes, True),
                                                   (w, xs, gs))  # fmt: skip
        row["step_ms"], row["step_timing"] = timed(steps)
        row["step_vs_bf16"] = {s: t / row["step_ms"]["bf16"] for s, t in row["step_ms"].items()}
        grads = {s: fn(*a) for s, (fn, a) in steps.items()}
        ref = grads["fp8 dX 16-bit (before)"]
        rel = lambda a, b: float(  # noqa: E731
            jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)).max()
            / jnp.abs(b.astype(jnp.float32)).max()
        )
        row["step_grad_rel_diff_vs_before"] = {
            s: [rel(a, b) for a, b in zip(g, ref, strict=True)] for s, g in grads.items()
        }
        print(json.dumps(row), flush=True)

        fwd = {
            "forward commgemm.grouped_matmul (bf16)": (
                jax.jit(cg.grouped_matmul), (xs[0], w, sizes)),
            "dense GEMM, same FLOPs": (jax.jit(lambda a, b: a @ b), (xs[0], w[0])),
        }  # fmt: skip
        row["forward_ms"], row["forward_timing"] = timed(fwd)
        row["torch _grouped_mm bf16 (events)"] = torch_grouped_ms(sizes, m, k, n, groups)
        rows.append(row)
        print(json.dumps(row), flush=True)
        (args.out / "grouped_fp8_dx.json").write_text(json.dumps(
            {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "m": m, "k": k,
             "n": n, "microbatches": args.microbatches, "rows": rows}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
