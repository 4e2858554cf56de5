"""ATOMIC_GEMM_RS: GEMM + reduce-scatter in one kernel, each tile reduce-added into its owner.

x [M, k] (K sharded), w [k, n]: device d owns rows block d, [M/P, n], of the sum over devices.
One persistent Mosaic GPU kernel walks the tiles of all P row blocks, interleaved (own block,
block d+1, ..., block d+P-1, then the next tile of each), and stores every finished tile with
a TMA reduce-add (`cp.reduce.async.bulk .add`) straight into the owner's output, over NVLink
for the other blocks. Nothing waits for a peer between tiles, so the transfers spread over the
whole GEMM instead of following a ring's steps, and no tile reads a partial sum back.

Two handshakes make the adds safe: the output is zeroed by this kernel (each CTA its share,
the stores issued before its first tile and awaited at that tile's epilogue) and a CTA's first
add waits until every device has signalled that its zeroing landed; at the end each device
waits until every peer has signalled that its adds landed. Partial sums are
added in the output dtype (bf16/fp16) at the owner, in arrival order.

Requirements as for the ring kernels (`fused.unsupported_reason`). The GEMM loop follows jax's
Hopper matmul kernel (`hopper_matmul_mgpu.kernel`), whose tiling config it takes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from commgemm.config import FusedTiles, OverlapConfig


def num_sms() -> int:
    """Streaming multiprocessors of this process's first device (the kernels' grid)."""
    return jax.devices()[0].core_count


def matmul_reduce_scatter(
    x: jax.Array,
    w: jax.Array,
    axis_name: str,
    config: OverlapConfig,
) -> jax.Array:
    """x [M, k], w [k, n] (both local; K sharded over axis_name) -> [M/P, n], this device's
    rows of sum_d x_d @ w_d, in x's dtype."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu
    from jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu import MatmulDimension

    size = lax.axis_size(axis_name)
    tiles = config.fused_tiles or FusedTiles()
    dtype = x.dtype
    rows, k, n = x.shape[0] // size, x.shape[1], w.shape[1]
    tile_m, tile_n, tile_k, epi = tiles.tile_m, tiles.tile_n, tiles.tile_k, tiles.epi
    cta_m, cta_n = tiles.cta_m, tiles.cta_n
    m_iters, n_iters, k_iters = rows // cta_m, n // cta_n, k // tile_k
    zero_pairs = (rows // epi) * (n // epi) // 2  # epi x epi blocks, two per CTA step
    num_tiles = size * m_iters * n_iters
    sms = num_sms()
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(tile_k * itemsize * 8)
    in_transforms = (
        plgpu.TilingTransform((8, swizzle // itemsize)),
        plgpu.SwizzleTransform(swizzle),
    )
    out_swizzle = plgpu.find_swizzle(epi * itemsize * 8)
    out_transforms = (
        plgpu.TilingTransform((8, out_swizzle // itemsize)),
        plgpu.SwizzleTransform(out_swizzle),
    )
    num_slots = min(2, (tile_m * tile_n) // (epi * epi))
    minor = MatmulDimension.M if tiles.grid_minor_m else MatmulDimension.N
    adds_per_device = 2 * sms  # each compute warpgroup of each CTA signals once

    def get_pipeline(body, compute_context):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(k_iters,),
            memory_registers=40,
            in_specs=[
                plgpu.BlockSpec(
                    (cta_m, tile_k),
                    lambda kk: (0, kk),
                    transforms=in_transforms,
                    memory_space=plgpu.SMEM,
                ),
                plgpu.BlockSpec(
                    (tile_k, cta_n),
                    lambda kk: (kk, 0),
                    transforms=in_transforms,
                    memory_space=plgpu.SMEM,
                ),
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=tiles.stages,
            compute_context=compute_context,
        )

    def body(x_ref, w_ref, out_ref):
        zeroed = pl.get_global(plgpu.SemaphoreType.REGULAR)
        landed = pl.get_global(plgpu.SemaphoreType.REGULAR)
        here = lax.axis_index(axis_name)
        peers = [lax.rem(here + offset, size) for offset in range(size)]  # peers[0] is here
        ignore = lambda *_, **__: None  # noqa: E731

        @functools.partial(
            pl.run_scoped,
            pipeline_allocs=get_pipeline(ignore, ignore).get_allocations(x_ref, w_ref),
            out_smem=plgpu.SMEM((2, num_slots, epi, epi), dtype, transforms=out_transforms),
            collective_axes="wg",
        )
        def _scope(pipeline_allocs, out_smem):
            wg = lax.axis_index("wg")

            def signal_zeroed():  # this warpgroup's zero stores have landed
                plgpu.wait_smem_to_gmem(0, wait_read_only=False)
                pl.semaphore_signal(zeroed)
                for peer in peers[1:]:
                    pl.semaphore_signal(zeroed, device_id=peer)

            @pl.when(wg < 2)
            def _zero_output():  # issued here, awaited at the first tile's epilogue
                out_smem[wg, 0] = jnp.zeros((epi, epi), dtype)
                plgpu.commit_smem()

                @plgpu.nd_loop((zero_pairs,), collective_axes="cluster_grid")
                def _zero(info):
                    (pair,) = info.index
                    block = 2 * pair + wg
                    bm, bn = block // (n // epi), lax.rem(block, n // epi)
                    plgpu.copy_smem_to_gmem(
                        out_smem.at[wg, 0], out_ref.at[pl.ds(bm * epi, epi), pl.ds(bn * epi, epi)]
                    )

            @plgpu.nd_loop((num_tiles,), collective_axes="cluster_grid")
            def _tiles(info):
                (lin,) = info.index
                offset = lax.rem(lin, size)
                block = lax.rem(here + offset, size)  # the device owning this tile's rows
                m_idx, n_idx = plgpu.planar_snake(
                    lin // size, (m_iters, n_iters), minor, tiles.grid_tile_width
                )
                cta_m_slice = pl.ds(m_idx * cta_m, cta_m)
                cta_n_slice = pl.ds(n_idx * cta_n, cta_n)
                if tiles.wg_along_m:
                    wg_m_slice, wg_n_slice = pl.ds(wg * tile_m, tile_m), slice(None)
                else:
                    wg_m_slice, wg_n_slice = slice(None), pl.ds(wg * tile_n, tile_n)

                def compute_context(eval_pipeline):
                    @functools.partial(
                        pl.run_scoped, acc_ref=plgpu.ACC((tile_m, tile_n), jnp.float32)
                    )
                    def _acc_scope(acc_ref):
                        eval_pipeline(acc_ref)
                        acc = acc_ref[...].astype(dtype)

                        @pl.when(info.local_index == 0)
                        def _outputs_zeroed():
                            signal_zeroed()
                            pl.semaphore_wait(zeroed, value=size * adds_per_device, decrement=False)

                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                        for epi_mi in range(tile_m // epi):
                            for epi_ni in range(tile_n // epi):
                                epi_m = slice(epi_mi * epi, (epi_mi + 1) * epi)
                                epi_n = slice(epi_ni * epi, (epi_ni + 1) * epi)
                                slot = (epi_mi * (tile_n // epi) + epi_ni) % num_slots
                                plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                                out_smem[wg, slot] = acc[epi_m, epi_n]
                                plgpu.commit_smem()
                                for i, peer in enumerate(peers):
                                    dest = out_ref if i == 0 else plgpu.remote_ref(out_ref, peer)
                                    plgpu.copy_smem_to_gmem(
                                        out_smem.at[wg, slot],
                                        dest.at[cta_m_slice, cta_n_slice]
                                        .at[wg_m_slice, wg_n_slice]
                                        .at[epi_m, epi_n],
                                        predicate=offset == i,
                                        commit_group=i == size - 1,  # one group per block
                                        reduction_op="add",
                                    )

                def mma_body(_, a_smem, b_smem, acc_ref):
                    plgpu.wgmma(acc_ref, a_smem.at[wg_m_slice], b_smem.at[:, wg_n_slice])
                    plgpu.wgmma_wait(0)
                    return acc_ref

                get_pipeline(mma_body, compute_context)(
                    x_ref.at[pl.ds(block * rows + m_idx * cta_m, cta_m), :],
                    w_ref.at[:, cta_n_slice],
                    allocations=pipeline_allocs,
                )

            @pl.when((wg < 2) & (lax.axis_index("cluster_grid") >= num_tiles))
            def _no_tiles():  # the others wait for every CTA's zeroing
                signal_zeroed()

            @pl.when(wg < 2)
            def _adds_landed():
                plgpu.wait_smem_to_gmem(0, wait_read_only=False)
                for peer in peers[1:]:
                    pl.semaphore_signal(landed, device_id=peer)
                pl.semaphore_wait(landed, value=(size - 1) * adds_per_device, decrement=False)

    with jax.named_scope("fused_gemm_scatter_add"):
        return plgpu.kernel(
            body,
            out_type=jax.ShapeDtypeStruct((rows, n), dtype),
            grid=(sms,),
            grid_names=("cluster_grid",),
            cluster=(1,),
            cluster_names=("cluster",),
            num_threads=3,  # two compute warpgroups and one that issues the loads
            thread_name="wg",
            compiler_params=plgpu.CompilerParams(
                lowering_semantics=plgpu.LoweringSemantics.Warpgroup
            ),
        )(x, w)
