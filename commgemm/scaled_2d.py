"""`matmul_2d` under `scaling=`: W's rows gathered over the row axis as their quantized payload
(float8 values; block modes' scales with their blocks), never in W's own dtype.

Scales: x and W each have one tensor scale (CURRENT: amax over both mesh axes; DELAYED: the
recipe's states), so the K blocks' partial sums, scaled back in each GEMM's epilogue, add in
one scale over `k_axis`. Block modes quantize W's local rows in blocks along K (which never
straddle shards: K per shard, of x and of W, must be whole blocks); the gathered scales are
sliced with their K block. The GEMM + all-reduce over `k_axis` is the ops' quantized path
(commgemm.autodiff's quantizer) on this device's K block of the gathered payload, per column
chunk for PIPELINE.

Backward (straight-through, as commgemm.autodiff's): dY quantized by current scaling (e5m2 by
default; block modes their own format, W again with blocks along N); dX is the local GEMM of dY
with this device's K block of W; dW's K block is X^T dY, and W's cotangent the transpose of the
gather and slice: the block put in its place among zeros and reduce-scattered over the row
axis (in W's dtype), then summed over `k_axis`, which W does not vary over.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from commgemm.autodiff import Quantizer, forward
from commgemm.config import Collective, OverlapConfig
from commgemm.operand_scaling import (
    check_blocks,
    dy_quantized,
    weight_operand,
    x_operand,
)
from commgemm.quant import (
    BLOCK,
    TENSOR_MODES,
    ScaledTensor,
    ScalingMode,
    ScalingRecipe,
    _held,
    amax,
    dequantize,
    quantize,
)
from commgemm.vma import all_reduce_transpose, like_primal, varying_like


def matmul_2d(
    x: jax.Array,
    w: jax.Array,
    row_axis: str,
    k_axis: str,
    cfg: OverlapConfig,
    splits: int,
    recipe: ScalingRecipe,
) -> jax.Array:
    """x [m, K/Y] (P(row_axis, k_axis)), w [K/X, N] (P(row_axis, None)) -> [m, N], this
    device's rows of X @ W under `recipe`, invariant over k_axis. `cfg` is the GEMM +
    all-reduce's config for each of `splits` column chunks of W (N divisible by splits)."""
    check_blocks(recipe, x.shape[1], w.shape[1])
    check_blocks(recipe, w.shape[0], w.shape[1])  # W's own rows are quantized where they are
    axes = (row_axis, k_axis)
    qx = x_operand(x, recipe, axes)
    w, qw, _ = weight_operand(w, recipe, 0, axes)  # its GEMMs take w's blocks as quantized
    quantizer = Quantizer.of(recipe)
    return _scaled_2d(row_axis, k_axis, cfg, splits, quantizer, x, w, qx, qw, recipe.dy_state)


def _columns(t: ScaledTensor, start: int, width: int) -> ScaledTensor:
    """Columns [start, start + width) of W's quantized rows [K/X, N] (blocks along K)."""
    data = t.data[:, start : start + width]
    scales = t.scale_inv if t.mode in TENSOR_MODES else t.scale_inv[start : start + width]
    return dataclasses.replace(t, data=data, scale_inv=scales)


