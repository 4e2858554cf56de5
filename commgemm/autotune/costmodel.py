"""A cost model for Method.AUTO when the autotuner has no measurement: the schedule of each
candidate simulated on two resources (the GEMM stream and the communication stream), with
measured (or default) FLOP rate, link bandwidth and per-transfer latency.

The graphs mirror what the algorithms ask XLA for: transfers one at a time (XLA's GPU scheduler
keeps one collective in flight), each ring piece's transfer after the previous piece's GEMM,
GEMMs in order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from commgemm.config import Collective, Method, OverlapConfig, split_requirement
from commgemm.mosaic_gpu.heuristics import direct_ag_config, direct_rs_config, ring_ag_first


@dataclasses.dataclass(frozen=True)
class MachineFigures:
    """flops_per_s: one device's GEMM rate; bytes_per_s: what one device receives per second in
    a collective; latency_s: fixed cost of one transfer (and of one GEMM launch); interference:
    how much slower a GEMM runs beside a transfer (they share SMs and memory bandwidth);
    duplex_ring: whether the two directions of a bidirectional ring move at once, each at
    bytes_per_s, on links of their own (TPU ICI), rather than one after the other through the
    device's one set of links (GPUs behind NVSwitch, where XLA also keeps one collective in
    flight)."""

    flops_per_s: float
    bytes_per_s: float
    latency_s: float
    interference: float = 0.25
    duplex_ring: bool = False


#: Defaults where the tuner measured nothing: a Hopper GPU's bf16 GEMM rate and NVLink
#: all-gather bandwidth received (an overlapped GEMM about 25% slower than alone), a slow CPU.
DEFAULT_FIGURES = {
    "gpu": MachineFigures(7.0e14, 2.4e11, 2.0e-5),
    "cpu": MachineFigures(2.0e10, 5.0e9, 5.0e-5),
}

#: TPU generations, not measured here (no TPU is lent to this project): peak dense bf16 FLOP/s
#: per chip (Cloud TPU docs, "TPU v5e", "TPU v5p", "TPU v6e"), one-way bandwidth of one ICI link
#: (the TPU chapter of "How to Scale Your Model", Austin et al., 2025: 4.5e10 B/s on v5e,
#: 9e10 B/s on v5p and v6e), which is what a device receives from one neighbour of a ring; the
#: latency a transfer costs and the interference are assumptions (docs/tpu.md); each direction of
#: a ring has links of its own (the torus' wraparound links both ways).
TPU_FIGURES = {
    "v5e": MachineFigures(1.97e14, 4.5e10, 1.0e-5, 0.1, duplex_ring=True),
    "v5p": MachineFigures(4.59e14, 9.0e10, 1.0e-5, 0.1, duplex_ring=True),
    "v6e": MachineFigures(9.18e14, 9.0e10, 1.0e-5, 0.1, duplex_ring=True),
}


#: How much faster than serial (NONE) the model must predict an overlapped plan before AUTO
#: takes it, by (backend, family, devices: 2 or "3+"): the model's own error where it was
#: measured, so that AUTO runs NONE wherever the predicted gain is within it. A candidate
#: scores its predicted time x (1 + margin); NONE scores its own. 0 where nothing was measured
#: (TPUs, CPUs): the model's choice as it is. A tune cache's measured winner overrides all.
AUTO_MARGINS = {
    # the fused kernels: the model predicts them well, a margin against noise
    ("gpu", "fused", 2): 0.10,
    ("gpu", "fused", "3+"): 0.10,
    # the split rings (where the fused kernels cannot run: one process per GPU on an older NCCL,
    # several machines): the model overrates them on GPUs; only a tuned winner picks them
    ("gpu", "split", 2): 1.0,
    ("gpu", "split", "3+"): 1.0,
    # FP8 operands (the model knows bf16 rates only): as bf16's, but the split rings never
    # beyond 2 GPUs (the layer step's FP8 dX in them is slower than serial there)
    ("gpu", "fused-fp8", 2): 0.10,
    ("gpu", "split-fp8", 2): 1.0,
    ("gpu", "fused-fp8", "3+"): 0.10,
    ("gpu", "split-fp8", "3+"): float("inf"),
}


def auto_margin(
    backend: str | None, cfg: OverlapConfig, size: int, *, quantized: bool = False
) -> float:
    """`AUTO_MARGINS`' entry for `cfg` on `size` devices of `backend`, its FP8 family's where
    `quantized` (0 for NONE, for no backend, and where nothing was measured)."""
    if backend is None or cfg.method is Method.NONE:
        return 0.0
    family = ("fused" if cfg.atomic_gemm else "split") + ("-fp8" if quantized else "")
    return AUTO_MARGINS.get((backend, family, 2 if size <= 2 else "3+"), 0.0)


def default_figures(backend: str, device_kind: str = "") -> MachineFigures:
    """The cost model's figures where the tuner measured none: a TPU's by its generation (v5e
    where it is not recognised), else the GPU's or the CPU's."""
    if backend == "tpu":
        kind = device_kind.lower()
        if "v6" in kind:
            return TPU_FIGURES["v6e"]
        if "v5p" in kind or ("v5" in kind and "lite" not in kind and "v5e" not in kind):
            return TPU_FIGURES["v5p"]
        return TPU_FIGURES["v5e"]
    return DEFAULT_FIGURES.get(backend, DEFAULT_FIGURES["gpu"])


@dataclasses.dataclass
class _Task:
    resource: str
    duration: float
    deps: list[int]


class _Graph:
    def __init__(self) -> None:
        self.tasks: list[_Task] = []

    def add(self, resource: str, duration: float, *deps: int | None) -> int:
        self.tasks.append(_Task(resource, duration, [d for d in deps if d is not None]))
        return len(self.tasks) - 1

    def makespan(self) -> float:
        """Tasks run in insertion order on their resource, each after its dependencies."""
        free: dict[str, float] = {}
        end: list[float] = []
        for task in self.tasks:
            start = max([free.get(task.resource, 0.0)] + [end[d] for d in task.deps])
            end.append(start + task.duration)
            free[task.resource] = end[-1]
        return max(end, default=0.0)


def _times(
    collective: Collective,
    shape: tuple[int, int, int],
    size: int,
    itemsize: int,
    fig: MachineFigures,
) -> tuple[float, float]:
    """(GEMM time, collective time) of one device without overlap."""
    m, k, n = shape
    flops = 2.0 * m * k * n / size
    received = {
        Collective.ALL_GATHER: (size - 1) * (m // size) * k,
        Collective.REDUCE_SCATTER: (size - 1) * (m // size) * n,
        Collective.ALL_REDUCE: 2 * (size - 1) * (m // size) * n,
    }[collective]
    return flops / fig.flops_per_s, received * itemsize / fig.bytes_per_s


def predict(
    collective: Collective,
    cfg: OverlapConfig,
    shape: tuple[int, int, int],
    size: int,
    itemsize: int,
    fig: MachineFigures,
) -> float:
    """Predicted seconds for one call of `cfg` (method NONE, PIPELINE or RING_EXCHANGE, or a
    fused kernel: atomic_gemm; the direct kernels (ATOMIC_GEMM_AG / _RS) spread their transfers
    over the GEMM with no step barrier, so they cost the larger of the two plus two handshakes)."""
    t_gemm, t_comm = _times(collective, shape, size, itemsize, fig)
    lat = fig.latency_s
    if cfg.atomic_gemm and size > 1:
        if cfg.method is Method.PIPELINE:  # the direct kernels: no ring, no step barrier
            return max(t_gemm, t_comm) + 2 * lat
        return _predict_fused(t_gemm, t_comm, size, lat)
    g = _Graph()
    if size == 1 or cfg.method is Method.NONE:
        if collective is Collective.ALL_GATHER:
            g.add("gemm", t_gemm + lat, g.add("comm", t_comm + lat))
        else:
            g.add("comm", t_comm + lat, g.add("gemm", t_gemm + lat))
        return g.makespan()
    s = cfg.num_splits
    t_gemm *= 1.0 + fig.interference
    if cfg.method is Method.PIPELINE:
        gemms: list[int] = []
        comm = None
        for c in range(s):
            if collective is Collective.ALL_GATHER:
                hint = gemms[c - 2] if c >= 2 else None
                comm = g.add("comm", t_comm / s + lat, comm, hint)
                gemms.append(g.add("gemm", t_gemm / s + lat, comm))
            else:
                gemms.append(g.add("gemm", t_gemm / s + lat, gemms[-1] if gemms else None))
                comm = g.add("comm", t_comm / s + lat, comm, gemms[-1])
        return g.makespan()
    # RING_EXCHANGE: steps of P-1 transfers (both ways, at once where fig.duplex_ring, when
    # bidirectional).
    bidi = cfg.bidirectional or cfg.aggregate
    n_fwd, n_bwd = (size // 2, (size - 1) // 2) if bidi else (size - 1, 0)
    link = {"fwd": "comm-fwd", "bwd": "comm-bwd" if fig.duplex_ring else "comm-fwd"}
    step_gemm = t_gemm / size / s
    if collective is Collective.ALL_GATHER:
        transfer = t_comm / (size - 1) / s
        arrived: dict[tuple[int, int, str], int] = {}
        last = None
        for t in range(n_fwd + 1):
            for j in range(s):
                for way, steps in (("fwd", n_fwd), ("bwd", n_bwd)):
                    if t < steps:
                        arrived[(t, j, way)] = g.add(
                            link[way], transfer + lat, arrived.get((t - 1, j, way)), last
                        )
                last = g.add("gemm", step_gemm + lat, arrived.get((t - 1, j, "fwd")), last)
                if 0 < t <= n_bwd:
                    last = g.add("gemm", step_gemm + lat, arrived.get((t - 1, j, "bwd")), last)
        return g.makespan()
    transfer = t_comm / (2 if collective is Collective.ALL_REDUCE else 1) / (size - 1) / s
    sent: dict[tuple[int, int, str], int] = {}
    last = None
    for t in range(n_fwd + 1):
        for j in range(s):
            for way, steps in (("fwd", n_fwd), ("bwd", n_bwd)):
                if way == "bwd" and t >= steps:
                    continue
                last = g.add("gemm", step_gemm + lat, last)
                if t < steps:  # the partial sum (received + this GEMM) moves on
                    sent[(t, j, way)] = g.add(
                        link[way], transfer + lat, last, sent.get((t - 1, j, way))
                    )
    if collective is Collective.ALL_REDUCE:
        g.add("comm-fwd", t_comm / 2 + lat, *sent.values(), last)
    return g.makespan()


def _predict_fused(t_gemm: float, t_comm: float, size: int, lat: float) -> float:
    """The fused kernel: P steps of one row block's GEMM each; a step's block (AG: the x rows it
    multiplied; RS: the partial sums it wrote) travels to the next device during the step, by the
    CTAs themselves, and the next step waits for it. No interference term: the CTAs that send
    are the ones computing."""
    step, transfer = t_gemm / size, t_comm / (size - 1)
    return (size - 1) * (max(step, transfer) + lat) + step + lat


def candidates(
    collective: Collective,
    rows: int,
    size: int,
    *,
    fused: bool = False,
    deterministic: bool = False,
    shape: tuple[int, int, int] | None = None,
    spread: bool = False,
    tpu: bool = False,
    interpret: bool = False,
) -> list[OverlapConfig]:
    """Configs the model (and the tuner) consider, keeping those x's split dimension allows;
    with `fused`, also the fused kernels (for AG and RS, where the caller found they can run):
    the ring and the direct one. The direct RS kernel takes `heuristics.direct_rs_config`; with
    `deterministic` it keeps whole tails and runs on 2 devices only (its adds otherwise happen
    in arrival order). The direct AG kernel takes
    `heuristics.direct_ag_config` (`spread`: sending a device's rows takes longer than their GEMM).
    `shape`: the global (M, K, N), where known (see `direct_rs_tiles`). With `tpu`, the fused
    candidates are the Pallas TPU kernels (ring and direct, adding in a fixed order; with
    `interpret`, interpreted)."""
    out = [OverlapConfig()]
    if tpu and fused and size > 1 and collective is not Collective.ALL_REDUCE:
        for method in (Method.PIPELINE, Method.RING_EXCHANGE):
            out.append(OverlapConfig(method=method, atomic_gemm=True, interpret=interpret))
        fused = False
    direct_rs = not deterministic or size == 2
    if fused and size > 1 and collective is Collective.REDUCE_SCATTER and direct_rs:
        tiles = direct_rs_config(rows, size, shape, deterministic=deterministic)
        out.append(OverlapConfig(method=Method.PIPELINE, atomic_gemm=True, kernel=tiles))
    if fused and size > 1 and collective is Collective.ALL_GATHER:
        n = None if shape is None else shape[2] // size
        tiles = direct_ag_config(rows, spread=spread, n=n)
        out.append(OverlapConfig(method=Method.PIPELINE, atomic_gemm=True, kernel=tiles))
    if fused and size > 1 and collective is not Collective.ALL_REDUCE:
        out.append(OverlapConfig(method=Method.RING_EXCHANGE, atomic_gemm=True))
    for s in (2, 4, 8):
        out.append(OverlapConfig(method=Method.PIPELINE, num_splits=s))
    for s in (1, 2, 4, 8):
        out.append(OverlapConfig(method=Method.RING_EXCHANGE, num_splits=s))
        if size > 2:
            out.append(OverlapConfig(method=Method.RING_EXCHANGE, num_splits=s, bidirectional=True))
    return [
        c for c in out if rows % split_requirement(collective, c.method, size, c.num_splits) == 0
    ]


def choose(
    collective: Collective,
    shape: tuple[int, int, int],
    rows: int,
    size: int,
    itemsize: int,
    fig: MachineFigures,
    *,
    fused: bool = False,
    runs: Callable[[OverlapConfig], bool] | None = None,
    deterministic: bool = False,
    tpu: bool = False,
    interpret: bool = False,
    backend: str | None = None,
    quantized: bool = False,
) -> tuple[OverlapConfig, float]:
    """The candidate with the least predicted time (the first, i.e. simplest, among equals), the
    ring AG kernel in place of the direct one where `heuristics.ring_ag_first`; `runs(config)`
    says whether a fused candidate can run the call (None: all can). On `backend`, an
    overlapped candidate must beat serial by its family's `AUTO_MARGINS` (its predicted time
    is scored x (1 + margin); `quantized`: the FP8 families'); the time returned is the
    prediction."""
    t_gemm, t_comm = _times(collective, shape, size, itemsize, fig)
    options = candidates(
        collective,
        rows,
        size,
        fused=fused,
        deterministic=deterministic,
        shape=shape,
        spread=t_comm > t_gemm / size,  # the own rows take longer to send than to multiply
        tpu=tpu,
        interpret=interpret,
    )
    if runs is not None:
        options = [c for c in options if not c.atomic_gemm or runs(c)]
    scored = [
        (predict(collective, c, shape, size, itemsize, fig), i, c) for i, c in enumerate(options)
    ]

    def score(entry) -> tuple[float, int]:
        margin = auto_margin(backend, entry[2], size, quantized=quantized)
        return round(entry[0] * (1 + margin), 12), entry[1]

    best = min(scored, key=score)
    hopper_ag = collective is Collective.ALL_GATHER and not tpu
    if hopper_ag and best[2].atomic_gemm and ring_ag_first(size):
        # the model has both AG kernels at the transfers' time; the tuner measures both. The
        # direct one is the slower there: where the ring does not beat serial, neither does it
        ring = [s for s in scored if s[2].atomic_gemm and s[2].method is Method.RING_EXCHANGE]
        serial = next(s for s in scored if s[2].method is Method.NONE)
        best = min(ring[:1] + [serial], key=score) if ring else best
    return best[2], best[0]
