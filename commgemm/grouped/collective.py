"""Grouped GEMMs with their collective overlapped, per shard inside `jax.shard_map`, for
tensor-parallel experts: all-gather + grouped GEMM (experts' columns sharded) and grouped GEMM
+ reduce-scatter (experts' rows, K, sharded). Methods NONE, PIPELINE (num_splits chunks of rows)
and RING_EXCHANGE (unidirectional ppermute ring), as the plain ops', and AUTO
(`plan.GROUPED_AUTO_RING_SIZES`).
The ring multiplies each block of rows as it arrives; the others multiply all the blocks of a
chunk in one grouped GEMM, their rows regrouped by group (`grouped.blocks`). Differentiable
through JAX's own transposes of the collectives and of the grouped GEMMs."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from commgemm.config import Method, OverlapConfig
from commgemm.grouped.blocks import block_matmul, merged_matmul
from commgemm.grouped.local import check_grouped, sizes_in_rows
from commgemm.grouped.scaling import (
    Float8Experts,
    Rows,
    carry,
    quantized_operands,
    with_quantized_cotangent,
)
from commgemm.operands import axis_size
from commgemm.plan import make_grouped_plan
from commgemm.quant import Scaling, check_weight_scaling
from commgemm.xla.common import after, send_one

ConfigLike = OverlapConfig | int | None


def all_gather_grouped_matmul(
    x: jax.Array,
    w: jax.Array,
    group_sizes: jax.Array,
    axis_name: str,
    *,
    config: ConfigLike = None,
    scaling: Scaling = None,
) -> jax.Array:
    """concat over shards s (axis order) of ragged_dot(x_s, w, group_sizes_s).

    Args:
      x: [m, K] this shard's rows, sorted by group.
      w: [G, K, n], the experts' column shard.
      group_sizes: [G] this shard's counts (summing to at most m).
      scaling: quantized operands (commgemm.grouped.scaling); x's rows travel quantized. On a
        Hopper GPU with tensor scaling each block's forward GEMM multiplies the rows' float8
        payload on the tensor cores, and its dX the quantized dY's rows
        (`grouped.blocks.block_matmul`); otherwise emulated.
    Returns:
      [P*m, n]: shard s's rows at [s*m, (s+1)*m), zero past each shard's sum.
    """
    args = (x, w, group_sizes, axis_name, config, scaling)
    return _quantized_call("all_gather_grouped_matmul", _all_gather_grouped, *args)


def _quantized_call(name: str, impl, x, w, group_sizes, axis_name, config, scaling):
    """`name`'s checks, then impl on the operands' (quantized) values, x's quantized rows and
    the float8 experts (`quantized_operands`), its cotangent quantized as the recipe says."""
    check_weight_scaling(name, w, scaling)
    check_grouped(x, w, group_sizes)
    x, w, recipe, rows, experts = quantized_operands(x, w, scaling, axis_name)
    out = impl(x, w, group_sizes, axis_name, config, rows, experts)
    return with_quantized_cotangent(out, recipe, axis_name, experts)


def _all_gather_grouped(
    x, w, group_sizes, axis_name, config, rows: Rows | None, experts: Float8Experts | None
) -> jax.Array:
    """`all_gather_grouped_matmul` on x's (quantized) values, its rows moving as `rows` where
    they are quantized (multiplied on float8 tensor cores with `experts`)."""
    size, m = axis_size(axis_name), x.shape[0]
    plan = make_grouped_plan(
        config, "all_gather_grouped_matmul", size, rows=m, float8=experts is not None
    )
    cfg, splits = plan.config, plan.splits
    dtype = cfg.out_dtype or x.dtype.name
    if cfg.method is Method.RING_EXCHANGE:
        me = lax.axis_index(axis_name)
        out = jnp.zeros((size * m, w.shape[2]), dtype)
        block, sizes, last = x, group_sizes, None
        hop = functools.partial(send_one, axis_name=axis_name, size=size, shift=1)
        for t in range(size):
            nxt = None
            if t < size - 1:  # pass the block on while multiplying it (held after the last GEMM)
                nxt = (*carry(hop, block, rows, last), hop(after(sizes, last)))
            last = block_matmul(block, w, sizes, rows, experts, dtype)
            src = lax.rem(me + jnp.int32(size - t), jnp.int32(size))
            out = lax.dynamic_update_slice_in_dim(out, last, src * m, axis=0)
            if nxt is not None:
                block, rows, sizes = nxt
        return out
    chunk = m // splits
    chunks, previous = [], None
    gather = functools.partial(lax.all_gather, axis_name=axis_name, axis=0)
    for c in range(splits):
        lo, hi = c * chunk, (c + 1) * chunk
        part_rows = None if rows is None else dataclasses.replace(rows, payload=rows.payload[lo:hi])
        sizes = sizes_in_rows(group_sizes, lo, hi)
        gathered, moved = carry(gather, x[lo:hi], part_rows, previous)  # [P, chunk, K]
        all_sizes = gather(sizes)  # [P, G]
        chunks.append(merged_matmul(gathered, w, all_sizes, moved, experts, dtype))  # regrouped
        previous = gathered
    return jnp.concatenate(chunks, axis=1).reshape(size * m, w.shape[2])


def grouped_matmul_reduce_scatter(
    x: jax.Array,
    w: jax.Array,
    group_sizes: jax.Array,
    axis_name: str,
    *,
    config: ConfigLike = None,
    scaling: Scaling = None,
) -> jax.Array:
    """This shard's rows of psum_scatter(ragged_dot(x, w, group_sizes)).

    Args:
      x: [M, k], this shard's K-slice, rows sorted by group (the same rows on every shard).
      w: [G, k, N], this shard's K-slice of the experts.
      group_sizes: [G], the same on every shard.
      scaling: quantized operands (commgemm.grouped.scaling), the partial sums reduced in
        the output (or reduce) dtype. On a Hopper GPU with tensor scaling the forward's GEMMs
        and their dX multiply float8 operands on the tensor cores
        (`grouped.blocks.block_matmul`) where their result is 16-bit; otherwise emulated.
    Returns:
      [M/P, N]: rows [d*M/P, (d+1)*M/P) of the sum over shards, for shard d.
    """
    args = (x, w, group_sizes, axis_name, config, scaling)
    return _quantized_call("grouped_matmul_reduce_scatter", _grouped_reduce_scatter, *args)


def _grouped_reduce_scatter(
    x, w, group_sizes, axis_name, config, rows: Rows | None, experts: Float8Experts | None
) -> jax.Array:
    """`grouped_matmul_reduce_scatter` on x's (quantized) values (`rows`, `experts`: as in
    `_all_gather_grouped`)."""
    size, rows_total = axis_size(axis_name), x.shape[0]
    plan = make_grouped_plan(
        config, "grouped_matmul_reduce_scatter", size, rows=rows_total, per_device=True
    )
    cfg, splits = plan.config, plan.splits
    dtype = cfg.out_dtype or x.dtype.name
    travel = cfg.reduce_dtype or dtype
    r = rows_total // size
    wide = jnp.promote_types(x.dtype, jnp.float32)  # the running sums' dtype

    def partial(lo: int | jax.Array, count: int) -> jax.Array:
        block = lax.dynamic_slice_in_dim(x, lo, count, axis=0)
        quantized = (
            None
            if rows is None
            else dataclasses.replace(
                rows, payload=lax.dynamic_slice_in_dim(rows.payload, lo, count, axis=0)
            )
        )
        sizes = sizes_in_rows(group_sizes, lo, lo + count)
        return block_matmul(block, w, sizes, quantized, experts, travel)

    if cfg.method is Method.RING_EXCHANGE:
        me = lax.axis_index(axis_name)
        acc, last = None, None
        for t in range(size):
            # the chain of a block visits the shards after its owner and ends on the owner
            block = lax.rem(me + jnp.int32(2 * size - 1 - t), jnp.int32(size))
            mine = partial(block * r, r).astype(wide)
            acc = mine if acc is None else acc + mine
            if t < size - 1:
                acc = send_one(after(acc.astype(travel), last), axis_name, size, 1).astype(wide)
            last = mine
        return acc.astype(dtype)
    sub = r // splits
    outs, previous = [], None
    for c in range(splits):
        if splits == 1:  # every shard's rows: one GEMM over x
            chunk = partial(0, rows_total)
        else:  # sub-chunk c of each shard's rows: one GEMM over them, regrouped
            starts = [b * r + c * sub for b in range(size)]
            blocks = jnp.stack([x[lo : lo + sub] for lo in starts])
            block_sizes = jnp.stack([sizes_in_rows(group_sizes, lo, lo + sub) for lo in starts])
            quantized = None
            if rows is not None:
                payload = jnp.stack([rows.payload[lo : lo + sub] for lo in starts])
                quantized = dataclasses.replace(rows, payload=payload)
            products = merged_matmul(blocks, w, block_sizes, quantized, experts, travel)
            chunk = products.reshape(size * sub, -1)
        chunk = after(chunk, previous)
        outs.append(lax.psum_scatter(chunk, axis_name, scatter_dimension=0, tiled=True))
        previous = outs[-1]
    return jnp.concatenate(outs).astype(dtype)
