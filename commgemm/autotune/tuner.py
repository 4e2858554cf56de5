"""The tuner behind `commgemm tune`: measure the candidate plans of one problem in one run
(`commgemm.bench.overlap_report`), store the fastest and the machine figures the run implies in
the tune cache for Method.AUTO."""

from __future__ import annotations

import dataclasses
import datetime
import pathlib
from collections.abc import Callable, Sequence

import jax
import numpy as np

from commgemm.autotune import cache
from commgemm.autotune.costmodel import MachineFigures, candidates, default_figures
from commgemm.config import Collective, OverlapConfig

OPS = {"ag": Collective.ALL_GATHER, "rs": Collective.REDUCE_SCATTER, "ar": Collective.ALL_REDUCE}


@dataclasses.dataclass(frozen=True)
class TuneResult:
    """What one tuning run measured: each candidate's time and vs_bound (ms, by `timing`), the
    winner, the machine figures, and whether (and where) the cache was written."""

    key: str
    best: OverlapConfig
    times_ms: dict[OverlapConfig, float]
    vs_bound: dict[OverlapConfig, float]
    machine: MachineFigures
    timing: str = "host"  # what ranked the candidates: "host" or "device periods"
    period_error: str | None = None  # why device periods were not used, where asked for
    saved_to: pathlib.Path | None = None
    save_error: str | None = None  # why the cache could not be written (the figures are kept)
    entry: dict | None = None  # the cache entry, as JSON
    #: ranked by device periods: the variant whose rounds spread most, and that spread
    #: (`OverlapReport.period_noise`); candidates closer than it are not told apart
    period_noise: tuple[str, float] | None = None


def _tuning_configs(op: str) -> list[OverlapConfig]:
    """The fused kernels' tuning candidates (`mosaic_gpu.heuristics`) as configs."""
    from commgemm.mosaic_gpu.configs import PIPELINE_FAMILIES
    from commgemm.mosaic_gpu.heuristics import TUNING_CANDIDATES

    return [
        OverlapConfig(
            method="pipeline" if isinstance(k, PIPELINE_FAMILIES) else "ring_exchange",
            atomic_gemm=True,
            kernel=k,
        )
        for k in TUNING_CANDIDATES.get(op, ())
    ]


