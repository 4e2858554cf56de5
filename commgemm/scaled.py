"""The quantized entry points beside the ops' `scaling=`: the collective GEMM on operands the
caller quantized (`prequantized_matmul`, forward only) and one quantized GEMM on global arrays
(`matmul`, differentiable). Both run commgemm.autodiff's quantizer; how the operands are
quantized: commgemm.operand_scaling; the quantized local GEMM: commgemm.quantized_gemm.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from commgemm.autodiff import Quantizer, collective_matmul, forward
from commgemm.config import Collective, OverlapConfig
from commgemm.operand_scaling import check_scales
from commgemm.operands import dot
from commgemm.quant import TENSOR_MODES, ScaledTensor, Scaling, ScalingRecipe, as_recipe


def prequantized_matmul(
    collective: Collective,
    qx: ScaledTensor,
    qw: ScaledTensor,
    axis_name: str,
    cfg: OverlapConfig,
    w_transposed: bool,
) -> jax.Array:
    """The 2-D collective GEMM on operands the caller quantized: qx [rows, K] (blocks along K),
    qw [K, n] (or [n, K] with w_transposed; blocks along K). Forward only; the result in
    cfg.out_dtype."""
    if qx.mode is not qw.mode:
        raise ValueError(f"x is {qx.mode.name} but w is {qw.mode.name}: quantize both alike")
    for name, t in (("x", qx), ("w", qw)):
        check_scales(name, t)
    k_dim = 1 if w_transposed else 0
    if qx.mode not in TENSOR_MODES and (qw.axis % 2 != k_dim):
        raise ValueError(
            f"w's blocks run along its dimension {qw.axis % 2}, but its K dimension is {k_dim}: "
            f"quantize w with axis={k_dim}"
        )
    quantizer = Quantizer.of(ScalingRecipe(qx.mode))
    like_x = qx.data[:0].astype(cfg.out_dtype)  # the dtype, K and varying axes forward reads
    out, _ = forward(collective, axis_name, cfg, w_transposed, quantizer, like_x, None, qx, qw)
    return out


def matmul(
    x: jax.Array, w: jax.Array, scaling: Scaling, *, w_transposed: bool = False
) -> jax.Array:
    """x [..., K] @ w [K, N] (or [N, K] with w_transposed) under `scaling`, as one GEMM: on one
    device, or on global arrays that XLA partitions (with the whole tensor's amax). Returns
    [..., N] in x's dtype; differentiable as the ops are. No scaling: a plain dot."""
    recipe = as_recipe(scaling)
    x2d = x.reshape(-1, x.shape[-1])
    if recipe is None:
        wide = jnp.promote_types(x.dtype, jnp.float32).name
        dims = ((1,), (1 if w_transposed else 0,))
        out = dot(x2d, w, dims, accumulate_dtype=wide, result_dtype=x.dtype)
        return out.reshape(*x.shape[:-1], -1)
    cfg = OverlapConfig(out_dtype=x.dtype.name)
    out = collective_matmul(Collective.NONE, x2d, w, None, cfg, w_transposed, recipe)
    return out.reshape(*x.shape[:-1], -1)
