"""`commgemm demo | bench | tune | launch | info` (and `python -m commgemm ...`)."""

from __future__ import annotations

import argparse
import json
import sys

from commgemm.cli import args as types
from commgemm.cli.args import PRESET_NAMES
from commgemm.cli.progress import steps
from commgemm.devices import setup_devices

__all__ = ["PRESET_NAMES", "build_parser", "main"]


def _demo(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from commgemm.demo import run_demo
    from commgemm.devices import environment

    env = environment()
    multiple = 4 * env["device_count"]
    if args.size % multiple:
        print(
            f"commgemm demo: --size {args.size} must be a multiple of {multiple} (4 x the "
            f"{env['device_count']} devices), e.g. {max(1, args.size // multiple) * multiple}",
            file=sys.stderr,
        )
        return 2
    console = Console(quiet=env["process_index"] != 0)  # one table, from process 0
    console.print(
        f"commgemm demo on {env['device_count']} x {env['device_kind']} ({env['backend']}) in "
        f"{env['process_count']} process(es), M=K=N={args.size}, {args.dtype}"
    )
    lead = env["process_index"] == 0
    with steps(console, "demo", lead=lead) as step:
        rows = run_demo(
            m=args.size, k=args.size, n=args.size, iters=args.iters, dtype=args.dtype, progress=step
        )
    table = Table("op", "method", "max |error|", "tolerance", "median ms", "check")
    for r in rows:
        table.add_row(
            r.op,
            r.method,
            f"{r.max_error:.2e}",
            f"{r.tolerance:.1e}",
            f"{r.ms:.2f}",
            "[green]ok[/]" if r.ok else "[red]FAIL[/]",
        )
    console.print(table)
    failed = [r for r in rows if not r.ok]
    console.print(f"{len(rows) - len(failed)} of {len(rows)} correct")
    return 1 if failed else 0


def _launch(args: argparse.Namespace) -> int:
    from commgemm.launch import LaunchError, launch

    command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not command:
        print("commgemm launch: no command to run: pass it after --", file=sys.stderr)
        return 2
    try:
        return launch(
            args.n,
            command,
            cpu_devices=args.cpu_devices,
            gpus_per_process=args.gpus_per_process,
            timeout_s=args.timeout,
            coordinator=args.coordinator,
        )
    except LaunchError as err:
        print(f"commgemm launch: {err}", file=sys.stderr)
        return err.returncode


def _relaunch(processes: int, argv: list[str]) -> int:
    """`demo` / `bench` with --processes N: the same command in N processes."""
    from commgemm.launch import LaunchError, gpu_count, launch

    gpus = gpu_count()
    if gpus and gpus % processes:
        print(f"--processes {processes} does not divide the {gpus} GPUs", file=sys.stderr)
        return 2
    try:
        return launch(
            processes,
            [sys.executable, "-m", "commgemm", *argv],
            gpus_per_process=gpus // processes if gpus else None,
        )
    except LaunchError as err:
        print(f"commgemm: {err}", file=sys.stderr)
        return err.returncode


def _tune(args: argparse.Namespace) -> int:
    import json

    from rich.console import Console
    from rich.table import Table

    from commgemm.autotune.tuner import tune
    from commgemm.bench.problems import PRESETS
    from commgemm.cli.specs import parse_method, spec_of

    shape = PRESETS[args.preset] if args.preset else args.shape
    try:
        methods = [parse_method(m, args.op) for m in args.methods] if args.methods else None
    except ValueError as err:
        print(f"commgemm tune: {err}", file=sys.stderr)
        return 2
    import jax

    lead = jax.process_index() == 0  # every process measures; process 0 reports
    console = Console(quiet=not lead)
    with steps(console, f"tune {args.op}", lead=lead) as step:
        result = tune(
            args.op,
            shape,
            dtype=args.dtype,
            methods=methods,
            iters=args.iters,
            periods=args.periods,
            label=spec_of,
            progress=step,
            scaling=args.scaling,
        )
    table = Table("method", f"median ms ({result.timing})", "vs_bound", title=result.key)
    for cfg, t in sorted(result.times_ms.items(), key=lambda kv: kv[1]):
        table.add_row(spec_of(cfg), f"{t:.3f}", f"{result.vs_bound[cfg]:.2f}")
    console.print(table)
    if result.period_error:
        console.print(f"device periods: {result.period_error}")
    if result.period_noise:
        from commgemm.cli.bench import noise_line

        console.print(noise_line(result.period_noise, "candidates"))
    if result.save_error:
        print(
            f"commgemm tune: could not write the tune cache ({result.save_error}); the "
            f"measured entry for {result.key} was:\n{json.dumps(result.entry, indent=1)}",
            file=sys.stderr,
        )
        return 1
    console.print(f"best: {spec_of(result.best)} (stored in {result.saved_to})")
    return 0


def _info(args: argparse.Namespace) -> int:
    from commgemm.devices import environment

    print(json.dumps(environment(), indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from commgemm import __version__
    from commgemm.cli import bench as bench_cli

    fmt = types.HelpFormatter
    parser = argparse.ArgumentParser(prog="commgemm", description=__doc__, formatter_class=fmt)
    parser.add_argument("--version", action="version", version=f"commgemm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    processes = dict(
        type=types.int_at_least(1),
        default=1,
        help="run in N processes under jax.distributed (see `commgemm launch`)",
    )
    demo = sub.add_parser(
        "demo", help="run every collective x method, check and time it", formatter_class=fmt
    )
    demo.add_argument(
        "--size",
        type=types.int_at_least(1),
        default=1024,
        help="M = K = N; a multiple of 4 x the device count",
    )
    demo.add_argument("--iters", type=types.int_at_least(1), default=5, help="timed calls each")
    demo.add_argument("--dtype", type=types.dtype, default="float32", help="operand dtype")
    demo.add_argument("--processes", **processes)
    demo.set_defaults(run=_demo)
    bench = sub.add_parser(
        "bench",
        help="overlap report: GEMM, collective, serial, methods",
        description=bench_cli.CPU_NOTE,
        formatter_class=fmt,
    )
    bench_cli.add_arguments(bench)
    bench.add_argument("--processes", **processes)
    bench.set_defaults(run=bench_cli.run)
    tune = sub.add_parser(
        "tune",
        help="measure candidate plans, cache the best for AUTO",
        description=bench_cli.TUNE_CPU_NOTE,
        formatter_class=fmt,
    )
    tune.add_argument("--op", choices=["ag", "rs", "ar"], default="ag", help="the op")
    group = tune.add_mutually_exclusive_group(required=True)
    group.add_argument("--shape", type=types.shape, help="M,K,N totals across the TP group")
    group.add_argument("--preset", choices=types.PRESET_NAMES, help="a named problem (M,K,N)")
    tune.add_argument("--dtype", type=types.dtype, default="bfloat16", help="operand dtype")
    tune.add_argument(
        "--scaling",
        choices=bench_cli.SCALINGS,
        help="time the candidates quantized and cache the winner for AUTO calls with this "
        "scaling (default: none, the operands as they are)",
    )
    tune.add_argument(
        "--methods",
        type=types.methods,
        help="comma-separated method specs (default: every candidate)",
    )
    tune.add_argument(
        "--iters",
        type=types.int_at_least(2),
        default=40,
        help="cycles: each times every candidate once, interleaved",
    )
    tune.add_argument(
        "--periods",
        type=types.int_at_least(0),
        default=6,
        help="rounds of device periods, which rank the candidates where they can be read (GPUs)",
    )
    tune.set_defaults(run=_tune)
    launch = sub.add_parser(
        "launch", help="run a command in N processes under jax.distributed", formatter_class=fmt
    )
    launch.add_argument("-n", type=types.int_at_least(1), required=True, help="processes")
    launch.add_argument(
        "--cpu-devices",
        type=types.int_at_least(1),
        help="virtual CPU devices per process (default: 8 // n)",
    )
    launch.add_argument(
        "--gpus-per-process", type=types.int_at_least(1), help="GPUs per process (GPU runs)"
    )
    launch.add_argument(
        "--timeout", type=types.positive_float, default=600.0, help="limit for the whole run (s)"
    )
    launch.add_argument(
        "--coordinator",
        help="host:port of the coordination service (default: 127.0.0.1 and a free port)",
    )
    launch.add_argument("cmd", nargs=argparse.REMAINDER, help="-- program and arguments")
    launch.set_defaults(run=_launch)
    info = sub.add_parser("info", help="devices, backend, versions, XLA flags", formatter_class=fmt)
    info.set_defaults(run=_info)
    return parser


def _without_processes(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--processes":
            skip = True
        elif not a.startswith("--processes="):
            out.append(a)
    return out


def main(argv: list[str] | None = None) -> int:
    from commgemm import distributed

    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if getattr(args, "processes", 1) > 1 and not distributed.launched():
        return _relaunch(args.processes, _without_processes(argv))
    if distributed.launched():
        distributed.initialize()
    elif args.command != "launch":
        setup_devices()
    from commgemm.launch import LaunchError

    try:
        return args.run(args)
    except (ValueError, OSError, LaunchError) as err:
        # the user's mistake (a shape, a name, a path) as one line, not a traceback
        print(f"commgemm {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
