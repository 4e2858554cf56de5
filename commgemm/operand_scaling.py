"""How an op quantizes its operands under a `ScalingRecipe`: x and w with their tensor (or
NVFP4 global) scale shared over the op's mesh axes (`quantize_operand`), a weight quantized
once for several calls (`quantize_weight` -> `QuantizedWeight`, taken by `weight_operand`),
dY for the backward (`dy_quantized`), the straight-through values of emulated paths
(`straight_through`), and the rows of operands each shard quantized by its own tensor scale
(`scales_may_differ`, `rescaled_by_source`). The ops' quantized GEMMs are commgemm.scaled and
commgemm.scaled_2d; the grouped ops' commgemm.grouped.scaling."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from commgemm.mosaic_gpu.transposes import quantized_swapped
from commgemm.quant import (
    BLOCK,
    TENSOR_MODES,
    QuantizedWeight,
    ScaledTensor,
    Scaling,
    ScalingMode,
    ScalingRecipe,
    ScalingState,
    amax,
    as_recipe,
    dequantize_fusible,
    quantize,
    scale_for,
)
from commgemm.vma import checks_vma, varying_axes


def straight_through(a: jax.Array, q: ScaledTensor, values: jax.Array | None = None) -> jax.Array:
    """q's values in a's dtype, with the identity gradient to a. The values are q's alone (not
    `values + (a - a)`, which reads `a` again and would put a's infinities in as NaNs), by
    `dequantize_fusible`: XLA may compute them in the pass that quantizes `a`; or `values`,
    where the caller has them (the kernel that quantized `a` wrote them)."""
    values = dequantize_fusible(q, a.dtype) if values is None else values
    return _identity_gradient(a, lax.stop_gradient(values))


@jax.custom_vjp
def _identity_gradient(a: jax.Array, values: jax.Array) -> jax.Array:
    return values


def _identity_gradient_fwd(a, values):
    return values, None


def _identity_gradient_bwd(_, ct):
    return ct, None


_identity_gradient.defvjp(_identity_gradient_fwd, _identity_gradient_bwd)


def check_blocks(recipe: ScalingRecipe, k: int, n: int) -> None:
    """Block modes need K (the forward's contracting size per shard) and N (dX's) in blocks."""
    block = BLOCK.get(recipe.mode)
    if block and (k % block or n % block):
        raise ValueError(
            f"{recipe.mode.name} scales blocks of {block} along the contracting dimensions: "
            f"K per shard ({k}) and N per shard ({n}) must be multiples of {block}"
        )


def x_operand(x: jax.Array, recipe: ScalingRecipe, axis_names) -> ScaledTensor:
    """x [..., K], a GEMM's row operand, quantized along K by `recipe` (no gradient through
    the quantizing; its x_state where delayed), its tensor scale shared over `axis_names`."""
    return quantize_operand(lax.stop_gradient(x), recipe, -1, axis_names, recipe.x_state)


def quantize_operand(
    a: jax.Array, recipe: ScalingRecipe, axis: int, axis_names, state: ScalingState | None
) -> ScaledTensor:
    """`a` quantized as an operand of a GEMM contracting its dimension `axis`, its tensor (or
    NVFP4 global) scale shared over `axis_names`."""
    if recipe.mode is ScalingMode.DELAYED_TENSOR_SCALING:
        return quantize(a, recipe.mode, dtype=recipe.dtype, axis=axis, state=state)[0]
    shared = None if recipe.mode is ScalingMode.MXFP8_1D_SCALING else amax(a, axis_names)
    return quantize(a, recipe.mode, dtype=recipe.dtype, axis=axis, amax=shared)


def quantize_swapped(
    a: jax.Array, recipe: ScalingRecipe, axis: int, axis_names, state: ScalingState | None
) -> tuple[ScaledTensor, jax.Array | None]:
    """`quantize_operand(a, ...)` and, for tensor modes, its float8 values with the last two
    dimensions swapped, both written by one pass where a CUDA GPU's kernel takes `a`
    (`mosaic_gpu.transposes.quantized_swapped`: the values bit for bit as `quantize` writes
    them); block modes: (`quantize_operand(a, ...)`, None)."""
    if recipe.mode not in TENSOR_MODES or a.ndim < 2:
        return quantize_operand(a, recipe, axis, axis_names, state), None
    if recipe.mode is ScalingMode.DELAYED_TENSOR_SCALING:
        scale = state.scale  # a delayed recipe holds its states
    else:
        scale = scale_for(amax(a, axis_names), recipe.dtype)
    data, t = quantized_swapped(a, scale, recipe.dtype)
    return ScaledTensor(data, 1.0 / scale, mode=recipe.mode, axis=axis), t


def quantize_weight(
    w: jax.Array,
    scaling: Scaling,
    *,
    axis: int = -2,
    axis_name: str | tuple[str, ...] | None = None,
    keep_transposed: bool = False,
) -> QuantizedWeight:
    """w quantized once for the calls that take it with the same `scaling` (`QuantizedWeight`):
    the values and scales each of those ops would compute itself, so the results and gradients
    are the same as passing w, without quantizing it again per call.

    Args:
      w: the weight as the ops take it: [K, N], [N, K] (w_transposed=True: pass axis=-1), or
        [G, K, N] for the grouped ops.
      scaling: a `ScalingMode` or `ScalingRecipe` (delayed scaling: the recipe's w_state gives
        the scale).
      axis: w's contracting (K) dimension, along which block modes scale their blocks.
      axis_name: inside shard_map, the op's mesh axis (for `matmul_2d` both of its axes): the
        tensor scale comes from the whole weight's amax over it, one scale on every shard, as
        the op's own quantization takes it. Outside shard_map: None.
      keep_transposed: also keep the float8 values with w's last two dimensions swapped
        (`QuantizedWeight.transposed`, as much memory again; tensor scaling only). Float8
        GEMMs on Hopper read both operands K-major: the grouped ops' forward reads the experts
        [G, N, K], the dense ops' GEMMs w [n, K] (the forward of w [K, n], dX of w [n, K] with
        w_transposed); each call transposes w's values for them without the kept copy.
        `matmul_2d` does not use it.
    Returns:
      A QuantizedWeight (a pytree) whose gradient flows to w (straight-through).
    """
    recipe = as_recipe(scaling)
    if recipe is None:
        raise ValueError("quantize_weight needs a scaling mode or recipe, not None or NO_SCALING")
    if keep_transposed and (recipe.mode not in TENSOR_MODES or w.ndim < 2):
        raise ValueError(
            f"keep_transposed keeps one tensor's float8 values in a second layout: it needs "
            f"tensor scaling and w of at least 2 dimensions, got {recipe.mode.name} and "
            f"shape {w.shape}"
        )
    names = () if axis_name is None else axis_name
    stopped = lax.stop_gradient(w)
    if keep_transposed:
        q, transposed = quantize_swapped(stopped, recipe, axis % w.ndim, names, recipe.w_state)
    else:
        q = quantize_operand(stopped, recipe, axis % w.ndim, names, recipe.w_state)
        transposed = None
    return QuantizedWeight(w, lax.stop_gradient(q), transposed)


def weight_operand(
    w: jax.Array | QuantizedWeight,
    recipe: ScalingRecipe,
    k_dim: int,
    axis_names,
    *,
    swap: bool = False,
) -> tuple[jax.Array, ScaledTensor, jax.Array | None]:
    """(the weight the gradient flows to, the weight quantized along its dimension k_dim, its
    float8 values transposed or None): a `QuantizedWeight`'s own (checked against `recipe`,
    the op's K dimension and its mesh axes), else w quantized now with its scale shared over
    `axis_names`, with `swap` (the caller reads both layouts) its values transposed in the
    same pass (`quantize_swapped`; None for block modes), else None."""
    if not isinstance(w, QuantizedWeight):
        stopped = lax.stop_gradient(w)
        if swap:
            return w, *quantize_swapped(stopped, recipe, k_dim, axis_names, recipe.w_state)
        return w, quantize_operand(stopped, recipe, k_dim, axis_names, recipe.w_state), None
    q, ndim = w.quantized, w.value.ndim
    if q.mode is not recipe.mode:
        raise ValueError(f"w was quantized as {q.mode.name}, but scaling= asks {recipe.mode.name}")
    if tuple(q.data.shape) != tuple(w.value.shape):
        raise ValueError(
            f"w's quantized values have shape {tuple(q.data.shape)}, its value "
            f"{tuple(w.value.shape)}"
        )
    if q.mode in TENSOR_MODES and q.data.dtype.name != recipe.dtype:
        raise ValueError(
            f"w was quantized to {q.data.dtype.name}, but scaling= asks {recipe.dtype}"
        )
    if q.mode not in TENSOR_MODES and q.axis % ndim != k_dim % ndim:
        raise ValueError(
            f"w's blocks run along its dimension {q.axis % ndim}, but the op contracts its "
            f"dimension {k_dim % ndim}: quantize_weight(w, ..., axis={k_dim % ndim})"
        )
    check_scales("w", q)
    check_transposed(w)
    names = (axis_names,) if isinstance(axis_names, str) else tuple(axis_names or ())
    spread = [a for a in names if checks_vma(a) and a in varying_axes(tensor_scale(q))]
    if spread:
        raise ValueError(
            f"w's tensor scale differs between the shards of mesh axis {spread[0]!r}: quantize "
            f"it with quantize_weight(..., axis_name={axis_names!r}), one scale for the whole "
            "weight, as the op's own quantization takes it"
        )
    return w.value, q, w.transposed


def check_transposed(w: QuantizedWeight) -> None:
    """A `QuantizedWeight`'s transposed values, where it has them, are its float8 values with
    the last two dimensions swapped (their shape and dtype; `quantize_weight` makes them)."""
    t, data = w.transposed, w.quantized.data
    if t is None:
        return
    swapped = (*data.shape[:-2], data.shape[-1], data.shape[-2])
    if w.quantized.mode not in TENSOR_MODES or tuple(t.shape) != swapped or t.dtype != data.dtype:
        raise ValueError(
            f"w's transposed values ({tuple(t.shape)}, {t.dtype}) must be its tensor-scaled "
            f"float8 values ({tuple(data.shape)}, {data.dtype}) with the last two dimensions "
            "swapped: quantize_weight(..., keep_transposed=True) makes them"
        )


def dy_quantized(
    dy: jax.Array, mode: ScalingMode, grad_dtype: str, axis_names, state: ScalingState | None
) -> tuple[ScaledTensor, ScalingState | None]:
    """dY quantized for the backward, and the cotangent of the recipe's dy_state (None without
    one). Without a state: tensor modes scale dY by its current amax over `axis_names`, block
    modes by blocks. With a state: its scale, and the state advanced by dY's amax over every
    mesh axis dY may vary over (the whole tensor's, so every device holds the same new state,
    as the replicated state needs). Unchecked shard_map sums a replicated input's cotangent
    over its devices: there the state is handed back divided by their number, which that sum
    restores."""
    if state is None:
        dmode = ScalingMode.CURRENT_TENSOR_SCALING if mode in TENSOR_MODES else mode
        return quantize(dy, dmode, dtype=grad_dtype, amax=amax(dy, axis_names)), None
    mesh = jax.sharding.get_abstract_mesh()
    manual = tuple(mesh.manual_axes) if not mesh.empty else ()
    checked = bool(manual) and checks_vma(manual[0])
    over = tuple(a for a in manual if a in varying_axes(dy)) if checked else manual
    whole = lax.pmax(amax(dy), over) if over else amax(dy)
    qdy, new = quantize(dy, mode, dtype=grad_dtype, state=state, amax=whole)
    if manual and not checked:
        devices = math.prod(lax.axis_size(a) for a in manual)
        new = jax.tree.map(lambda v: v / devices, new)
    return qdy, new


def tensor_scale(t: ScaledTensor) -> jax.Array:
    """The part of t's scale that is one number for the whole tensor."""
    if t.mode in TENSOR_MODES:
        return t.scale_inv
    if t.global_scale_inv is not None:
        return t.global_scale_inv
    return jnp.ones((), jnp.float32)


