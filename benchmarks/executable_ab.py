"""Same program, separate executables: is a gap between two identical configs (AUTO resolved
to "fused" vs "fused", seen in the final suite) the method or the compiled executable?

Compiles `--copies` executables of one config per case (distinct jit wrappers; 'fused+auto':
of each of two configs), times them in turn for `--rounds` rounds (pooled medians), beside
serial, and diffs the optimized HLO of the first two (backend configs, which hold the serialized
kernels, left out).

    PYTHONPATH=. python benchmarks/executable_ab.py --out DIR
"""

from __future__ import annotations

import argparse
import difflib
import functools
import json
import pathlib
import re

import jax
from jax.sharding import NamedSharding

import commgemm as cg
from commgemm.bench.problems import PRESETS, make_problem, parse_method
from commgemm.bench.timing import benchmark, pool


def copy_of(problem, cfg, tag: int):
    def call(x, w, tag=tag):  # a distinct function per copy: its own trace and executable
        del tag
        return cg.gemm(
            x,
            w,
            out_sharding=NamedSharding(problem.mesh, problem.out_spec),
            config=cfg,
            x_spec=problem.x_spec,
            w_spec=problem.w_spec,
        )

    return jax.jit(functools.partial(call, tag=tag))


def hlo_lines(fn, x, w) -> list[str]:
    text = fn.lower(x, w).compile().as_text()
    return [re.sub(r"backend_config=.*", "", line) for line in text.splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--cases", default="llama8b_mlp:rs:fused,comm_heavy:rs:fused")
    parser.add_argument("--copies", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--iters", type=int, default=8)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    out = {}
    for case in args.cases.split(","):
        preset, op, spec = case.split(":")
        problem = make_problem(op, PRESETS[preset], "bfloat16", None)
        x, w = problem.operands()
        gemm_fn, gemm_args = problem.gemm_alone()
        fns = {
            "gemm alone": (gemm_fn, gemm_args),
            "none": (problem.overlapped(cg.OverlapConfig()), (x, w)),
        }
        specs = spec.split("+")  # 'fused+auto': copies of each
        for i in range(args.copies):
            for sp in specs:
                fns[f"{sp} #{i}"] = (copy_of(problem, parse_method(sp), i), (x, w))
        runs = {name: [] for name in fns}
        for r in range(args.rounds):
            for name, (fn, fargs) in fns.items():
                runs[name].append(
                    benchmark(fn, *fargs, iters=args.iters, warmup=3 if r == 0 else 1)
                )
        t_gemm = pool(runs["gemm alone"]).median
        rows = {}
        for name, rs in runs.items():
            p = pool(rs)
            rows[name] = dict(
                t_ms=p.median,
                vs_gemm=p.median / t_gemm,
                round_medians=[r.median / t_gemm for r in rs],
            )
            print(
                f"{case} {name}: {p.median:.3f} ms  vs_gemm {p.median / t_gemm:.3f}  rounds "
                + " ".join(f"{r.median / t_gemm:.3f}" for r in rs),
                flush=True,
            )
        second = f"{specs[1]} #0" if len(specs) > 1 else f"{spec} #1"
        a = hlo_lines(fns[f"{specs[0]} #0"][0], x, w)
        b = hlo_lines(fns[second][0], x, w)
        diff = [d for d in difflib.unified_diff(a, b, lineterm="", n=0) if d[:1] in "+-"]
        print(
            f"{case}: optimized HLO of {specs[0]} #0 and {second}: {len(a)} lines, "
            f"{len(diff)} differ",
            flush=True,
        )
        (args.out / f"hlo_{preset}_{op}.txt").write_text("\n".join(a))
        out[case] = dict(rows=rows, hlo_lines=len(a), hlo_diff=diff[:200])
        (args.out / "executable_ab.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
