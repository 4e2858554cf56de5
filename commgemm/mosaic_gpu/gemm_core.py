"""`OverlapConfig.local_gemm="mosaic"`: a fused kernel run with no peers as the local GEMM of
the methods that are not fused (NONE, PIPELINE, RING_EXCHANGE).

Where the ping-pong RS kernel (`pingpong_rs`) takes the shape and its 192-wide
tiles pad at most 1% of N (`heuristics.pingpong_tiles`), it is that kernel with nothing to
add: each compute warpgroup a whole 128 x 192 tile, its epilogue under the other's K loop, 2-CTA
clusters (level with XLA's dot on the RS presets' local GEMMs, where the kernel below is
slower: docs/performance.md).
Elsewhere it is the kernel the fused AG op runs, with nothing to send: one persistent CTA per
SM, 128 x 256 tiles of two compute warpgroups, 4 stages of TMA loads, one wgmma in flight, TMA
stores of the result in 64 x 64 blocks; where the last wave of tiles fills at most half the
CTAs, those tiles run as two 128 x 128 halves each (`DirectAGConfig.narrow_tail`); N that is
whole 192s but not 256s takes 128 x 192 tiles (`tiling`). Float8 operands (an op's
tensor-scaled `scaling=`) multiply on the float8 tensor cores with w laid out [n, K] and the two
scales applied in the epilogue, as in the fused ops. Which of it and XLA's dot is faster
depends on the shape: the tuner measures both, and AUTO reads its
choice from the tune cache.

A GEMM the kernel cannot run (`gemm_reason`: not whole tiles, a float32 result, block-scaled
modes, two float8 formats, split accumulation) multiplies with XLA's dot instead, so a chunk of
a split method or a backward GEMM never fails for the choice; on a backend without the kernel
the plan refuses the config (`commgemm.plan`). Float8 asking for split accumulation stays on
XLA's promoted GEMM, faster than the kernel's split form.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from commgemm.config import Method, OverlapConfig
from commgemm.mosaic_gpu import tiles as mosaic_tiles
from commgemm.mosaic_gpu.configs import DirectAGConfig, PingPongRSConfig
from commgemm.mosaic_gpu.heuristics import COLUMNS_192, pingpong_tiles
from commgemm.quant import TENSOR_MODES

#: The kernel's tilings: bf16 / fp16, and float8 (128-byte K-steps, `configs.FLOAT8_TILE_K`);
#: a last wave at most half full runs its tiles as half-width ones (`narrow_tail`).
TILES = DirectAGConfig(narrow_tail=True)
FLOAT8_TILES = DirectAGConfig(tile_k=128, narrow_tail=True)


def tiling(n: int, *, float8: bool) -> DirectAGConfig:
    """The kernel's tiling for N = n columns (`TILES`, `FLOAT8_TILES`; 128 x 192 CTA tiles where
    n is whole 192s but not 256s)."""
    tiles = FLOAT8_TILES if float8 else TILES
    if n % tiles.cta_n and n % COLUMNS_192 == 0:
        tiles = dataclasses.replace(
            tiles, wg_along_m=True, tile_m=64, tile_n=COLUMNS_192, narrow_tail=False
        )
    return tiles


def gemm_reason(x: jax.Array, w, w_transposed: bool, result_dtype) -> str | None:
    """Why the kernel cannot compute x [r, K] @ w ([K, n], [n, K] with w_transposed, or a
    `quantized_gemm.QuantizedRhs`) in `result_dtype` on this backend, or None."""
    from commgemm.quantized_gemm import QuantizedRhs

    if (reason := mosaic_tiles.hopper_reason()) is not None:
        return reason
    if isinstance(w, QuantizedRhs):
        if w.w.mode not in TENSOR_MODES:
            return f"{w.w.mode.name} has no Hopper tensor-core path"
        if w.split_accumulator:
            return "XLA's promoted FP8 GEMM is faster than its split accumulation"
        if x.dtype != w.w.data.dtype:  # e.g. dX's e5m2 dY against e4m3 W
            return f"it takes one float8 format, got {x.dtype} and {w.w.data.dtype}"
        out, data = w.dtype, w.w.data
    else:
        if x.dtype not in (jnp.bfloat16, jnp.float16) or w.dtype != x.dtype:
            return f"it multiplies bf16 or fp16 operands, got {x.dtype} and {w.dtype}"
        out, data = x.dtype, w
    if jnp.dtype(result_dtype or "float32") != jnp.dtype(out):
        return f"its result is {jnp.dtype(out).name}, not {jnp.dtype(result_dtype).name}"
    if _pingpong(x, data, w_transposed, out) is not None:
        return None
    (rows, k), n = x.shape, data.shape[0 if w_transposed else 1]
    tiles = tiling(n, float8=isinstance(w, QuantizedRhs))
    return mosaic_tiles.shape_reason(tiles, rows, k, n)


def auto_takes(x: jax.Array, w, w_transposed: bool, result_dtype) -> bool:
    """Whether local_gemm "auto" runs x [r, K] @ w here: w a `quantized_gemm.QuantizedRhs` (tensor
    scales, fast accumulation, one float8 format) that the kernel can run (`gemm_reason`) on
    the ping-pong kernel (`heuristics.pingpong_tiles`: N padded at most 3.5%), where it is
    faster than XLA's FP8 dot on the presets' local shapes; bf16 stays on XLA's dot, as fast or
    faster there (docs/performance.md)."""
    from commgemm.quantized_gemm import QuantizedRhs

    if not isinstance(w, QuantizedRhs) or gemm_reason(x, w, w_transposed, result_dtype):
        return False
    return _pingpong(x, w.w.data, w_transposed, w.dtype) is not None


def _pingpong(x, data, w_transposed: bool, out_dtype) -> PingPongRSConfig | None:
    """The ping-pong kernel's tiling where it runs x @ data (w's values) well, else None.
    Float8 values are read [n, K] whatever their layout (`fused._float8_call`)."""
    (rows, k), n = x.shape, data.shape[0 if w_transposed else 1]
    w_nk = w_transposed or jnp.dtype(data.dtype).itemsize == 1
    return pingpong_tiles(rows, k, n, x.dtype, w_nk=w_nk, out_dtype=out_dtype)


def matmul(x: jax.Array, w, w_transposed: bool) -> jax.Array:
    """x [r, K] @ w by the kernel (`gemm_reason` must be None): [r, n] in x's dtype (a
    QuantizedRhs: in its dtype, scaled back)."""
    from commgemm.mosaic_gpu import fused
    from commgemm.quantized_gemm import QuantizedRhs

    quantized = isinstance(w, QuantizedRhs)
    data = w.w.data if quantized else w
    pingpong = _pingpong(x, data, w_transposed, w.dtype if quantized else x.dtype)
    n = data.shape[0 if w_transposed else 1]
    tiles = pingpong or tiling(n, float8=quantized)
    config = OverlapConfig(method=Method.PIPELINE, atomic_gemm=True, kernel=tiles)
    run = fused.all_gather_matmul if pingpong is None else fused.matmul_reduce_scatter
    with jax.named_scope("gemm_core"):
        return run(x, w, None, config, w_transposed=w_transposed)
