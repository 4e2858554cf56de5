"""ATOMIC_GEMM_AG_P2P and ATOMIC_GEMM_RS_P2P: the GEMM and the ring transfers in one GPU kernel.

The split methods (PIPELINE, RING_EXCHANGE) leave the order of GEMMs and transfers to XLA's
scheduler, which keeps one collective-permute in flight and starts each transfer only where the
compute stream reaches it. Here one persistent Mosaic GPU kernel (Pallas, Hopper) does both, the
way the reference's atomic GEMMs do with userbuffers. Every kernel is ours, on the GEMM of
`tiles` (jax's Hopper matmul kernel's tiling and pipeline):

  Method RING_EXCHANGE:
  ATOMIC_GEMM_AG_P2P: `direct_ag` with ring=True: while a CTA multiplies a band of
      rows it also writes them, already in shared memory, into the next device's inbox over
      NVLink; step s multiplies the rows of device d - s, each band once its own rows landed.
  ATOMIC_GEMM_RS_P2P: `ring_rs`: at step s device d computes its partial product of
      row block (d - s - 1) mod P, adds the partial sum of that block received from device d-1
      and writes each tile straight into device d+1's inbox; at the last step the block is d's
      own and the sum goes to the output. Partial sums travel in the output dtype.
  Method PIPELINE, no ring:
  ATOMIC_GEMM_AG: `direct_ag`: every device pushes its rows straight to every peer while
      multiplying them; a peer's tiles wait only for their own band of rows; with a
      `PingPongAGConfig`, `pingpong_ag`: the same on the ping-pong schedule.
  ATOMIC_GEMM_RS: `direct_rs`: every tile is reduce-added straight into its owner's
      output, tiles of all blocks interleaved; with a `PingPongRSConfig`,
      `pingpong_rs`: the same on the ping-pong schedule (each compute warpgroup a
      whole tile, its epilogue under the other's K loop).

Quantized operands (an op's `scaling=` with a tensor mode): every kernel takes float8 x and w
(w laid out [n, K], K-major, as float8 wgmma wants: quantizing w writes it so) and multiplies
on the float8 tensor cores, the rows on the wire float8. They accumulate as the recipe's
forward flag asks (ScalingRecipe.split_accumulator[0]): in the tensor cores' accumulator
across all K-steps (fast), or with each K-step's product added into a float32 total (split,
in 64 x 128 warpgroup tiles and 256-element K-steps: `tiles.accumulated`, `split_tiling`).
The epilogue multiplies the accumulator by the two tensor scales (one number: shards share
them) and stores the result in x's dtype, so RS partial sums add already scaled. Block modes
take no float8 operands here (`scaling_reason`).

Requirements (checked at plan time by `unsupported_reason`): a GPU of compute capability 9.x
with jax >= 0.11 (Mosaic GPU collectives), one process driving all devices or, with one process
per GPU, every process on one machine and NCCL >= 2.29.2 (`peers`), the mesh axis spanning all
of them, bf16 or fp16 operands and output, float32 accumulation, and shapes that
divide into the kernel's tiles. The kernels address a peer by its coordinate on the axis, the
others of the mesh (size 1 where the axis spans every device) kept. Mosaic GPU itself also
wants the mesh's devices in id order (it raises otherwise).

Backward: dX runs the other collective's kernel of the same method family (`backward_config`:
an AG forward's dX on the RS kernel, an RS forward's on the AG kernel, the cost model's tiling
for dY's shape; an AG on more than 2 GPUs on the ring kernel), where it can run, else the
XLA method the cost model picks for dX (`autodiff.unfused_backward`: serial on GPUs unless a
split plan beats it by `AUTO_MARGINS`); dW reads the gathered rows that the AG kernel received
(`direct_ag.gathered_rows`). A tensor-scaled op with fast dgrad multiplies its
float8_e5m2 dY by the float8_e4m3fn W (read as stored, [K, n]: K-major for dX's GEMM) in the
same kernels; with promoted dgrad its dX runs that XLA method (commgemm.scaled).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from commgemm.config import Collective, Method, OverlapConfig, fused_fields_reason
from commgemm.mosaic_gpu import (
    direct_ag,
    direct_rs,
    heuristics,
    peers,
    pingpong,
    pingpong_ag,
    pingpong_rs,
    ring_rs,
    rs_schedule,
)
from commgemm.mosaic_gpu import tiles as mosaic_tiles
from commgemm.mosaic_gpu.configs import (
    FLOAT8_TILE_K,
    PINGPONG_FAMILIES,
    DirectAGConfig,
    DirectRSConfig,
    KernelConfig,
    PingPongAGConfig,
    PingPongRSConfig,
    RingAGConfig,
    RingRSConfig,
)
from commgemm.quant import TENSOR_MODES, ScalingRecipe
from commgemm.vma import varying_like

#: The kernel family of each (collective, method) pairing with atomic_gemm: its default config
#: (PIPELINE also runs the ping-pong kernels, `OTHER_FAMILIES`).
FAMILY = {
    (Collective.ALL_GATHER, Method.RING_EXCHANGE): RingAGConfig,
    (Collective.REDUCE_SCATTER, Method.RING_EXCHANGE): RingRSConfig,
    (Collective.ALL_GATHER, Method.PIPELINE): DirectAGConfig,
    (Collective.REDUCE_SCATTER, Method.PIPELINE): DirectRSConfig,
}
#: The other kernel configs a pairing takes.
OTHER_FAMILIES = {
    (Collective.REDUCE_SCATTER, Method.PIPELINE): (PingPongRSConfig,),
    (Collective.ALL_GATHER, Method.PIPELINE): (PingPongAGConfig,),
}


def families(collective: Collective, method: Method) -> tuple[type, ...]:
    """The kernel config types the pairing runs, its default's first."""
    return (FAMILY[(collective, method)], *OTHER_FAMILIES.get((collective, method), ()))


