"""Every preset x op in the launch mode this script runs in: one process for all GPUs, or one
process per GPU under `commgemm launch -n P --gpus-per-process 1`. Each problem is one
`overlap_report` (XLA's dot, serial, AUTO; the best GEMM and the collective alone for the
bound), timed by device periods; AUTO's plan is read from the same resolution the op makes.

    PYTHONPATH=. python benchmarks/launch_modes.py --out DIR
    PYTHONPATH=. python -m commgemm launch -n 4 --gpus-per-process 1 -- \
        python benchmarks/launch_modes.py --out DIR
    PYTHONPATH=. python benchmarks/launch_modes.py --table DIR    # both modes side by side

Each run writes DIR/modes-<P>dev-<processes>proc.json (process 0); --table prints a markdown
table of every pair of runs with the same GPU count. With --table, DIR's one_process/step.json
and per_gpu/step.json (benchmarks/step.py in each mode: `run.sh step-modes`) print as the layer
step's table too.
"""

from __future__ import annotations

import argparse
import faulthandler
import functools
import json
import pathlib
import sys
import time

from commgemm.devices import setup_devices
from commgemm.distributed import initialize

PRESETS = "llama70b_mlp,llama8b_mlp,comm_heavy,llama13b_mlp"
OPS = "ag,rs"


