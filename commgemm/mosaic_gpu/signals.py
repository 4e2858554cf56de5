"""The NVLink kernels' signals between devices: a semaphore add on this device or on a peer,
after TMA stores or before any, and the fence that orders a TMA access with them.

`landed(sem, peer)` says this thread's TMA stores, awaited (`wait_smem_to_gmem(...,
wait_read_only=False)`), have landed where they went: an async-proxy fence, then an add that
releases at system scope (`pl.semaphore_signal`), so a reader whose wait (an acquire) sees the
count also sees the rows. A relaxed add is not ordered after those writes at the peer: it can
arrive first, and the reader then loads rows that are still on their way. `entered(sem, peer)`
is the relaxed add for a signal that orders no data of its own (a device has entered the
kernel): no system-scope fence, which stalls the warpgroup while its NVLink traffic drains.
`fence_async_proxy()` orders what a thread has acquired before its TMA loads."""

from __future__ import annotations

import jax


def fence_async_proxy() -> None:
    """fence.proxy.async.global: this thread's view of global memory (what its waits
    acquired, what its TMA stores wrote) ordered with its async-proxy (TMA) accesses."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    @plgpu.inline_mgpu()
    def _fence(_):
        from jax._src.lib.mlir import ir
        from jax._src.lib.mlir.dialects import llvm

        llvm.inline_asm(ir.Type.parse("!llvm.void"), [], "fence.proxy.async.global;", "",
                        has_side_effects=True)  # fmt: skip

    _fence()


def landed(sem, device_id=None) -> None:
    """Add 1 to semaphore `sem` (on peer `device_id`, or here) once this thread's awaited TMA
    stores have landed: ordered after them for whoever acquires the count."""
    from jax.experimental import pallas as pl

    fence_async_proxy()
    pl.semaphore_signal(sem, device_id=device_id)


def entered(sem, device_id=None) -> None:
    """Add 1 to semaphore `sem` (on peer `device_id`, or here) with a relaxed atomic, for a
    signal that orders no data: only that this thread got here. On jax < 0.11 (no peer refs in
    Mosaic GPU's inline code) it is `pl.semaphore_signal`."""
    from jax.experimental import pallas as pl
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if jax.__version_info__ < (0, 11):
        pl.semaphore_signal(sem, device_id=device_id)
        return
    ref = sem if device_id is None else plgpu.remote_ref(sem, device_id)

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
    def _signal(_, sem_ref):
        mgpu_utils.SemaphoreRef(mgpu_utils.memref_ptr(sem_ref)).signal(1, relaxed=True)

    _signal(ref)