def kernel_config(collective: Collective, config: OverlapConfig) -> KernelConfig:
    """The kernel config this call runs: config.kernel, or its family's default."""
    return config.kernel or FAMILY[(collective, config.method)]()


def _gpu_reason() -> str | None:
    if (reason := mosaic_tiles.hopper_reason()) is not None:
        return reason
    if jax.process_count() != 1 and (reason := peers.multiprocess_reason()) is not None:
        return reason
    try:
        from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu  # noqa: F401
    except ImportError as err:  # jax too old, or jaxlib without Mosaic GPU
        return f"this jax has no Mosaic GPU collective kernels ({err})"
    return None


def varies_between_calls(collective: Collective, config: OverlapConfig, size: int) -> str | None:
    """Why this fused config's result may differ in the last bit from call to call (partial
    sums added in arrival order), or None when it is the same every time."""
    if not config.atomic_gemm or config.method is not Method.PIPELINE:
        return None
    if collective is not Collective.REDUCE_SCATTER:
        return None
    tiles = kernel_config(collective, config)
    if getattr(tiles, "split_tail", 1) != 1 or getattr(tiles, "stream_tail", False):
        return "split_tail and stream_tail add a tile's K-ranges in arrival order"
    if size > 2:
        return f"on {size} devices a tile's partial sums are added in arrival order"
    return None


def unsupported_reason(
    collective: Collective,
    x: jax.Array,
    w: jax.Array,
    size: int,
    config: OverlapConfig,
    *,
    w_transposed: bool,
) -> str | None:
    """Why the fused kernel cannot run this per-shard call (x the 2-D view [rows, K], w [K, n]
    or [n, K] with w_transposed), or None when it can. Off a Hopper GPU (or with several
    processes) that comes first, and what the shape or config would still need after it."""
    shape_reason = _call_reason(collective, x, w, size, config, w_transposed=w_transposed)
    if (gpu := _gpu_reason()) is not None:
        return gpu if shape_reason is None else f"{gpu} (and there: {shape_reason})"
    return shape_reason