def auto_plan(op: str, shape: tuple[int, int, int], size: int, dtype: str) -> str:
    """The plan AUTO resolves to for one per-shard call of the bench problem (its method,
    splits and kernel), as the op's own plan would resolve it."""
    import jax

    from commgemm.autotune.auto import resolve_auto
    from commgemm.config import Collective, Method, OverlapConfig

    m, k, n = shape
    collective, x, w = {
        "ag": (Collective.ALL_GATHER, (m // size, k), (k, n // size)),
        "rs": (Collective.REDUCE_SCATTER, (m, k // size), (k // size, n)),
    }[op]
    cfg = resolve_auto(
        OverlapConfig(method=Method.AUTO),
        collective,
        jax.ShapeDtypeStruct(x, dtype),
        jax.ShapeDtypeStruct(w, dtype),
        size,
        w_transposed=False,
    )
    plan = cfg.method.name.lower()
    if cfg.atomic_gemm:
        plan = f"fused {cfg.kernel.__class__.__name__ if cfg.kernel else ''}".strip()
    elif cfg.num_splits > 1:
        plan += f":{cfg.num_splits}"
    return plan + (" bidi" if cfg.bidirectional else "")


def say(where: str, what: str) -> None:
    print(f"{where}: {what}", flush=True)


def measure(
    out: pathlib.Path, presets: list[str], ops: list[str], iters: int, periods: int, verbose: bool
):
    import jax

    from commgemm.bench.overlap import overlap_report
    from commgemm.bench.problems import PRESETS as SHAPES
    from commgemm.cli.specs import parse_method
    from commgemm.devices import environment

    size, processes = jax.device_count(), jax.process_count()
    lead = jax.process_index() == 0
    path = out / f"modes-{size}dev-{processes}proc.json"
    env = environment()
    records = []
    for preset in presets:
        for op in ops:
            shape, start = SHAPES[preset], time.perf_counter()
            methods = {name: parse_method(name, op) for name in ("none", "auto")}
            # every process's progress, so that a run that hangs shows where each one is
            where = f"{preset} {op}"
            progress = functools.partial(say, where) if verbose else None
            report = overlap_report(
                op, shape, methods=methods, iters=iters, warmup=2, periods=periods,
                progress=progress,
            ).as_dict()  # fmt: skip
            rows = {r["name"]: r for r in report["rows"]}
            record = {
                "preset": preset,
                "op": op,
                "bound_ms": report["period_bound_ms"],
                "period_error": report["period_error"],
                "auto_plan": auto_plan(op, shape, size, "bfloat16"),
                "failures": report["failures"],
                **{
                    f"{name}_ms": (rows[name]["period_ms"] if name in rows else None)
                    for name in ("xla", "none", "auto")
                },
                **{f"{name}_spread": report["period_spread"].get(name) for name in rows},
                "host_ms": {name: r["t_ms"] for name, r in rows.items()},
                "max_error": {name: r["max_error"] for name, r in rows.items()},
                "wall_s": round(time.perf_counter() - start, 1),
            }
            records.append(record)
            if lead:  # after every problem, so a run stopped early keeps what it measured
                print(json.dumps(record), flush=True)
                out.mkdir(parents=True, exist_ok=True)
                path.write_text(
                    json.dumps(
                        {
                            "environment": env,
                            "processes": processes,
                            "devices": size,
                            "records": records,
                        },
                        indent=1,
                    )
                )
    if lead:
        print(f"wrote {path}")


def ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None else f"{a / b:.3f}"


def table(directory: pathlib.Path) -> str:
    """Markdown: per GPU count, each problem's periods in one process and in one per GPU."""
    runs = {}
    for path in sorted(directory.glob("modes-*dev-*proc.json")):
        data = json.loads(path.read_text())
        runs[(data["devices"], data["processes"])] = {
            (r["preset"], r["op"]): r for r in data["records"]
        }
    lines = [
        "| P | preset | op | bound ms | XLA 1 proc | XLA P proc | serial 1 proc | serial P proc "
        "| AUTO 1 proc | AUTO P proc | AUTO / serial, 1 proc | AUTO / serial, P proc "
        "| AUTO's plan, 1 proc / P proc |",
        "|---" * 13 + "|",
    ]
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    for devices in sorted({d for d, _ in runs}):
        one, many = runs.get((devices, 1), {}), runs.get((devices, devices), {})
        for key in dict.fromkeys([*one, *many]):
            a, b = one.get(key, {}), many.get(key, {})
            lines.append(
                f"| {devices} | {key[0]} | {key[1]} | {fmt(a.get('bound_ms'))} "
                f"| {fmt(a.get('xla_ms'))} | {fmt(b.get('xla_ms'))} "
                f"| {fmt(a.get('none_ms'))} | {fmt(b.get('none_ms'))} "
                f"| {fmt(a.get('auto_ms'))} | {fmt(b.get('auto_ms'))} "
                f"| {ratio(a.get('auto_ms'), a.get('none_ms'))} "
                f"| {ratio(b.get('auto_ms'), b.get('none_ms'))} "
                f"| {a.get('auto_plan', '-')} / {b.get('auto_plan', '-')} |"
            )
    return "\n".join(lines)


def step_table(directory: pathlib.Path) -> str:
    """Markdown: the layer step (benchmarks/step.py's rows in DIR/one_process and DIR/per_gpu)
    per size x dtype: each variant's step / t_bound and AUTO's speedup over XLA's partitioning
    as step.py worked them out (each mode against its own run's t_bound; "host-bound" where the
    step was), in both launch modes."""
    found = [directory / mode / "step.json" for mode in ("one_process", "per_gpu")]
    data = [json.loads(path.read_text()) if path.exists() else None for path in found]
    devices = next(d["devices"] for d in data if d is not None)
    runs = [{(r["size"], r["dtype"]): r["ratios"] for r in (d or {"rows": []})["rows"]}
            for d in data]  # fmt: skip
    lines = [
        "| P | size | dtype | t_bound ms | 1 proc: AUTO | serial | XLA | AUTO vs XLA "
        "| P procs: AUTO | XLA | AUTO vs XLA |",
        "|---" * 11 + "|",
    ]

    def cell(ratios: dict, name: str, field: str = "vs_bound") -> str:
        got = ratios.get(name)
        if not isinstance(got, dict):
            return got or "-"  # "host-bound", or not run
        return "-" if got.get(field) is None else f"{got[field]:.3f}"

    for key in dict.fromkeys([*runs[0], *runs[1]]):
        one, many = runs[0].get(key, {}), runs[1].get(key, {})
        bound = one.get("t_bound_ms", many.get("t_bound_ms"))
        cells = [cell(one, n) for n in ("auto", "none", "xla")] + [
            cell(one, "auto", "speedup_vs_xla"), cell(many, "auto"), cell(many, "xla"),
            cell(many, "auto", "speedup_vs_xla")]  # fmt: skip
        bound_ms = "-" if bound is None else f"{bound:.2f}"
        lines.append(f"| {devices} | {key[0]} | {key[1]} | {bound_ms} | {' | '.join(cells)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path)
    parser.add_argument("--table", type=pathlib.Path, help="print the table of a DIR's runs")
    parser.add_argument("--presets", default=PRESETS)
    parser.add_argument("--ops", default=OPS)
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--periods", type=int, default=6)
    parser.add_argument("--verbose", action="store_true", help="each process's progress")
    parser.add_argument(
        "--stacks-every", type=float, help="print every thread's stack each this many seconds"
    )
    args = parser.parse_args(argv)
    if args.table:
        if any(args.table.glob("modes-*dev-*proc.json")):
            print(table(args.table))
        if any((args.table / mode / "step.json").exists() for mode in ("one_process", "per_gpu")):
            print(step_table(args.table))
        return 0
    if args.out is None:
        parser.error("--out or --table is required")
    if args.stacks_every:
        faulthandler.dump_traceback_later(args.stacks_every, repeat=True)
    setup_devices()
    initialize()  # under `commgemm launch`: join the other processes (a no-op otherwise)
    presets, ops = args.presets.split(","), args.ops.split(",")
    measure(args.out, presets, ops, args.iters, args.periods, args.verbose)
    return 0


if __name__ == "__main__":
    sys.exit(main())
