"""Multi-process runs: `initialize()` (from the variables `cg.launch` sets), the check that
every process plans the same collective GEMM, `agreed`, one answer for decisions each process
makes for itself, and `machines`, where each process runs.

One process per host (or per GPU) is how production JAX runs; every op works unchanged there, as
long as the global arrays are made with `jax.make_array_from_callback` /
`jax.make_array_from_process_local_data` and results are read through `addressable_shards`.
"""

from __future__ import annotations

import collections
import os
import pathlib
import socket
import threading
from collections.abc import Collection, Sequence

import jax
import numpy as np

#: Variables `commgemm launch` sets for each process it starts.
COORDINATOR = "COMMGEMM_COORDINATOR"
NUM_PROCESSES = "COMMGEMM_NUM_PROCESSES"
PROCESS_ID = "COMMGEMM_PROCESS_ID"
CPU_DEVICES = "COMMGEMM_CPU_DEVICES"
LOCAL_DEVICE_IDS = "COMMGEMM_LOCAL_DEVICE_IDS"
MARKER_DIR = "COMMGEMM_MARKER_DIR"
#: How long a process waits for the others' plan of the same call before it goes on unchecked
#: (a process may trace a call the others never do, e.g. to print its HLO).
PLAN_CHECK_WAIT_S = 10
#: How long the first `machines()` call waits for every process to publish its machine.
MACHINES_WAIT_S = 60


def launched() -> bool:
    """Whether this process was started by `commgemm launch`."""
    return COORDINATOR in os.environ


def marker(directory: str, rank: int) -> str:
    """The file a launched rank leaves once it has joined the distributed run."""
    return os.path.join(directory, f"rank{rank}")


def _mark_joined() -> None:
    directory = os.environ.get(MARKER_DIR)
    if directory and os.path.isdir(directory):
        pathlib.Path(marker(directory, int(os.environ[PROCESS_ID]))).touch()


def initialize(timeout_s: int = 60) -> None:
    """`jax.distributed.initialize` from the launcher's variables (a no-op without them).

    CPU: `COMMGEMM_CPU_DEVICES` virtual devices per process and gloo collectives. GPU: the
    process's GPUs from `COMMGEMM_LOCAL_DEVICE_IDS`. The coordinator (process 0) listens on
    the launcher's address only. Call before anything else touches jax.
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
        coordinator_bind_address=os.environ[COORDINATOR],
    )
    _mark_joined()


def check_launched_initialized() -> None:
    """Raises if `commgemm launch` started this process but it never joined the run: it would
    compute alone, as an unrelated one-process program."""
    if launched() and jax.process_count() != int(os.environ[NUM_PROCESSES]):
        raise RuntimeError(
            f"this process was started by `commgemm launch -n {os.environ[NUM_PROCESSES]}` but "
            "has not joined the run: call commgemm.initialize() before anything else uses jax"
        )


_lock = threading.Lock()
_seen: collections.Counter[str] = collections.Counter()


def check_same_plan(call: str, plan: str) -> None:
    """Raises, on a process that sees it, if the processes planned one call differently.

    `call` names the call (op, axis, shapes and dtypes; the n-th such call of this process),
    `plan` what this process will run for it (the config). Each process publishes its plan in
    the coordinator's key-value store and compares it with the others' plans of the same call
    (waiting up to PLAN_CHECK_WAIT_S for them), so a mismatch (num_splits=2 on one rank, 4 on
    another) becomes a clear error at trace time instead of a collective that never completes.
    A call only some processes trace (an extra `jit(...).lower()` to log HLO, say) is not an
    error: the others never publish it and the check passes it after the wait. One process: a
    no-op.
    """
    check_launched_initialized()
    if jax.process_count() == 1:
        return
    if launched():
        _mark_joined()  # joined by jax.distributed.initialize directly, too
    from jax._src import distributed  # the coordination service's client (no public handle)

    client = distributed.global_state.client
    if client is None:
        return
    with _lock:
        _seen[call] += 1
        key = f"commgemm/plan/{call}#{_seen[call]}"
    me = jax.process_index()
    client.key_value_set(f"{key}/{me}", plan)
    for rank in range(jax.process_count()):
        if rank == me:
            continue
        try:
            theirs = client.blocking_key_value_get(f"{key}/{rank}", PLAN_CHECK_WAIT_S * 1000)
        except Exception:  # noqa: BLE001 - not published (yet): nothing to compare with
            continue
        if theirs != plan:
            raise ValueError(
                f"processes disagree on collective GEMM {call}: process {me} planned {plan}, "
                f"process {rank} planned {theirs}; pass the same config and shapes on every "
                "process"
            )


def agreed(names: Sequence[str], mine: Collection[str], *, every: bool) -> set[str]:
    """Of `names`, those in `mine` on every process (every=True) or on any process (False):
    one answer on all processes where each process decided for itself (which variants ran,
    which traces it could read), so that every process goes on to run the same collectives in
    the same order. One process: `mine` (of `names`). Every process must call it, with the
    same `names` in the same order."""
    if jax.process_count() == 1:
        return {n for n in names if n in mine}
    from jax.experimental import multihost_utils

    local = np.array([n in mine for n in names], np.int32)
    found = np.asarray(multihost_utils.process_allgather(local)).reshape(-1, len(names))
    keep = found.all(axis=0) if every else found.any(axis=0)
    return {n for n, k in zip(names, keep, strict=True) if k}


def this_machine() -> str:
    """This machine's name: the host name and the kernel's boot id, so that two machines of
    one host name (or two containers of one machine) tell apart."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


_machines: tuple[str, ...] | None = None
_published = False


def machines() -> tuple[str, ...]:
    """Each process's machine (`this_machine`), by process index; one process: its own.

    The first call publishes this process's machine in the coordinator's key-value store and
    reads the others' (waiting up to MACHINES_WAIT_S: every process must call it); later calls
    return the same tuple. Raises TimeoutError where a process did not publish in time.
    """
    global _machines, _published
    if jax.process_count() == 1:
        return (this_machine(),)
    if _machines is None:
        from jax._src import distributed  # the coordination service's client (no public handle)

        client = distributed.global_state.client
        if client is None:
            raise TimeoutError("jax.distributed has no coordination client to ask")
        with _lock:
            if not _published:
                client.key_value_set(f"commgemm/machine/{jax.process_index()}", this_machine())
                _published = True
        found = []
        for rank in range(jax.process_count()):
            try:
                found.append(client.blocking_key_value_get(
                    f"commgemm/machine/{rank}", MACHINES_WAIT_S * 1000))  # fmt: skip
            except Exception as err:  # noqa: BLE001 - the client's own timeout error
                raise TimeoutError(f"process {rank} did not say where it runs ({err})") from err
        _machines = tuple(found)
    return _machines
