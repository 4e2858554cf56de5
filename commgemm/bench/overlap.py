"""`overlap_report()`: for one problem, the GEMM alone, the collective alone, the serial baseline
and each method, all timed in one run, with vs_bound and hidden (../shared/DESIGN.md)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import jax
import numpy as np

from commgemm.bench.problems import Problem, make_problem
from commgemm.bench.spans import (
    batch_spans_interleaved,
    device_periods_interleaved,
    device_spans,
)
from commgemm.bench.timing import BenchmarkResult, benchmark_interleaved
from commgemm.config import OverlapConfig
from commgemm.distributed import agreed
from commgemm.quant import ScalingMode

#: The two forms of XLA's GEMM alone (`Problem.gemm_alone`).
GEMM_ALONE = {False: "gemm alone", True: "gemm alone (float32 result, cast)"}
#: The other local GEMMs the best-GEMM bound takes, where they run (`Problem.gemm_alone_mosaic`,
#: `Problem.gemm_alone_torch`). t_gemm is the fastest of all; t_gemm_xla of XLA's two forms.
OTHER_GEMMS = ("gemm alone (Mosaic GPU)", "gemm alone (torch cuBLAS)")
#: The local GEMM under the report's scaling (its quantizing passes included).
QUANTIZED_GEMM = "gemm alone (quantized)"


#: What `overlap_report` times when no methods are given.
DEFAULT_METHODS = {
    "none": OverlapConfig(),
    "pipeline:4": OverlapConfig(method="pipeline", num_splits=4),
    "ring": OverlapConfig(method="ring_exchange"),
    "ring-bidi": OverlapConfig(method="ring_exchange", bidirectional=True),
}


@dataclasses.dataclass(frozen=True)
class OverlapRow:
    """One timed variant: t in ms (median), vs_bound = t / max(t_gemm, t_comm) with t_gemm the
    best local GEMM measured, vs_bound_xla the same over XLA's GEMM alone, and
    hidden = (t_gemm + t_comm - t) / min(t_gemm, t_comm) (1.0: the smaller one fully hidden).
    With device spans measured, span_ms is the median span and vs_bound_span the same ratio
    over the spans of the GEMM and the collective alone; with device periods, period_ms and
    vs_bound_period likewise (steady-state device time per call, `device_periods_interleaved`),
    and period_spread how far apart its rounds fell (`round_spread`)."""

    name: str
    t_ms: float
    vs_bound: float
    hidden: float
    max_error: float | None
    result: BenchmarkResult
    span_ms: float | None = None
    vs_bound_span: float | None = None
    period_ms: float | None = None
    vs_bound_period: float | None = None
    vs_bound_xla: float | None = None
    period_spread: float | None = None


def round_spread(rounds: Sequence[float]) -> float:
    """(largest - smallest) / median of one variant's per-round periods: how far apart the
    rounds of one trace fell (0.0 for one round). Two variants whose periods differ by less
    than their spreads are not told apart by that trace."""
    if not rounds:
        raise ValueError("no rounds")
    return float((max(rounds) - min(rounds)) / np.median(rounds))


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
    span_gemm_ms: float | None = None
    span_comm_ms: float | None = None
    span_error: str | None = None  # why device spans were not measured, when asked for
    gemm_ms: dict[str, float] = dataclasses.field(default_factory=dict)  # each GEMM-alone form
    period_gemm_ms: float | None = None
    period_comm_ms: float | None = None
    period_error: str | None = None  # why device periods were not measured, when asked for
    t_gemm_xla_ms: float | None = None  # XLA's GEMM alone (the bound before the best-GEMM one)
    period_gemm_xla_ms: float | None = None
    #: every variant's `round_spread` (the GEMMs and the collective alone included)
    period_spread: dict[str, float] = dataclasses.field(default_factory=dict)
    scaling: str | None = None  # the methods' ScalingMode, by name

    @property
    def period_noise(self) -> tuple[str, float] | None:
        """The variant whose device-period rounds spread most, and that spread, or None."""
        if not self.period_spread:
            return None
        name = max(self.period_spread, key=self.period_spread.__getitem__)
        return name, self.period_spread[name]

    @property
    def period_bound_ms(self) -> float | None:
        if self.period_gemm_ms is None or self.period_comm_ms is None:
            return None
        return max(self.period_gemm_ms, self.period_comm_ms)

    @property
    def bound_ms(self) -> float:
        return max(self.t_gemm_ms, self.t_comm_ms)

    def as_dict(self) -> dict:
        return {
            "op": self.op,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "scaling": self.scaling,
            "devices": self.devices,
            "t_gemm_ms": self.t_gemm_ms,
            "t_comm_ms": self.t_comm_ms,
            "bound_ms": self.bound_ms,
            "span_gemm_ms": self.span_gemm_ms,
            "span_comm_ms": self.span_comm_ms,
            "span_error": self.span_error,
            "period_gemm_ms": self.period_gemm_ms,
            "period_comm_ms": self.period_comm_ms,
            "period_bound_ms": self.period_bound_ms,
            "period_error": self.period_error,
            "gemm_alone_ms": self.gemm_ms,
            "t_gemm_xla_ms": self.t_gemm_xla_ms,
            "period_gemm_xla_ms": self.period_gemm_xla_ms,
            "period_spread": self.period_spread,
            "rows": [
                {
                    "name": r.name,
                    "t_ms": r.t_ms,
                    "vs_bound": r.vs_bound,
                    "hidden": r.hidden,
                    "max_error": r.max_error,
                    "span_ms": r.span_ms,
                    "vs_bound_span": r.vs_bound_span,
                    "period_ms": r.period_ms,
                    "vs_bound_period": r.vs_bound_period,
                    "vs_bound_xla": r.vs_bound_xla,
                    "period_spread": r.period_spread,
                    "timing": r.result.as_dict(),
                }
                for r in self.rows
            ],
            "failures": [list(f) for f in self.failures],
        }


def _max_error(out: jax.Array, ref: jax.Array) -> float:
    return float(
        jax.jit(lambda a, b: abs(a.astype("float32") - b.astype("float32")).max())(out, ref)
    )


def _spans(timed, calls: int, step) -> tuple[dict[str, float], str | None]:
    """{name: median device span in ms} of each timed variant, or ({}, why not). Every variant
    runs its calls even after a failure, so the processes of a multi-process run stay in step."""
    out, error = {}, None
    for name, (fn, args) in timed.items():
        step(f"{name} (device spans)")
        try:
            out[name] = float(np.median(device_spans(fn, *args, calls=calls)))
        except RuntimeError as err:
            error = error or f"{name}: {err}"
    return ({}, error) if error else (out, None)


def _periods(timed, rounds: int, step) -> tuple[dict[str, float], dict[str, float], str | None]:
    """({name: median device time per call in ms}, {name: `round_spread`}) of each timed
    variant that has one (and the bound's terms), or ({}, {}, why not). Device periods first;
    a variant whose calls they cannot tell apart (a host-paced variant, on 4 GPUs) is timed by
    device spans instead (`batch_spans_interleaved`: a batch's span / its calls, idle time
    inside included), the third item saying which. torch's GEMM is left out: its kernels are
    not in jax's profiler trace, so its batches were the ones missing from every round on 2
    GPUs and no variant got a period; it keeps its host-timed figure."""
    timed = {name: v for name, v in timed.items() if name != OTHER_GEMMS[1]}
    step(f"{len(timed)} variants, device periods, {rounds} rounds")
    unread = "(the trace)"  # a process that could not read its trace at all
    try:
        found = device_periods_interleaved(timed, rounds=rounds)
        error = None
    except RuntimeError as err:
        found, error = {}, str(err)
    errors = [f"{name}: {f['error']}" for name, f in found.items() if "error" in f]
    found = {name: f for name, f in found.items() if "error" not in f}
    # every process times the same variants by spans, or none does (each reads its own trace)
    mine = {*timed} - set(found) | ({unread} if error else set())
    missing = agreed([*timed, unread], mine, every=False)
    if unread in missing:
        return {}, {}, error or "another process could not read its trace"
    found = {name: f for name, f in found.items() if name not in missing}
    if missing := [name for name in timed if name in missing]:
        step(f"{len(missing)} variants, device spans, {rounds} rounds")
        try:
            found |= batch_spans_interleaved({n: timed[n] for n in missing}, rounds=rounds, calls=8)
            errors = [f"{e} (timed by device spans instead)" for e in errors]
        except RuntimeError as err:
            errors.append(f"device spans: {err}")
    if any(name not in found for name in (*GEMM_ALONE.values(), "collective alone")):
        return {}, {}, "; ".join(errors)
    medians = {name: f["median"] for name, f in found.items()}
    spreads = {name: round_spread(f["rounds"]) for name, f in found.items()}
    return medians, spreads, "; ".join(errors) or None


def overlap_report(
    op: str,
    shape: tuple[int, int, int],
    mesh_devices: Sequence | None = None,
    methods: Mapping[str, OverlapConfig] | Sequence[OverlapConfig] | None = None,
    *,
    dtype: str = "bfloat16",
    iters: int = 50,
    warmup: int = 3,
    group: int = 4,
    spans: int = 0,
    periods: int = 0,
    include_xla: bool = True,
    best_gemm: bool = True,
    progress: Callable[[str], None] | None = None,
    scaling: ScalingMode | str | None = None,
) -> OverlapReport:
    """Times, in one run: the GEMM alone (XLA's dot in both result forms of
    `Problem.gemm_alone`, and with best_gemm jax's Mosaic GPU Hopper matmul and torch's cuBLAS
    where they run; t_gemm is the fastest, t_gemm_xla the faster XLA form), the collective
    alone, XLA's own `jnp.dot` (if
    asked) and `cg.gemm` with each of `methods` ({name: config}, or configs named by their
    repr; default DEFAULT_METHODS) (max |error| against the serial baseline beside each).

    The variants are timed interleaved (`benchmark_interleaved`: `iters` cycles, each one
    sample of `group` calls of every variant in a shuffled order), so the GPUs' drift under
    sustained load reaches all of them alike. With spans > 0, each variant also runs `spans`
    calls under the profiler (`device_spans`) and rows carry the GPU-timestamp figures; where
    that cannot work (a CPU backend) span_error says why. With periods > 0, every variant's
    steady-state device time per call is read from one trace of `periods` interleaved rounds
    (`device_periods_interleaved`; period_error says why not, where it cannot work).

    With `scaling` (a stateless `ScalingMode`: current tensor scaling, MXFP8, NVFP4) the methods
    and the serial reference run quantized, and the quantized local GEMM (`QUANTIZED_GEMM`,
    its quantizing passes included) joins the GEMMs the bound takes the fastest of; XLA's dot
    and the other GEMMs stay in `dtype`.
    """
    if spans < 0 or periods < 0:
        raise ValueError(f"spans={spans} and periods={periods} must be >= 0")
    problem: Problem = make_problem(op, shape, dtype, mesh_devices)
    step = progress or (lambda _: None)
    if scaling is not None:
        scaling = ScalingMode(scaling)
        if scaling in (ScalingMode.NO_SCALING, ScalingMode.DELAYED_TENSOR_SCALING):
            raise ValueError(
                f"scaling={scaling.name}: the report takes a stateless mode "
                "(current tensor scaling, MXFP8, NVFP4)"
            )
    x, w = problem.operands()
    reference = problem.overlapped(OverlapConfig(), scaling=scaling)(x, w)
    timed: dict[str, tuple[Callable, tuple]] = {
        GEMM_ALONE[False]: problem.gemm_alone(),
        GEMM_ALONE[True]: problem.gemm_alone(cast=True),
        "collective alone": (problem.comm_alone(), (problem.comm_operand(),)),
    }
    errors, failures = {}, []
    if best_gemm:
        makers = (problem.gemm_alone_mosaic, problem.gemm_alone_torch)
        for name, make in zip(OTHER_GEMMS, makers, strict=True):
            try:
                found = make()
                if found is not None:
                    jax.block_until_ready(found[0](*found[1]))  # compiles and runs here
                    timed[name] = found
            except Exception as err:  # noqa: BLE001 - a GEMM that cannot run here is left out
                failures.append((name, f"{type(err).__name__}: {err}"[:300]))
        # timed by every process or by none: the interleaved runs go in one order everywhere
        for name in set(OTHER_GEMMS) - agreed(OTHER_GEMMS, timed, every=True):
            if timed.pop(name, None) is not None:
                failures.append((name, "it could not run on another process"))
    if scaling is not None:
        timed[QUANTIZED_GEMM] = problem.gemm_alone_quantized(scaling)
    if include_xla:
        timed["xla"] = (problem.xla(), (x, w))
    if methods is None:
        methods = DEFAULT_METHODS
    if not isinstance(methods, Mapping):
        methods = {repr(cfg): cfg for cfg in methods}
    for name, cfg in methods.items():
        step(f"{name} (compile, check)")
        fn = problem.overlapped(cfg, scaling=scaling)
        try:
            errors[name] = _max_error(fn(x, w), reference)
        except (ValueError, NotImplementedError) as err:  # e.g. fused kernel on a CPU
            failures.append((name, str(err)))
            step(f"{name} cannot run: {err}")
            continue
        timed[name] = (fn, (x, w))
    step(f"{len(timed)} variants interleaved, {iters} cycles")
    results = benchmark_interleaved(timed, iters=iters, warmup=warmup, group=group)
    span_ms, span_error = _spans(timed, spans, step) if spans else ({}, None)
    period_ms, spread, period_error = _periods(timed, periods, step) if periods else ({}, {}, None)
    gemm_names = [n for n in (*GEMM_ALONE.values(), *OTHER_GEMMS, QUANTIZED_GEMM) if n in results]
    gemm_ms = {name: results.pop(name).median for name in gemm_names}
    t_gemm = min(gemm_ms.values())
    t_gemm_xla = min(gemm_ms[name] for name in GEMM_ALONE.values())
    t_comm = results.pop("collective alone").median
    span_bound = span_gemm = None
    if span_ms:
        span_gemm = min(span_ms[name] for name in gemm_names if name in span_ms)
        span_bound = max(span_gemm, span_ms["collective alone"])
    period_bound = period_gemm = period_gemm_xla = None
    if period_ms:
        period_gemm = min(period_ms[name] for name in gemm_names if name in period_ms)
        period_gemm_xla = min(period_ms[name] for name in GEMM_ALONE.values())
        period_bound = max(period_gemm, period_ms["collective alone"])
    rows = tuple(
        OverlapRow(
            name,
            result.median,
            result.median / max(t_gemm, t_comm),
            (t_gemm + t_comm - result.median) / min(t_gemm, t_comm),
            errors.get(name),
            result,
            span_ms.get(name),
            span_ms[name] / span_bound if span_bound else None,
            period_ms.get(name),
            period_ms[name] / period_bound if period_bound and name in period_ms else None,
            result.median / max(t_gemm_xla, t_comm),
            spread.get(name),
        )
        for name, result in results.items()
    )
    return OverlapReport(
        op,
        tuple(shape),
        dtype,
        problem.size,
        t_gemm,
        t_comm,
        rows,
        tuple(failures),
        span_gemm,
        span_ms.get("collective alone"),
        span_error,
        gemm_ms,
        period_gemm,
        period_ms.get("collective alone"),
        period_error,
        t_gemm_xla,
        period_gemm_xla,
        spread,
        None if scaling is None else scaling.name,
    )
