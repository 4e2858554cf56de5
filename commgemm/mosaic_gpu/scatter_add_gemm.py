"""ATOMIC_GEMM_RS: GEMM + reduce-scatter in one kernel, each tile reduce-added into its owner.

x [M, k] (K sharded), w [k, n] -> [M/P, n]: device d owns row block d of the sum over devices.
One persistent Mosaic GPU kernel (following jax's `hopper_matmul_mgpu.kernel`) walks the tiles
of all P row blocks, the P copies of one output tile in consecutive steps, and stores each
finished tile with a TMA reduce-add straight into its owner's output (over NVLink for the peers'
blocks). No step barrier: the transfers spread over the whole GEMM.
Invariant: a tile is added into only after every device zeroed it. The compute warpgroups zero
the tiles of the first `zero_ahead` waves of CTAs (all of them when 0); with zero_ahead = D the
load warpgroups zero wave j + D's tiles while loading wave j, one semaphore a wave
(`wave_tiles`). Every signal follows awaited TMA stores, so it is a relaxed atomic
(`tiles.relaxed_signal`). `split_tail` splits the last, partly filled wave's tiles (this
device's own) along K (`tail_plan`). Partial sums are added in the output dtype, in arrival
order where a tile gets more than two (P > 2, split tails): `OverlapConfig.deterministic`
refuses those. On one device (axis_name None: the kernel's GEMM core) the main loop's tiles
are stored, not added; a split tail's tiles are zeroed first, then its K-ranges added, as on P
devices. Measurements behind these choices: docs/performance.md.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from commgemm.config import OverlapConfig
from commgemm.mosaic_gpu import tiles as mt
from commgemm.mosaic_gpu.configs import ZERO_ROWS, DirectRSConfig

#: What a tail unit costs beyond its K-steps (epilogue, pipeline ramp), in K-steps: the
#: automatic split_tail's model.
TAIL_OVERHEAD_STEPS = 2


def tail_plan(
    num_tiles: int, per_block: int, ctas: int, k_iters: int, tiles: DirectRSConfig
) -> tuple[int, int]:
    """(tail tiles, splits): the tiles of the last, partly filled wave (`num_tiles % ctas`) and
    how many K-ranges each is split into (DirectRSConfig.split_tail; 1: no tail). The tail tiles
    are this device's own, so their partial sums add up here, not over NVLink. A split must
    divide K/tile_k into ranges of at least `stages` steps; 0 picks the split that minimises
    ceil(tail * s / ctas) * (k_iters / s + TAIL_OVERHEAD_STEPS), 1 included."""
    tail = num_tiles % ctas
    split = tiles.split_tail
    if split == 1 or tail == 0:
        return 0, 1
    valid = [s for s in range(1, k_iters // tiles.stages + 1) if k_iters % s == 0]
    if split:
        if split not in valid:
            raise ValueError(
                f"DirectRSConfig.split_tail={split} must divide K/tile_k={k_iters} into ranges of "
                f"at least {tiles.stages} steps (stages)"
            )
        if tail > per_block:
            raise ValueError(
                f"DirectRSConfig.split_tail needs the tail ({tail} tiles) within one block "
                f"({per_block} tiles)"
            )
    else:
        if tail > per_block:
            return 0, 1

        def cost(s: int) -> float:
            return -(-tail * s // ctas) * (k_iters / s + TAIL_OVERHEAD_STEPS)

        split = min(valid, key=cost)
    return (tail, split) if split > 1 else (0, 1)


def signal_devices(sem, peers) -> None:
    """`tiles.relaxed_signal` semaphore `sem` here and on every peer (peers[0] is this device),
    with relaxed_signal's invariant: after this thread's awaited TMA stores."""
    for i, peer in enumerate(peers):
        mt.relaxed_signal(sem, device_id=None if i == 0 else peer)


def _rem(a, n: int):
    return a % n if isinstance(a, int) else lax.rem(a, jnp.int32(n))


def _select(pred, a, b):
    return (a if pred else b) if isinstance(pred, bool) else jnp.where(pred, a, b)


def main_unit(lin, size: int, per_block: int, tail_tiles: int):
    """(tile, offset) of the main loop's `lin`-th unit: the P blocks' copies of one tile are
    consecutive (offset: the owner's distance from here), except that the peers' copies of the
    last `tail_tiles` tiles come last (their own copies are the tail's). Python ints in, ints
    out; traced in, traced out."""
    tile, offset = lin // size, _rem(lin, size)
    if not tail_tiles or size == 1:  # one device: the main loop's tiles come in order
        return tile, offset
    late = lin - size * (per_block - tail_tiles)
    in_late = late >= 0
    tile = _select(in_late, per_block - tail_tiles + late // (size - 1), tile)
    offset = _select(in_late, 1 + _rem(late, size - 1), offset)
    return tile, offset


def wave_tiles(wave, ctas: int, main_units: int, size: int, per_block: int, tail_tiles: int):
    """[lo, hi): the tiles (of every block) first added into by the main loop's `wave`-th wave
    of `ctas` units. Every unit of a wave adds into a tile below its wave's hi, and the waves'
    ranges follow one another, so zeroing wave w's range before wave w runs is enough
    (DirectRSConfig.zero_ahead). The last wave's hi is per_block (the tail's tiles included)."""

    def last_tile(w):
        lin = (w + 1) * ctas - 1
        lin = min(lin, main_units - 1) if isinstance(lin, int) else jnp.minimum(lin, main_units - 1)
        return main_unit(lin, size, per_block, tail_tiles)[0]

    before = wave - 1 if isinstance(wave, int) else jnp.maximum(wave - 1, 0)
    return _select(wave == 0, 0, last_tile(before) + 1), last_tile(wave) + 1


class ZeroPlan(NamedTuple):
    """A reduce-adding kernel's zeroing (zero_ahead = D): the compute warpgroups zero the first
    `ahead` waves' tiles (`first_tiles` a block) first; with `late_zero` the load warpgroups
    zero each later wave's D waves early, at most `late_iters` ZERO_ROWS bands a CTA."""

    waves: int
    ahead: int
    late_zero: bool
    first_tiles: int
    late_iters: int


def zero_plan(zero_ahead: int, ctas: int, main_units: int, size: int, per_block: int,
              tail_tiles: int, bands: int, sms: int) -> ZeroPlan:  # fmt: skip
    """The ZeroPlan of `main_units` units on `ctas` CTAs (`sms` SMs), `size` blocks of
    `per_block` tiles (`tail_tiles` each past the main loop), `bands` bands a tile."""
    waves = -(-main_units // ctas)
    ahead = min(zero_ahead, waves) if zero_ahead else waves
    first_tiles = wave_tiles(ahead - 1, ctas, main_units, size, per_block, tail_tiles)[1]
    spans = [wave_tiles(w, ctas, main_units, size, per_block, tail_tiles)
             for w in range(ahead, waves)]  # fmt: skip
    late_iters = max([-(-(hi - lo) * bands // sms) for lo, hi in spans], default=0)
    return ZeroPlan(waves, ahead, size > 1 and ahead < waves, first_tiles, late_iters)


def zero_bands_per_tile(tiles: DirectRSConfig, block_m: int) -> int:
    """How many bands of block_m rows (the zeroing's units) one cluster tile of the output
    has."""
    return tiles.cluster_m // block_m


def tail_unit(unit, per_block: int, tail_tiles: int, splits: int):
    """(tile, part) of the tail's `unit`-th unit: the part-th of `splits` K-ranges of one of this
    device's last `tail_tiles` tiles."""
    return per_block - tail_tiles + unit // splits, lax.rem(unit, jnp.int32(splits))


def matmul_reduce_scatter(
    x: jax.Array,
    w: jax.Array,
    axis_name: str,
    config: OverlapConfig,
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
    tiles = config.kernel or DirectRSConfig()
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
        tiles.zero_ahead, ctas, main_units, size, per_block, tail_tiles,
        zero_bands_per_tile(tiles, ZERO_ROWS), sms)  # fmt: skip
    num_slots = mt.epilogue_slots(tiles)
    adds_per_device = 2 * sms  # each compute warpgroup of each CTA signals once
    # one device adds nothing: its tiles are stored, not reduce-added into zeroed outputs
    reduce = size > 1
    # one wgmma in flight, its smem slot released a K-step late (a pipeline of pipelines,
    # chain_tiles, takes no late release: there each wgmma is awaited)
    release = 0 if tiles.chain_tiles else 1

    def get_pipeline(steps, body, compute_context, state=None):
        return mt.tile_pipeline(
            tiles, dtype, steps, body, compute_context, release=release, state=state, w_nk=w_nk
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
        peers = [mt.peer_id(axis_name, lax.rem(here + offset, jnp.int32(size)))
                 for offset in range(size)]  # fmt: skip

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
                """One output tile's K-steps [k_first, k_first + k_steps) and its epilogue;
                `offset`: the owner's distance from here."""
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
                    return mt.accumulate(tiles, acc, a_smem.at[at.wg_m], rhs,
                                         split=split_accumulator, in_flight=release,
                                         last=idxs[0] == k_steps - 1)  # fmt: skip

                ks = pl.ds(k_first * tiles.tile_k, k_steps * tiles.tile_k)
                get_pipeline(k_steps, mma_body, compute_context, state)(
                    x_ref.at[pl.ds(block * rows + at.m_idx * tiles.cta_m, tiles.cta_m), ks],
                    mt.w_columns(w_ref, at.cta_n, ks, w_nk=w_nk),
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

            if tail_tiles:

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
                        mt.relaxed_signal(landed, device_id=peer)
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
