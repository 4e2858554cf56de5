"""Ring collectives as Pallas TPU kernels with remote DMA: all-gather (one way or both ways),
reduce-scatter and all-reduce over one mesh axis (the other axes fixed, so a 2-D mesh runs a
ring per row). Per-shard functions, called inside `jax.shard_map`.

Invariants: every step has its own receive semaphore, or a slot of a double buffer guarded by
a credit (the receiver signals the sender when it has read the slot), so a fast neighbour's
next block can never satisfy this step's byte-counted wait; a device writes into a peer only
after the start barrier (`common.barrier`); every semaphore is back at zero when the kernel
ends.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from commgemm.pallas_tpu.common import Ring, barrier, dma, pallas_call, signal
from commgemm.vma import out_struct


def _steps(size: int, bidirectional: bool) -> tuple[int, int]:
    return (size // 2, (size - 1) // 2) if bidirectional else (size - 1, 0)


def all_gather(
    x: jax.Array,
    axis_name: str,
    *,
    bidirectional: bool = False,
    interpret: bool = False,
    race_check: bool = False,
    with_barrier: bool = True,
    invariant_over: tuple[str, ...] = (),
) -> jax.Array:
    """x [m, K] local -> [P*m, K], the blocks in device order (`lax.all_gather(tiled=True)`;
    typed as varying over the axis as that is, or invariant with invariant_over=(axis,)).

    Step t sends the block that arrived last (this device's own at t = 0) to the next device
    (and, both ways, the previous one); each step's blocks land in their place of the output.
    """
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    size = lax.axis_size(axis_name)
    ring = Ring(axis_name, size)
    m, k = x.shape
    n_fwd, n_bwd = _steps(size, bidirectional)

    def kernel(x_ref, o_ref, local_sem, send_sems, recv_sems):
        barrier(ring, (1, -1), enabled=with_barrier)
        me = ring.index()
        local = pltpu.make_async_copy(x_ref, o_ref.at[pl.ds(me * m, m)], local_sem)
        local.start()
        local.wait()
        for t in range(n_fwd):
            moves = []
            for way, shift, steps in ((0, 1, n_fwd), (1, -1, n_bwd)):
                if t < steps:
                    src = ring.neighbour(-shift * t)
                    block = o_ref.at[pl.ds(src * m, m)]
                    moves.append(
                        dma(
                            block,
                            block,
                            send_sems.at[way],
                            recv_sems.at[way, t],
                            ring.device(ring.neighbour(shift)),
                        )
                    )
            for move in moves:
                move.start()
            for move in moves:
                move.wait_send()
                move.wait_recv()

    return pallas_call(
        kernel,
        ring,
        out_shape=out_struct((size * m, k), x.dtype, (x,), invariant_over=invariant_over),
        in_memory=["hbm"],
        out_memory=["hbm"],
        scratch=[
            pltpu.SemaphoreType.DMA,
            pltpu.SemaphoreType.DMA((2,)),
            pltpu.SemaphoreType.DMA((2, max(n_fwd, 1))),
        ],
        interpret=interpret,
        race_check=race_check,
    )(x)


def reduce_scatter(
    x: jax.Array,
    axis_name: str,
    *,
    out_dtype=None,
    interpret: bool = False,
    race_check: bool = False,
    with_barrier: bool = True,
) -> jax.Array:
    """x [P*r, n] this device's partial sums -> [r, n], this device's rows of the sum over the
    axis (`lax.psum_scatter(tiled=True)`). A chain of partial sums runs round the ring: at step
    t a device adds its rows of block (d - t - 1) mod P to what it received and passes the sum
    on; float32 accumulation, sums travel in x's dtype, the result in `out_dtype` (x's)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    size = lax.axis_size(axis_name)
    ring = Ring(axis_name, size)
    r, n = x.shape[0] // size, x.shape[1]
    out_dtype = jnp.dtype(out_dtype or x.dtype)

    def kernel(x_ref, o_ref, recv, send, block, local_sem, send_sem, recv_sems, credit):
        recv[...] = jnp.zeros_like(recv)  # this device's receive slots, before the barrier
        barrier(ring, (1, -1), enabled=with_barrier)
        right, left = ring.device(ring.neighbour(1)), ring.device(ring.neighbour(-1))
        for t in range(size):
            b = ring.neighbour(-t - 1)
            local = pltpu.make_async_copy(x_ref.at[pl.ds(b * r, r)], block, local_sem)
            local.start()
            local.wait()
            acc = block[...].astype(jnp.float32)
            if t:
                slot = (t - 1) % 2
                dma(send, recv.at[slot], send_sem, recv_sems.at[slot], right).wait_recv()
                acc = acc + recv[slot].astype(jnp.float32)
                if t <= size - 3:  # the left neighbour sends into this slot again
                    signal(credit, left)
            if t == size - 1:
                o_ref[...] = acc.astype(out_dtype)
                break
            send[...] = acc.astype(send.dtype)
            if t >= 2:
                pl.semaphore_wait(credit, 1)  # the right neighbour has read slot t % 2
            move = dma(send, recv.at[t % 2], send_sem, recv_sems.at[t % 2], right)
            move.start()
            move.wait_send()

    return pallas_call(
        kernel,
        ring,
        out_shape=out_struct((r, n), out_dtype, (x,)),
        in_memory=["hbm"],
        out_memory=["vmem"],
        scratch=[
            pltpu.VMEM((2, r, n), x.dtype),
            pltpu.VMEM((r, n), x.dtype),
            pltpu.VMEM((r, n), x.dtype),
            pltpu.SemaphoreType.DMA,
            pltpu.SemaphoreType.DMA,
            pltpu.SemaphoreType.DMA((2,)),
            pltpu.SemaphoreType.REGULAR,
        ],
        interpret=interpret,
        race_check=race_check,
    )(x)


def all_reduce(
    x: jax.Array, axis_name: str, *, interpret: bool = False, race_check: bool = False
) -> jax.Array:
    """x [M, n] partial sums -> their sum over the axis on every device (`lax.psum`): the ring
    reduce-scatter, then the ring all-gather of the reduced blocks (M divisible by P)."""
    block = reduce_scatter(x, axis_name, interpret=interpret, race_check=race_check)
    return all_gather(
        block, axis_name, interpret=interpret, race_check=race_check, invariant_over=(axis_name,)
    )
