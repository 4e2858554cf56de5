"""Enums and the frozen `OverlapConfig` that selects how a collective GEMM is overlapped.

The names follow the reference system (CommOverlapType, CommOverlapMethod, CommOverlapAlgo) so its
users feel at home.
"""

from __future__ import annotations

import dataclasses
import enum

import jax.numpy as jnp
import numpy as np

from commgemm.mosaic_gpu.configs import FAMILIES, PIPELINE_FAMILIES, KernelConfig


class Collective(enum.Enum):
    """Which collective accompanies the GEMM (the reference's CommOverlapType)."""

    NONE = "none"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"

    @classmethod
    def _missing_(cls, value: object) -> Collective | None:
        """Names in any case and the CLI's short spelling: "ALL_GATHER", "ag", "rs", "ar"."""
        if isinstance(value, str):
            key = value.strip().lower().replace("-", "_")
            short = {"ag": cls.ALL_GATHER, "rs": cls.REDUCE_SCATTER, "ar": cls.ALL_REDUCE}
            return cls.__members__.get(key.upper()) or short.get(key)
        return None


class Method(enum.Enum):
    """How the collective is overlapped with the GEMM (the reference's CommOverlapMethod).

    NONE: the collective, then one GEMM (the serial baseline).
    BULK: one GEMM and one *independent* collective issued together (`bulk_overlap`).
    PIPELINE: the operand is split in `num_splits` chunks; each chunk's collective overlaps the
      neighbouring chunk's GEMM.
    RING_EXCHANGE: point-to-point ring (`lax.ppermute`); each step's transfer overlaps the
      previous step's GEMM.
    AUTO: the autotuner's cached choice, or a cost model's when nothing is cached.
    """

    NONE = "none"
    BULK = "bulk"
    PIPELINE = "pipeline"
    RING_EXCHANGE = "ring_exchange"
    AUTO = "auto"

    @classmethod
    def _missing_(cls, value: object) -> Method | None:
        """Names in any case and the CLI's short spelling: "RING_EXCHANGE", "ring"."""
        if isinstance(value, str):
            key = value.strip().lower().replace("-", "_")
            return cls.__members__.get(key.upper()) or {"ring": cls.RING_EXCHANGE}.get(key)
        return None


class Algorithm(enum.Enum):
    """The concrete collective x method pairing (the reference's CommOverlapAlgo, plus ours)."""

    NO_OVERLAP = "no_overlap"
    BULK_OVERLAP_AG = "bulk_overlap_ag"
    BULK_OVERLAP_RS = "bulk_overlap_rs"
    BULK_OVERLAP_AR = "bulk_overlap_ar"  # ours
    SPLIT_PIPELINED_AG = "split_pipelined_ag"  # ours: chunked lax.all_gather
    SPLIT_PIPELINED_AG_P2P = "split_pipelined_ag_p2p"
    SPLIT_PIPELINED_RS = "split_pipelined_rs"
    SPLIT_PIPELINED_RS_P2P = "split_pipelined_rs_p2p"
    SPLIT_PIPELINED_AR = "split_pipelined_ar"  # ours: chunked lax.psum
    SPLIT_PIPELINED_AR_P2P = "split_pipelined_ar_p2p"  # ours: ring reduce-scatter + all-gather
    ATOMIC_GEMM_RS = "atomic_gemm_rs"
    ATOMIC_GEMM_AG = "atomic_gemm_ag"  # ours: rows pushed to every peer, flagged per band
    ATOMIC_GEMM_AG_P2P = "atomic_gemm_ag_p2p"
    ATOMIC_GEMM_RS_P2P = "atomic_gemm_rs_p2p"


#: Algorithms that run a fused (atomic) GEMM kernel on Hopper GPUs (commgemm.mosaic_gpu.fused):
#: AG_P2P and RS_P2P as rings, ATOMIC_GEMM_RS as direct reduce-adds into each owner,
#: ATOMIC_GEMM_AG as rows pushed straight to every peer.
ATOMIC_ALGORITHMS = frozenset(
    {
        Algorithm.ATOMIC_GEMM_RS,
        Algorithm.ATOMIC_GEMM_AG,
        Algorithm.ATOMIC_GEMM_AG_P2P,
        Algorithm.ATOMIC_GEMM_RS_P2P,
    }
)

