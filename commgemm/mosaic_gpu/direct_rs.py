"""ATOMIC_GEMM_RS: GEMM + reduce-scatter in one kernel, each tile reduce-added into its owner.

x [M, k] (K sharded), w [k, n] -> [M/P, n]: device d owns row block d of the sum over devices.
One persistent Mosaic GPU kernel (following jax's `hopper_matmul_mgpu.kernel`) walks the tiles
of all P row blocks, the P copies of one output tile in consecutive steps, and stores each
finished tile with a TMA reduce-add straight into its owner's output (over NVLink for the peers'
blocks). No step barrier: the transfers spread over the whole GEMM.
Invariant: a tile is added into only after every device zeroed it. The compute warpgroups zero
the tiles of the first `zero_ahead` waves of CTAs (all of them when 0); with zero_ahead = D the
load warpgroups zero wave j + D's tiles while loading wave j, one semaphore a wave
(`wave_tiles`). Every signal follows awaited TMA stores and is ordered after them
(`signals.landed`). `split_tail` splits the last, partly filled wave's tiles (this
device's own) along K (`tail_plan`), or `stream_tail` deals their K-steps evenly to every CTA
(`stream_pieces`); the schedule's arithmetic is `rs_schedule`'s. Partial sums are added in the
output dtype, in arrival order where a tile gets more than two (P > 2, split or streamed
tails): `OverlapConfig.deterministic` refuses those. On one device (axis_name None: the
kernel's GEMM core) the main loop's tiles are stored, not added; a split or streamed tail's
tiles are zeroed first, then its K-ranges added, as on P devices. Measurements behind these
choices: docs/performance.md.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jax import lax

from commgemm.mosaic_gpu import signals
from commgemm.mosaic_gpu import tiles as mt
from commgemm.mosaic_gpu.configs import ZERO_ROWS, DirectRSConfig
from commgemm.mosaic_gpu.rs_schedule import (
    STREAMED,
    main_unit,
    stream_pieces,
    stream_share,
    tail_plan,
    tail_unit,
    wave_tiles,
    zero_bands_per_tile,
    zero_plan,
)


def signal_devices(sem, peers) -> None:
    """`signals.landed` semaphore `sem` here and on every peer (peers[0] is this device): after
    this thread's awaited TMA stores."""
    for i, peer in enumerate(peers):
        signals.landed(sem, device_id=None if i == 0 else peer)


