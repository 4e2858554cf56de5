"""The grouped GEMMs of the collective grouped ops' blocks of rows (the blocks an all-gather or an
expert-parallel dispatch brings, each sorted by group with counts of its own): one block
(`block_matmul`: its forward and dX on Hopper's float8 tensor cores where its quantized rows
allow), or all blocks in one GEMM (`merged_matmul`): their rows regrouped so that each group's
rows, from every block, are contiguous, multiplied once, and put back. Regrouping costs a gather
of the rows and of the result; it pays because a grouped GEMM's cost grows with its group
boundaries, and P blocks of G groups have P times as many as G groups over the same rows
(docs/performance.md: "collective grouped ops' blocks as one grouped GEMM"). The ring
multiplies each block as it arrives (`block_matmul`)."""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from commgemm.grouped.local import grouped_matmul
from commgemm.grouped.scaling import (
    Float8Experts,
    Rows,
    quantized_rows,
    with_quantized_cotangent,
)
from commgemm.quant import ScalingRecipe, quantize_by
from commgemm.vma import like_primal, varying_like


def merged_rows(block_sizes: jax.Array, rows: int) -> tuple[jax.Array, jax.Array]:
    """How P blocks of `rows` rows, each sorted by group with counts block_sizes [P, G] (each
    block's summing to at most `rows`), become one group-sorted block of P * rows rows:
    (dest [P * rows] int32, where row p * rows + i goes; group_sizes [G] of the merged rows).
    Within a group the rows keep their blocks' order; the rows past a block's sum (in no
    group) go last, in order."""
    sizes = block_sizes.astype(jnp.int32)
    blocks, groups = sizes.shape
    total = jnp.sum(sizes, axis=0)
    group_start = jnp.cumsum(total) - total  # [G], in the merged rows
    earlier = jnp.cumsum(sizes, axis=0) - sizes  # [P, G]: the group's rows in earlier blocks
    local_end = jnp.cumsum(sizes, axis=1)
    local_start = local_end - sizes
    index = jnp.arange(rows, dtype=jnp.int32)
    group = jnp.sum(index[None, :, None] >= local_end[:, None, :], axis=2, dtype=jnp.int32)
    inside = group < groups  # [P, rows]
    group = jnp.minimum(group, groups - 1)
    at = functools.partial(jnp.take_along_axis, indices=group, axis=1)
    dest = group_start[group] + at(earlier) + index[None, :] - at(local_start)
    outside = ~inside.reshape(-1)
    rank = jnp.cumsum(outside, dtype=jnp.int32) - 1  # among the rows in no group
    dest = jnp.where(inside.reshape(-1), dest.reshape(-1), jnp.sum(total) + rank)
    return dest, total


def merged_matmul(
    blocks: jax.Array,
    w: jax.Array,
    block_sizes: jax.Array,
    rows: Rows | None,
    experts: Float8Experts | None,
    out_dtype=None,
) -> jax.Array:
    """The grouped GEMM of each of P blocks [P, r, K] (block p's rows sorted by group, counts
    block_sizes[p]) by w [G, K, N], in one GEMM: [P, r, N], block p's result at [p] (zero past
    its sum), as `block_matmul` of each block gives it. `rows`: the blocks' quantized rows
    (payload [P, r, K]), regrouped the same way for `block_matmul`."""
    count, r = blocks.shape[0], blocks.shape[1]
    dest, source, sizes = merged_order(block_sizes, r)
    flat, rows = regrouped(blocks, rows, source, dest)
    out = block_matmul(flat, w, sizes, rows, experts, out_dtype)
    return permuted(out, dest, source).reshape(count, r, -1)


