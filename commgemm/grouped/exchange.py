"""The expert-parallel exchange: each shard's rows for each shard moved into that shard's
regions for them, only the live rows (a ragged all-to-all), differentiable.

A `Layout` splits a shard's rows into R = P x g regions: region r is rows [bounds[r],
bounds[r + 1]), of which the first counts[r] are live, and stands for a (peer, group) pair:
(r // g, r % g), peer-major, or with `by_group` (r % P, r // P), group-major.
`ragged_all_to_all(src, send, recv)` moves the live rows of region (d, j) of each shard s's
src into region (s, j) of shard d's result, where `recv` is the result's layout
(recv.counts of (s, j) = shard s's send.counts of (me, j)); every other result row is zero.
With g = 1 a region is a peer. Groups let a shard's rows arrive in an order of the receiver's
choosing: the expert-parallel block's tokens, sorted by expert on each sender (peer-major),
land sorted by expert on their experts' shard (group-major), every source's rows for an
expert together. Its transpose is the same exchange the other way (recv -> send), so the
gradient moves the same rows back.

On one shard it is a select (g = 1: both layouts hold one region from row 0) or one gather.
On Hopper GPUs a kernel writes the live rows into the peers' results over NVLink
(`mosaic_gpu.ragged_a2a`; with one process per GPU where the fused kernels run there:
`mosaic_gpu.peers`); elsewhere each peer's rows travel in one `lax.all_to_all` of blocks of
`most` rows (the most live rows a shard holds for one peer, over its groups), gathered out of
and into the regions. Where every reader of a result takes its live rows only (a grouped GEMM
and the live-row kernels: the expert-parallel block's received tokens), `fill=False` lets the
kernel leave the other rows as the memory held them instead of writing zeros there.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from commgemm.vma import varying_like


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Layout:
    """A shard's rows as R = P x g regions: bounds [R + 1] int32 (region r: rows [bounds[r],
    bounds[r + 1]), bounds[0] = 0 and bounds[R] the rows), counts [R] int32 (the live rows at
    the top of each region); region r is the pair (peer, group) (r // g, r % g), or (r % P,
    r // P) where `by_group` (static)."""

    bounds: jax.Array
    counts: jax.Array
    by_group: bool = dataclasses.field(default=False, metadata=dict(static=True))

    def grid(self, a: jax.Array, size: int) -> jax.Array:
        """a [R] by region -> [P, g], [d, j] that of region (d, j)."""
        return a.reshape(-1, size).T if self.by_group else a.reshape(size, -1)

    def flat(self, a: jax.Array) -> jax.Array:
        """a [P, g] by (peer, group) -> [R] by region: `grid`'s inverse."""
        return a.T.reshape(-1) if self.by_group else a.reshape(-1)

    def pair(self, r: jax.Array, size: int) -> tuple[jax.Array, jax.Array]:
        """The (peer, group) of regions r (any int32 array)."""
        groups = self.counts.shape[0] // size
        return (r % size, r // size) if self.by_group else (r // groups, r % groups)


def kernel_reason(dtype, k: int) -> str | None:
    """Why rows of k elements of `dtype` do not travel by the NVLink kernel here, or None."""
    from commgemm.mosaic_gpu import fused, ragged_a2a

    if (reason := fused._gpu_reason()) is not None:  # with several processes: NCCL's peers
        return reason
    if ragged_a2a.tile_cols(k, dtype) is None:
        return f"rows of {k} x {jnp.dtype(dtype).name} are no whole 16-byte TMA boxes"
    return None


def ragged_all_to_all(
    src: jax.Array,
    send: Layout,
    recv: Layout,
    axis_name: str,
    most: int,
    out_rows: int,
    *,
    fill: bool = True,
    fill_grad: bool = True,
) -> jax.Array:
    """src [R, K] (this shard's rows in the regions of `send`) -> [out_rows, K] (the regions of
    `recv`, recv.bounds[-1] = out_rows): the live rows of region (me, j) of every shard s's src
    in region (s, j), zeros elsewhere. `most` (static): no shard's live rows for one peer (its
    counts over the peer's groups) exceed it; the fallback's block rows. Inside shard_map over
    `axis_name`. `fill` (static), False: the result's rows outside the live ones are
    unspecified where the NVLink kernel runs (not written; zeros elsewhere), for readers of the
    live rows only; `fill_grad` the same for the gradient's result [R, K]."""
    _check(src, send, recv, lax.axis_size(axis_name), most, out_rows)
    return _exchange(src, send, recv, axis_name, most, out_rows, (bool(fill), bool(fill_grad)))


def _check(src, send: Layout, recv: Layout, size: int, most, out_rows) -> None:
    """Clear errors for what the exchange cannot take (counts are data: not checked)."""
    if src.ndim != 2 or src.shape[0] < 1:
        raise ValueError(f"ragged_all_to_all: src must be [R >= 1, K], got {list(src.shape)}")
    for name, value in (("most", most), ("out_rows", out_rows)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"ragged_all_to_all: {name}={value!r} must be a positive int")
    regions = recv.counts.shape[0] if recv.counts.ndim == 1 else 0
    for side, layout in (("send", send), ("recv", recv)):
        shapes = (tuple(layout.bounds.shape), tuple(layout.counts.shape))
        if regions < size or regions % size or shapes != ((regions + 1,), (regions,)):
            raise ValueError(
                f"ragged_all_to_all: {side} layout bounds {list(shapes[0])} and counts "
                f"{list(shapes[1])} must be [R + 1] and [R], R a multiple of {size} (the axis), "
                f"the same R on both sides"
            )
        if not all(jnp.issubdtype(a.dtype, jnp.integer) for a in (layout.bounds, layout.counts)):
            raise ValueError(f"ragged_all_to_all: {side} layout must hold integers")


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _exchange(src, send: Layout, recv: Layout, axis_name: str, most: int, out_rows: int, fills):
    """The exchange; fills (static): whether the kernel zeroes the rows outside the live ones,
    (of this result, of the gradient's)."""
    size = lax.axis_size(axis_name)
    if size == 1:
        return _local(src, send, recv, out_rows)
    if kernel_reason(src.dtype, src.shape[1]) is None:
        from commgemm.mosaic_gpu import ragged_a2a

        peers = send.pair(jnp.arange(send.counts.shape[0], dtype=jnp.int32), size)[0]
        zeros_at, zero_rows = unwritten(recv)
        zero_rows = zero_rows if fills[0] else jnp.zeros_like(zeros_at)
        plan = ragged_a2a.plan_array(
            (send.bounds[:-1], send.counts, destinations(send, recv, axis_name), peers),
            (zeros_at, zero_rows),
            src.shape[1],
            src.dtype,
        )
        out = ragged_a2a.exchange_kernel(src, plan, out_rows, axis_name)
        return varying_like(out, src, plan)  # a Pallas result carries no varying axes
    return _blocks(src, send, recv, axis_name, most, out_rows)


def destinations(send: Layout, recv: Layout, axis_name: str) -> jax.Array:
    """[R] by region of `send`: the first row where region (d, j) of this shard's rows lands
    on peer d, that is peer d's region (me, j) of `recv`."""
    at = lax.all_to_all(recv.grid(recv.bounds[:-1], lax.axis_size(axis_name)), axis_name, 0, 0,
                        tiled=True)  # fmt: skip
    return send.flat(at)


def unwritten(recv: Layout) -> tuple[jax.Array, jax.Array]:
    """(first row, rows) [R]: the rows of each region of `recv` past its live ones, which no
    peer writes (the exchange's zeros)."""
    zeros_at = recv.bounds[:-1] + recv.counts
    return zeros_at, recv.bounds[1:] - zeros_at


def _regions(rows: int, layout: Layout) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(region [rows], offset in it [rows], live [rows] bool) of rows 0..rows-1 of `layout`."""
    index = jnp.arange(rows, dtype=jnp.int32)
    regions = layout.counts.shape[0]
    region = jnp.sum(index[:, None] >= layout.bounds[None, 1:regions], axis=1, dtype=jnp.int32)
    offset = index - layout.bounds[region]
    return region, offset, (offset >= 0) & (offset < layout.counts[region])


def _local(src, send: Layout, recv: Layout, out_rows: int):
    """The exchange on one shard: region j's live rows moved to the result's region j (with one
    region, both from row 0: a select)."""
    zero = jnp.zeros((), src.dtype)
    if send.counts.shape[0] == 1:
        rows = jnp.arange(out_rows, dtype=jnp.int32)
        live = (rows < jnp.minimum(send.counts[0], recv.counts[0]))[:, None]
        if src.shape[0] < out_rows:
            src = jnp.pad(src, ((0, out_rows - src.shape[0]), (0, 0)))
        return jnp.where(live, src[:out_rows], zero)
    region, offset, live = _regions(out_rows, recv)
    live = live & (offset < send.counts[region])
    take = jnp.clip(send.bounds[region] + offset, 0, src.shape[0] - 1)
    return jnp.where(live[:, None], src[take], zero)


def _blocks(src, send: Layout, recv: Layout, axis_name: str, most: int, out_rows: int):
    """The exchange as one all-to-all of [P, most, K] blocks (block d: the live rows of regions
    (d, 0), (d, 1), ... one after another), gathered out of src's regions and into the
    result's."""
    size, zero = lax.axis_size(axis_name), jnp.zeros((), src.dtype)
    counts, firsts = send.grid(send.counts, size), send.grid(send.bounds[:-1], size)  # [P, g]
    ends, index = jnp.cumsum(counts, axis=1), jnp.arange(most, dtype=jnp.int32)
    group = jnp.sum(index[None, :, None] >= ends[:, None, :], axis=2, dtype=jnp.int32)
    live = group < counts.shape[1]  # [P, most]
    at = functools.partial(jnp.take_along_axis, indices=jnp.minimum(group, counts.shape[1] - 1),
                           axis=1)  # fmt: skip
    take = jnp.clip(at(firsts) + index - at(ends - counts), 0, src.shape[0] - 1)
    blocks = jnp.where(live[..., None], src[take], zero)
    got = lax.all_to_all(blocks, axis_name, 0, 0).reshape(size * most, -1)  # [s]: from s
    region, offset, inside = _regions(out_rows, recv)
    peer, group = recv.pair(region, size)
    arrived = recv.grid(recv.counts, size)
    before = (jnp.cumsum(arrived, axis=1) - arrived)[peer, group]
    picked = got[jnp.where(inside, peer * most + before + offset, 0)]
    return jnp.where(inside[:, None], picked, zero)


def _exchange_fwd(src, send, recv, axis_name, most, out_rows, fills):
    out = _exchange(src, send, recv, axis_name, most, out_rows, fills)
    return out, (send, recv, src.shape[0])


def _exchange_bwd(axis_name, most, out_rows, fills, residuals, ct):
    send, recv, rows = residuals
    return _exchange(ct, recv, send, axis_name, most, rows, fills[::-1]), None, None


_exchange.defvjp(_exchange_fwd, _exchange_bwd)
