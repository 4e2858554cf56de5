"""`overlap_report()`: for one problem, the GEMM alone, the collective alone, the serial baseline
and each method, all timed in one run, with vs_bound and hidden (../shared/DESIGN.md)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax

import commgemm as cg
from commgemm.bench.problems import Problem, make_problem, parse_method
from commgemm.bench.timing import BenchmarkResult, benchmark


@dataclasses.dataclass(frozen=True)
class OverlapRow:
    """One timed variant: t in ms (median), vs_bound = t / max(t_gemm, t_comm), and
    hidden = (t_gemm + t_comm - t) / min(t_gemm, t_comm) (1.0: the smaller one fully hidden)."""

    name: str
    t_ms: float
    vs_bound: float
    hidden: float
    max_error: float | None
    result: BenchmarkResult


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
                    "timing": r.result.as_dict(),
                }
                for r in self.rows
            ],
            "failures": [list(f) for f in self.failures],
        }


def _row(name, result, t_gemm, t_comm, error=None) -> OverlapRow:
    t = result.median
    return OverlapRow(
        name, t, t / max(t_gemm, t_comm), (t_gemm + t_comm - t) / min(t_gemm, t_comm), error, result
    )


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
    include_xla: bool = True,
    progress: Callable[[str], None] | None = None,
) -> OverlapReport:
    """Times, in one run: the GEMM alone, the collective alone, XLA's own `jnp.dot` (if asked)
    and `cg.gemm` with each method (max |error| against the serial baseline beside each)."""
    problem: Problem = make_problem(op, shape, dtype, mesh_devices)
    step = progress or (lambda _: None)
    step("gemm alone")
    gemm_fn, gemm_args = problem.gemm_alone()
    t_gemm = benchmark(gemm_fn, *gemm_args, iters=iters, warmup=warmup).median
    del gemm_args
    step("collective alone")
    t_comm = benchmark(
        problem.comm_alone(), problem.comm_operand(), iters=iters, warmup=warmup
    ).median
    x, w = problem.operands()
    reference = problem.overlapped(cg.OverlapConfig())(x, w)
    rows, failures = [], []
    if include_xla:
        step("xla jnp.dot")
        rows.append(
            _row("xla", benchmark(problem.xla(), x, w, iters=iters, warmup=warmup), t_gemm, t_comm)
        )
    for spec in methods:
        cfg = parse_method(spec) if isinstance(spec, str) else spec
        name = spec if isinstance(spec, str) else repr(spec)
        step(name)
        fn = problem.overlapped(cfg)
        try:
            error = _max_error(fn(x, w), reference)
        except (ValueError, NotImplementedError) as err:  # e.g. fused kernel on a CPU
            failures.append((name, str(err)))
            step(f"{name} cannot run: {err}")
            continue
        rows.append(
            _row(name, benchmark(fn, x, w, iters=iters, warmup=warmup), t_gemm, t_comm, error)
        )
    return OverlapReport(
        op, tuple(shape), dtype, problem.size, t_gemm, t_comm, tuple(rows), tuple(failures)
    )
