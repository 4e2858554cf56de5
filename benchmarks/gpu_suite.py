"""The GPU benchmark suite: every preset, AG+GEMM and GEMM+RS, our methods beside the serial
baseline, XLA's own dot, XLA's windowed einsum and (when torch is importable) PyTorch async TP.

    PYTHONPATH=. python benchmarks/gpu_suite.py --out benchmarks/results/<name>

XLA flags are read when jax starts, so each flag set runs in its own process (this script
re-invoked with --mode). Writes one JSON per mode and suite.md (a markdown table) to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

from commgemm.launch import SAFE_ENV  # the NVLink-multicast-off variables

WINDOWED_EINSUM = (
    "--xla_gpu_threshold_for_windowed_einsum_mib=0 "
    "--xla_gpu_multi_streamed_windowed_einsum=true "
    "--xla_gpu_use_memcpy_local_p2p=true"
)
METHODS = ["none", "pipeline:4", "ring", "ring:2", "fused", "fused-w8", "fused-wgm", "auto"]
#: mode: (extra XLA_FLAGS, extra environment, methods). Each runs in its own process.
MODES = {
    "default": ("", {}, METHODS),
    "memcpy_p2p": ("--xla_gpu_use_memcpy_local_p2p=true", {}, METHODS),
    "cublas": ("--xla_gpu_enable_triton_gemm=false", {}, METHODS),
    "nccl_ctas4": ("", {"NCCL_MAX_CTAS": "4", "NCCL_MIN_CTAS": "4"}, METHODS),
    "windowed_einsum": (WINDOWED_EINSUM, {}, []),
}
PRESET_NAMES = ["llama70b_mlp", "llama8b_mlp", "comm_heavy"]


def run_reports(presets, ops, methods, iters, rounds, include_xla) -> list[dict]:
    import commgemm as cg

    out = []
    for preset in presets:
        for op in ops:
            start = time.time()
            report = cg.bench.overlap_report(
                op,
                cg.bench.PRESETS[preset],
                methods=methods,
                dtype="bfloat16",
                iters=iters,
                rounds=rounds,
                include_xla=include_xla,
            )
            row = report.as_dict() | {"preset": preset}
            out.append(row)
            best = min(report.rows, key=lambda r: r.t_ms)
            print(
                f"[{preset} {op}] gemm {report.t_gemm_ms:.3f} comm {report.t_comm_ms:.3f} "
                f"best {best.name} {best.t_ms:.3f} vs_bound {best.vs_bound:.2f} "
                f"({time.time() - start:.0f}s)",
                flush=True,
            )
    return out


def spawn(mode: str, out: pathlib.Path, args) -> None:
    extra_flags, extra_env, _ = MODES[mode]
    env = os.environ | SAFE_ENV | extra_env
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + extra_flags).strip()
    cmd = [
        sys.executable,
        __file__,
        "--mode",
        mode,
        "--out",
        str(out),
        "--iters",
        str(args.iters),
        "--rounds",
        str(args.rounds),
        "--presets",
        ",".join(args.presets),
        "--ops",
        ",".join(args.ops),
    ]
    shown = " ".join(f"{k}={v}" for k, v in extra_env.items())
    print("$", shown, f"XLA_FLAGS='{env['XLA_FLAGS']}'", " ".join(cmd), flush=True)
    try:
        subprocess.run(cmd, env=env, check=False, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        print(f"mode {mode} timed out after {args.timeout} s", flush=True)


def spawn_torch(out: pathlib.Path, args) -> None:
    try:
        import torch
    except ImportError:
        print("torch not importable: no PyTorch async-TP column", flush=True)
        return
    n = torch.cuda.device_count()
    script = pathlib.Path(__file__).with_name("torch_async_tp.py")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={n}",
        str(script),
        "--out",
        str(out / "torch_async_tp.json"),
        "--iters",
        str(args.iters),
        "--presets",
        ",".join(args.presets),
    ]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, env=os.environ | SAFE_ENV, check=False, timeout=args.timeout)


def markdown(out: pathlib.Path) -> str:
    """The suite table: vs_bound of each row as overlap_report gives it (with rounds, the median
    over rounds of t / bound within the round; windowed einsum against its own process's bound);
    PyTorch's median over our default-flags run's bound (another process, another time)."""

    def load(name):
        path = out / name
        return json.loads(path.read_text()) if path.exists() else None

    base, torch = load("xla_default.json"), load("torch_async_tp.json")
    if base is None:
        return "no results\n"
    header = ["preset", "op", "gemm ms", "comm ms", "XLA dot", "serial (NONE)"]
    header += ["best split (ring/pipeline)", "best fused", "AUTO"]
    header += ["XLA windowed einsum", "PyTorch async TP"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]

    def find(data, preset, op):
        for r in (data or {}).get("reports", []):
            if r["preset"] == preset and r["op"] == op:
                return r
        return None

    def best(rows, bound, keep) -> str:
        rows = [r for r in rows if keep(r["name"])]
        if not rows:
            return "not run"
        r = min(rows, key=lambda r: r["vs_bound"])
        return f"{r['vs_bound']:.2f} ({r['name']})"

    for rep in base["reports"]:
        preset, op, bound = rep["preset"], rep["op"], rep["bound_ms"]
        by = {r["name"]: r for r in rep["rows"]}
        cells = [
            preset,
            op,
            f"{rep['t_gemm_ms']:.3f}",
            f"{rep['t_comm_ms']:.3f}",
            f"{by['xla']['vs_bound']:.2f}",
            f"{by['none']['vs_bound']:.2f}",
            best(rep["rows"], bound, lambda n: n.startswith(("ring", "pipeline"))),
            best(rep["rows"], bound, lambda n: n.startswith("fused")),
            f"{by['auto']['vs_bound']:.2f}" if "auto" in by else "not run",
        ]
        w = find(load("xla_windowed_einsum.json"), preset, op)
        cells.append(f"{w['rows'][0]['vs_bound']:.2f}" if w else "not run")
        t = next(
            (r for r in (torch or {}).get("rows", []) if r["preset"] == preset and r["op"] == op),
            None,
        )
        cells.append(f"{t['t_ms'] / bound:.2f}" if t else "not run")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--mode", default="all", choices=["all", *MODES])
    parser.add_argument(
        "--modes",
        default="default,windowed_einsum",
        help="the modes an 'all' run spawns",
    )
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=1, help="variants timed in turn, pooled")
    parser.add_argument("--presets", default=",".join(PRESET_NAMES))
    parser.add_argument("--ops", default="ag,rs")
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--no-torch", action="store_true")
    args = parser.parse_args()
    args.presets, args.ops = args.presets.split(","), args.ops.split(",")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.mode == "all":
        for mode in args.modes.split(","):
            spawn(mode, args.out, args)
        if not args.no_torch:
            spawn_torch(args.out, args)
        table = markdown(args.out)
        (args.out / "suite.md").write_text(table)
        print(table)
        return
    from commgemm.devices import environment

    methods = MODES[args.mode][2]
    reports = run_reports(
        args.presets, args.ops, methods, args.iters, args.rounds, include_xla=True
    )
    path = args.out / f"xla_{args.mode}.json"
    path.write_text(
        json.dumps(
            {
                "environment": environment(),
                "mode": args.mode,
                "xla_flags": os.environ.get("XLA_FLAGS", ""),
                "reports": reports,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
