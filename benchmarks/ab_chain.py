"""A/B in one process: ring pieces with and without chained GEMMs (chain_gemms), twice each, on
the shapes where the two 2xH200 runs disagreed.

    PYTHONPATH=. python benchmarks/ab_chain.py --out DIR
"""

import argparse
import json
import pathlib

import commgemm as cg

parser = argparse.ArgumentParser()
parser.add_argument("--out", type=pathlib.Path, required=True)
args = parser.parse_args()
# (recorded 2026-11-22 with the then-spelling "X-free" for chain_gemms off and plain "X" on)
methods = [
    "none",
    "ring-chain",
    "ring",
    "ring:2-chain",
    "ring:2",
    "ring:4-chain",
    "ring:4",
    "ring:8-chain",
    "ring:8",
    "pipeline:4",
]
results = []
for preset, op in (("comm_heavy", "ag"), ("llama8b_mlp", "rs"), ("llama70b_mlp", "rs")):
    for repeat in range(2):
        r = cg.bench.overlap_report(
            op,
            cg.bench.PRESETS[preset],
            methods=methods,
            dtype="bfloat16",
            iters=20,
            include_xla=False,
        )
        results.append(r.as_dict() | {"preset": preset, "repeat": repeat})
        print(
            preset, op, repeat, " ".join(f"{x.name}={x.vs_bound:.2f}" for x in r.rows), flush=True
        )
args.out.mkdir(parents=True, exist_ok=True)
(args.out / "ab_chain.json").write_text(json.dumps(results, indent=1))