def check_scales(name: str, t: ScaledTensor) -> None:
    """A ScaledTensor's scales fit its values: one per tensor, or one per block along t.axis."""
    if t.mode in TENSOR_MODES:
        want = ()
    else:
        axis = t.axis % t.data.ndim
        want = list(t.data.shape)
        if want[axis] % BLOCK[t.mode]:
            raise ValueError(f"{name}'s dimension {axis} ({want[axis]}) is not whole blocks")
        blocks = want.pop(axis) // BLOCK[t.mode]
        want = (*want, blocks)  # the blocked axis moved last, as quantize lays them out
    if tuple(t.scale_inv.shape) != tuple(want):
        raise ValueError(
            f"{name}'s scales have shape {tuple(t.scale_inv.shape)}; {t.mode.name} values of shape "
            f"{tuple(t.data.shape)} with blocks along axis {t.axis} need {tuple(want)}"
        )


def scales_may_differ(x: ScaledTensor, axis_name: str) -> bool:
    """Whether x's tensor scale may differ between the shards of `axis_name`: unless
    shard_map's check_vma types it invariant there (quantized with an amax shared over the
    axis), each shard may have quantized with its own."""
    if x.mode not in TENSOR_MODES and x.global_scale_inv is None:
        return False  # MXFP8: the block scales travel with their rows
    return not checks_vma(axis_name) or axis_name in varying_axes(tensor_scale(x))


def rescaled_by_source(out: jax.Array, scale: jax.Array, axis_name: str) -> jax.Array:
    """The gathered GEMM's rows [P*m, n] (rows of source shard s at [s*m, (s+1)*m)), computed
    with this shard's tensor scale, each block multiplied by its source's scale over this one's:
    the product under each shard's own scale."""
    scales = lax.all_gather(scale, axis_name)  # [P]: a number from each shard
    blocks = out.reshape(scales.shape[0], -1, out.shape[-1]).astype(jnp.float32)
    return (blocks * (scales / scale)[:, None, None]).astype(out.dtype).reshape(out.shape)
