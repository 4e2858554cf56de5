"""`commgemm demo | bench | info` (and `python -m commgemm ...`)."""

from __future__ import annotations

import argparse
import json
import sys

from commgemm.devices import setup_devices


def _demo(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from commgemm.demo import run_demo
    from commgemm.devices import environment

    env = environment()
    console = Console()
    console.print(
        f"commgemm demo on {env['device_count']} x {env['device_kind']} ({env['backend']}), "
        f"M=K=N={args.size}, {args.dtype}"
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
    demo.set_defaults(run=_demo)
    from commgemm.bench import cli as bench_cli

    bench = sub.add_parser("bench", help="overlap report: GEMM, collective, serial, methods")
    bench_cli.add_arguments(bench)
    bench.set_defaults(run=bench_cli.run)
    info = sub.add_parser("info", help="devices, backend, versions, XLA flags")
    info.set_defaults(run=_info)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_devices()
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