_ALGORITHMS: dict[tuple[Collective, Method, bool], Algorithm] = {
    (Collective.ALL_GATHER, Method.BULK, False): Algorithm.BULK_OVERLAP_AG,
    (Collective.REDUCE_SCATTER, Method.BULK, False): Algorithm.BULK_OVERLAP_RS,
    (Collective.ALL_REDUCE, Method.BULK, False): Algorithm.BULK_OVERLAP_AR,
    (Collective.ALL_GATHER, Method.PIPELINE, False): Algorithm.SPLIT_PIPELINED_AG,
    (Collective.ALL_GATHER, Method.RING_EXCHANGE, False): Algorithm.SPLIT_PIPELINED_AG_P2P,
    (Collective.REDUCE_SCATTER, Method.PIPELINE, False): Algorithm.SPLIT_PIPELINED_RS,
    (Collective.REDUCE_SCATTER, Method.RING_EXCHANGE, False): Algorithm.SPLIT_PIPELINED_RS_P2P,
    (Collective.ALL_REDUCE, Method.PIPELINE, False): Algorithm.SPLIT_PIPELINED_AR,
    (Collective.ALL_REDUCE, Method.RING_EXCHANGE, False): Algorithm.SPLIT_PIPELINED_AR_P2P,
    (Collective.REDUCE_SCATTER, Method.PIPELINE, True): Algorithm.ATOMIC_GEMM_RS,
    (Collective.ALL_GATHER, Method.PIPELINE, True): Algorithm.ATOMIC_GEMM_AG,
    (Collective.ALL_GATHER, Method.RING_EXCHANGE, True): Algorithm.ATOMIC_GEMM_AG_P2P,
    (Collective.REDUCE_SCATTER, Method.RING_EXCHANGE, True): Algorithm.ATOMIC_GEMM_RS_P2P,
}


def uses_tpu_kernels(config: OverlapConfig) -> bool:
    """Whether an atomic_gemm config runs the Pallas TPU kernels (on a TPU, or interpreted)
    rather than the Hopper ones."""
    import jax

    return config.atomic_gemm and (config.interpret or jax.default_backend() == "tpu")


def fused_fields_reason(config: OverlapConfig, dtype) -> str | None:
    """Why `config`'s dtype and splitting fields do not suit a fused kernel (every family runs
    one GEMM, float32 accumulation, results and partial sums in the operands' dtype), or None."""
    for field in ("out_dtype", "reduce_dtype"):
        value = getattr(config, field)
        if value is not None and np.dtype(value) != np.dtype(dtype):
            return f"{field}={value} differs from the operands' {np.dtype(dtype).name}"
    if config.accumulate_dtype != "float32":
        return f"it accumulates in float32, got accumulate_dtype={config.accumulate_dtype}"
    if config.num_splits != 1 or config.bidirectional or config.aggregate:
        return "num_splits, bidirectional and aggregate do not apply (leave them at defaults)"
    return None


def select_algorithm(
    collective: Collective, method: Method, *, atomic_gemm: bool = False
) -> Algorithm:
    """Maps (collective, method, atomic_gemm) to the concrete `Algorithm`.

    Raises:
      ValueError: the pairing does not exist; the message lists the ones that do.
    """
    collective, method = Collective(collective), Method(method)
    if method is Method.AUTO:
        raise ValueError("method=AUTO is resolved by the autotuner before an algorithm is chosen")
    if collective is Collective.NONE or method is Method.NONE:
        if atomic_gemm:
            raise ValueError(
                "atomic_gemm=True needs an overlapped method (PIPELINE or RING_EXCHANGE) "
                "and a collective"
            )
        return Algorithm.NO_OVERLAP
    try:
        return _ALGORITHMS[(collective, method, bool(atomic_gemm))]
    except KeyError:
        allowed = ", ".join(
            f"({c.name}, {m.name}{', atomic' if a else ''})" for c, m, a in _ALGORITHMS
        )
        raise ValueError(
            f"unsupported pairing collective={collective.name}, method={method.name}, "
            f"atomic_gemm={atomic_gemm}; supported: {allowed}"
        ) from None


