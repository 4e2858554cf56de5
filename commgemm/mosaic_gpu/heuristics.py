"""Default configs and autotuning candidates of the fused kernel families, beside the kernels:
what the cost model proposes for a shape (`direct_rs_config`, `direct_ag_config`), the
thresholds they read, and the extra tilings the tuner also measures (`TUNING_CANDIDATES`).
Each entry is the fastest measured on some preset, or within noise of it; docs/performance.md
keeps the decisions and their outcomes."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from commgemm.mosaic_gpu import pingpong_rs
from commgemm.mosaic_gpu.configs import (
    FLOAT8_TILE_K,
    DirectAGConfig,
    DirectRSConfig,
    KernelConfig,
    PingPongAGConfig,
    PingPongRSConfig,
    RingAGConfig,
)
from commgemm.mosaic_gpu.tiles import HOPPER_SMS

#: Most of N that the ping-pong RS kernel's partial last column of 192-wide tiles may pad (the
#: work on columns past N is wasted); past it the cooperative kernel is the faster.
PINGPONG_PAD = 0.01
#: The same for float8 operands, whose core beats XLA's FP8 dot at more padding.
FLOAT8_PINGPONG_PAD = 0.035


def pingpong_tiles(
    rows: int, k: int, n: int, dtype="bfloat16", *, w_nk: bool = False, out_dtype="bfloat16"
) -> PingPongRSConfig | None:
    """`PingPongRSConfig()` where the ping-pong kernel runs x [rows, k] @ w [k, n] ([n, k] with
    w_nk) of `dtype` into `out_dtype` on one device (rows need not be whole tiles), in bf16
    and in float8 (K whole 128-element steps, as the fused ops raise them), and its partial
    last column and row of tiles pad at most PINGPONG_PAD of the output (float8 operands:
    FLOAT8_PINGPONG_PAD); else None."""
    tiles = PingPongRSConfig()
    pad = FLOAT8_PINGPONG_PAD if _float8(dtype) else PINGPONG_PAD
    padded = -(-n // tiles.tile_n) * tiles.tile_n * -(-rows // tiles.cluster_m) * tiles.cluster_m
    if padded > rows * n * (1 + pad):
        return None
    if k % FLOAT8_TILE_K:  # as the fused ops' check: float8's K-steps must fit
        return None
    steps = dataclasses.replace(tiles, tile_k=FLOAT8_TILE_K) if _float8(dtype) else tiles
    reason = pingpong_rs.shape_reason(
        steps, rows, k, n, dtype, w_nk=w_nk, out_dtype=out_dtype, partial_rows=True
    )
    return tiles if reason is None else None


def _float8(dtype) -> bool:
    return jnp.dtype(dtype).itemsize == 1


def direct_rs_config(
    rows: int,
    size: int,
    shape: tuple[int, int, int] | None = None,
    *,
    deterministic: bool = False,
) -> DirectRSConfig | PingPongRSConfig:
    """The direct RS kernel's tiling for x [rows, K/P] (global `shape` (M, K, N) if known).
    On 2 devices, where `pingpong_tiles` gives one: the ping-pong kernel with its last wave
    whole (as fast as the cooperative tiling or faster on the llama presets). Else the
    cooperative kernel: warpgroup tiles of 64 x 256 (a 128 x 256 CTA tile, as cuBLAS's
    cooperative kernels), 2-CTA clusters along M where the rows
    per device fill them, the last wave split or streamed along K (`rs_schedule.tail_plan`)
    unless `deterministic`, chained tile pipelines where K/tile_k is whole rounds of stages and
    every CTA of a 132-SM GPU gets two tiles, and the output zeroed two waves ahead of the adds:
    the fastest tiling measured on the RS presets."""
    if size == 2 and shape is not None:
        _, k, n = shape
        if (pingpong := pingpong_tiles(rows // size, k // size, n)) is not None:
            return dataclasses.replace(pingpong, narrow_tail=False)
    tiles = DirectRSConfig(
        wg_along_m=True, tile_m=64, tile_n=256, split_tail=int(deterministic), zero_ahead=2
    )
    if (rows // size) % dataclasses.replace(tiles, cluster="m").cluster_m == 0:
        tiles = dataclasses.replace(tiles, cluster="m")
    if shape is not None:
        _, k, n = shape
        k_iters = k // size // tiles.tile_k
        count = size * (rows // size // tiles.cluster_m) * (n // tiles.cluster_n)
        ctas = HOPPER_SMS // tiles.cluster_size  # the GPU may not be at hand
        if k_iters % tiles.stages == 0 and count >= 2 * ctas:
            tiles = dataclasses.replace(tiles, chain_tiles=True)
    return tiles


def ring_ag_first(size: int) -> bool:
    """Whether the ring AG kernel is the preferred fused AG on `size` devices (over the direct
    one, where both run): on more than 2 GPUs the ring, on 2 the direct plan
    (docs/performance.md)."""
    return size > 2


#: Columns of the direct AG kernel's CTA tile where N per device is whole 192s but not 256s
#: (llama13b's 3456 and 1728 at P = 4, 8): two 64 x 192 warpgroup tiles along M.
COLUMNS_192 = 192


def direct_ag_config(rows: int, *, spread: bool = False, n: int | None = None) -> DirectAGConfig:
    """The direct AG kernel's tiling for x [rows, K] on each device (n: w's columns there, if
    known): tiles walked along M, the last wave narrowed where it fills at most half the CTAs
    (where it applies); with `spread` (sending the own rows takes longer than
    their GEMM), the own tiles spread among the peers' (50%) in 2-CTA clusters where the rows
    allow (where the sends take less than the own GEMM, spreading does not pay). Where n
    is whole 192s but not 256s, 128 x 192 CTA tiles (as `gemm_core.tiling`), not narrowed."""
    base = DirectAGConfig()
    if n is not None and n % base.cta_n and n % COLUMNS_192 == 0:
        base = DirectAGConfig(wg_along_m=True, tile_m=64, tile_n=COLUMNS_192)
    if not spread:
        narrow = base.cta_n % 128 == 0  # narrowing halves whole 128-column tiles
        return dataclasses.replace(base, grid_minor_m=True, narrow_tail=narrow)
    tiles = dataclasses.replace(base, spread=50)
    if rows % dataclasses.replace(tiles, cluster="m").cluster_m == 0:
        tiles = dataclasses.replace(tiles, cluster="m")
    return tiles


#: Tilings the tuner measures beside the cost model's, per collective ("ag" / "rs").
TUNING_CANDIDATES: dict[str, tuple[KernelConfig, ...]] = {
    "ag": (
        RingAGConfig(grid_tile_width=16),
        RingAGConfig(grid_minor_m=True),
        DirectAGConfig(),
        DirectAGConfig(grid_tile_width=16),
        DirectAGConfig(cluster="m"),
        DirectAGConfig(cluster="m", spread=50),
        PingPongAGConfig(),  # not the plan: behind it on the presets
        # bands 1 row wide: the fastest AG cores on some local shapes, slower on others
        PingPongAGConfig(grid_tile_width=1),
        PingPongAGConfig(tile_n=128, grid_tile_width=1),
    ),
    "rs": (
        DirectRSConfig(),
        DirectRSConfig(cluster="m", split_tail=0),
        DirectRSConfig(cluster="m", chain_tiles=True),
        DirectRSConfig(cluster="m", chain_tiles=True, split_tail=0),
        DirectRSConfig(
            wg_along_m=True,
            cluster="m",
            chain_tiles=True,
            tile_m=64,
            tile_n=256,
            tile_k=128,
            stages=2,
            split_tail=0,
            zero_ahead=2,
        ),
        PingPongRSConfig(),
        # bands 1 row wide: the fastest RS cores on comm_heavy's local shapes, slower on most
        # llama shapes
        PingPongRSConfig(grid_tile_width=1),
    ),
}
