"""`overlap_report()`: for one problem, the GEMM alone, the collective alone, the serial baseline
and each method, all timed in one run, with vs_bound and hidden (../shared/DESIGN.md)."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Sequence

import jax
import numpy as np

import commgemm as cg
from commgemm.bench.problems import Problem, make_problem, parse_method
from commgemm.bench.timing import BenchmarkResult, benchmark, pool


@dataclasses.dataclass(frozen=True)
class OverlapRow:
    """One timed variant: t in ms (median), vs_bound = t / max(t_gemm, t_comm), and
    hidden = (t_gemm + t_comm - t) / min(t_gemm, t_comm) (1.0: the smaller one fully hidden).
    With several rounds, vs_bound is the median over rounds of that ratio, each round's t and
    bound measured in that round (vs_bound_rounds)."""

    name: str
    t_ms: float
    vs_bound: float
    hidden: float
    max_error: float | None
    result: BenchmarkResult
    vs_bound_rounds: tuple[float, ...] = ()


@dataclasses.dataclass(frozen=True)
class OverlapReport:
    op: str
    shape: tuple[int, int, int]
    dtype: str
    devices: int
    t_gemm_ms: float
    t_comm_ms: float
    rows: tuple[OverlapRow, ...]
    failures: tuple[tuple[str, str], ...] = ()  # (method, error) for methods that could not run

    @property
    def bound_ms(self) -> float:
        return max(self.t_gemm_ms, self.t_comm_ms)

    def as_dict(self) -> dict:
        return {
            "op": self.op,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "devices": self.devices,
            "t_gemm_ms": self.t_gemm_ms,
            "t_comm_ms": self.t_comm_ms,
            "bound_ms": self.bound_ms,
            "rows": [
                {
                    "name": r.name,
                    "t_ms": r.t_ms,
                    "vs_bound": r.vs_bound,
                    "hidden": r.hidden,
                    "max_error": r.max_error,
                    "vs_bound_rounds": list(r.vs_bound_rounds),
                    "timing": r.result.as_dict(),
                }
                for r in self.rows
            ],
            "failures": [list(f) for f in self.failures],
        }


def _row(name, result, t_gemm, t_comm, error=None, per_round=()) -> OverlapRow:
    t = result.median
    vs_bound = float(np.median(per_round)) if per_round else t / max(t_gemm, t_comm)
    hidden = (t_gemm + t_comm - t) / min(t_gemm, t_comm)
    return OverlapRow(name, t, vs_bound, hidden, error, result, tuple(per_round))


def _max_error(out: jax.Array, ref: jax.Array) -> float:
    return float(
        jax.jit(lambda a, b: abs(a.astype("float32") - b.astype("float32")).max())(out, ref)
    )


def overlap_report(
    op: str,
    shape: tuple[int, int, int],
    mesh_devices: Sequence | None = None,
    methods: Sequence[str | cg.OverlapConfig] = ("none", "pipeline:4", "ring", "ring-bidi"),
    *,
    dtype: str = "bfloat16",
    iters: int = 50,
    warmup: int = 3,
    rounds: int = 1,
    include_xla: bool = True,
    progress: Callable[[str], None] | None = None,
) -> OverlapReport:
    """Times, in one run: the GEMM alone, the collective alone, XLA's own `jnp.dot` (if asked)
    and `cg.gemm` with each method (max |error| against the serial baseline beside each).

    With rounds > 1 the variants (the GEMM and the collective alone included) are timed in
    turn, `rounds` times over in a shuffled order, `iters` samples each time: t_ms pools each
    variant's samples, and vs_bound is the median over rounds of t / bound within the round.
    On 2xH200 the GPUs' speed drifts under sustained load (the GEMM alone moved by up to 15%
    between rounds, identical executables by as much; benchmarks/NOTES.md), so a ratio of two
    figures measured seconds apart is steadier than one of figures measured a minute apart.
    """
    if rounds < 1:
        raise ValueError(f"rounds={rounds} must be >= 1")
    problem: Problem = make_problem(op, shape, dtype, mesh_devices)
    step = progress or (lambda _: None)
    x, w = problem.operands()
    reference = problem.overlapped(cg.OverlapConfig())(x, w)
    gemm_fn, gemm_args = problem.gemm_alone()
    timed: list[tuple[str, Callable, tuple]] = [
        ("gemm alone", gemm_fn, gemm_args),
        ("collective alone", problem.comm_alone(), (problem.comm_operand(),)),
    ]
    if include_xla:
        timed.append(("xla", problem.xla(), (x, w)))
    errors, failures = {}, []
    for spec in methods:
        cfg = parse_method(spec) if isinstance(spec, str) else spec
        name = spec if isinstance(spec, str) else repr(spec)
        step(f"{name} (compile, check)")
        fn = problem.overlapped(cfg)
        try:
            errors[name] = _max_error(fn(x, w), reference)
        except (ValueError, NotImplementedError) as err:  # e.g. fused kernel on a CPU
            failures.append((name, str(err)))
            step(f"{name} cannot run: {err}")
            continue
        timed.append((name, fn, (x, w)))
    results: dict[str, list[BenchmarkResult]] = {name: [] for name, _, _ in timed}
    for r in range(rounds):
        order = list(timed)
        if rounds > 1:
            random.Random(r).shuffle(order)
        for name, fn, args in order:
            step(f"{name} (round {r + 1} of {rounds})" if rounds > 1 else name)
            results[name].append(benchmark(fn, *args, iters=iters, warmup=warmup if r == 0 else 1))
    bounds = [
        max(g.median, c.median)
        for g, c in zip(results["gemm alone"], results["collective alone"], strict=True)
    ]
    pooled = {name: pool(rs) for name, rs in results.items()}
    t_gemm, t_comm = pooled.pop("gemm alone").median, pooled.pop("collective alone").median
    rows = tuple(
        _row(
            name,
            result,
            t_gemm,
            t_comm,
            errors.get(name),
            [r.median / b for r, b in zip(results[name], bounds, strict=True)]
            if rounds > 1
            else (),
        )
        for name, result in pooled.items()
    )
    return OverlapReport(
        op, tuple(shape), dtype, problem.size, t_gemm, t_comm, rows, tuple(failures)
    )