def matmul_reduce_scatter(
    x: jax.Array,
    w: jax.Array,
    axis_name: str,
    tiles: DirectRSConfig | None = None,
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
    float8 tensor cores; `split_accumulator` promotes their partial sums to float32 every K-step
    (`tiles.accumulated`). axis_name None: one device (the kernel's GEMM core)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    size = mt.axis_position(axis_name)[0]
    tiles = tiles or DirectRSConfig()
    dtype = x.dtype
    out_dtype = jnp.dtype(out_dtype or dtype)
    rows, k, n = mt.checked_shape(tiles, x, w, w_nk=w_nk, split=split_accumulator, owners=size)
    epi = tiles.epi
    m_iters, n_iters, k_iters = rows // tiles.cluster_m, n // tiles.cluster_n, k // tiles.tile_k
    sms = mt.num_sms()
    cluster = tiles.cluster_size
    per_block = m_iters * n_iters
    num_tiles = size * per_block
    ctas = sms // cluster
    # a split tail's K-ranges are reduce-added (on one device too: into its zeroed tiles)
    tail_tiles, splits = tail_plan(num_tiles, per_block, ctas, k_iters, tiles)
    main_units = num_tiles - tail_tiles
    if tiles.chain_tiles and main_units < 2 * ctas:
        raise ValueError(
            f"DirectRSConfig.chain_tiles needs two tiles per CTA, got {main_units} tiles for "
            f"{ctas} CTAs"
        )
    waves, ahead, late_zero, first_tiles, late_iters = zero_plan(
        tiles.zero_ahead,
        ctas,
        main_units,
        size,
        per_block,
        tail_tiles,
        zero_bands_per_tile(tiles, ZERO_ROWS),
        sms,
    )
    num_slots = mt.epilogue_slots(tiles)
    adds_per_device = 2 * sms  # each compute warpgroup of each CTA signals once
    # one device adds nothing: its tiles are stored, not reduce-added into zeroed outputs
    reduce = size > 1
    # one wgmma in flight, its smem slot released a K-step late (a pipeline of pipelines,
    # chain_tiles, takes no late release: there each wgmma is awaited)
    release = 0 if tiles.chain_tiles else 1

    def get_pipeline(steps, body, compute_context, state=None, k_first=0):
        return mt.tile_pipeline(
            tiles,
            dtype,
            steps,
            body,
            compute_context,
            release=release,
            state=state,
            w_nk=w_nk,
            k_first=k_first,
        )

    def body(x_ref, w_ref, *refs):
        scale_ref, out_ref = refs if scale is not None else (None, *refs)
        zeroed = pl.get_global(plgpu.SemaphoreType.REGULAR)
        landed = pl.get_global(plgpu.SemaphoreType.REGULAR)
        if late_zero:  # one a wave: every CTA of every device zeroed its share of the wave
            zeroed_waves = pl.get_global(plgpu.SemaphoreType.REGULAR((waves,)))
        here = mt.axis_position(axis_name)[1]
        in_cluster = lax.axis_index("cluster")
        cta = lax.axis_index("cluster_grid") * cluster + in_cluster
        # peers[0] is here
        peers = [
            mt.peer_id(axis_name, lax.rem(here + offset, jnp.int32(size))) for offset in range(size)
        ]

        signal_every_device = functools.partial(signal_devices, peers=peers)

        def zero_tiles(src, lo, hi, worker, workers: int, iters: int):
            """TMA-store the zero block `src` over tiles [lo, hi) of this device's output: the
            worker-th of every `workers` bands of src's rows across a tile, each band in
            blocks of src's shape."""
            block_m, block_n = src.shape
            bands = zero_bands_per_tile(tiles, block_m)
            first, end = lo * bands + worker, hi * bands

            @pl.loop(0, iters)
            def _band(i):
                unit = first + i * workers
                tile, band = divmod(jnp.minimum(unit, end - 1), bands)
                m_idx, n_idx = mt.cluster_tile(tiles, tile, m_iters, n_iters)
                rows_at = out_ref.at[pl.ds(m_idx * tiles.cluster_m + band * block_m, block_m)]
                for j in range(tiles.cluster_n // block_n):
                    cols = pl.ds(n_idx * tiles.cluster_n + j * block_n, block_n)
                    plgpu.copy_smem_to_gmem(src, rows_at.at[:, cols], predicate=unit < end)

        def _tiles_scope(pipeline_allocs, out_smem, zero_smem):
            wg = lax.axis_index("wg")

            @jax.named_scope("zero")
            def _zero_output():
                # the first waves' tiles; on one device only the split tail's, which it adds
                lo, hi = (0, first_tiles) if reduce else (per_block - tail_tiles, per_block)
                out_smem[wg, 0] = jnp.zeros((epi, epi), out_dtype)
                plgpu.commit_smem()
                iters = -(-(hi - lo) * zero_bands_per_tile(tiles, epi) // (2 * sms))
                zero_tiles(out_smem.at[wg, 0], lo, hi, 2 * cta + wg, 2 * sms, iters)
                plgpu.wait_smem_to_gmem(0, wait_read_only=False)
                signal_every_device(zeroed)

            if reduce or tail_tiles:
                pl.when(wg < 2)(_zero_output)

            if late_zero:

                @pl.when(wg == 2)
                def _zero_block():
                    zero_smem[...] = jnp.zeros((ZERO_ROWS, epi), out_dtype)
                    plgpu.commit_smem()

            def zero_waves_ahead(step):
                """The load warpgroup before the main loop's step `step`: signals that its
                share of the wave it zeroed last step landed, zeroes its share of wave step +
                ahead, and waits until every device has zeroed wave `step`."""
                pending = step - 1 + ahead

                @pl.when((step >= 1) & (pending < waves))
                @jax.named_scope("ahead_signal")
                def _signal():
                    plgpu.wait_smem_to_gmem(0, wait_read_only=False)
                    signal_every_device(zeroed_waves.at[pending])

                @pl.when(step + ahead < waves)
                @jax.named_scope("ahead_zero")
                def _zero():
                    lo, hi = wave_tiles(step + ahead, ctas, main_units, size, per_block, tail_tiles)
                    zero_tiles(zero_smem, lo, hi, cta, sms, late_iters)

                @pl.when(step >= ahead)
                @jax.named_scope("ahead_wait")
                def _wait():
                    pl.semaphore_wait(zeroed_waves.at[step], value=size * sms, decrement=False)

            def run_tile(tile, offset, k_first, k_steps, state=None, first=None):
                """One output tile's K-steps [k_first, k_first + k_steps) (traced in a
                streamed tail) and its epilogue; `offset`: the owner's distance from here."""
                # the device owning this tile's rows
                block = lax.rem(here + offset, jnp.int32(size))
                at = mt.tile_slices(tiles, tile, m_iters, n_iters)
                # a tail tile (offset 0, an int) is added into on one device too
                add = reduce or isinstance(offset, int)

                def tile_of(ref, epi_m, epi_n):
                    return ref.at[at.cta_m, at.cta_n].at[at.wg_m, at.wg_n].at[epi_m, epi_n]

                def store(src, dest, predicate=None, commit=True):
                    plgpu.copy_smem_to_gmem(
                        src,
                        dest,
                        predicate=predicate,
                        commit_group=commit,
                        reduction_op="add" if add else None,
                    )

                def epilogue_of(acc):
                    acc = mt.scaled(acc, scale_ref, out_dtype)
                    if first is not None and add:

                        @pl.when(first)
                        def _outputs_zeroed():
                            pl.semaphore_wait(zeroed, value=size * adds_per_device, decrement=False)

                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    for epi_m, epi_n, slot in mt.epilogue_blocks(tiles, num_slots):
                        plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                        out_smem[wg, slot] = acc[epi_m, epi_n]
                        plgpu.commit_smem()
                        src = out_smem.at[wg, slot]
                        if isinstance(offset, int):  # a tail tile: here (offset 0)
                            store(src, tile_of(out_ref, epi_m, epi_n))
                            continue
                        for i, peer in enumerate(peers):
                            dest = out_ref if i == 0 else plgpu.remote_ref(out_ref, peer)
                            store(
                                src,
                                tile_of(dest, epi_m, epi_n),
                                predicate=offset == i,
                                commit=i == size - 1,  # one group per block
                            )

                def finish(read):
                    with jax.named_scope("epilogue"):
                        epilogue_of(read())

                def compute_context(eval_pipeline):
                    mt.accumulated(tiles, eval_pipeline, finish, split=split_accumulator)

                def mma_body(idxs, a_smem, b_smem, acc):
                    rhs = mt.rhs_operand(b_smem, at.wg_n, w_nk=w_nk)
                    return mt.accumulate(
                        tiles,
                        acc,
                        a_smem.at[at.wg_m],
                        rhs,
                        split=split_accumulator,
                        in_flight=release,
                        last=idxs[0] == k_steps - 1,
                    )

                get_pipeline(k_steps, mma_body, compute_context, state, k_first)(
                    x_ref.at[pl.ds(block * rows + at.m_idx * tiles.cta_m, tiles.cta_m)],
                    mt.w_columns(w_ref, at.cta_n, w_nk=w_nk),
                    allocations=pipeline_allocs,
                )

            @plgpu.nd_loop((main_units,), collective_axes="cluster_grid")
            def _tiles(info):
                (lin,) = info.index
                if late_zero:
                    pl.when(wg == 2)(lambda: zero_waves_ahead(info.local_index))
                tile, offset = main_unit(lin, size, per_block, tail_tiles)
                state = mt.chain_state(info) if tiles.chain_tiles else None
                run_tile(tile, offset, 0, k_iters, state, first=info.local_index == 0)

            if late_zero:

                @pl.when(wg == 2)
                def _last_wave_zeroed():
                    cid = lax.axis_index("cluster_grid")
                    pending = (main_units - cid + ctas - 1) // ctas - 1 + ahead
                    plgpu.wait_smem_to_gmem(0, wait_read_only=False)
                    pl.when(pending < waves)(lambda: signal_every_device(zeroed_waves.at[pending]))
                    if tail_tiles:  # the tail's tiles are in the last wave's
                        pl.semaphore_wait(
                            zeroed_waves.at[waves - 1], value=size * sms, decrement=False
                        )

            if tail_tiles and splits == STREAMED:
                share = stream_share(tail_tiles, k_iters, ctas)
                pieces = stream_pieces(
                    lax.axis_index("cluster_grid"), share, per_block, tail_tiles, k_iters
                )
                for i, (tile, k_first, k_steps) in enumerate(pieces):
                    # on one device the first piece awaits the tail's zeroing
                    first = None if reduce or i else True
                    # jax's pipeline counts a dynamic grid's steps in this type (as a static
                    # grid's: int64 under jax_enable_x64)
                    k_steps = k_steps.astype(jnp.result_type(int))
                    pl.when(k_steps > 0)(
                        functools.partial(run_tile, tile, 0, k_first, k_steps, first=first)
                    )
            elif tail_tiles:

                @plgpu.nd_loop((tail_tiles * splits,), collective_axes="cluster_grid")
                def _tail(info):
                    (unit,) = info.index
                    tile, part = tail_unit(unit, per_block, tail_tiles, splits)
                    # on P devices the main loop's first tile awaited the zeroing already
                    first = None if reduce else info.local_index == 0
                    run_tile(tile, 0, part * (k_iters // splits), k_iters // splits, first=first)

            @pl.when(wg < 2)
            @jax.named_scope("landed")
            def _adds_landed():
                plgpu.wait_smem_to_gmem(0, wait_read_only=False)
                if reduce:
                    for peer in peers[1:]:
                        signals.landed(landed, device_id=peer)
                    pl.semaphore_wait(landed, value=(size - 1) * adds_per_device, decrement=False)

        @mt.tile_smem(
            tiles, dtype, k_iters, x_ref, w_ref, release=release, out_dtype=out_dtype, w_nk=w_nk
        )
        def _scope(pipeline_allocs, out_smem):
            if late_zero:
                zero_block = plgpu.SMEM((ZERO_ROWS, epi), out_dtype)
                pl.run_scoped(
                    functools.partial(_tiles_scope, pipeline_allocs, out_smem),
                    zero_block,
                    collective_axes="wg",
                )
            else:
                _tiles_scope(pipeline_allocs, out_smem, None)

    with jax.named_scope("fused_gemm_scatter_add"):
        return plgpu.kernel(
            body,
            out_type=jax.ShapeDtypeStruct((rows, n), out_dtype),
            **mt.kernel_params(sms, cluster, compiler_params),
        )(x, w, *([] if scale is None else [scale]))