def _core_runs(collective: Collective, shape: tuple[int, int, int], size: int, dtype: str) -> bool:
    """Whether the Hopper GEMM kernel (local_gemm "mosaic") runs the serial plan's local GEMM:
    AG gathered x [M, K] @ w [K, N/P]; RS and AR x [M, K/P] @ w [K/P, N]."""
    from commgemm.mosaic_gpu.gemm_core import gemm_reason

    m, k, n = shape
    if collective is Collective.ALL_GATHER:
        x, w = (m, k), (k, n // size)
    else:
        x, w = (m, k // size), (k // size, n)
    x, w = jax.ShapeDtypeStruct(x, dtype), jax.ShapeDtypeStruct(w, dtype)
    return gemm_reason(x, w, False, dtype) is None


def default_candidates(op: str, shape: tuple[int, int, int], size: int, dtype: str):
    """The cost model's candidates for this problem, and the extra fused tilings that can run."""
    from commgemm.mosaic_gpu.fused import reason_for_shape

    collective = OPS[op]
    rows = shape[0] // size if collective is Collective.ALL_GATHER else shape[0]

    def runs(c: OverlapConfig) -> bool:  # each fused candidate where its own kernel runs
        return not c.atomic_gemm or reason_for_shape(collective, shape, size, dtype, c) is None

    fused = collective is not Collective.ALL_REDUCE
    found = [c for c in candidates(collective, rows, size, fused=fused, shape=shape) if runs(c)]
    if _core_runs(collective, shape, size, dtype):  # each split plan on the Hopper kernel too
        found += [c.replace(local_gemm="mosaic") for c in found if not c.atomic_gemm]
    if fused:
        found += [c for c in _tuning_configs(op) if c not in found and runs(c)]
    return found


def tune(
    op: str,
    shape: tuple[int, int, int],
    *,
    dtype: str = "bfloat16",
    methods: Sequence[OverlapConfig] | None = None,
    iters: int = 40,
    periods: int = 6,
    path: pathlib.Path | None = None,
    progress: Callable[[str], None] | None = None,
    label: Callable[[OverlapConfig], str] = repr,
    scaling: str | None = None,
) -> TuneResult:
    """Measures every candidate (`overlap_report`: one run, interleaved) and stores the fastest
    and the machine figures the run implies (GEMM rate, received bytes per second) in the cache.
    With `scaling` (a stateless ScalingMode's value) the candidates run quantized and the winner
    is stored under that mode's key (`cache.plan_key`), which AUTO reads for calls with that
    scaling; the machine figures, which the cost model reads for plain operands, are then left
    as they are.
    Where device periods can be read (GPUs; `periods` rounds, 0 for none) they rank the
    candidates, being far steadier than the host-timed medians; elsewhere the host timing.
    A cache that cannot be written does not lose the measurements: `save_error` says why and
    `entry` holds what would have been stored."""
    from commgemm.bench.overlap import overlap_report

    if op not in OPS:
        raise ValueError(f"op={op!r}: the tuner handles {sorted(OPS)}")
    size = len(jax.devices())
    methods = list(methods) if methods is not None else default_candidates(op, shape, size, dtype)
    if not methods:
        raise ValueError("no candidate to measure")
    named = {label(c): c for c in methods}
    report = overlap_report(
        op,
        shape,
        methods=named,
        dtype=dtype,
        iters=iters,
        periods=periods,
        include_xla=False,
        progress=progress,
        scaling=scaling,
    )
    if not report.rows:
        raise ValueError(f"no candidate could run: {report.failures}")
    by_period = all(r.period_ms is not None for r in report.rows)

    def t_of(r) -> float:
        return r.period_ms if by_period else r.t_ms

    def vs_bound_of(r) -> float:
        return r.vs_bound_period if by_period else r.vs_bound

    best = min(report.rows, key=t_of)
    if jax.process_count() > 1:  # every rank stores and then plans the same winner: process 0's
        from jax.experimental import multihost_utils

        index = np.int32(report.rows.index(best))
        best = report.rows[int(multihost_utils.broadcast_one_to_all(index))]
    # the split methods multiply with XLA's dot: its rate is what the cost model predicts with
    t_gemm = report.period_gemm_xla_ms if by_period else report.t_gemm_xla_ms
    t_comm = report.period_comm_ms if by_period else report.t_comm_ms
    kind = jax.devices()[0].device_kind
    itemsize = np.dtype(dtype).itemsize
    m, k, n = shape
    received = {
        "ag": (size - 1) * (m // size) * k,
        "rs": (size - 1) * (m // size) * n,
        "ar": 2 * (size - 1) * (m // size) * n,
    }[op]
    default = default_figures(jax.default_backend(), kind)
    machine = MachineFigures(
        flops_per_s=2.0 * m * k * n / size / (t_gemm * 1e-3),
        bytes_per_s=received * itemsize / (t_comm * 1e-3) if size > 1 else default.bytes_per_s,
        latency_s=default.latency_s,
        interference=default.interference,
        duplex_ring=default.duplex_ring,
    )
    timing = "device periods" if by_period else "host"
    key = cache.plan_key(kind, size, op, shape, dtype, scaling)
    entry = cache.PlanEntry(
        config=named[best.name],
        t_ms=t_of(best),
        vs_bound=vs_bound_of(best),
        timing=timing,
        measured=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    )
    saved_to = save_error = None
    try:
        machines = {cache.machine_key(kind, size): machine} if scaling is None else {}
        saved_to = cache.store({key: entry}, machines, path)
    except OSError as err:
        save_error = f"{type(err).__name__}: {err}"
    return TuneResult(
        key,
        named[best.name],
        {named[r.name]: t_of(r) for r in report.rows},
        {named[r.name]: vs_bound_of(r) for r in report.rows},
        machine,
        timing,
        report.period_error,
        saved_to,
        save_error,
        entry.as_json(),
        report.period_noise if by_period else None,
    )


__all__ = ["TuneResult", "default_candidates", "tune"]
