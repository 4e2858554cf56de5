"""ATOMIC_GEMM_RS: GEMM + reduce-scatter in one kernel, each tile reduce-added into its owner.

x [M, k] (K sharded), w [k, n]: device d owns rows block d, [M/P, n], of the sum over devices.
One persistent Mosaic GPU kernel walks the tiles of all P row blocks, interleaved (the P blocks'
copies of one output tile are consecutive loop steps), and stores every finished tile with a
TMA reduce-add (`cp.reduce.async.bulk .add`) straight into the owner's output, over NVLink for
the other blocks. Nothing waits for a peer between tiles, so the transfers spread over the
whole GEMM instead of following a ring's steps, and no tile reads a partial sum back.

Two handshakes make the adds safe: the output is zeroed by this kernel (each CTA its share)
and a CTA's first add waits until every device has signalled that its zeroing landed; at the
end each device waits until every peer has signalled that its adds landed. Partial sums are
added in the output dtype (bf16/fp16) at the owner, in arrival order.

`epilogue="add"` is the kernel. Diagnostics that give wrong sums, for timing the kernel's
parts (benchmarks/probe.py): "local-add" (every tile reduce-added into this device's output,
no NVLink), "store" (every tile stored plainly here: the bare GEMM loop), "remote-store"
(plain stores to the owner). Tried and dropped (BENCHMARKS.md): plain own stores with the
peer's add of a tile waiting for that store, both copies of a tile in the same step (stage 14,
commit 5c3e0f1: 10 to 15% slower) or the own tiles two waves ahead (stage 16, commit a87e7e7:
2 to 5% slower); rotating the CTAs through the blocks and whole-tile epilogue buffers (stage
15, commit b0b290f: no change); a ping-pong schedule, whole 128 x 128 tiles per compute
warpgroup fed from one smem ring each, one's epilogue under the other's K loop (stage 23,
commit 537cbb7: 1.35 to 1.37x the bound against 1.10 to 1.14 here, 3 stages a ring; 2 stages
2.2 to 2.4x).

Requirements as for the ring kernels (`fused.unsupported_reason`). The GEMM loop follows jax's
Hopper matmul kernel (`hopper_matmul_mgpu.kernel`), whose tiling config it takes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from commgemm.algorithms import mosaic_tiles as mt
from commgemm.config import FusedTiles, OverlapConfig

EPILOGUES = ("add",)
PROBES = ("local-add", "store", "remote-store")


def matmul_reduce_scatter(
    x: jax.Array,
    w: jax.Array,
    axis_name: str,
    config: OverlapConfig,
    *,
    epilogue: str = "add",
) -> jax.Array:
    """x [M, k], w [k, n] (both local; K sharded over axis_name) -> [M/P, n], this device's
    rows of sum_d x_d @ w_d, in x's dtype. `epilogue`: the module docstring."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    size = lax.axis_size(axis_name)
    tiles = config.fused_tiles or FusedTiles()
    dtype = x.dtype
    rows, k, n = x.shape[0] // size, x.shape[1], w.shape[1]
    epi = tiles.epi
    m_iters, n_iters, k_iters = rows // tiles.cluster_m, n // tiles.cluster_n, k // tiles.tile_k
    sms = mt.num_sms()
    cluster = tiles.cluster_size
    num_tiles = size * m_iters * n_iters
    if tiles.chain_tiles and num_tiles < 2 * (sms // cluster):
        raise ValueError(
            f"FusedTiles.chain_tiles needs two tiles per CTA, got {num_tiles} tiles for "
            f"{sms // cluster} CTAs"
        )
    # epi x epi blocks to zero, two per CTA (one per compute warpgroup) in each loop step
    zero_steps = (rows // epi) * (n // epi) // (2 * cluster)
    num_slots = mt.epilogue_slots(tiles)
    adds_per_device = 2 * sms  # each compute warpgroup of each CTA signals once
    if epilogue not in EPILOGUES + PROBES:
        raise ValueError(f"epilogue={epilogue!r} must be one of {EPILOGUES + PROBES}")
    zeroes = epilogue in ("add", "local-add")  # the output is zeroed, then added into

    def get_pipeline(body, compute_context, state=None):
        return mt.tile_pipeline(
            tiles, dtype, k_iters, body, compute_context, release=tiles.release_lag, state=state
        )

    def body(x_ref, w_ref, out_ref):
        zeroed = pl.get_global(plgpu.SemaphoreType.REGULAR)
        landed = pl.get_global(plgpu.SemaphoreType.REGULAR)
        here = lax.axis_index(axis_name)
        in_cluster = lax.axis_index("cluster")
        # peers[0] is here
        peers = [lax.rem(here + offset, jnp.int32(size)) for offset in range(size)]

        @mt.tile_smem(tiles, dtype, k_iters, x_ref, w_ref, release=tiles.release_lag)
        def _scope(pipeline_allocs, out_smem):
            wg = lax.axis_index("wg")

            if zeroes:

                @pl.when(wg < 2)
                def _zero_output():
                    out_smem[wg, 0] = jnp.zeros((epi, epi), dtype)
                    plgpu.commit_smem()

                    @plgpu.nd_loop((zero_steps,), collective_axes="cluster_grid")
                    def _zero(info):
                        (step,) = info.index
                        block = 2 * (step * cluster + in_cluster) + wg
                        bm, bn = block // (n // epi), lax.rem(block, jnp.int32(n // epi))
                        plgpu.copy_smem_to_gmem(
                            out_smem.at[wg, 0],
                            out_ref.at[pl.ds(bm * epi, epi), pl.ds(bn * epi, epi)],
                        )

                    plgpu.wait_smem_to_gmem(0, wait_read_only=False)
                    pl.semaphore_signal(zeroed)
                    for peer in peers[1:]:
                        pl.semaphore_signal(zeroed, device_id=peer)

            @plgpu.nd_loop((num_tiles,), collective_axes="cluster_grid")
            def _tiles(info):
                (lin,) = info.index
                tile, offset = lin // size, lax.rem(lin, jnp.int32(size))
                # the device owning this tile's rows
                block = lax.rem(here + offset, jnp.int32(size))
                at = mt.tile_slices(tiles, tile, m_iters, n_iters)

                def tile_of(ref, epi_m, epi_n):
                    return ref.at[at.cta_m, at.cta_n].at[at.wg_m, at.wg_n].at[epi_m, epi_n]

                def store(src, dest, predicate=None, commit=True, add=True):
                    plgpu.copy_smem_to_gmem(
                        src,
                        dest,
                        predicate=predicate,
                        commit_group=commit,
                        reduction_op="add" if add else None,
                    )

                def compute_context(eval_pipeline):
                    @functools.partial(
                        pl.run_scoped, acc_ref=plgpu.ACC((tiles.tile_m, tiles.tile_n), jnp.float32)
                    )
                    def _acc_scope(acc_ref):
                        eval_pipeline(acc_ref)
                        acc = acc_ref[...].astype(dtype)
                        if zeroes:

                            @pl.when(info.local_index == 0)
                            def _outputs_zeroed():
                                pl.semaphore_wait(
                                    zeroed, value=size * adds_per_device, decrement=False
                                )

                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                        for epi_m, epi_n, slot in mt.epilogue_blocks(tiles, num_slots):
                            plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                            out_smem[wg, slot] = acc[epi_m, epi_n]
                            plgpu.commit_smem()
                            src = out_smem.at[wg, slot]
                            if epilogue in ("local-add", "store"):
                                store(
                                    src,
                                    tile_of(out_ref, epi_m, epi_n),
                                    add=epilogue == "local-add",
                                )
                                continue
                            for i, peer in enumerate(peers):
                                dest = out_ref if i == 0 else plgpu.remote_ref(out_ref, peer)
                                store(
                                    src,
                                    tile_of(dest, epi_m, epi_n),
                                    predicate=offset == i,
                                    commit=i == size - 1,  # one group per block
                                    add=epilogue == "add",
                                )

                def mma_body(_, a_smem, b_smem, acc_ref):
                    plgpu.wgmma(acc_ref, a_smem.at[at.wg_m], b_smem.at[:, at.wg_n])
                    plgpu.wgmma_wait(tiles.release_lag)
                    return acc_ref

                state = mt.chain_state(info) if tiles.chain_tiles else None
                get_pipeline(mma_body, compute_context, state)(
                    x_ref.at[pl.ds(block * rows + at.m_idx * tiles.cta_m, tiles.cta_m), :],
                    w_ref.at[:, at.cta_n],
                    allocations=pipeline_allocs,
                )

            @pl.when(wg < 2)
            def _adds_landed():
                plgpu.wait_smem_to_gmem(0, wait_read_only=False)
                if epilogue in ("local-add", "store"):
                    return
                for peer in peers[1:]:
                    pl.semaphore_signal(landed, device_id=peer)
                pl.semaphore_wait(landed, value=(size - 1) * adds_per_device, decrement=False)

    with jax.named_scope("fused_gemm_scatter_add"):
        return plgpu.kernel(
            body,
            out_type=jax.ShapeDtypeStruct((rows, n), dtype),
            **mt.kernel_params(sms, cluster),
        )(x, w)
