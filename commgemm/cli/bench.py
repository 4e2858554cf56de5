"""`commgemm bench`: an overlap report with a progress bar, a table, JSON, a plot and a trace."""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import sys

from commgemm.cli import args as types
from commgemm.cli.progress import steps

DEFAULT_METHODS = "none,pipeline:2,pipeline:4,ring,ring-bidi,ring:2,ring-bidi:2"
#: The stateless scaling modes `--scaling` takes, by ScalingMode value.
SCALINGS = ("current_tensor_scaling", "mxfp8_1d_scaling", "nvfp4_1d_scaling")
#: How long the commands take where there is no GPU, for the help texts (measured on a 2-core
#: machine with 8 virtual CPU devices: wall time and peak memory of the whole command).
CPU_NOTE = (
    "The presets are GPU-sized: on a 2-core CPU with 8 virtual devices one call of a preset "
    "takes seconds and a preset with the default flags runs for hours; there, CPU timings are "
    "only a smoke test (--shape 1024,1024,1024 --iters 5: about 10 s and 0.5 GB on 2 cores)."
)
TUNE_CPU_NOTE = (
    "Tuning compiles and times every candidate plan (about 20 on 8 devices): on a 2-core CPU "
    "with 8 virtual devices --shape 1024,1024,1024 --iters 5 takes about 50 s and 5 GB; CPU "
    "timings are only a smoke test."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--op", choices=["ag", "rs", "ar", "2d"], default="ag", help="the op")
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--shape",
        type=types.shape,
        default=(2048, 2048, 1024),
        help="M,K,N totals across the TP group",
    )
    group.add_argument("--preset", choices=types.PRESET_NAMES, help="a named problem (M,K,N)")
    parser.add_argument("--dtype", type=types.dtype, default="bfloat16", help="operand dtype")
    parser.add_argument(
        "--scaling",
        choices=SCALINGS,
        help="quantized methods (FP8 or block scaling); the bound also takes the quantized "
        "local GEMM (default: none, the operands as they are)",
    )
    parser.add_argument(
        "--methods",
        type=types.methods,
        default=DEFAULT_METHODS,
        help="comma-separated method specs: none, pipeline:N, ring, ring:N, ring-bidi[:N], "
        "ring-agg, auto, fused[-...], fused-direct[-...]",
    )
    parser.add_argument(
        "--iters",
        type=types.int_at_least(2),
        default=50,
        help="cycles: each times every variant once, interleaved",
    )
    parser.add_argument(
        "--warmup", type=types.int_at_least(1), default=3, help="untimed calls per variant"
    )
    parser.add_argument(
        "--spans",
        type=types.int_at_least(0),
        default=0,
        help="also profile this many calls per variant and report GPU-timestamp spans (GPU only)",
    )
    parser.add_argument(
        "--periods",
        type=types.int_at_least(0),
        default=0,
        help="also read steady-state device periods from this many interleaved rounds (GPU only)",
    )
    parser.add_argument("--json", type=pathlib.Path, help="write every raw figure here")
    parser.add_argument("--plot", type=pathlib.Path, help="write a vs_bound bar chart (PNG)")
    parser.add_argument("--trace", type=pathlib.Path, help="write a jax.profiler trace here")


def run(args: argparse.Namespace) -> int:
    import jax
    from rich.console import Console
    from rich.table import Table

    from commgemm.bench.overlap import overlap_report
    from commgemm.bench.problems import PRESETS
    from commgemm.cli.specs import parse_method
    from commgemm.devices import environment

    shape = PRESETS[args.preset] if args.preset else args.shape
    try:
        methods = {spec: parse_method(spec, args.op) for spec in args.methods}
    except ValueError as err:
        print(f"commgemm bench: {err}", file=sys.stderr)
        return 2
    dtype = args.dtype

    lead = jax.process_index() == 0  # every process measures; process 0 reports
    console = Console(quiet=not lead)
    trace = contextlib.nullcontext()
    if args.trace:
        trace = jax.profiler.trace(str(args.trace))
    # compile steps, the interleaved timing, then spans of each method, 2 GEMMs, comm, xla
    total = len(methods) + 1 + (len(methods) + 4 if args.spans else 0) + bool(args.periods)
    with steps(console, f"bench {args.op}", total=total, lead=lead) as step, trace:
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
            scaling=args.scaling,
        )
    env = environment()
    table = Table(
        title=f"{args.op} M,K,N={shape} {dtype}"
        f"{'' if args.scaling is None else ', ' + args.scaling} on {report.devices} x "
        f"{env['device_kind']}: best gemm {report.t_gemm_ms:.3f} ms "
        f"(XLA's {report.t_gemm_xla_ms:.3f}), comm {report.t_comm_ms:.3f} ms"
    )
    columns = [
        "method",
        "median ms",
        "vs_bound",
        "vs_bound (XLA gemm)",
        "hidden",
        "max |err| vs serial",
    ]
    if report.span_gemm_ms is not None:
        columns += ["span ms", "vs_bound (spans)"]
    if report.period_bound_ms is not None:
        columns += ["period ms", "vs_bound (periods)", "rounds' spread"]
    for col in columns:
        table.add_column(col)
    for r in report.rows:
        err = "" if r.max_error is None else f"{r.max_error:.2e}"
        cells = [
            r.name,
            f"{r.t_ms:.3f}",
            f"{r.vs_bound:.2f}",
            f"{r.vs_bound_xla:.2f}",
            f"{r.hidden:.2f}",
            err,
        ]
        if r.span_ms is not None:
            cells += [f"{r.span_ms:.3f}", f"{r.vs_bound_span:.2f}"]
        if r.period_ms is not None:
            cells += [f"{r.period_ms:.3f}", f"{r.vs_bound_period:.2f}", f"{r.period_spread:.1%}"]
        table.add_row(*cells)
    console.print(table)
    if jax.default_backend() == "cpu":
        console.print("CPU backend: these timings are only a smoke test, not a measurement.")
    if report.span_error:
        console.print(f"device spans not measured: {report.span_error}")
    if report.period_error:
        console.print(f"device periods not measured: {report.period_error}")
    if report.period_noise:
        console.print(noise_line(report.period_noise, "rows"))
    for name, why in report.failures:
        console.print(f"{name}: not run: {why}")
    ran = {r.name for r in report.rows}
    if not ran & set(methods):
        print(f"commgemm bench: none of the methods {', '.join(methods)} ran", file=sys.stderr)
        return 1
    if not lead:
        return 0
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"environment": env, "report": report.as_dict()}, indent=2))
    if args.plot:
        plot_vs_bound(report, args.plot)
    return 0


def noise_line(noise: tuple[str, float], what: str) -> str:
    """The note on device periods' noise (`OverlapReport.period_noise`): `what` (rows,
    candidates) closer than the widest spread of rounds are not told apart by the run."""
    name, spread = noise
    return (
        f"device periods: rounds spread up to {spread:.1%} ({name}); {what} closer than "
        "that are not told apart by this run"
    )


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
