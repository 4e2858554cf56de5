"""Expert parallelism: tokens dispatched to the shard that owns their expert, the experts'
grouped GEMM, and the way back, per shard inside `jax.shard_map`.

Shard d of P owns experts [d*e, (d+1)*e) of E = P*e. Each shard's tokens are sorted by global
expert; group_sizes [E] are its counts. Shapes stay static: what shard d receives from shard s
is a block of C rows (s's tokens for d's experts first, zeros after), with their e counts
beside it. C, the capacity, is m (all of s's m token rows could go to one shard) unless the
caller caps it: then the tokens past the first C for a shard are dropped (results of zero),
and the received [P*C, .] activations shrink by m / C (`moe_per_shard`'s capacity_factor caps
each expert's tokens instead).
RING_EXCHANGE sends to shard me + t at step t, a whole block of C rows, while multiplying what
arrived at step t - 1, so the expert GEMMs start on the first tokens while the rest are in
flight; NONE exchanges every shard's tokens first in one ragged all-to-all
(`grouped.exchange`: only the routed rows travel, straight from the sorted tokens into expert
order, every source's rows for an expert together and the padding last: regions per shard and
expert, `_layouts`), multiplies all of them in one grouped GEMM and returns the blocks by
source (a gather); on the way back it regroups the blocks by expert (a gather), multiplies,
and one ragged all-to-all takes the results from expert order straight into token order.
AUTO runs NONE (`plan.GROUPED_AUTO_RING_SIZES`). `expert_mlp` is dispatch, activation and
return in one: with NONE the rows arrive sorted by expert and leave from there, no gathers.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from commgemm.config import Method
from commgemm.epilogue import Activation
from commgemm.grouped.activation import activation_rows, as_function
from commgemm.grouped.blocks import (
    block_matmul,
    merged_order,
    permuted,
    regrouped,
    row_block,
)
from commgemm.grouped.exchange import Layout, ragged_all_to_all
from commgemm.grouped.local import check_grouped, sizes_in_rows
from commgemm.grouped.returned import matmul_dispatched, matmul_returned, to_experts
from commgemm.grouped.scaling import (
    Float8Experts,
    Rows,
    carry,
    quantized_operands,
    with_quantized_cotangent,
)
from commgemm.operands import axis_size, check_divisible
from commgemm.plan import make_grouped_plan
from commgemm.quant import ScaledTensor, Scaling, check_weight_scaling
from commgemm.xla.common import after


def _starts(group_sizes: jax.Array, size: int, capacity: int) -> tuple[jax.Array, jax.Array]:
    """(first row, count sent: at most `capacity`) of each shard's tokens in a shard's
    expert-sorted rows."""
    per_shard = group_sizes.astype(jnp.int32).reshape(size, -1).sum(axis=1)
    return jnp.cumsum(per_shard) - per_shard, jnp.minimum(per_shard, capacity)


def _capped(sizes: jax.Array, capacity: int) -> jax.Array:
    """Counts [P, e] of each shard's experts cut to the first `capacity` rows of each shard."""
    before = jnp.cumsum(sizes, axis=1) - sizes
    return jnp.clip(capacity - before, 0, sizes)


def _capacity(capacity: int | None, rows: int) -> int:
    """The rows of each block: `capacity` (at most `rows`, which it defaults to)."""
    if capacity is None:
        return rows
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"capacity must be a positive number of rows, got {capacity!r}")
    return min(capacity, rows)