def _call_reason(collective, x, w, size, config, *, w_transposed: bool) -> str | None:
    """Why the fused kernel cannot run this call on a machine that runs the kernels."""
    if collective not in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER):
        return f"there is no fused kernel for {collective.name}"
    if x.dtype not in (jnp.bfloat16, jnp.float16):
        return f"it needs bfloat16 or float16 operands, got {x.dtype}"
    if (reason := fused_fields_reason(config, x.dtype)) is not None:
        return reason
    kinds = families(collective, config.method)
    tiles = kernel_config(collective, config)
    if not isinstance(tiles, kinds):
        return (
            f"kernel={type(tiles).__name__}(...) is another kernel's config: this call runs "
            f"{' or '.join(kind.__name__ for kind in kinds)}'s kernel ({collective.name} with "
            f"{config.method.name})"
        )
    chain_tiles = getattr(tiles, "chain_tiles", False)
    rows, k = x.shape
    m = rows if collective is Collective.ALL_GATHER else rows // size
    n = w.shape[0] if w_transposed else w.shape[1]
    if isinstance(tiles, PINGPONG_FAMILIES):
        reason = pingpong.shape_reason(tiles, m, k, n, x.dtype, w_nk=w_transposed)
        if reason is not None:
            return reason
        if k % FLOAT8_TILE_K:  # a quantized call runs it in float8's whole 128-byte K-steps
            family = type(tiles).__name__
            return f"K={k} must be whole {FLOAT8_TILE_K}s for {family} (its float8 steps)"
    else:
        for what, value, by in (
            ("rows per device", m, tiles.cluster_m),
            ("N", n, tiles.cluster_n),
            ("K", k, tiles.tile_k),
        ):
            if value % by:
                return f"{what}={value} must be divisible by the tile {by}"
    if chain_tiles and (k // tiles.tile_k) % tiles.stages:
        return f"chain_tiles needs K/tile_k={k // tiles.tile_k} divisible by {tiles.stages} stages"
    if config.deterministic and (why := varies_between_calls(collective, config, size)):
        return f"deterministic=True, and {why}"
    if size != jax.device_count():
        return f"the mesh axis must span all {jax.device_count()} devices, it has {size}"
    if isinstance(tiles, DirectRSConfig):
        ctas = mosaic_tiles.num_sms() // tiles.cluster_size
        per_block = (m // tiles.cluster_m) * (n // tiles.cluster_n)
        if chain_tiles and size * per_block < 2 * ctas:
            count = size * per_block
            return f"chain_tiles needs two tiles per CTA, got {count} tiles for {ctas} CTAs"
        return rs_schedule.tail_reason(size * per_block, per_block, ctas, tiles)
    return None


def reason_for_shape(
    collective: Collective,
    shape: tuple[int, int, int],
    size: int,
    dtype: str,
    config: OverlapConfig | None = None,
) -> str | None:
    """`unsupported_reason` for a global (M, K, N) problem over `size` devices (the tuner's
    view): AG x [M/P, K], w [K, N/P]; RS x [M, K/P], w [K/P, N]."""
    m, k, n = shape
    if collective is Collective.ALL_GATHER:
        x_shape, w_shape = (m // size, k), (k, n // size)
    else:
        x_shape, w_shape = (m, k // size), (k // size, n)
    config = config or OverlapConfig(method="ring_exchange", atomic_gemm=True)
    return unsupported_reason(
        collective,
        jax.ShapeDtypeStruct(x_shape, dtype),
        jax.ShapeDtypeStruct(w_shape, dtype),
        size,
        config,
        w_transposed=False,
    )


def scaling_reason(config: OverlapConfig, recipe: ScalingRecipe) -> str | None:
    """Why the fused kernel of `config` cannot take operands quantized by `recipe`, or None."""
    if recipe.mode not in TENSOR_MODES:
        return (
            f"{recipe.mode.name} has no Hopper tensor-core path (the XLA methods emulate block "
            "scales)"
        )
    if isinstance(config.kernel, PINGPONG_FAMILIES) and recipe.split_accumulator[0]:
        family = type(config.kernel).__name__
        return f"{family} takes no split accumulation (the recipe's forward flag)"
    return None


def float8_tiling(tiles: KernelConfig, k: int, *, split: bool = False) -> KernelConfig:
    """`tiles` for float8 operands with K = k: K-steps of at least FLOAT8_TILE_K where k is
    whole steps of it (the faster K-step for float8 on Hopper: docs/performance.md), chained
    tiles only where K is still whole rounds of stages; with `split` accumulation, warpgroup
    tiles of 64 x 128 where larger ones leave no registers for the second accumulator
    (`tiles.split_reason`); the ping-pong kernels take no split accumulation."""
    if split and isinstance(tiles, PINGPONG_FAMILIES):
        raise ValueError(pingpong.no_split(type(tiles)))
    if split and mosaic_tiles.split_reason(tiles) is not None:
        tiles = dataclasses.replace(tiles, tile_m=64, tile_n=128, wg_along_m=True)
    return _longer_steps(tiles, k, FLOAT8_TILE_K, tiles.stages)


#: K-steps of the fused kernels' split form, in 3 stages (the shared memory of 4 of 128): one
#: promotion per 256 products, half the awaits of 128-element steps, at the same error.
SPLIT_TILE_K, SPLIT_STAGES = 256, 3


def split_tiling(tiles: KernelConfig, k: int) -> KernelConfig:
    """`float8_tiling(tiles, k, split=True)` with K-steps of SPLIT_TILE_K where k is whole steps
    of it and the tiling's are shorter, in at most SPLIT_STAGES stages (chained tiles kept only
    where K is still whole rounds of them)."""
    tiles = float8_tiling(tiles, k, split=True)
    return _longer_steps(tiles, k, SPLIT_TILE_K, min(tiles.stages, SPLIT_STAGES))


def _longer_steps(tiles: KernelConfig, k: int, tile_k: int, stages: int) -> KernelConfig:
    """`tiles` with K-steps of `tile_k` in `stages` stages where its steps are shorter and k is
    whole steps of tile_k, chained tiles only where K is still whole rounds of stages; else
    `tiles` as it is."""
    if tiles.tile_k >= tile_k or k % tile_k:
        return tiles
    tiles = dataclasses.replace(tiles, tile_k=tile_k, stages=stages)
    if getattr(tiles, "chain_tiles", False) and (k // tile_k) % tiles.stages:
        tiles = dataclasses.replace(tiles, chain_tiles=False)
    return tiles


def _float8_call(collective: Collective, x, w, axis_name, config, w_transposed: bool, options=None):
    """The kernel of `collective` and config's method on a float8 payload x [rows, K] and a
    `QuantizedRhs` w: float8 wgmma on w laid out [n, K], the two scales applied in the
    epilogue, the result in x's original dtype, in config's tiling (`float8_tiling`; with split
    accumulation `split_tiling`); `options`: more of the kernel's options."""
    data = w.k_major(w_transposed)  # [n, K]: the kept transposed values where w has them
    scale = (w.lhs_scale_inv * w.w.scale_inv).astype(jnp.float32).reshape(1)
    split = w.split_accumulator
    tiles = kernel_config(collective, config)
    k = x.shape[1]
    tiles = split_tiling(tiles, k) if split else float8_tiling(tiles, k)
    return _run(
        collective,
        config.replace(kernel=tiles),
        x,
        data,
        axis_name,
        w_nk=True,
        out_dtype=w.dtype,
        scale=scale,
        split_accumulator=split,
        **(options or {}),
    )


def _run(collective: Collective, config: OverlapConfig, x, w, axis_name, **options):
    """config's kernel for `collective` on x and w, given its family config (options: the
    kernels' w_nk, out_dtype, scale, split_accumulator, and the AG kernel's return_gathered)."""
    ring, tiles = config.method is Method.RING_EXCHANGE, config.kernel
    if collective is Collective.REDUCE_SCATTER:
        kernel = ring_rs if ring else direct_rs
        if isinstance(tiles, PingPongRSConfig):
            kernel = pingpong_rs
        return kernel.matmul_reduce_scatter(x, w, axis_name, tiles, **options)
    if isinstance(tiles, PingPongAGConfig):
        return pingpong_ag.all_gather_matmul(x, w, axis_name, tiles, **options)
    return direct_ag.all_gather_matmul(x, w, axis_name, tiles, ring=ring, **options)


def backward_config(
    collective: Collective,
    config: OverlapConfig,
    dy: jax.Array,
    w: jax.Array,
    size: int,
    *,
    w_transposed: bool,
) -> OverlapConfig | None:
    """The fused config of dX = `collective`(dY @ W^T) in the backward pass of a fused forward
    (`collective` the forward's other one): the same method family (the ring, or the direct
    kernel in the cost model's tiling for dY's shape), except an AG where
    `heuristics.ring_ag_first` (more than 2 GPUs), which runs the ring kernel where it can, as
    AUTO does; None where no such kernel can run this call
    (`unsupported_reason`). dy: the 2-D view of dY; w and w_transposed as the dX GEMM takes them
    (the forward's w, w_transposed flipped)."""
    rows, n = dy.shape
    out_columns = w.shape[0] if w_transposed else w.shape[1]
    back = config.replace(kernel=None, collective=None, out_dtype=dy.dtype.name)
    if collective is Collective.REDUCE_SCATTER:
        shape = (rows, n * size, out_columns)  # the global (M, K, N) of the dX GEMM
        tiles = heuristics.direct_rs_config(rows, size, shape, deterministic=config.deterministic)
    else:
        tiles = heuristics.direct_ag_config(rows, n=out_columns)
    direct = back.replace(method=Method.PIPELINE, kernel=tiles)
    ring = back.replace(method=Method.RING_EXCHANGE)
    if collective is Collective.ALL_GATHER and heuristics.ring_ag_first(size):
        options = [ring, direct]
    else:
        options = [ring if config.method is Method.RING_EXCHANGE else direct]
    for option in options:
        if unsupported_reason(collective, dy, w, size, option, w_transposed=w_transposed) is None:
            return option
    return None


def _array(w) -> jax.Array:
    """w's values: w itself, or a QuantizedRhs's float8 data."""
    return w.w.data if _is_quantized(w) else w


def _is_quantized(w) -> bool:
    from commgemm.quantized_gemm import QuantizedRhs

    return isinstance(w, QuantizedRhs)


def all_gather_matmul(
    x: jax.Array,
    w: jax.Array,
    axis_name: str,
    config: OverlapConfig,
    *,
    w_transposed: bool,
    return_gathered: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """x [m, K] local rows, w [K, n] ([n, K] with w_transposed) -> all_gather(x) @ w
    [P*m, n], in one kernel.

    With return_gathered also all_gather(x) [P*m, K], from the rows the kernel received.
    """
    options = dict(return_gathered=return_gathered)
    if _is_quantized(w):
        out = _float8_call(Collective.ALL_GATHER, x, w, axis_name, config, w_transposed, options)
    else:
        out = _run(Collective.ALL_GATHER, config, x, w, axis_name, w_nk=w_transposed, **options)
    out, gathered = out if return_gathered else (out, None)
    out = varying_like(out, x, _array(w))  # a Pallas result carries no varying axes of its own
    return (out, varying_like(gathered, x)) if return_gathered else out


def matmul_reduce_scatter(
    x: jax.Array,
    w: jax.Array,
    axis_name: str,
    config: OverlapConfig,
    *,
    w_transposed: bool,
) -> jax.Array:
    """x [M, k], w [k, n] (K sharded) -> this device's rows [M/P, n] of the sum, in one kernel:
    the ring (RING_EXCHANGE) or the direct reduce-adds of `direct_rs` (PIPELINE)."""
    if _is_quantized(w):
        out = _float8_call(Collective.REDUCE_SCATTER, x, w, axis_name, config, w_transposed)
    else:
        out = _run(Collective.REDUCE_SCATTER, config, x, w, axis_name, w_nk=w_transposed)
    return varying_like(out, x, _array(w))  # a Pallas result carries no varying axes of its own


def matmul_all_reduce(*args, **kwargs):
    raise NotImplementedError("there is no fused GEMM + all-reduce kernel")