#: Short dtype spellings the CLI uses, accepted everywhere a dtype is.
DTYPE_ALIASES = {
    "bf16": "bfloat16",
    "f16": "float16",
    "fp16": "float16",
    "f32": "float32",
    "fp32": "float32",
    "f64": "float64",
    "fp64": "float64",
}

#: The most chunks PIPELINE / RING_EXCHANGE split an operand into: past this each chunk's
#: GEMM is too small to pay for its collective, and compile time grows with the chunks.
MAX_NUM_SPLITS = 64


def dtype_name(value: object, field: str = "dtype") -> str:
    """The numpy name of a dtype given as a dtype, its name, or a short alias ("bf16")."""
    if isinstance(value, str):
        value = DTYPE_ALIASES.get(value.strip().lower(), value)
    try:
        return np.dtype(value).name  # ml_dtypes registers bfloat16 / float8 with numpy
    except TypeError as err:
        raise ValueError(f"{field}={value!r} is not a dtype") from err


def floating_dtype_name(value: object, field: str) -> str:
    """`dtype_name` of a floating dtype (bf16, fp16, float32, ...); integers and bools would
    silently wrap a GEMM's result, so they are refused."""
    name = dtype_name(value, field)
    if not jnp.issubdtype(np.dtype(name), jnp.floating):
        raise ValueError(f"{field}={name} must be a floating dtype (bfloat16, float16, float32)")
    return name


def check_bool(value: object, field: str) -> None:
    """A flag must be a bool: the string "no" is truthy and would silently turn it on."""
    if not isinstance(value, bool | np.bool_):
        raise ValueError(f"{field}={value!r} must be True or False")


#: OverlapConfig.local_gemm's values.
LOCAL_GEMMS = ("auto", "xla", "mosaic")

_FLAGS = (
    "interpret",
    "bidirectional",
    "aggregate",
    "atomic_gemm",
    "save_gathered_input",
    "chain_gemms",
    "deterministic",
)


