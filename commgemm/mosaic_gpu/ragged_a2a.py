"""A ragged all-to-all on Hopper GPUs (the exchange of `lax.ragged_all_to_all`): each device's
rows for each peer written straight into that peer's result over NVLink, only the rows that are
there, where an all-to-all of static shapes moves whole blocks.

Plans (`plan_array`): items, each rows of this device's source for one peer and where they land
there (the regions of `grouped.exchange`), then the rows of this device's result that no peer
writes; `exchange_kernel` moves the one and zeroes the other.

One persistent kernel, one CTA per SM, one warpgroup: the work is units of tile_rows x
tile_cols (a TMA load of the source block into shared memory, then a ladder of TMA stores of
powers of two rows into the peer's result: `grouped_pingpong.ladder`, so a transfer writes its
live rows and no others), then the units that zero the rest of this device's regions, dealt
round-robin to the CTAs, each finding its item by a binary search of the items' first units.
CTA c first adds 1 to semaphore c on every device (itself included) and waits for P of its
own: no device writes into a peer's result before the peer has entered the kernel (its earlier
work, whose memory the result may reuse, done). Every CTA, its stores landed, adds 1 to
another semaphore on every device, ordered after those stores (`signals.landed`); CTA 0 waits
for P x CTAs of them, so the kernel ends when every row has arrived. Waits take their counts
off: each call starts where the last left them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from commgemm.mosaic_gpu import signals
from commgemm.mosaic_gpu import tiles as mt
from commgemm.mosaic_gpu.grouped_pingpong import ladder_store

#: Rows of a unit: a TMA box dimension is at most 256 elements.
TILE_ROWS = 128
#: Bytes of a unit's row: 64 KiB a unit at 128 rows, two units' buffers in shared memory.
ROW_BYTES = 512


def tile_cols(k: int, dtype) -> int | None:
    """Columns of a unit for rows of k elements of `dtype`: ROW_BYTES worth (at most 256
    elements, a TMA box's limit), down to what divides k; None where no 16-byte multiple does."""
    itemsize = jnp.dtype(dtype).itemsize
    cols = min(k, ROW_BYTES // itemsize, 256)
    while cols * itemsize >= 16:
        if k % cols == 0 and (cols * itemsize) % 16 == 0:
            return cols
        cols //= 2
    return None


def plan_array(sends, fills, k: int, dtype) -> jax.Array:
    """The kernel's int32 [5, 2R + 1] for R send and R fill items: sends (first row here [R],
    rows [R], first row on the peer [R], peer [R]), fills (first row here [R], rows [R]: the
    rows of this device's result that no peer writes). [0] each item's first unit (and the
    total), [1] its source row, [2] its rows, [3] its first destination row, [4] its peer (-1:
    this device, from the zero block)."""
    src_first, rows, dst_first, peer = (jnp.asarray(a, jnp.int32) for a in sends)
    fill_first, fill_rows = (jnp.asarray(a, jnp.int32) for a in fills)
    blocks = k // tile_cols(k, dtype)
    count = jnp.concatenate([rows, fill_rows])
    units = (jnp.maximum(count, 0) + TILE_ROWS - 1) // TILE_ROWS * blocks
    first = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(units, dtype=jnp.int32)])
    pad = lambda a: jnp.append(a, jnp.int32(0))  # noqa: E731
    return jnp.stack([first, pad(jnp.concatenate([src_first, jnp.zeros_like(fill_first)])),
                      pad(count), pad(jnp.concatenate([dst_first, fill_first])),
                      pad(jnp.concatenate([peer, jnp.full_like(fill_first, -1)]))])  # fmt: skip


def item_of(plan_ref, unit, items: int):
    """In a kernel: the item of `unit` by a plan whose row 0 holds the items' first units
    (`plan_array`'s): the last item whose first unit is at most `unit` (a binary search over
    the nondecreasing firsts; empty items share their successor's)."""
    item, step = jnp.int32(0), 1 << ((items - 1).bit_length() - 1) if items > 1 else 0
    while step:
        ahead = jnp.minimum(item + step, items - 1)
        item = jnp.where((item + step < items) & (plan_ref[0, ahead] <= unit), ahead, item)
        step >>= 1
    return item


