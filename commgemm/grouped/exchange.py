"""The expert-parallel exchange: each shard's rows for each shard moved into that shard's
region for it, only the live rows (a ragged all-to-all), differentiable.

A `Layout` splits a shard's rows into P regions: region j is rows [bounds[j], bounds[j + 1]),
of which the first counts[j] are live. `ragged_all_to_all(src, send, recv)` moves the live rows
of region d of each shard's src into region `me` of shard d's result, where `recv` is the
result's layout (recv.counts[s] = shard s's send.counts[me]); every other result row is zero.
Its transpose is the same exchange the other way (recv -> send), so the gradient moves the
same rows back.

On one shard it is a select (both layouts hold one region from row 0). On Hopper GPUs driven
by one process a kernel writes the live rows into the peers' results over NVLink
(`mosaic_gpu.ragged_a2a`); elsewhere, one process per GPU included, each region's rows travel
in one `lax.all_to_all` of blocks of `most` rows (the largest live count any region can hold),
gathered out of and into the regions.
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
    """A shard's rows as P regions: bounds [P + 1] int32 (region j: rows [bounds[j],
    bounds[j + 1]), bounds[0] = 0 and bounds[P] the rows), counts [P] int32 (the live rows at
    the top of each region)."""

    bounds: jax.Array
    counts: jax.Array


def kernel_reason(dtype, k: int) -> str | None:
    """Why rows of k elements of `dtype` do not travel by the NVLink kernel here, or None."""
    from commgemm.mosaic_gpu import fused, ragged_a2a

    if jax.process_count() != 1:
        return "it is for one process driving every GPU; with several the all-to-all form runs"
    if (reason := fused._gpu_reason()) is not None:
        return reason
    if ragged_a2a.tile_cols(k, dtype) is None:
        return f"rows of {k} x {jnp.dtype(dtype).name} are no whole 16-byte TMA boxes"
    return None


def ragged_all_to_all(
    src: jax.Array, send: Layout, recv: Layout, axis_name: str, most: int, out_rows: int
) -> jax.Array:
    """src [R, K] (this shard's rows in the regions of `send`) -> [out_rows, K] (the regions of
    `recv`, recv.bounds[P] = out_rows): the live rows of region me of every shard s's src in
    region s, zeros elsewhere. `most` (static): no count exceeds it, the fallback's block rows.
    Inside shard_map over `axis_name`."""
    _check(src, send, recv, lax.axis_size(axis_name), most, out_rows)
    return _exchange(src, send, recv, axis_name, most, out_rows)


def _check(src, send: Layout, recv: Layout, size: int, most, out_rows) -> None:
    """Clear errors for what the exchange cannot take (counts are data: not checked)."""
    if src.ndim != 2 or src.shape[0] < 1:
        raise ValueError(f"ragged_all_to_all: src must be [R >= 1, K], got {list(src.shape)}")
    for name, value in (("most", most), ("out_rows", out_rows)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"ragged_all_to_all: {name}={value!r} must be a positive int")
    for side, layout in (("send", send), ("recv", recv)):
        shapes = (tuple(layout.bounds.shape), tuple(layout.counts.shape))
        if shapes != ((size + 1,), (size,)):
            raise ValueError(
                f"ragged_all_to_all: {side} layout bounds {list(shapes[0])} and counts "
                f"{list(shapes[1])} must be [{size + 1}] and [{size}] on an axis of {size}"
            )
        if not all(jnp.issubdtype(a.dtype, jnp.integer) for a in (layout.bounds, layout.counts)):
            raise ValueError(f"ragged_all_to_all: {side} layout must hold integers")


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _exchange(src, send: Layout, recv: Layout, axis_name: str, most: int, out_rows: int):
    if lax.axis_size(axis_name) == 1:
        return _local(src, send, recv, out_rows)
    if kernel_reason(src.dtype, src.shape[1]) is None:
        from commgemm.mosaic_gpu import ragged_a2a

        # where this shard's rows land on each peer d: d's region for it
        at = lax.all_to_all(recv.bounds[:-1], axis_name, 0, 0, tiled=True)
        plan = ragged_a2a.plan_array(send.bounds, send.counts, at, recv.bounds, recv.counts)
        out = ragged_a2a.exchange_kernel(src, plan, out_rows, axis_name)
        return varying_like(out, src, plan)  # a Pallas result carries no varying axes
    return _blocks(src, send, recv, axis_name, most, out_rows)


def _local(src, send: Layout, recv: Layout, out_rows: int):
    """The exchange on one shard: the live rows of its one region, moved to the top of the
    result's one region (a select where both start at row 0, as they do)."""
    rows = jnp.arange(out_rows, dtype=jnp.int32)
    live = (rows < jnp.minimum(send.counts[0], recv.counts[0]))[:, None]
    if src.shape[0] < out_rows:
        src = jnp.pad(src, ((0, out_rows - src.shape[0]), (0, 0)))
    return jnp.where(live, src[:out_rows], jnp.zeros((), src.dtype))


def _blocks(src, send: Layout, recv: Layout, axis_name: str, most: int, out_rows: int):
    """The exchange as one all-to-all of [P, most, K] blocks, gathered out of src's regions and
    into the result's."""
    size, index = send.counts.shape[0], jnp.arange(most, dtype=jnp.int32)
    take = jnp.clip(send.bounds[:size, None] + index, 0, src.shape[0] - 1)
    live = (index < send.counts[:, None])[..., None]
    blocks = jnp.where(live, src[take], jnp.zeros((), src.dtype))
    got = lax.all_to_all(blocks, axis_name, 0, 0).reshape(size * most, -1)  # [s]: from s
    rows = jnp.arange(out_rows, dtype=jnp.int32)
    region = jnp.sum(rows[:, None] >= recv.bounds[None, 1:size], axis=1)
    offset = rows - recv.bounds[region]
    inside = (offset >= 0) & (offset < recv.counts[region])
    picked = got[jnp.where(inside, region * most + offset, 0)]
    return jnp.where(inside[:, None], picked, jnp.zeros((), src.dtype))


def _exchange_fwd(src, send, recv, axis_name, most, out_rows):
    return _exchange(src, send, recv, axis_name, most, out_rows), (send, recv, src.shape[0])


def _exchange_bwd(axis_name, most, out_rows, residuals, ct):
    send, recv, rows = residuals
    return _exchange(ct, recv, send, axis_name, most, rows), None, None


_exchange.defvjp(_exchange_fwd, _exchange_bwd)