@jax.custom_vjp
def _select_rows(keep: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
    """Row r of a where keep [R] (bool) holds, else b's: `jnp.where` by rows, whose gradient
    keeps only the [R] flags (jnp.where's keeps its condition broadcast to a's shape)."""
    return jnp.where(_by_rows(keep, a), a, b)


def _by_rows(keep: jax.Array, a: jax.Array) -> jax.Array:
    return keep.reshape(keep.shape + (1,) * (a.ndim - 1))


def _select_rows_fwd(keep, a, b):
    return _select_rows(keep, a, b), keep


def _select_rows_bwd(keep, ct):
    keep, zero = _by_rows(keep, ct), jnp.zeros((), ct.dtype)
    return None, jnp.where(keep, ct, zero), jnp.where(keep, zero, ct)


_select_rows.defvjp(_select_rows_fwd, _select_rows_bwd)


def _window(x: jax.Array, start, count, rows: int) -> jax.Array:
    """Rows [start, start + count) of x moved to the top of `rows` rows, zeros below."""
    if rows > x.shape[0]:
        x = jnp.pad(x, ((0, rows - x.shape[0]), (0, 0)))
    moved = jnp.roll(x, -start, axis=0)[:rows]
    return _select_rows(jnp.arange(rows) < count, moved, jnp.zeros_like(moved))


def _exchange(values, axis_name: str, size: int, shift: int):
    perm = [(i, (i + shift) % size) for i in range(size)]
    return jax.tree.map(lambda v: lax.ppermute(v, axis_name, perm), values)


def _all_to_all(values, axis_name: str):
    """values [P, ...], [d] for shard d -> [P, ...], [s] from shard s: one all-to-all."""
    return jax.tree.map(lambda v: lax.all_to_all(v, axis_name, 0, 0), values)


def _place(out, back: jax.Array, start, count, tokens: int) -> jax.Array:
    """out [tokens, N] with rows [start, start + count) replaced by back's [C, N] first count
    rows (zeros elsewhere where out is None)."""
    index = jnp.arange(tokens, dtype=jnp.int32)
    placed = jnp.roll(_window(back, 0, count, tokens), start, axis=0)
    inside = (index >= start) & (index < start + count)
    return _select_rows(inside, placed, jnp.zeros_like(placed) if out is None else out)


def _method(config, op: str, size: int) -> Method:
    return make_grouped_plan(config, op, size).config.method


def all_to_all_grouped_matmul(
    x: jax.Array,
    w: jax.Array,
    group_sizes: jax.Array,
    axis_name: str,
    *,
    config=None,
    scaling: Scaling = None,
    capacity: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Dispatch this shard's tokens to their experts' shards and run this shard's experts.

    Args:
      x: [m, K] tokens sorted by global expert.
      w: [e, K, N] this shard's experts.
      group_sizes: [E = P*e] this shard's token counts per global expert.
      capacity: C, the rows each shard sends each shard (default m): the tokens for a shard
        past its first C are dropped (not sent; zeros where their results go back).
    Returns:
      (y [P, C, N]: y[s] = this shard's experts applied to shard s's tokens for them, in their
      order, zeros past their count; recv_sizes [P, e]: those counts), the input of
      `grouped_matmul_all_to_all`. `scaling`: quantized operands (commgemm.grouped.scaling);
      the tokens travel quantized. On a Hopper GPU with tensor scaling the forward multiplies
      the tokens' float8 payload as it arrived on the tensor cores, and dX the quantized dY
      (`grouped.blocks.block_matmul`); otherwise emulated. In 16 bits on several Hopper GPUs
      (NONE) dX's GEMM stores its rows straight into their owners' dX (`grouped.returned`).
    """
    return _all_to_all_grouped(x, w, group_sizes, axis_name, config, scaling, capacity)


def _all_to_all_grouped(x, w, group_sizes, axis_name, config, scaling, capacity, qx=None):
    """`all_to_all_grouped_matmul`; `qx`: x as `scaling` quantizes it, or None."""
    check_weight_scaling("all_to_all_grouped_matmul", w, scaling)
    x, w, recipe, rows, experts = quantized_operands(x, w, scaling, axis_name, qx)
    capacity = _capacity(capacity, x.shape[0])
    y, recv = _dispatch_grouped(x, w, group_sizes, axis_name, config, rows, experts, capacity)
    return with_quantized_cotangent(y, recipe, axis_name, experts), recv


def _dispatch_grouped(
    x, w, group_sizes, axis_name, config, rows: Rows | None, experts: Float8Experts | None,
    capacity: int,
):  # fmt: skip
    """`all_to_all_grouped_matmul` on x's (quantized) values, the tokens travelling as `rows`
    (their quantized payload) where they are quantized (multiplied on float8 tensor cores with
    `experts`)."""
    size = axis_size(axis_name)
    method = _method(config, "all_to_all_grouped_matmul", size)
    if method is not Method.RING_EXCHANGE:  # the tokens arrive by expert: one GEMM
        tokens, by_expert, sizes = _expert_layouts(x, w, group_sizes, axis_name, capacity)
        if rows is None:  # 16 bits: dX may return its rows from its GEMM (`matmul_dispatched`)
            out = matmul_dispatched(x, w, sizes.sum(axis=0), None, None, None, axis_name,
                                    tokens, by_expert, capacity)[0]  # fmt: skip
        else:
            flat, flat_rows = carry(to_experts(axis_name, capacity), x, rows, None, tokens,
                                    by_expert)  # fmt: skip
            out = block_matmul(flat, w, sizes.sum(axis=0), flat_rows, experts)
        dest, source, _ = merged_order(sizes, capacity)  # by expert -> by source: a gather
        return permuted(out, dest, source).reshape(size, capacity, -1), sizes
    blocks, arrived, by_step_sizes = _ring_exchanged(x, w, group_sizes, axis_name, rows, capacity)
    parts = zip(blocks, arrived, by_step_sizes, strict=True)  # each block's GEMM as it arrives
    by_step_y = jnp.stack([block_matmul(b, w, c, q, experts) for b, q, c in parts])
    # order by source shard: source s arrived at step (me - s) mod P, and step t came from
    # source (me - t) mod P: the permutation is its own inverse (a gather both ways, no scatter)
    me = lax.axis_index(axis_name)
    step_of = lax.rem(me - jnp.arange(size, dtype=jnp.int32) + jnp.int32(size), jnp.int32(size))
    return permuted(by_step_y, step_of, step_of), by_step_sizes[step_of]


def _routed(x, w, group_sizes, axis_name, capacity: int):
    """(starts [P], counts [P], sizes [P, e]) of this shard's tokens x [m, K] (sorted by global
    expert, counts group_sizes [P*e]) for each shard: the first row, the rows sent (at most
    the capacity C) and their counts per expert."""
    size, e = axis_size(axis_name), w.shape[0]
    check_divisible(group_sizes.shape[0], size, "all_to_all_grouped_matmul: experts", "P")
    if group_sizes.shape[0] != size * e:
        raise ValueError(
            f"group_sizes has {group_sizes.shape[0]} experts, w {e} per shard x {size} shards"
        )
    check_grouped(x, w, group_sizes[:e])
    # traced counts may sum past the rows: cut them at row m, as grouped_matmul does, so that
    # no shard is sent (or returns results for) rows this shard does not have
    group_sizes = sizes_in_rows(group_sizes, 0, x.shape[0])
    starts, counts = _starts(group_sizes, size, capacity)
    return starts, counts, _capped(group_sizes.astype(jnp.int32).reshape(size, e), capacity)


def _sent(x, rows: Rows | None, start, count, capacity: int):
    """The block of x's rows [start, start + count) for one shard ([C, K], zeros after) and
    its quantized rows (or None)."""
    block = _window(x, start, count, capacity)
    if rows is None:
        return block, None
    return block, dataclasses.replace(rows, payload=_window(rows.payload, start, count, capacity))


def _bounds(starts: jax.Array, rows: int) -> jax.Array:
    """[R + 1] int32 region bounds: the R regions' first rows, then `rows`."""
    return jnp.append(starts.astype(jnp.int32), jnp.int32(rows))


def _ring_exchanged(x, w, group_sizes, axis_name, rows: Rows | None, capacity: int):
    """This shard's tokens x [m, K] sent to their experts' shards by the ring, each block after
    the one before: (blocks: P arrays [C, K], block t from shard me - t; their quantized rows
    as they travelled, or Nones; sizes [P, e]: each block's counts)."""
    size = axis_size(axis_name)
    me = lax.axis_index(axis_name)
    starts, counts, sizes = _routed(x, w, group_sizes, axis_name, capacity)
    received, last = [], None
    for t in range(size):
        dest = lax.rem(me + jnp.int32(t), jnp.int32(size))
        block, sent = _sent(x, rows, starts[dest], counts[dest], capacity)
        shift = functools.partial(_exchange, axis_name=axis_name, size=size, shift=t)
        received.append((*carry(shift, block, sent, last), shift(sizes[dest])))
        last = received[-1][0]
    blocks, arrived, counts = zip(*received, strict=True)
    return blocks, arrived, jnp.stack(counts)


def grouped_matmul_all_to_all(
    y: jax.Array,
    w: jax.Array,
    recv_sizes: jax.Array,
    group_sizes: jax.Array,
    axis_name: str,
    *,
    config=None,
    scaling: Scaling = None,
    tokens: int | None = None,
) -> jax.Array:
    """This shard's experts applied to the tokens it received, sent back to their shards.

    Args:
      y: [P, C, K2] per source shard, as `all_to_all_grouped_matmul` returns (after, say, an
        activation).
      w: [e, K2, N] this shard's experts.
      recv_sizes: [P, e] the counts that came with y.
      group_sizes: [E] this shard's own token counts per global expert (where its tokens'
        results go back to).
      scaling: quantized operands (commgemm.grouped.scaling); on a Hopper GPU with tensor
        scaling the forward's GEMMs and their dX multiply float8 operands on the tensor cores
        (`grouped.blocks.block_matmul`), otherwise emulated. In 16 bits on several Hopper
        GPUs (NONE) the GEMM stores each row straight into its owner's result over NVLink, the
        exchange inside the GEMM's kernel (`grouped.returned`).
      tokens: m, this shard's token rows (default C: `all_to_all_grouped_matmul` without a
        capacity).
    Returns:
      [m, N] in this shard's token order (zeros past the tokens' count and for the tokens
      dropped past the capacity).
    """
    check_weight_scaling("grouped_matmul_all_to_all", w, scaling)
    tokens = y.shape[1] if tokens is None else tokens
    if not isinstance(tokens, int) or tokens < y.shape[1]:
        raise ValueError(f"tokens={tokens!r} must be an int of at least y's {y.shape[1]} rows")
    y, w, recipe, rows, experts = quantized_operands(y, w, scaling, axis_name)
    out = _return_grouped(y, w, recv_sizes, group_sizes, axis_name, config, rows, experts, tokens)
    return with_quantized_cotangent(out, recipe, axis_name, experts)


def _return_grouped(y, w, recv_sizes, group_sizes, axis_name, config, rows, experts, tokens):
    """`grouped_matmul_all_to_all` on y's (quantized) values (`rows`, `experts`: as in
    `_dispatch_grouped`)."""
    size = axis_size(axis_name)
    method = _method(config, "grouped_matmul_all_to_all", size)
    check_grouped(y[0], w, recv_sizes[0])
    if method is Method.NONE:  # one GEMM over every source's tokens by expert, sent from there
        dest, source, sizes = merged_order(recv_sizes, y.shape[1])
        flat, flat_rows = regrouped(y, rows, source, dest)
        cut = sizes_in_rows(group_sizes, 0, tokens).astype(jnp.int32)  # as the dispatch cut them
        sent = _capped(cut.reshape(size, -1), y.shape[1])
        mine, by_expert = _layouts(sent, recv_sizes, cut, tokens, y.shape[1])
        if rows is None:  # 16 bits: the rows may go back from the GEMM (`matmul_returned`)
            return matmul_returned(flat, w, sizes, None, None, None, axis_name, by_expert, mine,
                                   y.shape[1], tokens)  # fmt: skip
        z = block_matmul(flat, w, sizes, flat_rows, experts)
        return ragged_all_to_all(z, by_expert, mine, axis_name, y.shape[1], tokens)
    me = lax.axis_index(axis_name)
    starts, counts = _starts(group_sizes, size, y.shape[1])
    out, last = None, None
    for t in range(size):  # the ring: shard me - t's results, each sent after the one before
        src = lax.rem(me - jnp.int32(t) + jnp.int32(size), jnp.int32(size))
        z = block_matmul(y[src], w, recv_sizes[src], row_block(rows, src), experts)
        last = _exchange(after(z, last), axis_name, size, -t)
        dest = lax.rem(me + jnp.int32(t), jnp.int32(size))
        out = _place(out, last, starts[dest], counts[dest], tokens)
    return out


def expert_mlp(
    x: jax.Array,
    w1: jax.Array,
    w2: jax.Array,
    group_sizes: jax.Array,
    axis_name: str,
    *,
    activation: Callable | Activation = "gelu_tanh",
    config=None,
    scaling=None,
    capacity: int | None = None,
    x_quantized: ScaledTensor | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The experts' MLP on this shard's tokens, dispatched and returned: x [m, K] sorted by
    global expert (counts group_sizes [P*e]), w1 [e, K, F] and w2 [e, F, N] this shard's
    experts -> (out [m, N] in x's order, zeros past the tokens' count; the activations between
    the GEMMs [P*C, F], in an order of their own: for their amax). The same as
    `all_to_all_grouped_matmul` (with `capacity`), `activation` (a function of the [P*C, F]
    rows, or a name: "gelu", "gelu_tanh", None), `grouped_matmul_all_to_all`; `scaling`: one
    recipe for both GEMMs or a pair (up, down). `x_quantized`: x as the up recipe quantizes it
    where the caller has it (`grouped.scaling.copied_rows`: the tokens' copies quantized once
    per token), else None.

    Where both ops run NONE (AUTO's choice on GPUs) the tokens arrive sorted by expert (the
    exchange's regions are (shard, expert) pairs: `_expert_layouts`), stay so from the first
    GEMM to the second, and the results go back from there into token order: two ragged
    all-to-alls and no permutation, where the two ops would regroup the [P*C, K] rows, put the
    [P*C, F] activations back in the order of their source shards and regroup them again. A
    named activation then runs on the rows that hold tokens only (`grouped.activation`), and
    on several shards so do the passes of current tensor scaling over the received rows (the
    tokens' values on arrival, h's and both dYs' quantization: `grouped.scaling.
    quantized_rows`); on one shard, with no padding to skip, XLA's fused passes. Where the
    GEMMs' gradients read the groups' rows only (`mosaic_gpu.grouped.padding_reason`) the
    padding is not even written: not by the exchange, dY's kernels or the quantizing passes."""
    up, down = scaling if isinstance(scaling, tuple) else (scaling, scaling)
    size, m = axis_size(axis_name), x.shape[0]
    capacity = _capacity(capacity, m)
    ops = ("all_to_all_grouped_matmul", "grouped_matmul_all_to_all")
    if any(_method(config, op, size) is not Method.NONE for op in ops):
        y, received = _all_to_all_grouped(x, w1, group_sizes, axis_name, config, up, capacity,
                                          x_quantized)  # fmt: skip
        h = activation(y) if callable(activation) else as_function(activation)(y)
        out = grouped_matmul_all_to_all(h, w2, received, group_sizes, axis_name,
                                        config=config, scaling=down, tokens=m)  # fmt: skip
        return out, h
    check_weight_scaling("all_to_all_grouped_matmul", w1, up)
    check_weight_scaling("grouped_matmul_all_to_all", w2, down)
    x, w1, recipe, rows, experts = quantized_operands(x, w1, up, axis_name, x_quantized)
    tokens, by_expert, arrived = _expert_layouts(x, w1, group_sizes, axis_name, capacity)
    sizes = arrived.sum(axis=0)
    live = jnp.sum(sizes)  # the received rows that hold tokens: the rest is padding
    skip = live if size > 1 else None  # FP8's passes: on one shard no padding worth skipping
    from commgemm.mosaic_gpu.grouped import padding_reason

    # where every reader of the received buffers takes their live rows only, the exchange and
    # the live-row kernels leave the padding unwritten (h, returned for its amax, keeps zeros)
    unread = size > 1 and all(padding_reason(size * capacity, x.dtype, w) is None for w in (w1, w2))
    y, dy1_read = matmul_dispatched(x, w1, sizes, rows, experts, recipe, axis_name, tokens,
                                    by_expert, capacity, live=skip, fill=not unread)  # fmt: skip
    named = not callable(activation)  # zeros past the live rows (GELU(0) = 0)
    dy1_unread = unread and not dy1_read
    h = activation_rows(y, live, activation, fill_grad=not dy1_unread) if named else activation(y)
    check_grouped(h, w2, sizes)
    h2, w2, recipe, rows, experts = quantized_operands(h, w2, down, axis_name,
                                                       live=skip if named else None,
                                                       fill=not unread)  # fmt: skip
    out = matmul_returned(h2, w2, sizes, rows, experts, recipe, axis_name, by_expert, tokens,
                          capacity, m, padded=size > 1, fill=not unread)  # fmt: skip
    return out, h


def _expert_layouts(x, w, group_sizes, axis_name, capacity: int):
    """The exchange layouts of this shard's tokens x [m, K] (sorted by global expert, counts
    group_sizes [P*e]) and the rows its experts receive, `_layouts`, with the counts [P, e] that
    arrive from each shard for each of its experts."""
    sent = _routed(x, w, group_sizes, axis_name, capacity)[2]  # [P, e], capped
    arrived = _all_to_all(sent, axis_name)
    cut = sizes_in_rows(group_sizes, 0, x.shape[0]).astype(jnp.int32)
    return *_layouts(sent, arrived, cut, x.shape[0], capacity), arrived


def _layouts(sent, arrived, cut, m: int, capacity: int) -> tuple[Layout, Layout]:
    """(tokens: a shard's m token rows, sorted by global expert with counts cut [P*e], as
    regions per (shard, expert), each expert's first `sent` [P, e] rows live (peer-major);
    by_expert: the [P*C] rows its experts receive, `arrived` [P, e] from each shard, sorted by
    expert, every source's rows for one expert together and in source order, the padding last
    (group-major)). On one shard both are one region: the sorted tokens' first C rows are the
    rows its experts take, in order (the exchange a select)."""
    size = sent.shape[0]
    if size == 1:
        live = jnp.sum(sent, dtype=jnp.int32)[None]
        ends = jnp.array([0, m], jnp.int32), jnp.array([0, capacity], jnp.int32)
        return Layout(ends[0], live), Layout(ends[1], live)
    tokens = Layout(_bounds(jnp.cumsum(cut) - cut, m), sent.reshape(-1).astype(jnp.int32))
    counts = arrived.T.reshape(-1).astype(jnp.int32)  # (expert j, source s) at j * P + s
    ends = jnp.cumsum(counts, dtype=jnp.int32)
    return tokens, Layout(_bounds(ends - counts, size * capacity), counts, by_group=True)
