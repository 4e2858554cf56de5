"""`commgemm bench`: an overlap report with a progress bar, a table, JSON, a plot and a trace."""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib

DEFAULT_METHODS = "none,pipeline:2,pipeline:4,ring,ring-bidi,ring:2,ring-bidi:2"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--op", choices=["ag", "rs", "ar", "2d"], default="ag")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--shape", help="M,K,N totals across the TP group")
    group.add_argument("--preset", help="llama70b_mlp, llama8b_mlp, comm_heavy or notebook")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "f32"])
    parser.add_argument(
        "--methods",
        default=DEFAULT_METHODS,
        help=f"comma-separated method specs (default {DEFAULT_METHODS})",
    )
    parser.add_argument(
        "--iters", type=int, default=50, help="cycles: each times every variant once, interleaved"
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--spans",
        type=int,
        default=0,
        help="also profile this many calls per variant and report GPU-timestamp spans (GPU only)",
    )
    parser.add_argument(
        "--periods",
        type=int,
        default=0,
        help="also read steady-state device periods from this many interleaved rounds (GPU only)",
    )
    parser.add_argument("--json", type=pathlib.Path, help="write every raw figure here")
    parser.add_argument("--plot", type=pathlib.Path, help="write a vs_bound bar chart (PNG)")
    parser.add_argument("--trace", type=pathlib.Path, help="write a jax.profiler trace here")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from commgemm.bench.overlap import overlap_report
    from commgemm.bench.problems import PRESETS, parse_method, parse_shape
    from commgemm.devices import environment

    if args.preset:
        if args.preset not in PRESETS:
            raise SystemExit(f"unknown preset {args.preset!r}; choose from {sorted(PRESETS)}")
        shape = PRESETS[args.preset]
    else:
        shape = parse_shape(args.shape or "2048,2048,1024")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in methods:
        parse_method(m)  # fail before any work
    dtype = {"bf16": "bfloat16", "f32": "float32"}[args.dtype]
    import jax

    lead = jax.process_index() == 0  # every process measures; process 0 reports
    console = Console(quiet=not lead)
    trace = contextlib.nullcontext()
    if args.trace:
        trace = jax.profiler.trace(str(args.trace))
    with Progress(console=console, transient=True, disable=not lead) as progress, trace:
        # compile steps, the interleaved timing, then spans of each method, 2 GEMMs, comm, xla
        steps = len(methods) + 1 + (len(methods) + 4 if args.spans else 0) + bool(args.periods)
        task = progress.add_task("benchmark", total=steps)

        def step(name: str) -> None:
            progress.update(task, advance=1, description=f"{args.op} {name}")

        report = overlap_report(
            args.op,
            shape,
            methods=methods,
            dtype=dtype,
            iters=args.iters,
            warmup=args.warmup,
            spans=args.spans,
            periods=args.periods,
            progress=step,
        )
    env = environment()
    table = Table(
        title=f"{args.op} M,K,N={shape} {dtype} on {report.devices} x "
        f"{env['device_kind']}: gemm {report.t_gemm_ms:.3f} ms, "
        f"comm {report.t_comm_ms:.3f} ms"
    )
    columns = ["method", "median ms", "vs_bound", "hidden", "max |err| vs serial"]
    if report.span_gemm_ms is not None:
        columns += ["span ms", "vs_bound (spans)"]
    if report.period_bound_ms is not None:
        columns += ["period ms", "vs_bound (periods)"]
    for col in columns:
        table.add_column(col)
    for r in report.rows:
        err = "" if r.max_error is None else f"{r.max_error:.2e}"
        cells = [r.name, f"{r.t_ms:.3f}", f"{r.vs_bound:.2f}", f"{r.hidden:.2f}", err]
        if r.span_ms is not None:
            cells += [f"{r.span_ms:.3f}", f"{r.vs_bound_span:.2f}"]
        if r.period_ms is not None:
            cells += [f"{r.period_ms:.3f}", f"{r.vs_bound_period:.2f}"]
        table.add_row(*cells)
    console.print(table)
    if report.span_error:
        console.print(f"device spans not measured: {report.span_error}")
    if report.period_error:
        console.print(f"device periods not measured: {report.period_error}")
    for name, why in report.failures:
        console.print(f"{name}: not run: {why}")
    if not lead:
        return 0
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"environment": env, "report": report.as_dict()}, indent=2))
    if args.plot:
        plot_vs_bound(report, args.plot)
    return 0


def plot_vs_bound(report, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.name for r in report.rows]
    values = [r.vs_bound for r in report.rows]
    fig, ax = plt.subplots(figsize=(max(4, len(names) * 0.9), 3.5))
    ax.bar(names, values, color="tab:blue")
    ax.axhline(1.0, color="black", linewidth=1, linestyle="--", label="bound")
    ax.set_ylabel("t / max(t_gemm, t_comm)")
    ax.set_title(f"{report.op} {report.shape} {report.dtype}, {report.devices} devices")
    ax.tick_params(axis="x", rotation=30)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
