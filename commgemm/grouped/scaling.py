"""Quantized grouped GEMMs (`scaling=` on the grouped ops), emulated: x and the experts' weights
are quantized with blocks (or one scale) along K, their scales shared over the op's mesh axis as
in commgemm.scaled, and the grouped GEMMs run on the quantized values in x's dtype; the
backward is straight-through, with dY quantized as in commgemm.scaled (current scaling to
float8_e5m2, or the block mode along N). What is emulated: the GEMMs are not FP8 tensor-core
GEMMs, and the payloads move in x's dtype, not as float8 (XLA's ragged dot takes no float8
operands here). The one exception: the local op on a Hopper GPU with current tensor scaling
multiplies float8 operands on the tensor cores (`mosaic_gpu.grouped.float8_ragged_dot`), with
the same quantized values and the same backward."""

from __future__ import annotations

import functools

import jax
from jax import lax

from commgemm.operand_scaling import (
    check_blocks,
    fake_quantize,
    straight_through,
    weight_operand,
)
from commgemm.quant import (
    TENSOR_MODES,
    Scaling,
    ScalingMode,
    ScalingRecipe,
    amax,
    as_recipe,
    dequantize,
    quantize,
)


def quantized_operands(
    x: jax.Array, w: jax.Array, scaling: Scaling, axis_name: str | None = None
) -> tuple[jax.Array, jax.Array, ScalingRecipe | None]:
    """(x, w, recipe) with x [..., K] and w [G, K, N] (or a `QuantizedWeight` of it) replaced
    by their quantized values (straight-through); unchanged when scaling is None."""
    recipe = as_recipe(scaling)
    if recipe is None:
        return x, w, None
    if recipe.dy_state is not None:
        raise ValueError(
            "the grouped ops' emulated scaling quantizes dY by its current amax: pass the "
            "recipe without dy_state"
        )
    check_blocks(recipe, x.shape[-1], w.shape[2])
    names = () if axis_name is None else axis_name
    x = fake_quantize(x, recipe, -1, names, recipe.x_state)
    w, qw = weight_operand(w, recipe, 1, names)
    return x, straight_through(w, qw), recipe


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _quantized_cotangent(y: jax.Array, mode: ScalingMode, grad_dtype: str, axis_name):
    return y


def _fwd(y, mode, grad_dtype, axis_name):
    return y, None


def _bwd(mode, grad_dtype, axis_name, _, dy):
    names = () if axis_name is None else axis_name
    if mode in TENSOR_MODES:
        q = quantize(dy, ScalingMode.CURRENT_TENSOR_SCALING, dtype=grad_dtype,
                     amax=amax(dy, names))  # fmt: skip
    else:
        shared = None if mode is ScalingMode.MXFP8_1D_SCALING else amax(dy, names)
        q = quantize(dy, mode, amax=shared)
    return (lax.stop_gradient(dequantize(q, dy.dtype)),)


_quantized_cotangent.defvjp(_fwd, _bwd)


def with_quantized_cotangent(y: jax.Array, recipe: ScalingRecipe | None, axis_name=None):
    """y itself; its cotangent quantized as `recipe` quantizes dY (nothing without a recipe)."""
    if recipe is None:
        return y
    return _quantized_cotangent(y, recipe.mode, recipe.grad_dtype, axis_name)
