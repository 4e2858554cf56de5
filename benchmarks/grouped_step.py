"""A training step's grouped GEMMs on one GPU with gradient accumulation: the forward and
backward of `cg.grouped_matmul` over several microbatches that share the experts' weights, in
bf16, in float8 with current tensor scaling quantizing w in each call, and in float8 with w
quantized once for the step (`cg.quantize_weight`), the microbatches unrolled in one program
or in a `lax.scan`, timed interleaved in one run (device periods where the GPU's timestamps
can be read, else host medians); and as a host loop of one jitted program per microbatch
(wall time), where a weight quantized once is passed between programs. Also the largest
difference between the two float8 forms' gradients (the same quantization: expected 0), and
with --kernels one microbatch's kernels in order.
Writes OUT/grouped_step.json.

    PYTHONPATH=. python benchmarks/grouped_step.py --out DIR [--microbatches 4] [--kernels]
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp
from grouped_gemm import timed, uneven_sizes

import commgemm as cg
from commgemm.bench.record import record

MODE = "current_tensor_scaling"


def _loss(y: jax.Array, g: jax.Array) -> jax.Array:
    """Half the squared distance of y from a target: its cotangent y - g needs the forward."""
    return 0.5 * jnp.sum(jnp.square(y.astype(jnp.float32) - g))


def step(form: str, sizes: jax.Array, scan: bool):
    """grad of sum_i _loss(grouped_matmul(x_i, w), g_i) over the microbatches, in `form`, the
    microbatches unrolled in the program or in a `lax.scan`."""

    def loss(w, xs, gs):
        qw = cg.quantize_weight(w, MODE, axis=1) if form == "fp8, w quantized once" else w
        scaling = None if form == "bf16" else MODE

        def one(a, g):
            return _loss(cg.grouped_matmul(a, qw, sizes, scaling=scaling), g)

        if scan:
            return jax.lax.scan(lambda c, ag: (c + one(*ag), None), 0.0, (xs, gs))[0]
        return sum(one(xs[i], gs[i]) for i in range(xs.shape[0]))

    return jax.jit(jax.grad(loss, argnums=(0, 1)))


def separate_programs(form: str, sizes: jax.Array):
    """The step as a host loop over the microbatches, each microbatch's gradients one jitted
    program (summed by a device add): w quantized by each program, or once by a program of its
    own and passed in (`QuantizedWeight`), the gradient taken with respect to its value."""
    scaling = None if form == "bf16" else MODE

    def loss(w, q, a, g):
        b = w if q is None else cg.QuantizedWeight(w, q)
        return _loss(cg.grouped_matmul(a, b, sizes, scaling=scaling), g)

    grad = jax.jit(jax.grad(loss, argnums=(0, 2)))
    quantize = jax.jit(lambda w: cg.quantize_weight(w, MODE, axis=1).quantized)

    def run(w, xs, gs):
        q = quantize(w) if form == "fp8, w quantized once" else None
        dw, dxs = None, []
        for i in range(xs.shape[0]):
            d, dx = grad(w, q, xs[i], gs[i])
            dw = d if dw is None else dw + d
            dxs.append(dx)
        return dw, dxs

    return run


def wall_ms(fn, args, steps: int = 5, repeats: int = 5) -> float:
    """The median over `repeats` of the host's wall time per step for `steps` steps run back to
    back (the host enqueues ahead of the GPU; its dispatch is part of a host loop's cost)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) * 1e3 / steps)
    return statistics.median(times)


def kernel_sequence(fn, args, min_us: float = 5.0) -> list[tuple[str, float]]:
    """One call's kernels in order (name, ms), those of at least `min_us`."""
    from commgemm.bench.spans import _gpu_events, _trace

    jax.block_until_ready(fn(*args))
    events = _gpu_events(_trace(lambda: jax.block_until_ready(fn(*args))))[0]
    return [(name[:60], (end - start) / 1e6) for start, end, name in events
            if end - start >= min_us * 1e3]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--m", type=int, default=8192, help="tokens a microbatch")
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--n", type=int, default=14336 // 8)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--kernels", action="store_true", help="the GPU's time by kernel too")
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
        variants = {f"{form} ({loop})": (step(form, sizes, loop == "scan"), (w, xs, gs))
                    for form in forms for loop in ("unrolled", "scan")}  # fmt: skip
        times, timing = timed(variants)
        diffs = {}
        for loop in ("unrolled", "scan"):
            each, once = (variants[f"{f} ({loop})"][0](w, xs, gs) for f in forms[1:])
            diffs[loop] = max(float(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)).max())
                              for a, b in zip(each, once, strict=True))  # fmt: skip
        row = {
            "groups": groups,
            "timing": timing,
            "ms": times,
            "vs_bf16": {
                name: t / times[f"bf16 ({name.rsplit('(', 1)[1]}"] for name, t in times.items()
            },
            "max_grad_difference_once_vs_each_call": diffs,
        }
        separate = {f"{form} (separate programs)": (separate_programs(form, sizes), (w, xs, gs))
                    for form in forms}  # fmt: skip
        row["separate_programs_wall_ms"] = {name: wall_ms(*v) for name, v in separate.items()}
        if args.kernels:
            one = (w, xs[:1], gs[:1])  # one microbatch: each kernel of the step in order
            row["one_microbatch_kernels"] = {
                form: kernel_sequence(step(form, sizes, False), one) for form in forms[:2]
            }
        record(args.out / "grouped_step.json", rows, row, m=args.m, k=args.k, n=args.n,
               microbatches=args.microbatches)  # fmt: skip


if __name__ == "__main__":
    main()
