"""ATOMIC_GEMM_RS_P2P: GEMM + reduce-scatter in one kernel, the partial sums passed on a ring.

x [M, k] (K sharded), w [k, n] -> [M/P, n]: device d owns row block d of the sum over devices.
At step s (0 to P - 1) device d computes its partial product of row block (d - s - 1) mod P,
adds the partial sum of that block received from device d - 1 (read in the epilogue; none at
step 0) and writes each finished tile straight into slot s of device d + 1's inbox; at the last
step the block is d's own and the sum goes to the output. Each link carries one block a step.
One persistent Mosaic GPU kernel (the GEMM of `tiles`, as jax's Hopper matmul kernel walks
it) runs all steps; partial sums are added and travel in the output dtype, always in the same
order (deterministic).
Invariant: a device reads slot s - 1 only after every compute warpgroup of device d - 1 said
its stores of step s - 1 landed (one count per step: with one shared count, a CTA a step
ahead could complete the count of a step whose writes have not all landed), and each signal
follows awaited TMA stores, ordered after them (`signals.landed`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jax import lax

from commgemm.mosaic_gpu import signals
from commgemm.mosaic_gpu import tiles as mt
from commgemm.mosaic_gpu.configs import RingRSConfig


def matmul_reduce_scatter(
    x: jax.Array,
    w: jax.Array,
    axis_name: str | None,
    tiles: RingRSConfig | None = None,
    *,
    w_nk: bool = False,
    out_dtype=None,
    scale: jax.Array | None = None,
    split_accumulator: bool = False,
    compiler_params: Mapping | None = None,
) -> jax.Array:
    """x [M, k], w [k, n] ([n, k] with w_nk; both local, K sharded over axis_name) -> [M/P, n],
    this device's rows of sum_d x_d @ w_d in `out_dtype` (default x's dtype), each partial
    product times `scale` [1] float32 if given. Float8 x and w (w_nk) multiply on float8 tensor
    cores; `split_accumulator` promotes their partial sums to float32 every K-step
    (`tiles.accumulated`). axis_name None: one device (the kernel's GEMM core)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    size = mt.axis_position(axis_name)[0]
    tiles = tiles or RingRSConfig()
    dtype = x.dtype
    out_dtype = jnp.dtype(out_dtype or dtype)
    rows, k, n = mt.checked_shape(tiles, x, w, w_nk=w_nk, split=split_accumulator, owners=size)
    m_iters, n_iters, k_iters = rows // tiles.cluster_m, n // tiles.cluster_n, k // tiles.tile_k
    sms = mt.num_sms()
    signals_per_step = 2 * sms  # each compute warpgroup of each CTA signals once a step
    num_slots = mt.epilogue_slots(tiles)

    def body(x_ref, w_ref, *refs):
        scale_ref, out_ref, inbox_ref = refs if scale is not None else (None, *refs)
        received = pl.get_global(plgpu.SemaphoreType.REGULAR((max(size - 1, 1),)))
        here = mt.axis_position(axis_name)[1]
        wg = lax.axis_index("wg")
        succ = None if size == 1 else mt.peer_id(axis_name, lax.rem(here + 1, jnp.int32(size)))

        def run_step(step: int, pipeline_allocs, out_smem, added):
            block = lax.rem(here + 2 * size - step - 1, jnp.int32(size))
            last = step == size - 1
            dest = out_ref if last else plgpu.remote_ref(inbox_ref, succ).at[step]
            addend = inbox_ref.at[step - 1] if step else None

            @plgpu.nd_loop((m_iters * n_iters,), collective_axes="cluster_grid")
            def _tiles(info):
                (lin,) = info.index
                at = mt.tile_slices(tiles, lin, m_iters, n_iters)

                def tile_of(ref, epi_m, epi_n):
                    return ref.at[at.cta_m, at.cta_n].at[at.wg_m, at.wg_n].at[epi_m, epi_n]

                def finish(read):
                    acc = mt.scaled(read(), scale_ref, out_dtype)
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    for epi_m, epi_n, slot in mt.epilogue_blocks(tiles, num_slots):
                        plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                        if addend is None:
                            out_smem[wg, slot] = acc[epi_m, epi_n]
                        else:  # the received partial sum, through the slot, plus this one's
                            barrier = added.at[wg * num_slots + slot]
                            src = tile_of(addend, epi_m, epi_n)
                            plgpu.copy_gmem_to_smem(src, out_smem.at[wg, slot], barrier)
                            plgpu.barrier_wait(barrier)
                            out_smem[wg, slot] += acc[epi_m, epi_n]
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(out_smem.at[wg, slot], tile_of(dest, epi_m, epi_n))

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
                        in_flight=1,
                        last=idxs[0] == k_iters - 1,
                    )

                mt.tile_pipeline(
                    tiles, dtype, k_iters, mma_body, compute_context, release=1, w_nk=w_nk
                )(
                    x_ref.at[pl.ds(block * rows + at.m_idx * tiles.cta_m, tiles.cta_m)],
                    mt.w_columns(w_ref, at.cta_n, w_nk=w_nk),
                    allocations=pipeline_allocs,
                )

            if not last:

                @pl.when(wg < 2)
                @jax.named_scope("step_sent")
                def _sent():
                    plgpu.wait_smem_to_gmem(0, wait_read_only=False)  # the writes have landed
                    signals.landed(received.at[step], device_id=succ)

        @mt.tile_smem(
            tiles, dtype, k_iters, x_ref, w_ref, release=1, out_dtype=out_dtype, w_nk=w_nk
        )
        def _scope(pipeline_allocs, out_smem):
            @functools.partial(
                pl.run_scoped,
                added=plgpu.Barrier(num_barriers=2 * num_slots),
                collective_axes="wg",
            )
            def _steps(added):
                for step in range(size):
                    if step:  # the partial sums of this block from device d - 1 have landed
                        pl.semaphore_wait(
                            received.at[step - 1], value=signals_per_step, decrement=False
                        )
                    run_step(step, pipeline_allocs, out_smem, added)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    with jax.named_scope("fused_gemm_rs"):
        out, _ = plgpu.kernel(
            body,
            out_type=[
                jax.ShapeDtypeStruct((rows, n), out_dtype),
                jax.ShapeDtypeStruct((max(size - 1, 1), rows, n), out_dtype),  # received
            ],
            **mt.kernel_params(sms, tiles.cluster_size, compiler_params),
        )(x, w, *([] if scale is None else [scale]))
    return out
