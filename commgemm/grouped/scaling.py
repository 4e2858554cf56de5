"""Quantized grouped GEMMs (`scaling=` on the grouped ops), emulated: x and the experts' weights
are quantized with blocks (or one scale) along K, their scales shared over the op's mesh axis as
in commgemm.scaled, and the grouped GEMMs run on the quantized values in x's dtype; the
backward is straight-through, with dY quantized as in commgemm.autodiff (current scaling to
float8_e5m2, delayed with the recipe's dy_state, or the block mode along N). Where x's rows
travel (the all-gather's ring or gathers, the expert-parallel dispatch) they travel quantized:
float8 values, or bytes of values and block scales (`Rows`, `moved`), dequantized on arrival;
the gradients travel back in x's dtype, as JAX's transposes of the same collectives send them.
What is emulated: the GEMMs are not FP8 tensor-core GEMMs (XLA's ragged dot takes no float8
operands here). The exceptions, on a Hopper GPU with tensor scaling (current or delayed): the
local op multiplies float8 operands on the tensor cores in its forward and dX
(`mosaic_gpu.grouped.float8_ragged_dot`), and the collective ops multiply each block of rows
as it travelled (its float8 payload) by the experts' float8 values, and each block's rows of
the quantized dY by them in dX (`grouped.blocks.block_matmul`), with the same quantized
values; dW stays 16-bit. The forward reads the experts' float8 values [G, N, K]: a
`QuantizedWeight`'s kept copy (`quantize_weight(..., keep_transposed=True)`), else transposed
once per call (`mosaic_gpu.transposes.swapped`)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from commgemm.mosaic_gpu.transposes import swapped
from commgemm.operand_scaling import (
    check_blocks,
    dy_quantized,
    straight_through,
    tensor_scale,
    weight_operand,
    x_operand,
)
from commgemm.quant import (
    TENSOR_MODES,
    ScaledTensor,
    Scaling,
    ScalingMode,
    ScalingRecipe,
    amax,
    as_recipe,
    clip_cast,
    dequantize,
    dequantize_fusible,
    quantize,
    scale_for,
)
from commgemm.quantized_gemm import payload, unpack_rows
from commgemm.vma import varying_like
from commgemm.xla.common import after


def quantized_operands(
    x: jax.Array,
    w: jax.Array,
    scaling: Scaling,
    axis_name: str | None = None,
    qx: ScaledTensor | None = None,
    live: jax.Array | None = None,
    fill: bool = True,
) -> tuple[jax.Array, jax.Array, ScalingRecipe | None, Rows | None, Float8Experts | None]:
    """(x, w, recipe, rows, experts) with x [..., K] and w [G, K, N] (or a `QuantizedWeight`
    of it) replaced by their quantized values (straight-through), x's rows as they travel
    (`Rows`) and w as Hopper's float8 kernel reads it (`float8_experts`); unchanged, and rows
    and experts None, when scaling is None. `qx`: x as the recipe quantizes it, where the
    caller has it (`copied_rows`), else quantized here. `live`: x [R, K] holds values in its
    first `live` rows only, zeros past them (a grouped GEMM's result on a padded buffer): with
    current tensor scaling only those rows are quantized (`quantized_rows`; `fill=False`:
    its results' rows past `live` unspecified, for readers of the groups' rows only)."""
    recipe = as_recipe(scaling)
    if recipe is None:
        return x, w, None, None, None
    check_blocks(recipe, x.shape[-1], w.shape[2])
    names = () if axis_name is None else axis_name
    values = None
    if qx is None and live is not None and recipe.mode is ScalingMode.CURRENT_TENSOR_SCALING:
        qx, values = quantized_rows(lax.stop_gradient(x), live, recipe.dtype, names, fill=fill)
    elif qx is None:
        qx = x_operand(x, recipe, names)
    rows = Rows(payload(qx), tensor_scale(qx), qx.mode, x.shape[-1], x.dtype.name)
    w, qw, nk = weight_operand(w, recipe, 1, names, swap=float8_kernels(recipe))
    experts = float8_experts(recipe, qw, nk)
    return straight_through(x, qx, values), straight_through(w, qw), recipe, rows, experts


def rows_reason(shape: tuple[int, ...], dtype, float8) -> str | None:
    """Why `quantized_rows` (or `Rows.values`) works over every row of a [R, F] buffer of
    `dtype` and its `float8` values here, or None where the live-row kernels take it."""
    from commgemm.mosaic_gpu import rows

    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"the kernels write bf16 or f16 values, not {jnp.dtype(dtype).name}"
    return rows.kernel_reason(shape, dtype, float8)


def quantized_rows(
    x: jax.Array, live: jax.Array | None, dtype, axis_names=(), *, fill: bool = True
) -> tuple[ScaledTensor, jax.Array]:
    """x [R, F] quantized to the float8 `dtype` by current tensor scaling, its amax the largest
    of its first `live` rows' over `axis_names` (shared as `quant.amax` shares it), and the
    values that stands for in x's dtype: (ScaledTensor, values), both zeros past `live`
    (whatever x holds there). Where x's rows past `live` are zeros, exactly `quantize(x,
    amax=amax(x, axis_names))` and its `dequantize`. On a Hopper GPU (`rows_reason`) two
    passes over the live rows only (`mosaic_gpu.rows`: the amax, then one that writes the
    float8 values and the 16-bit ones; with `fill=False` the results' rows past `live` are not
    written, their values unspecified); elsewhere, or where `live` is None (no padding to
    skip: XLA's fused passes are the faster), XLA's over every row (those past `live` taken as
    zeros)."""
    mode = ScalingMode.CURRENT_TENSOR_SCALING
    if live is None or rows_reason(x.shape, x.dtype, dtype) is not None:
        if live is not None:  # the rows past `live` may hold anything (unwritten padding)
            x = jnp.where(jnp.arange(x.shape[0])[:, None] < live, x, jnp.zeros((), x.dtype))
        q = quantize(x, mode, dtype=dtype, amax=amax(x, axis_names))
        return q, dequantize_fusible(q, x.dtype)
    from commgemm.mosaic_gpu.rows import amax_rows, map_rows

    scale = scale_for(amax(x, axis_names, local=amax_rows(x, live)), dtype)

    def math_(tiles, scalars):
        q = clip_cast(tiles[0] * scalars[0], dtype)  # `quant.quantize`'s rounding
        return q, q.astype(jnp.float32) * scalars[1]

    q, values = map_rows(math_, (x,), live, (dtype, x.dtype), (scale, 1.0 / scale), fill=fill)
    q, values = (varying_like(a, x, live) for a in (q, values))
    return ScaledTensor(q, 1.0 / scale, mode=mode), values


def copied_rows(
    x: jax.Array, index: jax.Array, scaling: Scaling, axis_name: str | None = None
) -> ScaledTensor | None:
    """x[index] (rows [m, K] taken, each any number of times: a token's copies) as the recipe
    quantizes it, from x quantized once: its tensor scale is x's where every row is taken
    (the copies' amax is the tokens'), and each copy's float8 values are its row's. None
    without a tensor-scaled recipe (block modes quantize the copies themselves)."""
    recipe = as_recipe(scaling)
    if recipe is None or recipe.mode not in TENSOR_MODES:
        return None
    q = x_operand(x, recipe, () if axis_name is None else axis_name)
    return dataclasses.replace(q, data=q.data[index])


@dataclasses.dataclass(frozen=True)
class Float8Experts:
    """The experts' weights as commgemm's grouped kernel multiplies them on Hopper's float8
    tensor cores, for one call of a collective grouped op: their float8 values laid out
    [G, N, K] for the forward (`nk`: a `QuantizedWeight`'s `transposed`, else transposed once
    per call, not per block) and as quantized,
    [G, K, N], for dX (`kn`: K-major for dX's contraction over N), their tensor scale, whether
    the forward, dX and dW accumulate split (the recipe's `split_accumulator`), and dY's float8
    format.

    `tags`: one zero scalar from each block that multiplied on the kernel. The op hands their
    sum to `with_quantized_cotangent`, whose backward gives it dY's tensor scale as its
    cotangent; so every block's backward gets that scale with its rows of dY, requantizes
    them to the float8 values the whole dY was quantized to, and runs dX on the kernel too."""

    nk: jax.Array
    kn: jax.Array
    scale_inv: jax.Array
    split: tuple[bool, bool, bool]
    grad_dtype: str
    tags: list = dataclasses.field(default_factory=list, compare=False, repr=False)

    @staticmethod
    def of(recipe: ScalingRecipe, qw: ScaledTensor, nk: jax.Array | None = None) -> Float8Experts:
        """qw [G, K, N], tensor-scaled by `recipe`, as the kernel reads it; `nk`: its values
        transposed already ([G, N, K]), or None."""
        split = tuple(recipe.split_accumulator)
        nk = swapped(qw.data) if nk is None else nk
        return Float8Experts(nk, qw.data, qw.scale_inv, split, jnp.dtype(recipe.grad_dtype).name)

    def link(self) -> jax.Array | None:
        """The sum of the blocks' tags (None where no block ran on the kernel)."""
        return functools.reduce(jnp.add, self.tags) if self.tags else None


def float8_experts(
    recipe: ScalingRecipe, qw: ScaledTensor, nk: jax.Array | None = None
) -> Float8Experts | None:
    """qw [G, K, N] (`nk`: its values transposed already, or None) as `Float8Experts`, or None
    where the collective grouped ops' GEMMs stay emulated: block modes, and backends other
    than a Hopper GPU."""
    return Float8Experts.of(recipe, qw, nk) if float8_kernels(recipe) else None


def float8_kernels(recipe: ScalingRecipe) -> bool:
    """Whether the collective grouped ops' GEMMs multiply on the float8 kernels under `recipe`
    (`float8_experts`): tensor modes on a Hopper GPU."""
    from commgemm.mosaic_gpu import tiles as mosaic_tiles

    return recipe.mode in TENSOR_MODES and mosaic_tiles.hopper_reason() is None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Rows:
    """Quantized rows [..., K] as they travel: `payload` (float8 values, or values and block
    scales as bytes [..., K + K/block]: `quantized_gemm.payload`) and `scale`, the part of the
    scale that is one number for the whole tensor (tensor modes; NVFP4's global scale),
    dequantized on arrival to `dtype` (`values`): the values of the sender's rows, exactly."""

    payload: jax.Array
    scale: jax.Array
    mode: ScalingMode = dataclasses.field(metadata=dict(static=True))
    k: int = dataclasses.field(metadata=dict(static=True))
    dtype: str = dataclasses.field(metadata=dict(static=True))
    live: jax.Array | None = None
    fill: bool = dataclasses.field(default=True, metadata=dict(static=True))

    def values(self) -> jax.Array:
        """The rows' values in `dtype`. Where `live` is set (the payload [R, K] holds rows in
        its first `live` only: the rows an exchange brought; past them padding) and the
        live-row kernels take it (`rows_reason`), those rows only are dequantized: zeros past
        them, or, without `fill` (no one reads the padding), nothing written there."""
        lead, flat = self.payload.shape[:-1], self.payload.reshape(-1, self.payload.shape[-1])
        kernel = self.live is not None and self.mode in TENSOR_MODES and self.payload.ndim == 2
        if kernel and rows_reason(self.payload.shape, self.dtype, self.payload.dtype) is None:
            from commgemm.mosaic_gpu.rows import map_rows

            math_ = lambda tiles, scalars: (tiles[0] * scalars[0],)  # noqa: E731
            (out,) = map_rows(
                math_, (self.payload,), self.live, (self.dtype,), (self.scale,), fill=self.fill
            )
            return varying_like(out, self.payload, self.live)
        if self.mode in TENSOR_MODES:
            t = ScaledTensor(flat, self.scale, mode=self.mode)
        else:
            t = unpack_rows(flat, self.mode, self.k)
            if self.mode is ScalingMode.NVFP4_1D_SCALING:
                t = dataclasses.replace(t, global_scale_inv=self.scale)
        return dequantize(t, self.dtype).reshape(*lead, self.k)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def moved(fn, values: jax.Array, rows: Rows, *args) -> tuple[jax.Array, Rows]:
    """fn(block, *args), a collective linear in the block (a ppermute, an all-gather, a ragged
    all-to-all whose layouts are `args`), applied to a block of quantized rows: to their
    payload, which is what travels, the values dequantized on arrival (fn of `values`, the
    block's values); the gradient flows to `values` through fn's transpose, as it would
    through fn(values). Returns (the values, the moved rows)."""
    arrived = dataclasses.replace(rows, payload=fn(rows.payload, *args))
    return arrived.values(), arrived


def _moved_fwd(fn, values, rows, *args):
    # values: the point of fn's (linear) VJP; the block's GEMM keeps it as a residual anyway
    return moved(fn, values, rows, *args), (values, args)


def _moved_bwd(fn, residuals, cotangents):
    values, args = residuals
    pullback = jax.vjp(lambda v: fn(v, *args), values)[1]
    return (pullback(cotangents[0])[0], None, *(None for _ in args))


moved.defvjp(_moved_fwd, _moved_bwd)


def carry(
    fn,
    block: jax.Array,
    rows: Rows | None,
    previous,
    *args,
    live: jax.Array | None = None,
    fill: bool = True,
) -> tuple[jax.Array, Rows | None]:
    """fn(block, *args) (a collective; `args` its traced operands besides the block) applied to
    a block of x's rows, held until `previous` exists (the collectives of a pipeline stay
    apart: commgemm.xla.common.after): to its quantized payload where it has one (`moved`),
    else to the block itself. Returns (the values, the moved rows). `live`: the rows that
    hold values once moved, where known, and `fill`: whether the values' padding past them is
    written (`Rows.live`, `Rows.fill`)."""
    if rows is None:
        return fn(after(block, previous), *args), None
    held = dataclasses.replace(rows, payload=after(rows.payload, previous), live=live, fill=fill)
    return moved(fn, block, held, *args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _quantized_cotangent(y: jax.Array, link, state, mode: ScalingMode, grad_dtype: str, axis_name):
    return y


def _fwd(y, link, state, mode, grad_dtype, axis_name):
    return y, (state, link)


def _bwd(mode, grad_dtype, axis_name, residuals, dy):
    # dy_quantized: by the current amax over the axis (block modes by blocks), or by the
    # delayed state's scale, the state's cotangent then the advanced state
    state, link = residuals
    names = () if axis_name is None else axis_name
    q, new = dy_quantized(dy, mode, grad_dtype, names, state)
    scale = None  # the link's cotangent: dY's tensor scale, for the blocks' float8 dX
    if link is not None:
        scale = varying_like(q.scale_inv.astype(jnp.float32).reshape(link.shape), link)
    return lax.stop_gradient(dequantize_fusible(q, dy.dtype)), scale, new


_quantized_cotangent.defvjp(_fwd, _bwd)


def with_quantized_cotangent(
    y: jax.Array, recipe: ScalingRecipe | None, axis_name=None, experts: Float8Experts | None = None
):
    """y itself; its cotangent quantized as `recipe` quantizes dY (nothing without a recipe):
    by its current amax over `axis_name` (tensor modes; block modes by blocks), or with the
    recipe's `dy_state` by that state's scale, the state's cotangent then the state advanced by
    dY's amax over every device (`operand_scaling.dy_quantized`: "overwrite with gradient").
    `experts`: those of the op's call, whose blocks' tags (`Float8Experts.tags`) get dY's
    tensor scale as their cotangent."""
    if recipe is None:
        return y
    link = None if experts is None else experts.link()
    return _quantized_cotangent(y, link, recipe.dy_state, recipe.mode, recipe.grad_dtype, axis_name)
