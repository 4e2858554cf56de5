"""A training step's grouped GEMMs on one GPU with gradient accumulation: the forward and
backward of `cg.grouped_matmul` over several microbatches that share the experts' weights, in
bf16, in float8 with current tensor scaling quantizing w in each call, and in float8 with w
quantized once for the step (`cg.quantize_weight`), timed interleaved in one run (device
periods where the GPU's timestamps can be read, else host medians). Also the largest
difference between the two float8 forms' gradients (the same quantization: expected 0).
Writes OUT/grouped_step.json.

    PYTHONPATH=. python benchmarks/grouped_step.py --out DIR [--microbatches 4]
"""

from __future__ import annotations

import argparse
import json
import pathlib

import jax
import jax.numpy as jnp
from grouped_gemm import timed, uneven_sizes

import commgemm as cg

MODE = "current_tensor_scaling"


def step(form: str, sizes: jax.Array):
    """grad of sum_i <grouped_matmul(x_i, w), g_i> over the microbatches, in `form`."""

    def loss(w, xs, gs):
        qw = cg.quantize_weight(w, MODE, axis=1) if form == "fp8, w quantized once" else w
        scaling = None if form == "bf16" else MODE
        total = jnp.zeros((), jnp.float32)
        for i in range(xs.shape[0]):
            y = cg.grouped_matmul(xs[i], qw, sizes, scaling=scaling)
            total += jnp.sum(y.astype(jnp.float32) * gs[i])
        return total

    return jax.jit(jax.grad(loss, argnums=(0, 1)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--m", type=int, default=8192, help="tokens a microbatch")
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--n", type=int, default=14336 // 8)
    parser.add_argument("--microbatches", type=int, default=4)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for groups in (8, 64):
        keys = jax.random.split(jax.random.key(groups), 3)
        shape = (args.microbatches, args.m)
        xs = jax.random.normal(keys[0], (*shape, args.k), jnp.bfloat16)
        gs = jax.random.normal(keys[1], (*shape, args.n), jnp.bfloat16)
        w = jax.random.normal(keys[2], (groups, args.k, args.n), jnp.float32) / args.k**0.5
        w = w.astype(jnp.bfloat16)
        sizes = jnp.asarray(uneven_sizes(groups, args.m, groups))
        forms = ("bf16", "fp8, quantizing w each call", "fp8, w quantized once")
        variants = {form: (step(form, sizes), (w, xs, gs)) for form in forms}
        times, timing = timed(variants)
        each, once = (variants[f][0](w, xs, gs) for f in forms[1:])
        diff = max(float(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)).max())
                   for a, b in zip(each, once, strict=True))  # fmt: skip
        row = {
            "groups": groups,
            "timing": timing,
            "ms": times,
            "vs_bf16": {f: t / times["bf16"] for f, t in times.items()},
            "once_vs_each_call": times[forms[2]] / times[forms[1]],
            "max_grad_difference_once_vs_each_call": diff,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    (args.out / "grouped_step.json").write_text(json.dumps(
        {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "m": args.m,
         "k": args.k, "n": args.n, "microbatches": args.microbatches, "rows": rows},
        indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