@dataclasses.dataclass(frozen=True)
class OverlapConfig:
    """How one collective GEMM is overlapped. Frozen and hashable: a jit static argument.

    Attributes:
      collective: the collective; None means "implied by the op" (or inferred by `gemm`).
      method: see `Method`.
      num_splits: chunks per step (PIPELINE: chunks of the whole operand; RING_EXCHANGE: chunks
        of each ring step). Must divide the split dimension.
      bidirectional: RING_EXCHANGE in both directions at once (about P/2 steps instead of P-1).
      aggregate: ALL_GATHER ring only: exchange both ways and run one GEMM on the two chunks that
        arrived in a step (the reference's aggregate_ag).
      atomic_gemm: one fused kernel does the GEMM and the transfers (Hopper GPUs, one process,
        bf16/fp16; see commgemm.mosaic_gpu.fused): with RING_EXCHANGE a ring
        (ATOMIC_GEMM_AG_P2P / ATOMIC_GEMM_RS_P2P); with PIPELINE no ring: AG pushes x's rows
        straight to every peer, whose tiles wait only for their own band (ATOMIC_GEMM_AG), RS
        reduce-adds each tile straight into its owner (ATOMIC_GEMM_RS). Where it cannot run, the op
        raises at plan time.
      accumulate_dtype: dtype of the GEMM accumulator (preferred_element_type); operands of
        more precision accumulate in theirs (float64 operands in float64).
      reduce_dtype: dtype partial sums travel in (RS / AR); None: the output dtype, as
        XLA's own reduce-scatter of the GEMM output would.
      out_dtype: dtype of the result; None: the input dtype.
      save_gathered_input: AG backward: keep the gathered X [P*m, K] from the forward pass for
        dW (default: the forward has it anyway, and keeping it spares the backward a second
        all-gather of the largest operand) instead of saving only the local x and re-gathering
        it beside the dX GEMM (BULK overlap; P times less activation memory, for long sequences).
      interpret: atomic_gemm: run the fused kernels as Pallas TPU kernels in Pallas' TPU
        interpret mode, on any backend (the CPU tests and the demo; on a TPU backend they run
        natively without it; see commgemm.pallas_tpu).
      kernel: atomic_gemm: the fused kernel's config, of the family the call runs
        (`RingAGConfig`, `RingRSConfig`, `DirectAGConfig`, `DirectRSConfig`; checked at plan
        time); None: that family's default.
      chain_gemms: RING_EXCHANGE: run the GEMMs strictly in order (a schedule hint that keeps
        XLA's dot merger from fusing the pieces' GEMMs). Off by default: the slower on GPUs
        (docs/performance.md).
      local_gemm: the GEMM of the methods that are not fused (NONE, PIPELINE, RING_EXCHANGE):
        "xla" (XLA's dot, every backend), "mosaic" (the fused kernels' GEMM core run with no
        peers, `commgemm.mosaic_gpu.gemm_core`: Hopper GPUs with jax >= 0.11, else refused at
        plan time; a GEMM it cannot run multiplies on XLA's dot), or "auto" (the default):
        XLA's dot, except a tensor-scaled float8 GEMM with fast accumulation that the ping-pong
        kernel takes on a Hopper GPU (`gemm_core.auto_takes`), which runs on it (faster than
        XLA's FP8 dot there). AUTO takes it from the tune cache, where the tuner measured
        "mosaic" faster.
      deterministic: only plans whose result is the same bit for bit on every call. The direct
        reduce-add kernel (ATOMIC_GEMM_RS) adds partial sums in their arrival order where a
        tile gets more than two of them: on more than 2 devices, and with DirectRSConfig.split_tail
        (which AUTO may pick); with deterministic=True such a config raises at plan time and
        AUTO passes over such plans. Off by default, as XLA's own GPU reductions.
    """

    collective: Collective | None = None
    method: Method = Method.NONE
    num_splits: int = 1
    bidirectional: bool = False
    aggregate: bool = False
    atomic_gemm: bool = False
    accumulate_dtype: str = "float32"
    reduce_dtype: str | None = None
    out_dtype: str | None = None
    save_gathered_input: bool = True
    chain_gemms: bool = False
    kernel: KernelConfig | None = None
    interpret: bool = False
    deterministic: bool = False
    local_gemm: str = "auto"

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        for field in _FLAGS:
            check_bool(getattr(self, field), field)
            set_(self, field, bool(getattr(self, field)))
        if self.collective is not None:
            try:
                set_(self, "collective", Collective(self.collective))
            except ValueError:
                allowed = [c.name for c in Collective]
                raise ValueError(
                    f"collective={self.collective!r} is not a Collective; allowed: {allowed}"
                ) from None
        try:
            set_(self, "method", Method(self.method))
        except ValueError:
            allowed = [m.name for m in Method]
            raise ValueError(
                f"method={self.method!r} is not a Method; allowed: {allowed}"
            ) from None
        if isinstance(self.num_splits, bool) or not isinstance(self.num_splits, int | np.integer):
            raise ValueError(f"num_splits={self.num_splits!r} must be an int >= 1")
        if not 1 <= self.num_splits <= MAX_NUM_SPLITS:
            raise ValueError(f"num_splits={self.num_splits} must be from 1 to {MAX_NUM_SPLITS}")
        set_(self, "num_splits", int(self.num_splits))
        set_(
            self, "accumulate_dtype", floating_dtype_name(self.accumulate_dtype, "accumulate_dtype")
        )
        for field in ("reduce_dtype", "out_dtype"):
            value = getattr(self, field)
            if value is not None:
                set_(self, field, floating_dtype_name(value, field))
        if self.bidirectional and self.method not in (Method.RING_EXCHANGE, Method.AUTO):
            raise ValueError(
                f"bidirectional=True needs method=RING_EXCHANGE, got method={self.method.name}"
            )
        if self.aggregate:
            if self.method not in (Method.RING_EXCHANGE, Method.AUTO):
                raise ValueError(
                    f"aggregate=True needs method=RING_EXCHANGE, got method={self.method.name}"
                )
            if self.collective not in (None, Collective.ALL_GATHER):
                raise ValueError(
                    f"aggregate=True is for ALL_GATHER only, got collective={self.collective.name}"
                )
        if self.interpret and not (self.atomic_gemm or self.method is Method.AUTO):
            raise ValueError(
                "interpret=True needs atomic_gemm=True (the fused TPU kernels) or method=AUTO"
            )
        if self.kernel is not None:
            if not isinstance(self.kernel, tuple(FAMILIES.values())):
                raise ValueError(
                    f"kernel={self.kernel!r} must be one of the kernel configs {sorted(FAMILIES)}"
                )
            direct = isinstance(self.kernel, PIPELINE_FAMILIES)
            if self.method not in (
                Method.AUTO,
                Method.PIPELINE if direct else Method.RING_EXCHANGE,
            ):
                raise ValueError(
                    f"kernel={type(self.kernel).__name__}(...) is for method "
                    f"{'PIPELINE' if direct else 'RING_EXCHANGE'}, got {self.method.name}"
                )
            if not self.atomic_gemm:
                raise ValueError("kernel needs atomic_gemm=True (the fused kernels)")
        if self.local_gemm not in LOCAL_GEMMS:
            raise ValueError(f"local_gemm={self.local_gemm!r} must be one of {LOCAL_GEMMS}")
        if self.local_gemm == "mosaic" and (self.atomic_gemm or self.method is Method.AUTO):
            raise ValueError(
                f"local_gemm={self.local_gemm!r} is for the methods that are not fused (atomic_gemm"
                "=True runs the kernel's own GEMM; with method=AUTO the tune cache chooses it)"
            )
        if self.collective is not None and self.method is not Method.AUTO:
            select_algorithm(self.collective, self.method, atomic_gemm=self.atomic_gemm)

    def replace(self, **changes: object) -> OverlapConfig:
        """A copy with `changes` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    def algorithm(self, collective: Collective | None = None) -> Algorithm:
        """The concrete `Algorithm` for this config, with `collective` filling in a None."""
        coll = self.collective if self.collective is not None else collective
        if coll is None:
            raise ValueError("the collective is not set: pass collective= or call an op")
        if self.collective is not None and collective is not None and self.collective != collective:
            raise ValueError(
                f"config.collective={self.collective.name} but this op performs {collective.name}"
            )
        return select_algorithm(coll, self.method, atomic_gemm=self.atomic_gemm)


def split_requirement(collective: Collective, method: Method, size: int, splits: int) -> int:
    """What x's split dimension (rows of the 2-D view) must be divisible by."""
    if collective is Collective.ALL_GATHER:
        return splits if method in (Method.PIPELINE, Method.RING_EXCHANGE) else 1
    if collective is Collective.REDUCE_SCATTER:
        return size * (splits if method in (Method.PIPELINE, Method.RING_EXCHANGE) else 1)
    if method is Method.PIPELINE:
        return splits
    return size * splits if method is Method.RING_EXCHANGE else 1


