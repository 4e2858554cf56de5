"""Why is Method.NONE slower than XLA's own jnp.dot on the same shardings? Times both (and NONE
with a bf16 GEMM result) in one process and writes both GPU schedules.

    PYTHONPATH=. python benchmarks/serial_gap.py --out DIR
"""

import argparse
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))

from experiments import schedule  # noqa: E402

import commgemm as cg  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--out", type=pathlib.Path, required=True)
parser.add_argument("--cases", default="llama70b_mlp:ag,llama70b_mlp:rs,comm_heavy:rs")
args = parser.parse_args()
args.out.mkdir(parents=True, exist_ok=True)
result = {}
for preset, op in (case.split(":") for case in args.cases.split(",")):
    shape = cg.bench.PRESETS[preset]
    variants = [cg.OverlapConfig(), cg.OverlapConfig(accumulate_dtype="bfloat16")]
    report = cg.bench.overlap_report(op, shape, methods=variants, dtype="bfloat16", iters=30)
    problem = cg.bench.make_problem(op, shape, "bfloat16")
    x, w = problem.operands()
    hlo = {
        "xla": schedule(problem.xla().lower(x, w).compile().as_text()),
        "none": schedule(problem.overlapped(variants[0]).lower(x, w).compile().as_text()),
    }
    times = {r.name: round(r.t_ms, 3) for r in report.rows}
    result[f"{preset} {op}"] = {"times_ms": times, "schedules": hlo}
    print(
        preset,
        op,
        "gemm",
        round(report.t_gemm_ms, 3),
        "comm",
        round(report.t_comm_ms, 3),
        list(times.values()),
    )
    for name, events in hlo.items():
        print("  ", name, " | ".join(events))
(args.out / "serial_gap.json").write_text(json.dumps(result, indent=1))
