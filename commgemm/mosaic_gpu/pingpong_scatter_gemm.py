"""ATOMIC_GEMM_RS on the ping-pong schedule: GEMM + reduce-scatter in one kernel, each compute
warpgroup a whole output tile, its epilogue under the other's K loop.

x [M, k] (K sharded), w [k, n] -> [M/P, n]: device d owns row block d of the sum over devices,
as in `scatter_add_gemm` (the P copies of one output tile in consecutive units, each stored by
a TMA reduce-add straight into its owner's output, over NVLink for the peers'). The schedule is
CUTLASS's ping-pong (and cuBLASLt's kernel for these shapes): a persistent CTA's two compute
warpgroups take its tiles in turn, each a whole tile_m x tile_n tile; one load warpgroup fills
ONE ring of smem slots in tile order; each compute warpgroup awaits only its own tiles' slots
(one barrier array each) and their K loops alternate (an ordered barrier pair), so while one
runs its epilogue the other keeps the tensor cores busy. The two epilogues alternate too, so
they share one buffer of EPI rows (a barrier pair hands it over once a warpgroup's stores have
read it), which leaves shared memory for 5 stages of 128 x 192 tiles. The last column of tiles
may be partial: TMA zero-fills the loads past n and clips the stores.
Invariant (P > 1): a tile is added into only after every device zeroed it. The compute
warpgroups zero the tiles of the first `zero_ahead` waves of CTAs (all when 0) before their
first tile; the load warpgroups zero wave j + D's tiles between wave j's loads, one semaphore
a wave, as `scatter_add_gemm` does (`scatter_add_gemm.wave_tiles`). Every signal follows
awaited TMA stores, so it is a relaxed atomic (`tiles.relaxed_signal`); at the end each
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

from commgemm.config import OverlapConfig
from commgemm.mosaic_gpu import tiles as mt
from commgemm.mosaic_gpu.configs import EPI, HOPPER_SMEM, ZERO_ROWS, PingPongRSConfig
from commgemm.mosaic_gpu.scatter_add_gemm import signal_devices, wave_tiles


def _swizzle_columns(dtype, tile_n: int) -> int:
    """Columns of the TMA tiling of a tile of tile_n columns of `dtype` (its smem swizzle)."""
    return mt.smem_transforms(dtype, tile_n)[0].tiling[1]


def shape_reason(tiles: PingPongRSConfig, rows: int, k: int, n: int, dtype, *, w_nk: bool,
                 out_dtype=None) -> str | None:  # fmt: skip
    """Why the kernel cannot multiply `rows` rows per device (of each owner's block), K `k` and
    `n` columns of `dtype` in `tiles` (w read [n, K] with `w_nk`), or None."""
    itemsize = jnp.dtype(dtype).itemsize
    if rows % tiles.cluster_m:
        return f"rows per device={rows} must be divisible by the tile {tiles.cluster_m}"
    if k % tiles.tile_k:
        return f"K={k} must be divisible by the tile {tiles.tile_k}"
    if tiles.tile_k * itemsize % 128:
        return f"tile_k={tiles.tile_k} must be whole 128-byte rows of {jnp.dtype(dtype).name}"
    if not w_nk and tiles.tile_n * itemsize % 128:
        return (f"tile_n={tiles.tile_n} with w read [K, n] must be whole 128-byte rows of "
                f"{jnp.dtype(dtype).name} (its smem swizzle)")  # fmt: skip
    out_dtype = jnp.dtype(out_dtype or dtype)
    for what, of in (("the output", out_dtype), *(() if w_nk else (("w [K, n]", dtype),))):
        minor = _swizzle_columns(of, tiles.tile_n)
        if n % minor:
            return f"N={n} must be whole {minor}s (the TMA tiling of {what}'s tiles)"
    smem = tiles.smem_bytes(itemsize, out_dtype.itemsize)
    if smem > HOPPER_SMEM:
        return f"its {tiles.stages} stages and epilogue buffer take {smem} bytes of shared memory"
    return None


def matmul_reduce_scatter(
    x: jax.Array,
    w: jax.Array,
    axis_name: str | None,
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
    float8 tensor cores with fast accumulation (`split_accumulator` is refused: a second
    accumulator does not fit beside a whole tile's). axis_name None: one device."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu
    from jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu import MatmulDimension

    size = mt.axis_position(axis_name)[0]
    tiles = config.kernel
    if not isinstance(tiles, PingPongRSConfig):
        raise ValueError(f"kernel={tiles!r} is not a PingPongRSConfig")
    if split_accumulator:
        raise ValueError("PingPongRSConfig takes no split accumulation (two accumulators of a "
                         "whole tile do not fit in a warpgroup's registers)")  # fmt: skip
    if x.shape[0] % size:
        raise ValueError(f"rows={x.shape[0]} must be divisible by the {size} devices")
    dtype = x.dtype
    out_dtype = jnp.dtype(out_dtype or dtype)
    rows, k, n = x.shape[0] // size, x.shape[1], w.shape[0 if w_nk else 1]
    if reason := shape_reason(tiles, rows, k, n, dtype, w_nk=w_nk, out_dtype=out_dtype):
        raise ValueError(f"PingPongRSConfig: {reason}")
    tile_m, tile_n, tile_k, stages = tiles.tile_m, tiles.tile_n, tiles.tile_k, tiles.stages
    pair = tiles.cluster_size
    m_pairs, n_iters, k_iters = rows // tiles.cluster_m, -(-n // tile_n), k // tile_k
    sms = mt.num_sms()
    ctas = sms // pair
    per_block = m_pairs * n_iters
    units = size * per_block
    reduce = size > 1
    # the compute warpgroups zero the tiles of the first `ahead` waves; the load warpgroups the
    # others', `ahead` waves early (late_zero)
    waves = -(-units // ctas)
    ahead = min(tiles.zero_ahead, waves) if tiles.zero_ahead else waves
    late_zero = reduce and ahead < waves
    first_tiles = wave_tiles(ahead - 1, ctas, units, size, per_block, 0)[1]
    bands = tiles.cluster_m // ZERO_ROWS  # the load warpgroups zero a band at a time
    spans = [wave_tiles(w, ctas, units, size, per_block, 0) for w in range(ahead, waves)]
    late_iters = max([-(-(hi - lo) * bands // sms) for lo, hi in spans], default=0)
    zero_columns = tiles.zero_columns
    signals = 2 * sms  # each compute warpgroup of each CTA signals each device once
    minor = MatmulDimension.M if tiles.grid_minor_m else MatmulDimension.N
    transforms = mt.smem_transforms(dtype, tile_k)
    w_block = (tile_n, tile_k) if w_nk else (tile_k, tile_n)
    w_transforms = transforms if w_nk else mt.smem_transforms(dtype, tile_n)
    out_transforms = mt.smem_transforms(out_dtype, tile_n)

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
        mine = (units - cid + ctas - 1) // ctas  # this CTA's units: cid, cid + ctas, ...
        # peers[0] is here
        peers = [mt.peer_id(axis_name, lax.rem(here + offset, jnp.int32(size)))
                 for offset in range(size)]  # fmt: skip

        def tile_origin(tile):
            """(first row, first column) of cluster tile `tile` in an owner's output: tiles
            walked in bands (`plgpu.planar_snake`)."""
            m_pair, n_idx = plgpu.planar_snake(
                tile, (m_pairs, n_iters), minor, tiles.grid_tile_width
            )
            return m_pair * tiles.cluster_m, n_idx * tile_n

        def where(i):
            """(x's first row, the output's first row and column, the owner's distance) of this
            CTA's i-th unit: the P owners' copies of a tile consecutive."""
            lin = cid + i * ctas
            tile, offset = lin // size, lax.rem(lin, jnp.int32(size))
            row0, col0 = tile_origin(tile)
            row = row0 + in_cluster * tile_m
            block = lax.rem(here + offset, jnp.int32(size))
            return block * rows + row, row, col0, offset

        signal_every_device = functools.partial(signal_devices, peers=peers)

        def scoped(x_smem, w_smem, full0, full1, empty, out_smem, *rest):
            wg = lax.axis_index("wg")
            full, order, free = (full0, full1), rest[0:2], rest[2:4]
            zero_smem = rest[4] if late_zero else None

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
                        plgpu.copy_smem_to_gmem(zero_smem, dest, predicate=unit < end)

            def zero_waves_ahead(i):
                """The load warpgroup before its i-th tile's loads: signals that its share of
                the wave it zeroed last landed, and zeroes its share of wave i + ahead."""
                pending = i - 1 + ahead

                @pl.when((i >= 1) & (pending < waves))
                @jax.named_scope("ahead_signal")
                def _signal():
                    plgpu.wait_smem_to_gmem(0, wait_read_only=False)
                    signal_every_device(zeroed_waves.at[pending])

                pl.when(i + ahead < waves)(jax.named_scope("ahead_zero")(
                    lambda: zero_wave(i + ahead)))  # fmt: skip

            def issue(c, s):  # step s's loads, into the slots of compute warpgroup c
                i, kk, slot = s // k_iters, lax.rem(s, jnp.int32(k_iters)), s % stages
                x_row, _, col, _ = where(i)
                ks = pl.ds(kk * tile_k, tile_k)
                plgpu.copy_gmem_to_smem(
                    x_ref.at[pl.ds(x_row, tile_m), ks], x_smem.at[slot], full[c].at[slot]
                )
                cols = pl.ds(col, tile_n)
                src = w_ref.at[cols, ks] if w_nk else w_ref.at[ks, cols]
                shared = dict(collective_axes="cluster") if pair > 1 else {}
                plgpu.copy_gmem_to_smem(src, w_smem.at[slot], full[c].at[slot], **shared)

            def load():
                plgpu.set_max_registers(40, action="decrease")
                if late_zero:
                    zero_smem[...] = jnp.zeros((ZERO_ROWS, zero_columns), out_dtype)
                    plgpu.commit_smem()

                @pl.loop(0, mine * k_iters)
                def _step(s):
                    if late_zero:
                        pl.when(lax.rem(s, jnp.int32(k_iters)) == 0)(
                            lambda: zero_waves_ahead(s // k_iters))  # fmt: skip

                    @pl.when(s >= stages)
                    def _():
                        plgpu.barrier_wait(empty.at[s % stages])

                    for c in (0, 1):
                        pl.when((s // k_iters) % 2 == c)(functools.partial(issue, c, s))

                if late_zero:  # the last wave it zeroed

                    @pl.when(mine - 1 + ahead < waves)
                    def _last_wave_zeroed():
                        plgpu.wait_smem_to_gmem(0, wait_read_only=False)
                        signal_every_device(zeroed_waves.at[mine - 1 + ahead])

            def store(src, dest, predicate=None, commit=True):
                plgpu.copy_smem_to_gmem(src, dest, predicate=predicate, commit_group=commit,
                                        reduction_op="add" if reduce else None)  # fmt: skip

            @jax.named_scope("zero")
            def zero_output():
                """This CTA's share of the first waves' tiles, in blocks of the epilogue buffer
                (zeros)."""
                out_smem[...] = jnp.zeros((EPI, tile_n), out_dtype)
                plgpu.commit_smem()
                per_tile = tiles.cluster_m // EPI
                blocks = first_tiles * per_tile

                @pl.loop(0, -(-blocks // (2 * sms)))
                def _block(j):
                    unit = 2 * cta + wg + j * 2 * sms
                    tile, r = divmod(jnp.minimum(unit, blocks - 1), per_tile)
                    row0, col0 = tile_origin(tile)
                    dest = out_ref.at[pl.ds(row0 + r * EPI, EPI), pl.ds(col0, tile_n)]
                    plgpu.copy_smem_to_gmem(out_smem, dest, predicate=unit < blocks)

                plgpu.wait_smem_to_gmem(0, wait_read_only=False)
                signal_every_device(zeroed)

            def epilogue(c, i, acc_ref):
                _, row, col, offset = where(i)

                @pl.when(i > 0)
                def _():  # the other warpgroup's stores have read the shared buffer
                    plgpu.barrier_wait(free[c])

                if reduce:

                    @pl.when(i < 2)
                    def _():  # before this warpgroup's first adds: the first waves zeroed
                        pl.semaphore_wait(zeroed, value=size * signals, decrement=False)

                if late_zero:

                    @pl.when(i >= ahead)
                    def _():  # this tile's wave zeroed on every device
                        pl.semaphore_wait(zeroed_waves.at[i], value=size * sms, decrement=False)

                for r in range(tile_m // EPI):
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    out_smem[...] = mt.scaled(acc_ref[r * EPI : (r + 1) * EPI], scale_ref,
                                              out_dtype)  # fmt: skip
                    plgpu.commit_smem()
                    at = (pl.ds(row + r * EPI, EPI), pl.ds(col, tile_n))
                    for p, peer in enumerate(peers):
                        dest = out_ref if p == 0 else plgpu.remote_ref(out_ref, peer)
                        store(out_smem, dest.at[at], predicate=offset == p, commit=p == size - 1)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                plgpu.barrier_arrive(free[1 - c])

            def tile(c, i):
                def kstep(kk, acc):
                    s = i * k_iters + kk
                    plgpu.barrier_wait(full[c].at[s % stages])
                    rhs = w_smem.at[s % stages]
                    plgpu.wgmma(acc, x_smem.at[s % stages], rhs.T if w_nk else rhs)
                    plgpu.wgmma_wait(1)

                    @pl.when(kk > 0)
                    def _():  # the previous step's wgmma is done with its slot
                        plgpu.barrier_arrive(empty.at[(s - 1) % stages])

                    return acc

                def acc_scope(acc_ref):
                    @pl.when(i > 0)
                    def _():  # the K loops alternate: the other's was issued
                        plgpu.barrier_wait(order[c])

                    lax.fori_loop(0, k_iters, kstep, acc_ref)
                    plgpu.barrier_arrive(order[1 - c])
                    plgpu.wgmma_wait(0)
                    plgpu.barrier_arrive(empty.at[(i * k_iters + k_iters - 1) % stages])
                    with jax.named_scope("epilogue"):
                        epilogue(c, i, acc_ref)

                pl.run_scoped(acc_scope, plgpu.ACC((tile_m, tile_n), jnp.float32))

            def compute(c):
                plgpu.set_max_registers(232, action="increase")
                if reduce:
                    zero_output()
                pl.loop(c, mine, step=2)(functools.partial(tile, c))
                plgpu.wait_smem_to_gmem(0, wait_read_only=False)
                if reduce:
                    with jax.named_scope("landed"):
                        for peer in peers[1:]:
                            mt.relaxed_signal(landed, device_id=peer)
                        pl.semaphore_wait(landed, value=(size - 1) * signals, decrement=False)

            pl.when(wg == 2)(load)
            for c in (0, 1):
                pl.when(wg == c)(functools.partial(compute, c))

        pl.run_scoped(
            scoped,
            plgpu.SMEM((stages, tile_m, tile_k), dtype, transforms=transforms),
            plgpu.SMEM((stages, *w_block), w.dtype, transforms=w_transforms),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            plgpu.ClusterBarrier(collective_axes=("cluster",), num_barriers=stages)
            if pair > 1
            else plgpu.Barrier(num_arrivals=1, num_barriers=stages),
            plgpu.SMEM((EPI, tile_n), out_dtype, transforms=out_transforms),
            *[plgpu.Barrier(num_arrivals=1) for _ in range(4)],
            *([plgpu.SMEM((ZERO_ROWS, zero_columns), out_dtype)] if late_zero else []),
            collective_axes="wg",
        )

    with jax.named_scope("fused_gemm_scatter_add_pingpong"):
        return plgpu.kernel(
            body,
            out_type=jax.ShapeDtypeStruct((rows, n), out_dtype),
            **mt.kernel_params(sms, pair, compiler_params),
        )(x, w, *([] if scale is None else [scale]))
