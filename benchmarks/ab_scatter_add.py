"""A/B in one run: two versions of the direct reduce-add kernel (fused-direct) on the RS
presets, interleaved, with the strict bound (the faster of XLA's two GEMM forms): v1, the
package's (the output zeroed and awaited before any tile), and v2, kept with the results as
scatter_add_gemm_v2.py (the zeroing awaited at the first tile's epilogue). Stage 13 ran this at
commit c75998d, where v2 was the package's kernel and v1 a copy; v2 was no faster and the
package kept v1.

    PYTHONPATH=. python benchmarks/ab_scatter_add.py --out DIR
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib

import jax
import numpy as np

import commgemm as cg
import commgemm.algorithms.scatter_add_gemm as current
from commgemm.bench.overlap import GEMM_ALONE
from commgemm.bench.problems import make_problem, parse_method

RUN = "2xh200-2026-11-22-scatter-add"


def load_v2():
    path = pathlib.Path(__file__).parent / "results" / RUN / "scatter_add_gemm_v2.py"
    spec = importlib.util.spec_from_file_location("scatter_add_gemm_v2", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--presets", default="llama8b_mlp,comm_heavy,llama70b_mlp,llama13b_mlp")
    args = parser.parse_args()
    now = current.matmul_reduce_scatter
    v1, v2 = now, load_v2().matmul_reduce_scatter
    results = []
    for preset in args.presets.split(","):
        problem = make_problem("rs", cg.bench.PRESETS[preset], "bfloat16")
        x, w = problem.operands()
        variants = {
            GEMM_ALONE[False]: problem.gemm_alone(),
            GEMM_ALONE[True]: problem.gemm_alone(cast=True),
            "collective alone": (problem.comm_alone(), (problem.comm_operand(),)),
        }
        outs = {}
        for spec in ("fused-direct", "fused-direct-w16"):
            for version, fn in (("v1", v1), ("v2", v2)):
                current.matmul_reduce_scatter = fn  # traced at the first call below
                try:
                    f = problem.overlapped(parse_method(spec))
                    outs[f"{spec} {version}"] = np.asarray(f(x, w), np.float32)
                finally:
                    current.matmul_reduce_scatter = now
                variants[f"{spec} {version}"] = (f, (x, w))
        timed = cg.bench.benchmark_interleaved(variants, iters=args.iters)
        t_gemm = min(timed[name].median for name in GEMM_ALONE.values())
        bound = max(t_gemm, timed["collective alone"].median)
        ref = outs["fused-direct v1"]
        row = {
            "preset": preset,
            "bound_ms": bound,
            "ms": {name: r.median for name, r in timed.items()},
            "vs_bound": {name: r.median / bound for name, r in timed.items()},
            "max_diff_vs_v1": {name: float(np.abs(o - ref).max()) for name, o in outs.items()},
        }
        results.append(row)
        print(
            preset,
            " ".join(f"{k}={v:.3f}" for k, v in row["vs_bound"].items() if k.startswith("fused")),
            "max diff",
            max(row["max_diff_vs_v1"].values()),
            flush=True,
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ab_scatter_add.json").write_text(
        json.dumps({"devices": jax.device_count(), "rows": results}, indent=1)
    )


if __name__ == "__main__":
    main()
