"""Plan time: one op call's arguments (collective, shapes, axis, config, scaling recipe) turned
into a validated `Plan` before any collective: AUTO resolved, the algorithm, the backend that
runs it and the recipe. Everything downstream (ops, the VJP, the kernels) reads the plan.

Every check here raises at trace time, so a wrong shape never becomes a hang.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from commgemm.backend import Backend, auto_may_fuse, backend_for, fused_backend
from commgemm.config import (
    ATOMIC_ALGORITHMS,
    Algorithm,
    Collective,
    Method,
    OverlapConfig,
    split_requirement,
)
from commgemm.distributed import check_same_plan
from commgemm.operands import axis_size, check_divisible, check_dtypes, check_matmul_shapes
from commgemm.quant import ScalingRecipe
from commgemm.registry import OverlapBuffer, resolve


@dataclasses.dataclass(frozen=True)
class Plan:
    """A validated call: `config` has out_dtype filled in and method never AUTO; `backend`
    runs it (`commgemm.backend`); `recipe` quantizes its operands (None: as they are)."""

    config: OverlapConfig
    algorithm: Algorithm
    axis_size: int
    backend: Backend
    recipe: ScalingRecipe | None = None


#: The axis sizes at which AUTO runs a grouped op's ring (RING_EXCHANGE) on 16-bit blocks; at
#: the others, and wherever the blocks multiply on the float8 kernel, it runs NONE, every block
#: in one regrouped GEMM: only the all-gather's ring on 2 GPUs beats none; beyond, the ring's P
#: blocks each bring their G group boundaries (docs/performance.md: "AUTO for the grouped ops on
#: four GPUs"). The return follows the dispatch. Column chunks are never the fastest.
GROUPED_AUTO_RING_SIZES = {"all_gather_grouped_matmul": frozenset({2})}
#: The grouped ops that exchange rows between experts' devices (no column chunks).
EXPERT_PARALLEL_OPS = ("all_to_all_grouped_matmul", "grouped_matmul_all_to_all")


@dataclasses.dataclass(frozen=True)
class GroupedPlan:
    """A validated grouped call: `config` never AUTO; `splits` its column chunks (PIPELINE)."""

    config: OverlapConfig
    axis_size: int
    splits: int = 1


def make_grouped_plan(
    config: OverlapConfig | int | None,
    op: str,
    size: int,
    *,
    rows: int | None = None,
    per_device: bool = False,
    float8: bool = False,
) -> GroupedPlan:
    """Validates one grouped op's call on an axis of `size` devices. AUTO becomes the ring
    where `GROUPED_AUTO_RING_SIZES` says so and the blocks are not multiplied on the float8
    kernel (`float8`), else NONE; one-way and unsplit. `rows`: x's rows, which must split into
    the column chunks' pieces (`per_device`: into size x splits, the reduce-scatter's)."""
    cfg, _ = resolve(config)
    if cfg.method is Method.AUTO:
        ring = not float8 and size in GROUPED_AUTO_RING_SIZES.get(op, ())
        method = Method.RING_EXCHANGE if ring else Method.NONE
        cfg = cfg.replace(method=method, num_splits=1, bidirectional=False, aggregate=False)
    if op in EXPERT_PARALLEL_OPS:
        if cfg.method not in (Method.NONE, Method.RING_EXCHANGE) or cfg.atomic_gemm:
            raise ValueError(f"{op} supports methods NONE and RING_EXCHANGE, got {cfg.method.name}")
        return GroupedPlan(cfg, size)
    if cfg.method not in (Method.NONE, Method.PIPELINE, Method.RING_EXCHANGE) or cfg.atomic_gemm:
        raise ValueError(
            f"{op} supports methods NONE, PIPELINE and RING_EXCHANGE (no fused kernel), got "
            f"{cfg.method.name}{' with atomic_gemm' if cfg.atomic_gemm else ''}"
        )
    if cfg.bidirectional or cfg.aggregate:
        raise ValueError(f"{op}: the grouped ring runs one way (bidirectional=False)")
    splits = cfg.num_splits if cfg.method is Method.PIPELINE else 1
    if rows is not None:
        need = (size if per_device else 1) * splits
        check_divisible(rows, need, f"{op}: x's rows", "the split requirement")
    return GroupedPlan(cfg, size, splits)


def _check_buffer(buf: OverlapBuffer, x: jax.Array, size: int) -> None:
    if buf.tp_size is not None and buf.tp_size != size:
        raise ValueError(
            f"overlap buffer {buf.id} was created for tp_size={buf.tp_size}, "
            f"but the mesh axis has size {size}"
        )
    if buf.buffer_shape is not None and tuple(x.shape) != buf.buffer_shape:
        raise ValueError(
            f"overlap buffer {buf.id} was created for shape {buf.buffer_shape}, got x {x.shape}"
        )
    if buf.buffer_dtype is not None and x.dtype.name != buf.buffer_dtype:
        raise ValueError(
            f"overlap buffer {buf.id} was created for dtype {buf.buffer_dtype}, got x {x.dtype}"
        )


def _check_fused(
    algorithm: Algorithm,
    collective: Collective,
    x: jax.Array,
    w: jax.Array,
    size: int,
    cfg: OverlapConfig,
    w_transposed: bool,
) -> None:
    """ATOMIC_GEMM_AG_P2P / _RS_P2P / _RS run one fused kernel (commgemm.mosaic_gpu.fused)
    where it can run; anything else is a clear error, not a silent fallback."""
    reason = fused_backend(cfg).unsupported_reason(
        collective, x, w, size, cfg, w_transposed=w_transposed
    )
    if reason is not None:
        raise ValueError(
            f"{algorithm.name} (the fused GEMM kernel) cannot run this call: {reason}. Use "
            "atomic_gemm=False for the split algorithm of the same method"
        )


def _check_fused_scaling(op: str, cfg: OverlapConfig, recipe: ScalingRecipe) -> None:
    """A fused config asked for explicitly must take the quantized operands."""
    if cfg.atomic_gemm and (why := fused_backend(cfg).scaling_reason(cfg, recipe)):
        raise ValueError(
            f"{op} with {recipe.mode.name} and atomic_gemm=True: {why}; use atomic_gemm=False"
        )


def _quantized_config(
    cfg: OverlapConfig, recipe: ScalingRecipe, requested: OverlapConfig
) -> OverlapConfig:
    """The config a quantized call runs: a fused config whose kernel cannot take the quantized
    operands, or one AUTO chose (`requested` not fused itself) where `backend.auto_may_fuse`
    says no (AUTO does not choose those: this guards a stale cached winner), becomes the split
    algorithm of its method."""
    auto_pick = not requested.atomic_gemm
    if cfg.atomic_gemm and (
        fused_backend(cfg).scaling_reason(cfg, recipe)
        or (auto_pick and not auto_may_fuse(cfg, recipe))
    ):
        return cfg.replace(atomic_gemm=False, kernel=None, interpret=False)
    return cfg


def with_dtypes(cfg: OverlapConfig, dtype) -> OverlapConfig:
    """cfg for operands of `dtype`: out_dtype defaulted to it, and an accumulator of at least
    its precision (float64 operands accumulate in float64 whatever accumulate_dtype says, so a
    float64 call is never rounded to float32 on the way)."""
    acc = jnp.promote_types(cfg.accumulate_dtype, dtype).name
    return cfg.replace(out_dtype=cfg.out_dtype or jnp.dtype(dtype).name, accumulate_dtype=acc)


def make_plan(
    x: jax.Array,
    w: jax.Array,
    axis_name: str,
    config: OverlapConfig | int | None,
    collective: Collective,
    *,
    rows: int,
    w_transposed: bool,
    op: str,
    recipe: ScalingRecipe | None = None,
) -> Plan:
    """Validates one per-shard call. `rows` is the size of x's split dimension in its 2-D view;
    `recipe` the scaling the operands are quantized by (None: as they are)."""
    cfg, buf = resolve(config)
    requested = cfg
    if recipe is not None:
        _check_fused_scaling(op, cfg, recipe)
    check_dtypes(x, w)
    check_matmul_shapes(x, w, w_transposed=w_transposed)
    size = axis_size(axis_name)
    if buf is not None:
        _check_buffer(buf, x, size)
    if cfg.method is Method.AUTO:
        from commgemm.autotune.auto import resolve_auto

        cfg = resolve_auto(cfg, collective, x, w, size, w_transposed=w_transposed, recipe=recipe)
    algorithm = cfg.algorithm(collective)
    if algorithm in (
        Algorithm.BULK_OVERLAP_AG,
        Algorithm.BULK_OVERLAP_RS,
        Algorithm.BULK_OVERLAP_AR,
    ):
        raise ValueError(
            f"{op} with method=BULK is not supported: BULK overlaps a GEMM with an independent "
            "collective of another buffer (use commgemm.bulk_overlap); for this op use "
            "PIPELINE or RING_EXCHANGE"
        )
    if size == 1 and algorithm is not Algorithm.NO_OVERLAP:
        # one device: nothing to move or overlap, so every method is the local GEMM (a fused
        # kernel would also need peers' memory, which a single device has no runtime for)
        cfg = cfg.replace(
            method=Method.NONE,
            num_splits=1,
            bidirectional=False,
            aggregate=False,
            atomic_gemm=False,
            interpret=False,
            kernel=None,
            chain_gemms=False,
        )
        algorithm = Algorithm.NO_OVERLAP
    if cfg.local_gemm == "mosaic":
        from commgemm.mosaic_gpu.tiles import hopper_reason

        if (reason := hopper_reason()) is not None:
            raise ValueError(f"local_gemm='mosaic' (the Hopper GEMM kernel) cannot run: {reason}")
    if algorithm in ATOMIC_ALGORITHMS:
        _check_fused(algorithm, collective, x, w, size, cfg, w_transposed)
    need = split_requirement(collective, cfg.method, size, cfg.num_splits)
    split = cfg.method in (Method.PIPELINE, Method.RING_EXCHANGE)
    per_device = collective is Collective.REDUCE_SCATTER or (
        collective is Collective.ALL_REDUCE and cfg.method is Method.RING_EXCHANGE
    )
    why = {(True, True): "P*num_splits", (True, False): "P", (False, True): "num_splits"}.get(
        (per_device, split), "1"
    )
    check_divisible(rows, need, f"{op}: x's split dimension", why)
    cfg = with_dtypes(cfg, x.dtype).replace(collective=collective)
    if recipe is not None:
        cfg = _quantized_config(cfg, recipe, requested)
    check_same_plan(
        f"{op}(x {x.dtype.name}{list(x.shape)}, w {w.dtype.name}{list(w.shape)}, "
        f"axis {axis_name!r} of {size})",
        str(cfg),
    )
    return Plan(cfg, algorithm, size, backend_for(cfg), recipe)
