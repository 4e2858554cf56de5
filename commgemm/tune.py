"""The autotuner behind Method.AUTO: measure candidate plans, keep the winner in an on-disk cache
keyed by device kind, mesh size, op, global shape and dtype; without an entry, the cost model
(commgemm.costmodel) decides, from the machine figures the tuner measured or from defaults.

Cache: $COMMGEMM_TUNE_CACHE, else ~/.cache/commgemm/tune.json. One JSON object:
  {"plans": {key: {"method": "ring:2", "t_ms": ..., "vs_bound": ..., "measured": ISO date}},
   "machines": {device_kind/P: {"flops_per_s": ..., "bytes_per_s": ..., "latency_s": ...}}}
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
import pathlib

import jax
import numpy as np

from commgemm.config import Collective, Method, OverlapConfig
from commgemm.costmodel import DEFAULT_FIGURES, MachineFigures, candidates, choose

OPS = {"ag": Collective.ALL_GATHER, "rs": Collective.REDUCE_SCATTER, "ar": Collective.ALL_REDUCE}
SPEC_OF = {v: k for k, v in OPS.items()}


#: Tilings of the fused kernels the tuner also measures, beside the cost model's candidates
#: ("fused", "fused-direct-gm" for AG and `costmodel.direct_rs_tiles` for RS), where the shape
#: allows them; on 2xH200 each was the fastest, or within noise of it, on some preset
#: (BENCHMARKS.md: fused-w16 and fused-direct-w16 on llama70b AG, fused-gm on llama8b and
#: llama13b AG, stages 19 and 20; fused-direct-cm on comm_heavy AG, stages 22 to 26;
#: fused-direct-cm-ct-t0 on llama70b RS, stage 24; fused-direct-cm-r50 to -r100 on comm_heavy
#: AG, stage 30).
FUSED_TILINGS = {
    Collective.ALL_GATHER: (
        "fused-w16",
        "fused-gm",
        "fused-direct",
        "fused-direct-w16",
        "fused-direct-cm",
        "fused-direct-cm-r50",
    ),
    Collective.REDUCE_SCATTER: (
        "fused-direct",
        "fused-direct-cm-t0",
        "fused-direct-cm-ct",
        "fused-direct-cm-ct-t0",
        "fused-direct-wgm-cm-ct-m64-n256-k128-s2-t0-a2",
    ),
}


def cache_path() -> pathlib.Path:
    env = os.environ.get("COMMGEMM_TUNE_CACHE")
    if env:
        return pathlib.Path(env)
    return pathlib.Path.home() / ".cache" / "commgemm" / "tune.json"


def plan_key(device_kind: str, size: int, op: str, shape: tuple[int, int, int], dtype: str) -> str:
    m, k, n = shape
    return f"{device_kind}/P{size}/{op}/{m}x{k}x{n}/{np.dtype(dtype).name}"


def machine_key(device_kind: str, size: int) -> str:
    return f"{device_kind}/P{size}"


@functools.lru_cache(maxsize=8)
def _read(path: str, mtime: float) -> dict:
    del mtime  # part of the cache key only: a rewritten file is read again
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"tune cache {path} is not a JSON object")
    return data


def load_cache(path: pathlib.Path | None = None) -> dict:
    """The cache's contents ({} if there is no file yet)."""
    path = path or cache_path()
    if not path.exists():
        return {"plans": {}, "machines": {}}
    data = _read(str(path), path.stat().st_mtime)
    return {"plans": dict(data.get("plans", {})), "machines": dict(data.get("machines", {}))}


