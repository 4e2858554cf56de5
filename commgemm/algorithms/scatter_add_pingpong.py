"""ATOMIC_GEMM_RS with a ping-pong schedule (FusedTiles.pingpong): the same reduce-adds into
each tile's owner as `scatter_add_gemm`, but each compute warpgroup owns whole tiles.

In `scatter_add_gemm` (jax's Hopper matmul loop) the CTA's two compute warpgroups split one tile
and run its epilogue together, so the tensor cores idle while they convert, stage and store it:
the Mosaic GEMM ran 5 to 7% over cuBLAS where K per device is 2 to 2.5k (BENCHMARKS.md, stages
14 to 16). Here the CTA's tiles alternate between the warpgroups (tile_m x tile_n each, 128 x 128
by default), the load warpgroup fills one smem ring per compute warpgroup (`stages` deep each)
in tile order, so one warpgroup's epilogue runs while the other's K loop runs, as in CUTLASS's
ping-pong kernels. A K-step's slot is released one step late (one wgmma in flight). No 2-CTA
clusters (each CTA loads its own blocks), so it moves more from L2 per FLOP than the
clustered kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from commgemm.algorithms import mosaic_tiles as mt
from commgemm.config import FusedTiles, OverlapConfig

#: Shared memory one CTA may use (H100 / H200: 227 KiB).
SMEM_BYTES = 227 * 1024


def smem_bytes(tiles: FusedTiles, itemsize: int) -> int:
    """Shared memory of the ping-pong kernel: two rings of `stages` x and w blocks, and the
    epilogue's blocks."""
    ring = tiles.stages * (tiles.tile_m + tiles.tile_n) * tiles.tile_k * itemsize
    slots = min(2, (tiles.tile_m * tiles.tile_n) // (tiles.epi * tiles.epi))
    return 2 * ring + 2 * slots * tiles.epi * tiles.epi * itemsize


def matmul_reduce_scatter(
    x: jax.Array, w: jax.Array, axis_name: str, config: OverlapConfig
) -> jax.Array:
    """x [M, k], w [k, n] (both local; K sharded over axis_name) -> [M/P, n], this device's
    rows of sum_d x_d @ w_d, in x's dtype."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu
    from jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu import MatmulDimension

    size = lax.axis_size(axis_name)
    tiles = config.fused_tiles or FusedTiles(pingpong=True)
    dtype = x.dtype
    rows, k, n = x.shape[0] // size, x.shape[1], w.shape[1]
    tm, tn, tk, stages, epi = tiles.tile_m, tiles.tile_n, tiles.tile_k, tiles.stages, tiles.epi
    m_iters, n_iters, k_iters = rows // tm, n // tn, k // tk
    sms = mt.num_sms()
    num_tiles = size * m_iters * n_iters
    zero_steps = (rows // epi) * (n // epi) // 2  # epi x epi blocks, one per warpgroup a step
    out_smem_type, num_slots = mt.out_smem(tiles, dtype)
    adds_per_device = 2 * sms  # each compute warpgroup of each CTA signals once
    minor = MatmulDimension.M if tiles.grid_minor_m else MatmulDimension.N
    transforms = mt.smem_transforms(dtype, tk)
    i32 = jnp.int32

    def body(x_ref, w_ref, out_ref):
        zeroed = pl.get_global(plgpu.SemaphoreType.REGULAR)
        landed = pl.get_global(plgpu.SemaphoreType.REGULAR)
        here = lax.axis_index(axis_name)
        cta = lax.axis_index("cluster_grid")
        peers = [lax.rem(here + offset, i32(size)) for offset in range(size)]  # [0] is here
        local_tiles = lax.div(i32(num_tiles) - cta + i32(sms - 1), i32(sms))

        def where(i):
            """This CTA's i-th tile: the owner's offset, the block of x rows, band, column."""
            lin = cta + i * sms
            tile, offset = lin // size, lax.rem(lin, i32(size))
            m_idx, n_idx = plgpu.planar_snake(
                tile, (m_iters, n_iters), minor, tiles.grid_tile_width
            )
            return offset, lax.rem(here + offset, i32(size)), m_idx, n_idx

        @functools.partial(
            pl.run_scoped,
            x_smem=plgpu.SMEM((2, stages, tm, tk), dtype, transforms=transforms),
            w_smem=plgpu.SMEM((2, stages, tk, tn), dtype, transforms=transforms),
            produced=plgpu.Barrier(num_arrivals=2, num_barriers=2 * stages),
            consumed=plgpu.Barrier(num_arrivals=1, num_barriers=2 * stages),
            out_smem=out_smem_type,
            collective_axes="wg",
        )
        def _scope(x_smem, w_smem, produced, consumed, out_smem):
            wg = lax.axis_index("wg")

            @pl.when(wg == 2)
            def _loads():
                plgpu.set_max_registers(40, action="decrease")

                @pl.loop(0, local_tiles)
                def _tile(i):
                    _, block, m_idx, n_idx = where(i)
                    ring = lax.rem(i, i32(2))

                    @pl.loop(0, k_iters)
                    def _step(kk):
                        use = (i // 2) * k_iters + kk  # this ring's use count
                        slot = lax.rem(use, i32(stages))
                        barrier = ring * stages + slot

                        @pl.when(use >= stages)
                        def _slot_free():
                            plgpu.barrier_wait(consumed.at[barrier])

                        plgpu.copy_gmem_to_smem(
                            x_ref.at[pl.ds(block * rows + m_idx * tm, tm), pl.ds(kk * tk, tk)],
                            x_smem.at[ring, slot],
                            produced.at[barrier],
                        )
                        plgpu.copy_gmem_to_smem(
                            w_ref.at[pl.ds(kk * tk, tk), pl.ds(n_idx * tn, tn)],
                            w_smem.at[ring, slot],
                            produced.at[barrier],
                        )

            @pl.when(wg < 2)
            def _compute():
                plgpu.set_max_registers(232, action="increase")
                out_smem[wg, 0] = jnp.zeros((epi, epi), dtype)
                plgpu.commit_smem()

                @plgpu.nd_loop((zero_steps,), collective_axes="cluster_grid")
                def _zero(info):
                    (step,) = info.index
                    block = 2 * step + wg
                    bm, bn = block // (n // epi), lax.rem(block, i32(n // epi))
                    plgpu.copy_smem_to_gmem(
                        out_smem.at[wg, 0],
                        out_ref.at[pl.ds(bm * epi, epi), pl.ds(bn * epi, epi)],
                    )

                plgpu.wait_smem_to_gmem(0, wait_read_only=False)
                pl.semaphore_signal(zeroed)
                for peer in peers[1:]:
                    pl.semaphore_signal(zeroed, device_id=peer)

                @pl.loop(0, (local_tiles - wg + 1) // 2)
                def _tile(j):
                    offset, _, m_idx, n_idx = where(2 * j + wg)

                    @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tm, tn), jnp.float32))
                    def _acc_scope(acc_ref):
                        def k_step(kk, acc_ref):
                            use = j * k_iters + kk
                            slot = lax.rem(use, i32(stages))
                            plgpu.barrier_wait(produced.at[wg * stages + slot])
                            plgpu.wgmma(acc_ref, x_smem.at[wg, slot], w_smem.at[wg, slot])
                            plgpu.wgmma_wait(1)  # the previous step's wgmma is done

                            @pl.when(kk > 0)
                            def _release_previous():
                                previous = lax.rem(use - 1, i32(stages))
                                plgpu.barrier_arrive(consumed.at[wg * stages + previous])

                            return acc_ref

                        lax.fori_loop(0, k_iters, k_step, acc_ref)
                        plgpu.wgmma_wait(0)
                        last = lax.rem(j * k_iters + k_iters - 1, i32(stages))
                        plgpu.barrier_arrive(consumed.at[wg * stages + last])
                        acc = acc_ref[...].astype(dtype)

                        @pl.when(j == 0)
                        def _outputs_zeroed():
                            pl.semaphore_wait(zeroed, value=size * adds_per_device, decrement=False)

                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                        for epi_m, epi_n, slot in mt.epilogue_blocks(tiles, num_slots):
                            plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                            out_smem[wg, slot] = acc[epi_m, epi_n]
                            plgpu.commit_smem()
                            for i, peer in enumerate(peers):
                                dest = out_ref if i == 0 else plgpu.remote_ref(out_ref, peer)
                                tile = dest.at[pl.ds(m_idx * tm, tm), pl.ds(n_idx * tn, tn)]
                                plgpu.copy_smem_to_gmem(
                                    out_smem.at[wg, slot],
                                    tile.at[epi_m, epi_n],
                                    predicate=offset == i,
                                    commit_group=i == size - 1,  # one group per block
                                    reduction_op="add",
                                )

                plgpu.wait_smem_to_gmem(0, wait_read_only=False)
                for peer in peers[1:]:
                    pl.semaphore_signal(landed, device_id=peer)
                pl.semaphore_wait(landed, value=(size - 1) * adds_per_device, decrement=False)

    with jax.named_scope("fused_gemm_scatter_add_pingpong"):
        return plgpu.kernel(
            body,
            out_type=jax.ShapeDtypeStruct((rows, n), dtype),
            **mt.kernel_params(sms, 1),
        )(x, w)
