"""GPU probe, one process: the fused kernels (ATOMIC_GEMM_*_P2P) in a few tilings, and finer rings
with more collectives in flight, beside the GEMM alone, the collective alone, serial and the
2-step ring, for every preset, AG+GEMM and GEMM+RS, all timed in one run (medians of grouped
samples). Each variant's max |error| is against the serial result (bf16).

    PYTHONPATH=. python benchmarks/fused_probe.py --out DIR
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import time
import traceback

import jax

import commgemm as cg
from commgemm.algorithms import fused
from commgemm.bench.problems import PRESETS, make_problem, parse_method
from commgemm.bench.timing import benchmark

TILINGS = ["fused", "fused-w8", "fused-wgm", "fused-s3"]
#: XLA's limit on collectives in flight (default 1), per jit.
OVERLAP_LIMIT = "xla_gpu_experimental_parallel_collective_overlap_limit"
FLAG_VARIANTS = {"ring:4 limit4": ("ring:4", 4), "ring:8 limit8": ("ring:8", 8)}


def max_error(a, b) -> float:
    return float(jax.jit(lambda p, q: abs(p.astype("float32") - q.astype("float32")).max())(a, b))


def mosaic_gemm_alone(problem, iters: int) -> float:
    """jax's Hopper matmul kernel (the one the fused kernels build on) on the op's local GEMM,
    on one device: how fast the fused kernels' GEMM is before any communication."""
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm

    m, k, n = problem.shape
    p = problem.size
    lm, lk, ln = {"ag": (m, k, n // p), "rs": (m // p, k // p, n)}[problem.op]
    a = jax.random.normal(jax.random.key(1), (lm, lk), "bfloat16")
    b = jax.random.normal(jax.random.key(2), (lk, ln), "bfloat16")
    fn = jax.jit(functools.partial(hm.matmul, c=None, config=fused.tuning_config(cg.FusedTiles())))
    t = benchmark(fn, a, b, iters=iters).median
    return t * (p if problem.op == "rs" else 1)  # RS: P row blocks of M/P each


def probe(preset: str, op: str, iters: int, log) -> dict:
    problem = make_problem(op, PRESETS[preset], "bfloat16", None)
    gemm_fn, gemm_args = problem.gemm_alone()
    t_gemm = benchmark(gemm_fn, *gemm_args, iters=iters).median
    del gemm_args
    t_comm = benchmark(problem.comm_alone(), problem.comm_operand(), iters=iters).median
    bound = max(t_gemm, t_comm)
    try:
        t_mosaic = mosaic_gemm_alone(problem, iters)
    except Exception as err:
        t_mosaic = None
        log(f"  mosaic gemm alone FAILED {type(err).__name__}: {str(err)[:800]}")
    log(f"  {preset} {op}: gemm {t_gemm:.3f} comm {t_comm:.3f} mosaic gemm {t_mosaic}")
    x, w = problem.operands()
    reference = problem.overlapped(cg.OverlapConfig())(x, w)
    variants = [("xla", problem.xla())]
    variants += [(m, problem.overlapped(parse_method(m))) for m in ("none", "ring", "ring:2")]
    variants += [
        (name, problem.overlapped(parse_method(m), {OVERLAP_LIMIT: limit}))
        for name, (m, limit) in FLAG_VARIANTS.items()
    ]
    variants += [(name, problem.overlapped(parse_method(name))) for name in TILINGS]
    rows = []
    for name, fn in variants:
        try:
            out = fn(x, w)  # compiles
            error = max_error(out, reference)
            del out
            r = benchmark(fn, x, w, iters=iters)
            rows.append(
                dict(
                    name=name,
                    t_ms=r.median,
                    vs_bound=r.median / bound,
                    max_error=error,
                    stdev=r.stdev,
                    min=r.min,
                )
            )
            log(
                f"  {preset} {op} {name}: {r.median:.3f} ms vs_bound {r.median / bound:.3f} "
                f"err {error:.3g}"
            )
        except Exception as err:  # a probe records what failed and goes on
            rows.append(dict(name=name, error=f"{type(err).__name__}: {err}"[:3000]))
            log(f"  {preset} {op} {name} FAILED {type(err).__name__}: {str(err)[:800]}")
            traceback.print_exc()
    return dict(
        preset=preset,
        op=op,
        shape=PRESETS[preset],
        t_gemm_ms=t_gemm,
        t_comm_ms=t_comm,
        bound_ms=bound,
        t_mosaic_gemm_ms=t_mosaic,
        rows=rows,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--presets", default="comm_heavy,llama8b_mlp,llama70b_mlp")
    parser.add_argument("--ops", default="ag,rs")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    from commgemm.devices import environment

    results = dict(environment=environment(), reports=[])

    def log(msg: str) -> None:
        print(msg, flush=True)

    for op in args.ops.split(","):
        for preset in args.presets.split(","):
            start = time.time()
            results["reports"].append(probe(preset, op, args.iters, log))
            log(f"[{preset} {op}] {time.time() - start:.0f}s")
            (args.out / "fused_probe.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
