"""`commgemm demo | bench | tune | launch | info` (and `python -m commgemm ...`)."""

from __future__ import annotations

import argparse
import json
import sys

from commgemm.devices import setup_devices

#: commgemm.bench.PRESETS' names (that module imports jax, which must wait for setup_devices).
PRESET_NAMES = ("llama70b_mlp", "llama8b_mlp", "comm_heavy", "llama13b_mlp", "notebook")


def _demo(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from commgemm.demo import run_demo
    from commgemm.devices import environment

    env = environment()
    console = Console(quiet=env["process_index"] != 0)  # one table, from process 0
    console.print(
        f"commgemm demo on {env['device_count']} x {env['device_kind']} ({env['backend']}) in "
        f"{env['process_count']} process(es), M=K=N={args.size}, {args.dtype}"
    )
    rows = run_demo(m=args.size, k=args.size, n=args.size, iters=args.iters, dtype=args.dtype)
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
    try:
        return launch(
            args.n,
            command,
            cpu_devices=args.cpu_devices,
            gpus_per_process=args.gpus_per_process,
            timeout_s=args.timeout,
        )
    except LaunchError as err:
        print(f"commgemm launch: {err}", file=sys.stderr)
        return 1


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
        return 1


def _tune(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from commgemm.bench.problems import PRESETS, parse_shape
    from commgemm.tune import cache_path, tune

    shape = PRESETS[args.preset] if args.preset else parse_shape(args.shape)
    dtype = {"bf16": "bfloat16", "f32": "float32"}[args.dtype]
    methods = args.methods.split(",") if args.methods else None
    result = tune(
        args.op, shape, dtype=dtype, methods=methods, iters=args.iters, periods=args.periods
    )
    table = Table("method", f"median ms ({result.timing})", "vs_bound", title=result.key)
    for name, t in sorted(result.times_ms.items(), key=lambda kv: kv[1]):
        table.add_row(name, f"{t:.3f}", f"{result.vs_bound[name]:.2f}")
    console = Console()
    console.print(table)
    if result.period_error:
        console.print(f"device periods: {result.period_error}")
    console.print(f"best: {result.best} (stored in {cache_path()})")
    return 0


def _info(args: argparse.Namespace) -> int:
    from commgemm.devices import environment

    print(json.dumps(environment(), indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="commgemm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run every collective x method, check and time it")
    demo.add_argument("--size", type=int, default=1024, help="M = K = N (default 1024)")
    demo.add_argument("--iters", type=int, default=5)
    demo.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    demo.add_argument(
        "--processes",
        type=int,
        default=1,
        help="run in N processes under jax.distributed (see `commgemm launch`)",
    )
    demo.set_defaults(run=_demo)
    from commgemm.bench import cli as bench_cli

    bench = sub.add_parser("bench", help="overlap report: GEMM, collective, serial, methods")
    bench_cli.add_arguments(bench)
    bench.add_argument(
        "--processes",
        type=int,
        default=1,
        help="run in N processes under jax.distributed (see `commgemm launch`)",
    )
    bench.set_defaults(run=bench_cli.run)
    tune = sub.add_parser("tune", help="measure candidate plans, cache the best for AUTO")
    tune.add_argument("--op", choices=["ag", "rs", "ar"], default="ag")
    group = tune.add_mutually_exclusive_group(required=True)
    group.add_argument("--shape", help="M,K,N totals across the TP group")
    group.add_argument("--preset", choices=sorted(PRESET_NAMES))
    tune.add_argument("--dtype", default="bf16", choices=["bf16", "f32"])
    tune.add_argument("--methods", help="comma-separated specs (default: every candidate)")
    tune.add_argument(
        "--iters", type=int, default=40, help="cycles: each times every candidate once, interleaved"
    )
    tune.add_argument(
        "--periods",
        type=int,
        default=6,
        help="rounds of device periods, which rank the candidates where they can be read (GPUs)",
    )
    tune.set_defaults(run=_tune)
    launch = sub.add_parser("launch", help="run a command in N processes under jax.distributed")
    launch.add_argument("-n", type=int, required=True, help="number of processes")
    launch.add_argument("--cpu-devices", type=int, help="virtual CPU devices per process")
    launch.add_argument("--gpus-per-process", type=int, help="GPUs per process (GPU runs)")
    launch.add_argument("--timeout", type=float, default=600.0, help="limit for the whole run (s)")
    launch.add_argument("cmd", nargs=argparse.REMAINDER, help="-- program and arguments")
    launch.set_defaults(run=_launch)
    info = sub.add_parser("info", help="devices, backend, versions, XLA flags")
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
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