def unit_of(plan_ref, unit, items: int, blocks: int, tile_rows: int, tile_cols: int):
    """In a kernel: (item, chunk, rows, columns) of `unit` by a plan whose row 0 holds the
    items' first units and row 2 their rows (`plan_array`'s), each item's units its chunks of
    tile_rows rows times `blocks` blocks of tile_cols columns: the unit's chunk of its item,
    the rows of that chunk (the last one's may be fewer) and its columns (a `pl.ds`)."""
    from jax.experimental import pallas as pl

    item = item_of(plan_ref, unit, items)
    local = unit - plan_ref[0, item]
    chunk, cols = local // blocks, pl.ds(lax.rem(local, blocks) * tile_cols, tile_cols)
    return item, chunk, jnp.minimum(tile_rows, plan_ref[2, item] - chunk * tile_rows), cols


def exchange_kernel(src: jax.Array, plan: jax.Array, out_rows: int, axis_name: str) -> jax.Array:
    """src [R, K] -> [out_rows, K] by `plan` (`plan_array`), on a Hopper GPU inside
    shard_map over `axis_name` (every device of the axis calls it)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    size = lax.axis_size(axis_name)
    k, dtype = src.shape[1], src.dtype
    tm, tc = TILE_ROWS, tile_cols(k, dtype)
    if tc is None:
        raise ValueError(f"ragged all-to-all kernel: rows of {k} x {jnp.dtype(dtype).name}")
    blocks, ctas = k // tc, mt.num_sms()
    items = plan.shape[1] - 1
    sends = items // 2

    def body(plan_ref, src_ref, zeros_ref, out_ref):
        pl.run_scoped(
            lambda *scratch: exchange(plan_ref, src_ref, zeros_ref, out_ref, *scratch),
            plgpu.SMEM((tm, tc), dtype),
            plgpu.SMEM((tm, tc), dtype),
            plgpu.Barrier(num_arrivals=1),
        )

    def exchange(plan_ref, src_ref, zeros_ref, out_ref, buf, zeros, loaded):
        cta = lax.axis_index("sm")
        entered = pl.get_global(plgpu.SemaphoreType.REGULAR((ctas,)))
        arrived = pl.get_global(plgpu.SemaphoreType.REGULAR((1,)))
        # no store into a peer's result before the peer runs this kernel: its earlier work,
        # which may use the same memory, has finished by then
        for d in range(size):
            signals.entered(entered.at[cta], device_id=mt.peer_id(axis_name, jnp.int32(d)))
        plgpu.copy_gmem_to_smem(zeros_ref, zeros, loaded)  # the zero block, once
        plgpu.barrier_wait(loaded)
        pl.semaphore_wait(entered.at[cta], value=size, decrement=True)
        total = plan_ref[0, items]

        @pl.loop(0, (total - cta + ctas - 1) // ctas)
        def _units(i):
            unit = cta + i * ctas
            item, chunk, rows, cols = unit_of(plan_ref, unit, items, blocks, tm, tc)
            first = plan_ref[3, item] + chunk * tm

            @pl.when(item < sends)
            def _send():
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # buf read by the last stores
                plgpu.copy_gmem_to_smem(
                    src_ref.at[pl.ds(plan_ref[1, item] + chunk * tm, tm), cols], buf, loaded
                )
                plgpu.barrier_wait(loaded)
                for d in range(size):  # a TMA store's peer is static: one branch each

                    @pl.when(plan_ref[4, item] == d)
                    def _to(d=d):
                        peer = plgpu.remote_ref(out_ref, mt.peer_id(axis_name, jnp.int32(d)))
                        ladder_store(buf, peer, first, rows, cols, tm)

            @pl.when(item >= sends)
            def _fill():
                ladder_store(zeros, out_ref, first, rows, cols, tm)

        plgpu.wait_smem_to_gmem(0, wait_read_only=False)  # every store has landed
        for d in range(size):
            signals.landed(arrived.at[0], device_id=mt.peer_id(axis_name, jnp.int32(d)))

        @pl.when(cta == 0)
        def _all_arrived():
            pl.semaphore_wait(arrived.at[0], value=size * ctas, decrement=True)

    with jax.named_scope("ragged_all_to_all"), jax.enable_x64(False):
        return plgpu.kernel(
            body,
            out_type=jax.ShapeDtypeStruct((out_rows, k), dtype),
            grid=(ctas,),
            grid_names=("sm",),
            compiler_params=plgpu.CompilerParams(
                lowering_semantics=plgpu.LoweringSemantics.Warpgroup
            ),
        )(plan, src, jnp.zeros((tm, tc), dtype))