def config_to_fields(config: OverlapConfig) -> dict:
    """`config` as JSON-ready fields (enums by value, dtypes by name, the kernel config a dict
    with its family's name under "family")."""
    out = dataclasses.asdict(config)
    if config.kernel is not None:
        out["kernel"] = {"family": type(config.kernel).__name__, **out["kernel"]}
    out["method"] = config.method.value
    out["collective"] = None if config.collective is None else config.collective.value
    return out


def config_from_fields(fields: dict) -> OverlapConfig:
    """The inverse of `config_to_fields` (any subset of the fields); validated as any config.

    Raises:
      ValueError / TypeError: unknown fields or values that do not validate.
    """
    fields = dict(fields)
    kernel = fields.get("kernel")
    if kernel is not None:
        if not isinstance(kernel, dict) or kernel.get("family") not in FAMILIES:
            raise ValueError(
                f"kernel={kernel!r} must be an object with a family of {sorted(FAMILIES)}"
            )
        from commgemm.mosaic_gpu.configs import PINGPONG_FAMILIES

        kernel, family = dict(kernel), FAMILIES[kernel["family"]]
        if family in PINGPONG_FAMILIES:  # written before narrow_tail existed: its last wave whole
            kernel.setdefault("narrow_tail", False)
        kernel.pop("family")
        fields["kernel"] = family(**kernel)
    return OverlapConfig(**fields)