def merged_order(block_sizes: jax.Array, rows: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`merged_rows`' (dest, group_sizes) with source [P * rows], dest's inverse: merged row j
    is row source[j] of the blocks' rows."""
    dest, sizes = merged_rows(block_sizes, rows)
    return dest, inverse_permutation(dest), sizes


def inverse_permutation(index: jax.Array) -> jax.Array:
    """The inverse of a permutation `index` of range(R): inverse[index[i]] = i."""
    every = jnp.arange(index.shape[0], dtype=index.dtype)
    return jnp.zeros_like(index).at[index].set(every, unique_indices=True)


def regrouped(
    blocks: jax.Array, rows: Rows | None, source: jax.Array, dest: jax.Array
) -> tuple[jax.Array, Rows | None]:
    """Blocks [P, r, K] (and their quantized rows) as one merged block [P * r, K] in
    `merged_order`'s order."""
    flat = permuted(blocks.reshape(-1, blocks.shape[-1]), source, dest)
    if rows is not None:  # no gradient: a gather is enough
        payload = rows.payload.reshape(flat.shape[0], -1)[source]
        rows = dataclasses.replace(rows, payload=payload)
    return flat, rows


@jax.custom_vjp
def permuted(a: jax.Array, index: jax.Array, inverse: jax.Array) -> jax.Array:
    """The rows of a [R, ...] in the order `index` (a permutation of range(R); `inverse` its
    inverse): a gather whose gradient is the inverse gather, not the scatter-add a gather's
    transpose is in general."""
    return a[index]


def _permuted_fwd(a, index, inverse):
    return a[index], (index, inverse)


def _permuted_bwd(residuals, ct):
    index, inverse = residuals
    return ct[inverse], None, None


permuted.defvjp(_permuted_fwd, _permuted_bwd)


def row_block(rows: Rows | None, index) -> Rows | None:
    """Block `index` of quantized rows whose payload is stacked [blocks, r, K], or None."""
    return None if rows is None else dataclasses.replace(rows, payload=rows.payload[index])


def block_matmul(
    values: jax.Array,
    w: jax.Array,
    sizes: jax.Array,
    rows: Rows | None,
    experts: Float8Experts | None,
    out_dtype=None,
) -> jax.Array:
    """`grouped_matmul(values, w, sizes)` for a block of x's rows [r, K] whose quantized form
    is `rows` (a payload [r, K], as it travelled), w [G, K, N] the experts' quantized values.
    With `experts` (Hopper, tensor scaling) and a shape and result dtype the float8 kernel
    takes (`float8_block_reason`), the forward multiplies the payload's float8 values by the
    experts' on the tensor cores, the two scales in the kernel's epilogue (no dequantized
    copy of either operand), and so does dX in the backward: dY's rows requantized by dY's
    tensor scale (which reaches the block through its tag, `Float8Experts.tags`) times the
    experts' float8 values, where the kernel takes dX's shape (`mosaic_gpu.grouped.float8_dx`).
    dW multiplies the payload's and dY's float8 values on commgemm's float8 dW kernel where the
    recipe lets dW accumulate fast and the groups are large enough (`mosaic_gpu.grouped.
    float8_dw`), else it is the 16-bit product of the values and dY. Elsewhere `grouped_matmul`
    on the values."""
    out_dtype = out_dtype or values.dtype.name
    if float8_block_reason(rows, experts, out_dtype) is not None:
        return grouped_matmul(values, w, sizes, out_dtype=out_dtype)
    how = Float8Block(jnp.dtype(out_dtype).name, experts.split, experts.grad_dtype)
    out, tag = _float8_block(
        values, w, sizes, rows.payload, rows.scale, experts.nk, experts.kn, experts.scale_inv, how
    )
    experts.tags.append(tag)
    return out


def whole_block_matmul(
    values: jax.Array,
    w: jax.Array,
    sizes: jax.Array,
    rows: Rows | None,
    experts: Float8Experts | None,
    recipe: ScalingRecipe | None,
    axis_name=None,
    padded: bool = False,
    fill: bool = True,
) -> jax.Array:
    """`block_matmul` of a block that is the op's whole result, its cotangent quantized as
    `with_quantized_cotangent` quantizes it. On the float8 kernel with dY scaled by its current
    amax (no dy_state), the block's own backward quantizes dY (its amax over `axis_name`) in
    one pass that writes both the float8 values dX multiplies and their 16-bit dequantized
    copy dW reads, where the op-wide form (`with_quantized_cotangent` handing dY's scale to
    every block's tag) dequantizes dY and the block quantizes it again. `padded`: the block's
    rows past its groups are padding worth skipping (`grouped.scaling.quantized_rows` then
    quantizes dY's rows of the groups only; `fill=False`: its results' rows past them are left
    unwritten, for dX's kernel and dW, which read the groups' rows only)."""
    if recipe is None:
        return grouped_matmul(values, w, sizes)
    if reads_cotangent_padding(values, rows, experts, recipe):
        out = block_matmul(values, w, sizes, rows, experts)
        return with_quantized_cotangent(out, recipe, axis_name, experts)
    return own_dy_block_matmul(values, w, sizes, rows, experts, axis_name, padded, fill)


def own_dy_block_matmul(
    values: jax.Array,
    w: jax.Array,
    sizes: jax.Array,
    rows: Rows,
    experts: Float8Experts,
    axis_name=None,
    padded: bool = False,
    fill: bool = True,
) -> jax.Array:
    """`whole_block_matmul` under current tensor scaling on the float8 kernel (where
    `reads_cotangent_padding` is False): the block's backward quantizes dY itself."""
    names = () if axis_name is None else axis_name
    how = Float8Block(values.dtype.name, experts.split, experts.grad_dtype, names, padded, fill)
    return _float8_block(
        values, w, sizes, rows.payload, rows.scale, experts.nk, experts.kn, experts.scale_inv, how
    )[0]


def reads_cotangent_padding(
    values: jax.Array, rows: Rows | None, experts: Float8Experts | None, recipe
) -> bool:
    """Whether `whole_block_matmul`'s backward reads dY's rows past the groups: where it hands
    dY to `with_quantized_cotangent` (delayed scaling, or no float8 kernel), whose amax takes
    every row, so those rows must be zeros. The 16-bit GEMM's gradients and the block's own
    float8 backward read the groups' rows only (`mosaic_gpu.grouped.padding_reason` says
    where)."""
    if recipe is None:
        return False
    return (
        recipe.dy_state is not None or float8_block_reason(rows, experts, values.dtype) is not None
    )


def float8_block_reason(rows: Rows | None, experts: Float8Experts | None, out_dtype) -> str | None:
    """Why `block_matmul` emulates the GEMM of `rows` by `experts` into `out_dtype`, or None."""
    from commgemm.mosaic_gpu import grouped as hopper

    if rows is None or experts is None:
        return "no float8 operands for Hopper's tensor cores (block modes, or another backend)"
    if jnp.dtype(out_dtype) not in (jnp.bfloat16, jnp.float16):
        return f"the kernel's result is bf16 or fp16, not {jnp.dtype(out_dtype).name}"
    (m, k), (groups, n, _) = rows.payload.shape, experts.nk.shape
    return hopper.float8_shape_reason(m, k, n, groups, rows.payload.dtype, split=experts.split[0])


class Float8Block(NamedTuple):
    """How a block multiplies on the float8 kernel (static): its result's dtype, split
    accumulation in the forward, dX and dW, dY's float8 dtype, and `dy_over`: None where dY
    comes quantized by the op's scale (its tag's cotangent), else the mesh axes over which the
    block's own backward takes dY's current amax (`whole_block_matmul`), over the rows of the
    groups only where `padded` (the quantized dY's rows past them left unwritten unless
    `fill`)."""

    out_dtype: str
    split: tuple[bool, bool, bool]
    grad_dtype: str
    dy_over: str | tuple[str, ...] | None = None
    padded: bool = False
    fill: bool = True


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _float8_block(values, w, sizes, payload_rows, x_scale, nk, kn, w_scale, how):
    """The float8 kernel's product of a block (`block_matmul`) and its tag (a zero scalar);
    values and w only carry the gradient."""
    from commgemm.mosaic_gpu import grouped as hopper

    out = hopper.float8_matmul(
        payload_rows, x_scale, nk, w_scale, sizes, how.out_dtype, split=how.split[0]
    )
    out = varying_like(out, values, w)
    return out, varying_like(jnp.zeros((), jnp.float32), out)


def _float8_block_fwd(values, w, sizes, payload_rows, x_scale, nk, kn, w_scale, how):
    out = _float8_block(values, w, sizes, payload_rows, x_scale, nk, kn, w_scale, how)
    return out, (values, w, sizes, payload_rows, x_scale, kn, w_scale)


def _float8_block_bwd(how, residuals, cotangents):
    from commgemm.mosaic_gpu import grouped as hopper

    values, w, sizes, payload_rows, x_scale, kn, w_scale = residuals
    dy, dy_scale = cotangents  # dY's rows, and the tensor scale the op quantized dY by
    qdy = None
    if how.dy_over is not None:  # dY as it comes: quantized here, once (where padded, its
        # rows of the groups only: the GEMM's rows past them are zeros, and add nothing)
        live = jnp.sum(sizes) if how.padded else None
        qdy, dy = quantized_rows(dy, live, how.grad_dtype, how.dy_over, fill=how.fill)
        dy = lax.stop_gradient(dy)
    product = functools.partial(grouped_matmul, group_sizes=sizes, out_dtype=how.out_dtype)
    dx = dw = None
    if values.dtype in (jnp.bfloat16, jnp.float16):  # the kernel's result is 16-bit
        # dY's float8 values (as the op quantized them) times the experts', on the kernel
        qdy = quantize_by(dy, dy_scale, how.grad_dtype) if qdy is None else qdy
        dx = hopper.float8_dx(qdy, kn, w_scale, sizes, values.dtype, how.split[1])
        dw = hopper.float8_dw(payload_rows, x_scale, qdy, sizes, w.dtype, how.split[2])
    if dw is None:  # the 16-bit product of the rows' values and dY
        dw = jax.vjp(lambda b: product(values, b), w)[1](dy)[0]
    if dx is None:  # emulated: the 16-bit product of dY and the experts' quantized values
        dx = jax.vjp(lambda a: product(a, w), values)[1](dy)[0]
    return like_primal(dx, values), like_primal(dw, w), None, None, None, None, None, None


_float8_block.defvjp(_float8_block_fwd, _float8_block_bwd)