def _k_block(t: ScaledTensor, row_axis: str, k_axis: str, k_block: int) -> ScaledTensor:
    """W's quantized rows gathered over row_axis as bytes (float8 values, block scales) and
    sliced to this device's K block [k_block, n]; tensor scales are already shared."""
    index = lax.axis_index(k_axis) * k_block
    values = t.data
    if t.mode is ScalingMode.NVFP4_1D_SCALING:
        values = _held(values).astype(jnp.float8_e4m3fn)  # exact: float4_e2m1fn travels as e4m3
    values = lax.all_gather(values, row_axis, axis=0, tiled=True)
    values = lax.dynamic_slice_in_dim(values, index, k_block, axis=0).astype(t.data.dtype)
    scales = t.scale_inv
    if t.mode not in TENSOR_MODES:  # [n, K/X/block] -> [n, K/block] -> [n, k_block/block]
        block = BLOCK[t.mode]
        raw = lax.all_gather(
            lax.bitcast_convert_type(scales, jnp.uint8), row_axis, axis=1, tiled=True
        )
        raw = lax.dynamic_slice_in_dim(raw, index // block, k_block // block, axis=1)
        scales = lax.bitcast_convert_type(raw, scales.dtype)
    return dataclasses.replace(t, data=values, scale_inv=scales)


def _concat(blocks: list[ScaledTensor]) -> ScaledTensor:
    """The column chunks' K blocks side by side: [k_block, N]."""
    first = blocks[0]
    if len(blocks) == 1:
        return first
    data = jnp.concatenate([b.data for b in blocks], axis=1)
    if first.mode in TENSOR_MODES:
        return dataclasses.replace(first, data=data)
    scales = jnp.concatenate([b.scale_inv for b in blocks], axis=0)
    return dataclasses.replace(first, data=data, scale_inv=scales)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _scaled_2d(row_axis, k_axis, cfg, splits, quantizer, x, w, qx, qw, dy_state) -> jax.Array:
    """The 2-D GEMM on quantized operands qx (x's rows, blocks along K) and qw (W's local rows,
    blocks along K); x and w are what gradients flow to (straight-through); dy_state's
    cotangent is its advanced state (`operand_scaling.dy_quantized`)."""
    return _forward_2d(row_axis, k_axis, cfg, splits, quantizer, x, w, qx, qw, dy_state)[0]


def _forward_2d(row_axis, k_axis, cfg, splits, quantizer, x, w, qx, qw, dy_state):
    width = w.shape[1] // splits
    outs, blocks = [], []
    for c in range(splits):
        block = _k_block(_columns(qw, c * width, width), row_axis, k_axis, x.shape[1])
        out, _ = forward(Collective.ALL_REDUCE, k_axis, cfg, False, quantizer, x, None, qx, block)
        outs.append(out)
        blocks.append(block)
    out = outs[0] if splits == 1 else jnp.concatenate(outs, axis=1)
    rows, x_scale = quantizer.lhs(x, qx)
    return out, (rows, x_scale, _concat(blocks), x[:0], w[:, :0], dy_state)


def _backward_2d(row_axis, k_axis, cfg, splits, quantizer, residuals, dy):
    rows, x_scale, qw, like_x, like_w, dy_state = residuals
    mode = quantizer.mode
    k_block, n = like_x.shape[1], dy.shape[1]
    dy = all_reduce_transpose(dy, k_axis)
    axes = (row_axis, k_axis)
    qdy, new_state = dy_quantized(dy, mode, quantizer.grad_dtype, axes, dy_state)
    if mode not in TENSOR_MODES:  # blocks along N, dX's contracting dimension
        values = dequantize(qw, like_x.dtype)
        qw = quantize(values, mode, axis=1, amax=amax(values, axes))
    d, d_scale = quantizer.lhs(dy, qdy)
    rhs = quantizer.rhs(None, qw, d_scale, n, like_x.dtype.name, quantizer.split[1])
    dx = quantizer.local(d, rhs, True, cfg.accumulate_dtype, like_x.dtype)
    acc = cfg.accumulate_dtype
    dw = quantizer.weight_grad(rows, x_scale, d, d_scale, k_block, n, False, acc, like_w.dtype)
    # the transpose of gather-then-slice: the block among zeros, reduce-scattered over rows
    whole = varying_like(jnp.zeros((like_w.shape[0] * lax.axis_size(row_axis), n), dw.dtype), dw)
    whole = lax.dynamic_update_slice_in_dim(whole, dw, lax.axis_index(k_axis) * k_block, axis=0)
    dw = lax.psum_scatter(whole, row_axis, scatter_dimension=0, tiled=True)
    return (
        like_primal(dx.astype(like_x.dtype), like_x),
        like_primal(dw, like_w),
        None,
        None,
        new_state,
    )


_scaled_2d.defvjp(_forward_2d, _backward_2d)
