"""Multi-process runs: `initialize()` (from the variables `cg.launch` sets) and the check that
every process plans the same collective GEMM.

One process per host (or per GPU) is how production JAX runs; every op works unchanged there, as
long as the global arrays are made with `jax.make_array_from_callback` /
`jax.make_array_from_process_local_data` and results are read through `addressable_shards`.
"""

from __future__ import annotations

import itertools
import os

import jax

#: Variables `commgemm launch` sets for each process it starts.
COORDINATOR = "COMMGEMM_COORDINATOR"
NUM_PROCESSES = "COMMGEMM_NUM_PROCESSES"
PROCESS_ID = "COMMGEMM_PROCESS_ID"
CPU_DEVICES = "COMMGEMM_CPU_DEVICES"
LOCAL_DEVICE_IDS = "COMMGEMM_LOCAL_DEVICE_IDS"
PLAN_CHECK_TIMEOUT_S = 60

_plan_counter = itertools.count()


def launched() -> bool:
    """Whether this process was started by `commgemm launch`."""
    return COORDINATOR in os.environ


def initialize(timeout_s: int = 60) -> None:
    """`jax.distributed.initialize` from the launcher's variables (a no-op without them).

    CPU: `COMMGEMM_CPU_DEVICES` virtual devices per process and gloo collectives. GPU: the
    process's GPUs from `COMMGEMM_LOCAL_DEVICE_IDS`. Call before anything else touches jax.
    """
    if not launched():
        return
    if os.environ.get(CPU_DEVICES):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.config.update("jax_num_cpu_devices", int(os.environ[CPU_DEVICES]))
    local = os.environ.get(LOCAL_DEVICE_IDS)
    jax.distributed.initialize(
        coordinator_address=os.environ[COORDINATOR],
        num_processes=int(os.environ[NUM_PROCESSES]),
        process_id=int(os.environ[PROCESS_ID]),
        local_device_ids=[int(i) for i in local.split(",")] if local else None,
        initialization_timeout=timeout_s,
    )


def check_same_plan(fingerprint: str) -> None:
    """Raises, on every process, if the processes planned different calls at the same point.

    Each process publishes its plan in the coordinator's key-value store and reads the others'
    (with a timeout), so a mismatch (say num_splits=2 on one rank, 4 on another) becomes a clear
    error at trace time instead of a collective that never completes. One process: a no-op.
    """
    if jax.process_count() == 1:
        return
    from jax._src import distributed  # the coordination service's client (no public handle)

    client = distributed.global_state.client
    if client is None:
        return
    seq = next(_plan_counter)
    me = jax.process_index()
    client.key_value_set(f"commgemm/plan/{seq}/{me}", fingerprint)
    for rank in range(jax.process_count()):
        if rank == me:
            continue
        try:
            theirs = client.blocking_key_value_get(
                f"commgemm/plan/{seq}/{rank}", PLAN_CHECK_TIMEOUT_S * 1000
            )
        except Exception as err:  # noqa: BLE001 - the store raises its own error types
            raise RuntimeError(
                f"process {rank} did not plan collective GEMM #{seq} within "
                f"{PLAN_CHECK_TIMEOUT_S} s (this process {me} planned {fingerprint}): "
                "every process must call the same ops in the same order"
            ) from err
        if theirs != fingerprint:
            raise ValueError(
                f"processes disagree on collective GEMM #{seq}: process {me} planned "
                f"{fingerprint}, process {rank} planned {theirs}; pass the same config and "
                "shapes on every process"
            )
