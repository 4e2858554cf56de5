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
#: "fused" has bands 8 tiles wide (the default since the scatter-add run; "fused-w1" the earlier
#: default); split tails ("-t0") are GEMM+RS only (on AG listed among the failures).
METHODS = [
    "none",
    "pipeline:4",
    "ring",
    "ring:2",
    "fused",
    "fused-w16",
    "fused-direct",
    "fused-direct-cm",
    "fused-direct-cm-t0",
    "auto",
]
#: mode: (extra XLA_FLAGS, extra environment, methods). Each runs in its own process.
MODES = {
    "default": ("", {}, METHODS),
    "memcpy_p2p": ("--xla_gpu_use_memcpy_local_p2p=true", {}, METHODS),
    "cublas": ("--xla_gpu_enable_triton_gemm=false", {}, METHODS),
    "nccl_ctas4": ("", {"NCCL_MAX_CTAS": "4", "NCCL_MIN_CTAS": "4"}, METHODS),
    "windowed_einsum": (WINDOWED_EINSUM, {}, []),
}
PRESET_NAMES = ["llama70b_mlp", "llama8b_mlp", "comm_heavy", "llama13b_mlp"]


def auto_choice(op: str, preset: str) -> str:
    """The method spec Method.AUTO resolves to for this preset (cache, else cost model)."""
    import jax

    import commgemm as cg
    from commgemm.autotune.auto import resolve_auto
    from commgemm.autotune.tuner import OPS
    from commgemm.cli.specs import spec_of

    m, k, n = cg.bench.PRESETS[preset]
    size = jax.device_count()
    if op == "ag":
        x, w = (m // size, k), (k, n // size)
    else:
        x, w = (m, k // size), (k // size, n)
    sds = [jax.ShapeDtypeStruct(s, "bfloat16") for s in (x, w)]
    cfg = cg.OverlapConfig(method="auto")
    return spec_of(resolve_auto(cfg, OPS[op], *sds, size, w_transposed=False))


def run_reports(presets, ops, methods, iters, spans, periods, save) -> list[dict]:
    """Every preset x op's `overlap_report` (XLA's dot included); save(reports) after each, so
    a run cut short keeps what it measured."""
    import commgemm as cg

    out = []
    for preset in presets:
        for op in ops:
            start = time.time()
            from commgemm.cli.specs import parse_method

            report = cg.bench.overlap_report(
                op,
                cg.bench.PRESETS[preset],
                methods={spec: parse_method(spec, op) for spec in methods},
                dtype="bfloat16",
                iters=iters,
                spans=spans,
                periods=periods,
                include_xla=True,
            )
            row = report.as_dict() | {"preset": preset, "auto_choice": auto_choice(op, preset)}
            out.append(row)
            save(out)
            best = min(report.rows, key=lambda r: r.t_ms)
            auto = next((r for r in report.rows if r.name == "auto"), None)
            periods_note = ""
            if auto is not None and auto.vs_bound_period is not None:
                periods_note = f", AUTO by device periods {auto.vs_bound_period:.2f}"
            print(
                f"[{preset} {op}] gemm {report.t_gemm_ms:.3f} comm {report.t_comm_ms:.3f} "
                f"best {best.name} {best.t_ms:.3f} vs_bound {best.vs_bound:.2f}{periods_note} "
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
        "--spans",
        str(args.spans),
        "--periods",
        str(args.periods),
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
    """The suite tables. First, vs_bound from the interleaved timing (`overlap_report`; windowed
    einsum against its own process's bound; PyTorch's median, timed with CUDA events in other
    processes, over our default-flags run's bound). Then, where measured, the same ratios from
    the GPUs' own timestamps: device periods (`device_periods_interleaved`: steady state, calls
    back to back; PyTorch's CUDA-event time per call over our run's period bound) and device
    spans (`device_spans`: each call alone, busy time)."""

    def load(name):
        path = out / name
        return json.loads(path.read_text()) if path.exists() else None

    base, torch = load("xla_default.json"), load("torch_async_tp.json")
    windowed = load("xla_windowed_einsum.json")
    if base is None:
        return "no results\n"

    def find(data, preset, op):
        for r in (data or {}).get("reports", []):
            if r["preset"] == preset and r["op"] == op:
                return r
        return None

    def best(rows, keep, key="vs_bound") -> str:
        rows = [r for r in rows if keep(r["name"]) and r.get(key) is not None]
        if not rows:
            return "not run"
        r = min(rows, key=lambda r: r[key])
        return f"{r[key]:.2f} ({r['name']})"

    def torch_row(preset, op):
        rows = (torch or {}).get("rows", [])
        return next((r for r in rows if r["preset"] == preset and r["op"] == op), None)

    def cell(row, key="vs_bound") -> str:
        return f"{row[key]:.2f}" if row and row.get(key) is not None else "not run"

    header = ["preset", "op", "gemm ms", "comm ms", "XLA dot", "serial (NONE)"]
    header += ["best split (ring/pipeline)", "best fused", "AUTO (its choice)"]
    header += ["XLA windowed einsum", "PyTorch async TP"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    split = lambda n: n.startswith(("ring", "pipeline"))  # noqa: E731
    fused = lambda n: n.startswith("fused")  # noqa: E731
    for rep in base["reports"]:
        preset, op, bound = rep["preset"], rep["op"], rep["bound_ms"]
        by = {r["name"]: r for r in rep["rows"]}
        auto = f"{cell(by.get('auto'))} ({rep.get('auto_choice', '?')})"
        w = find(windowed, preset, op)
        t = torch_row(preset, op)
        cells = [preset, op, f"{rep['t_gemm_ms']:.3f}", f"{rep['t_comm_ms']:.3f}"]
        cells += [cell(by.get("xla")), cell(by.get("none"))]
        cells += [best(rep["rows"], split), best(rep["rows"], fused), auto]
        cells += [cell(w["rows"][0]) if w else "not run"]
        cells += [f"{t['t_ms'] / bound:.2f}" if t else "not run"]
        lines.append("| " + " | ".join(cells) + " |")
    if any(rep.get("period_bound_ms") for rep in base["reports"]):
        header = ["preset", "op", "gemm period ms", "comm period ms", "XLA dot", "serial (NONE)"]
        header += ["best split (ring/pipeline)", "best fused", "AUTO (its choice)"]
        header += ["XLA windowed einsum", "PyTorch async TP", "rounds' widest spread"]
        lines += ["", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        key = "vs_bound_period"
        for rep in base["reports"]:
            if not rep.get("period_bound_ms"):
                continue
            preset, op = rep["preset"], rep["op"]
            by = {r["name"]: r for r in rep["rows"]}
            w = find(windowed, preset, op)
            t = torch_row(preset, op)
            cells = [preset, op, f"{rep['period_gemm_ms']:.3f}", f"{rep['period_comm_ms']:.3f}"]
            cells += [cell(by.get("xla"), key), cell(by.get("none"), key)]
            cells += [best(rep["rows"], split, key), best(rep["rows"], fused, key)]
            cells += [f"{cell(by.get('auto'), key)} ({rep.get('auto_choice', '?')})"]
            cells += [cell(w["rows"][0], key) if w else "not run"]
            cells += [f"{t['t_ms'] / rep['period_bound_ms']:.2f}" if t else "not run"]
            spread = rep.get("period_spread")  # not in suites before 2026-11-27
            cells += [f"{max(spread.values()):.1%}" if spread else "-"]
            lines.append("| " + " | ".join(cells) + " |")
    if not any(rep.get("span_gemm_ms") for rep in base["reports"]):
        return "\n".join(lines) + "\n"
    header = ["preset", "op", "gemm span ms", "comm span ms", "XLA dot", "serial (NONE)"]
    header += ["best fused", "AUTO", "XLA windowed einsum"]
    lines += ["", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for rep in base["reports"]:
        if not rep.get("span_gemm_ms"):
            continue
        by = {r["name"]: r for r in rep["rows"]}
        w = find(windowed, rep["preset"], rep["op"])
        cells = [rep["preset"], rep["op"], f"{rep['span_gemm_ms']:.3f}"]
        cells += [f"{rep['span_comm_ms']:.3f}"]
        cells += [cell(by.get("xla"), "vs_bound_span"), cell(by.get("none"), "vs_bound_span")]
        cells += [best(rep["rows"], fused, "vs_bound_span"), cell(by.get("auto"), "vs_bound_span")]
        cells += [cell(w["rows"][0], "vs_bound_span") if w else "not run"]
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
    parser.add_argument("--iters", type=int, default=30, help="interleaved cycles per problem")
    parser.add_argument(
        "--spans", type=int, default=0, help="profiled calls per variant (device spans), 0: none"
    )
    parser.add_argument(
        "--periods", type=int, default=6, help="rounds of device periods per problem, 0: none"
    )
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
    path = args.out / f"xla_{args.mode}.json"
    env = environment()

    def save(reports):
        data = {
            "environment": env,
            "mode": args.mode,
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "reports": reports,
        }
        path.write_text(json.dumps(data, indent=1))

    run_reports(args.presets, args.ops, methods, args.iters, args.spans, args.periods, save)


if __name__ == "__main__":
    main()
