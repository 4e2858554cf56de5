"""ATOMIC_GEMM_RS on the ping-pong schedule: GEMM + reduce-scatter in one kernel, each compute
warpgroup a whole output tile, its epilogue under the other's K loop (`pingpong`).

x [M, k] (K sharded), w [k, n] -> [M/P, n]: device d owns row block d of the sum over devices,
as in `direct_rs` (the P copies of one output tile in consecutive units, each stored by
a TMA reduce-add straight into its owner's output, over NVLink for the peers'). The shared
epilogue buffer leaves shared memory for 5 stages of 128 x 192 tiles. The last column of tiles
may be partial: TMA zero-fills the loads past n and clips the stores; on one device so may the
last row of tiles (M need not be whole tiles: the loads past M read zeros, the stores clip).
Invariant (P > 1): a tile is added into only after every device zeroed it. The compute
warpgroups zero the tiles of the first `zero_ahead` waves of CTAs (all when 0) before their
first tile; the load warpgroups zero wave j + D's tiles between wave j's loads, one semaphore
a wave, as `direct_rs` does (`rs_schedule.wave_tiles`). Every signal follows
awaited TMA stores, ordered after them (`signals.landed`); at the end each
compute warpgroup awaits the peers' "landed" signals. On one device
(axis_name None: the kernel's GEMM core) the tiles are stored, not added, and nothing is zeroed.
Partial sums are added in the output dtype, in arrival order on more than 2 devices.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jax import lax

from commgemm.mosaic_gpu import pingpong, signals
from commgemm.mosaic_gpu import tiles as mt
from commgemm.mosaic_gpu.configs import EPI, ZERO_ROWS, PingPongRSConfig
from commgemm.mosaic_gpu.direct_rs import signal_devices
from commgemm.mosaic_gpu.pingpong import shape_reason
from commgemm.mosaic_gpu.rs_schedule import wave_tiles, zero_plan

__all__ = ["matmul_reduce_scatter", "shape_reason"]


def matmul_reduce_scatter(
    x: jax.Array,
    w: jax.Array,
    axis_name: str | None,
    tiles: PingPongRSConfig,
    *,
    w_nk: bool = False,
    out_dtype=None,
    scale: jax.Array | None = None,
    split_accumulator: bool = False,
    compiler_params: Mapping | None = None,
) -> jax.Array:
    """x [M, k], w [k, n] ([n, k] with w_nk; both local, K sharded over axis_name) -> [M/P, n],
    this device's rows of sum_d x_d @ w_d, in `out_dtype` (default x's dtype), the partial sums
    added in it, each times `scale` [1] float32 if given. Float8 x and w (w_nk) multiply on
    float8 tensor cores with fast accumulation (`split_accumulator` is refused: a second
    accumulator does not fit beside a whole tile's). axis_name None: one device."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    size = mt.axis_position(axis_name)[0]
    tiles = pingpong.checked_tiles(tiles, PingPongRSConfig, split_accumulator)
    if x.shape[0] % size:
        raise ValueError(f"rows={x.shape[0]} must be divisible by the {size} devices")
    dtype = x.dtype
    out_dtype = jnp.dtype(out_dtype or dtype)
    rows, k, n = x.shape[0] // size, x.shape[1], w.shape[0 if w_nk else 1]
    if reason := shape_reason(
        tiles, rows, k, n, dtype, w_nk=w_nk, out_dtype=out_dtype, partial_rows=size == 1
    ):
        raise ValueError(f"PingPongRSConfig: {reason}")
    tile_m, tile_n = tiles.tile_m, tiles.tile_n
    pair = tiles.cluster_size
    m_pairs, n_iters, k_iters = -(-rows // tiles.cluster_m), -(-n // tile_n), k // tiles.tile_k
    sms = mt.num_sms()
    ctas = sms // pair
    per_block = m_pairs * n_iters
    units = size * per_block
    dealt = pingpong.deal(tiles, units, ctas)
    reduce = size > 1
    bands = tiles.cluster_m // ZERO_ROWS  # the load warpgroups zero a band at a time
    waves, ahead, late_zero, first_tiles, late_iters = zero_plan(
        tiles.zero_ahead, ctas, units, size, per_block, 0, bands, sms
    )
    zero_columns = tiles.zero_columns
    adds = 2 * sms  # each compute warpgroup of each CTA signals each device once

    def body(x_ref, w_ref, *refs):
        scale_ref, out_ref = refs if scale is not None else (None, *refs)
        if reduce:
            zeroed = pl.get_global(plgpu.SemaphoreType.REGULAR)
            landed = pl.get_global(plgpu.SemaphoreType.REGULAR)
        if late_zero:  # one a wave: every CTA of every device zeroed its share of the wave
            zeroed_waves = pl.get_global(plgpu.SemaphoreType.REGULAR((waves,)))
        here = mt.axis_position(axis_name)[1]
        in_cluster = lax.axis_index("cluster")
        cid = lax.axis_index("cluster_grid")
        cta = cid * pair + in_cluster
        mine = dealt.count(cid)  # this CTA's units: cid, cid + ctas, ... (`pingpong.Deal`)
        # peers[0] is here
        peers = [
            mt.peer_id(axis_name, lax.rem(here + offset, jnp.int32(size))) for offset in range(size)
        ]
        tile_origin = functools.partial(
            pingpong.tile_origin, tiles, m_pairs=m_pairs, n_iters=n_iters
        )
        zero_smem = []  # the load warpgroup's zero block (late_zero)

        def where(i):
            """(x's first row, the output's first row and column, the owner's distance) of this
            CTA's i-th unit: the P owners' copies of a tile consecutive."""
            lin, half = dealt.tile(cid, i)
            tile, offset = lin // size, lax.rem(lin, jnp.int32(size))
            row0, col0 = tile_origin(tile)
            row = row0 + in_cluster * tile_m + half * (tile_m // 2)
            block = lax.rem(here + offset, jnp.int32(size))
            return block * rows + row, row, col0, offset

        signal_every_device = functools.partial(signal_devices, peers=peers)

        def zero_wave(wave):
            """The load warpgroup: this CTA's share of the bands of `wave`'s tiles."""
            lo, hi = wave_tiles(wave, ctas, units, size, per_block, 0)
            first, end = lo * bands + cta, hi * bands

            @pl.loop(0, late_iters)
            def _band(j):
                unit = first + j * sms
                tile, band = divmod(jnp.minimum(unit, end - 1), bands)
                row0, col0 = tile_origin(tile)
                at = out_ref.at[pl.ds(row0 + band * ZERO_ROWS, ZERO_ROWS)]
                for q in range(tile_n // zero_columns):
                    dest = at.at[:, pl.ds(col0 + q * zero_columns, zero_columns)]
                    plgpu.copy_smem_to_gmem(zero_smem[0], dest, predicate=unit < end)

        def load_start(extra):
            zero_smem.append(extra[0])
            zero_smem[0][...] = jnp.zeros((ZERO_ROWS, zero_columns), out_dtype)
            plgpu.commit_smem()

        def zero_waves_ahead(i):
            """The load warpgroup before its i-th tile's loads: signals that its share of the
            wave it zeroed last landed, and zeroes its share of wave i + ahead."""
            pending = i - 1 + ahead

            @pl.when((i >= 1) & (pending < waves))
            @jax.named_scope("ahead_signal")
            def _signal():
                plgpu.wait_smem_to_gmem(0, wait_read_only=False)
                signal_every_device(zeroed_waves.at[pending])

            pl.when(i + ahead < waves)(jax.named_scope("ahead_zero")(lambda: zero_wave(i + ahead)))

        def last_wave_zeroed():
            @pl.when(mine - 1 + ahead < waves)
            def _():
                plgpu.wait_smem_to_gmem(0, wait_read_only=False)
                signal_every_device(zeroed_waves.at[mine - 1 + ahead])

        def load_x(i, kk, dest, barrier):
            x_rows = pl.ds(where(i)[0], dest.shape[0])
            plgpu.copy_gmem_to_smem(
                x_ref.at[x_rows, pl.ds(kk * tiles.tile_k, tiles.tile_k)], dest, barrier
            )

        @jax.named_scope("zero")
        def zero_output(c, out_smem):
            """This CTA's share of the first waves' tiles, in blocks of the epilogue buffer
            (zeros)."""
            out_smem[...] = jnp.zeros((EPI, tile_n), out_dtype)
            plgpu.commit_smem()
            per_tile = tiles.cluster_m // EPI
            blocks = first_tiles * per_tile

            @pl.loop(0, -(-blocks // (2 * sms)))
            def _block(j):
                unit = 2 * cta + c + j * 2 * sms
                tile, r = divmod(jnp.minimum(unit, blocks - 1), per_tile)
                row0, col0 = tile_origin(tile)
                dest = out_ref.at[pl.ds(row0 + r * EPI, EPI), pl.ds(col0, tile_n)]
                plgpu.copy_smem_to_gmem(out_smem, dest, predicate=unit < blocks)

            plgpu.wait_smem_to_gmem(0, wait_read_only=False)
            signal_every_device(zeroed)

        def before_stores(c, i):
            @pl.when(i < 2)
            def _():  # before this warpgroup's first adds: the first waves zeroed
                pl.semaphore_wait(zeroed, value=size * adds, decrement=False)

            if late_zero:

                @pl.when(i >= ahead)
                def _():  # this tile's wave zeroed on every device
                    pl.semaphore_wait(zeroed_waves.at[i], value=size * sms, decrement=False)

        def store(i, r, out_smem):
            _, row, col, offset = where(i)
            at = (pl.ds(row + r * EPI, EPI), pl.ds(col, tile_n))
            for p, peer in enumerate(peers):
                dest = out_ref if p == 0 else plgpu.remote_ref(out_ref, peer)
                plgpu.copy_smem_to_gmem(
                    out_smem,
                    dest.at[at],
                    predicate=offset == p,
                    commit_group=p == size - 1,
                    reduction_op="add" if reduce else None,
                )

        def compute_end(c):
            plgpu.wait_smem_to_gmem(0, wait_read_only=False)
            if not reduce:
                return
            with jax.named_scope("landed"):
                for peer in peers[1:]:
                    signals.landed(landed, device_id=peer)
                pl.semaphore_wait(landed, value=(size - 1) * adds, decrement=False)

        unit = pingpong.Unit(
            load_x=load_x,
            column=lambda i: where(i)[2],
            store=store,
            load_start=load_start if late_zero else None,
            before_unit=zero_waves_ahead if late_zero else None,
            load_end=last_wave_zeroed if late_zero else None,
            compute_start=zero_output if reduce else None,
            before_stores=before_stores if reduce else None,
            compute_end=compute_end,
        )
        pingpong.run(
            tiles,
            unit,
            tiles_dealt=dealt,
            k_iters=k_iters,
            w_ref=w_ref,
            dtype=dtype,
            w_dtype=w.dtype,
            out_dtype=out_dtype,
            w_nk=w_nk,
            scale_ref=scale_ref,
            extra_smem=[plgpu.SMEM((ZERO_ROWS, zero_columns), out_dtype)] if late_zero else (),
        )

    with jax.named_scope("fused_gemm_scatter_add_pingpong"):
        return plgpu.kernel(
            body,
            out_type=jax.ShapeDtypeStruct((rows, n), out_dtype),
            **mt.kernel_params(sms, pair, compiler_params),
        )(x, w, *([] if scale is None else [scale]))