def _write(data: dict, path: pathlib.Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    tmp.replace(path)  # atomic: a reader never sees half a file


def spec_of(cfg: OverlapConfig) -> str:
    """The method spec string (as `commgemm bench --methods` takes) of a config."""
    if cfg.atomic_gemm:
        from commgemm.bench.problems import fused_spec

        return fused_spec(cfg.fused_tiles, direct=cfg.method is Method.PIPELINE)
    name = {Method.NONE: "none", Method.PIPELINE: "pipeline"}.get(cfg.method)
    if name is None:
        name = "ring-agg" if cfg.aggregate else "ring-bidi" if cfg.bidirectional else "ring"
    if cfg.num_splits > 1 and cfg.method is not Method.NONE:
        name = f"{name}:{cfg.num_splits}"
    return f"{name}-chain" if cfg.chain_gemms else name


@dataclasses.dataclass(frozen=True)
class TuneResult:
    key: str
    best: str
    times_ms: dict[str, float]
    vs_bound: dict[str, float]
    machine: MachineFigures
    timing: str = "host"  # what ranked the candidates: "host" or "device periods"
    period_error: str | None = None  # why device periods were not used, where asked for


def tune(
    op: str,
    shape: tuple[int, int, int],
    *,
    dtype: str = "bfloat16",
    methods: list[str] | None = None,
    iters: int = 40,
    periods: int = 6,
    path: pathlib.Path | None = None,
    progress=None,
) -> TuneResult:
    """Measures every candidate (`overlap_report`: one run, interleaved), stores the fastest and
    the machine figures the run implies (GEMM rate, received bytes per second) in the cache.
    Where device periods can be read (GPUs; `periods` rounds, 0 for none) they rank the
    candidates, being far steadier than the host-timed medians; elsewhere the host timing."""
    from commgemm.bench.overlap import overlap_report

    if op not in OPS:
        raise ValueError(f"op={op!r}: the tuner handles {sorted(OPS)}")
    size = len(jax.devices())
    collective = OPS[op]
    rows = shape[0] // size if collective is Collective.ALL_GATHER else shape[0]
    if methods is None:
        from commgemm.algorithms.fused import reason_for_shape

        fused = collective is not Collective.ALL_REDUCE and (
            reason_for_shape(collective, shape, size, dtype) is None
        )
        found = candidates(collective, rows, size, fused=fused, shape=shape)
        methods = [spec_of(c) for c in found]
        if fused:
            from commgemm.bench.problems import parse_method

            methods += [
                m
                for m in FUSED_TILINGS[collective]
                if m not in methods
                and reason_for_shape(collective, shape, size, dtype, parse_method(m)) is None
            ]
    report = overlap_report(
        op,
        shape,
        methods=methods,
        dtype=dtype,
        iters=iters,
        periods=periods,
        include_xla=False,
        progress=progress,
    )
    by_period = all(r.period_ms is not None for r in report.rows)

    def t_of(r) -> float:
        return r.period_ms if by_period else r.t_ms

    def vs_bound_of(r) -> float:
        return r.vs_bound_period if by_period else r.vs_bound

    best = min(report.rows, key=t_of)
    t_gemm = report.period_gemm_ms if by_period else report.t_gemm_ms
    t_comm = report.period_comm_ms if by_period else report.t_comm_ms
    kind = jax.devices()[0].device_kind
    itemsize = np.dtype(dtype).itemsize
    m, k, n = shape
    received = {
        "ag": (size - 1) * (m // size) * k,
        "rs": (size - 1) * (m // size) * n,
        "ar": 2 * (size - 1) * (m // size) * n,
    }[op]
    default = DEFAULT_FIGURES.get(jax.default_backend(), DEFAULT_FIGURES["gpu"])
    machine = MachineFigures(
        flops_per_s=2.0 * m * k * n / size / (t_gemm * 1e-3),
        bytes_per_s=received * itemsize / (t_comm * 1e-3) if size > 1 else default.bytes_per_s,
        latency_s=default.latency_s,
        interference=default.interference,
    )
    path = path or cache_path()
    data = load_cache(path)
    key = plan_key(kind, size, op, shape, dtype)
    data["plans"][key] = {
        "method": best.name,
        "t_ms": t_of(best),
        "vs_bound": vs_bound_of(best),
        "timing": "device periods" if by_period else "host",  # what ranked the candidates
        "measured": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    data["machines"][machine_key(kind, size)] = dataclasses.asdict(machine)
    _write(data, path)
    return TuneResult(
        key,
        best.name,
        {r.name: t_of(r) for r in report.rows},
        {r.name: vs_bound_of(r) for r in report.rows},
        machine,
        "device periods" if by_period else "host",
        report.period_error,
    )


def resolve_auto(
    cfg: OverlapConfig,
    collective: Collective,
    x: jax.Array,
    w: jax.Array,
    size: int,
    *,
    w_transposed: bool,
) -> OverlapConfig:
    """The concrete config for method=AUTO on this per-shard call: the cached winner for the
    global shape, else the cost model's choice (with cfg.deterministic, among the plans whose
    result is the same on every call). Dtype fields, save_gathered_input and deterministic are
    kept."""
    from commgemm.algorithms.fused import varies_between_calls
    from commgemm.bench.problems import parse_method

    rows = x.shape[0]
    n_local = w.shape[0] if w_transposed else w.shape[1]
    if collective is Collective.ALL_GATHER:
        shape = (size * rows, x.shape[1], size * n_local)
    else:
        shape = (rows, size * x.shape[1], n_local)
    kind = jax.devices()[0].device_kind
    data = load_cache()
    entry = data["plans"].get(plan_key(kind, size, SPEC_OF[collective], shape, x.dtype.name))
    chosen = parse_method(entry["method"]) if entry is not None else None
    fused_ok = _fused_runs(cfg, collective, x, w, size, w_transposed)
    if chosen is not None and chosen.atomic_gemm:
        varies = cfg.deterministic and varies_between_calls(collective, chosen, size)
        if not fused_ok or varies:
            chosen = None
    if chosen is None:
        figures = data["machines"].get(machine_key(kind, size))
        fig = (
            MachineFigures(**figures)
            if figures
            else DEFAULT_FIGURES.get(jax.default_backend(), DEFAULT_FIGURES["gpu"])
        )
        chosen, _ = choose(
            collective,
            shape,
            rows,
            size,
            x.dtype.itemsize,
            fig,
            fused=fused_ok,
            deterministic=cfg.deterministic,
        )
    return cfg.replace(
        method=chosen.method,
        num_splits=chosen.num_splits,
        bidirectional=chosen.bidirectional,
        aggregate=chosen.aggregate,
        atomic_gemm=chosen.atomic_gemm,
        fused_tiles=chosen.fused_tiles,
    )


def _fused_runs(cfg, collective, x, w, size, w_transposed) -> bool:
    """Whether the fused kernel can run this call under cfg's dtype fields."""
    from commgemm.algorithms.fused import unsupported_reason

    if collective is Collective.ALL_REDUCE:
        return False
    trial = cfg.replace(
        method=Method.RING_EXCHANGE,
        num_splits=1,
        bidirectional=False,
        aggregate=False,
        atomic_gemm=True,
        fused_tiles=None,
    )
    return unsupported_reason(collective, x, w, size, trial, w_transposed=w_transposed) is None
