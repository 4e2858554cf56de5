"""`commgemm launch -n N -- CMD...`: N local processes under jax.distributed, one coordinator.

Each process gets COMMGEMM_COORDINATOR / _NUM_PROCESSES / _PROCESS_ID and either
COMMGEMM_CPU_DEVICES (CPU: virtual devices per process, gloo collectives) or
COMMGEMM_LOCAL_DEVICE_IDS (GPU: its own GPUs); the program calls `commgemm.initialize()` first
(the demo and `commgemm bench` do). Output is forwarded line by line with a "[rank i]" prefix.

Nothing is left running: every rank runs in its own process group, so stopping a rank stops
its children too (a `bash -c '...'` wrapper and what it started). The launcher stops every
group when a rank fails (reported at once, with its exit code and last lines), when the run
times out (naming the ranks still running, with their last lines), and when it receives
SIGTERM or SIGINT (forwarded to every group, then SIGKILL after a grace period).
The coordinator listens on 127.0.0.1 unless another address is given.
"""

from __future__ import annotations

import collections
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence

from commgemm import distributed as dist

SAFE_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
#: Seconds a rank has to exit after SIGTERM before it is killed.
GRACE_S = 5.0
#: Exit code of a run that timed out (as coreutils' timeout).
TIMEOUT_CODE = 124


class LaunchError(RuntimeError):
    """A launched process failed, or the run timed out or was interrupted; `returncode` is
    the code the launcher exits with (the failing rank's)."""

    def __init__(self, message: str, returncode: int) -> None:
        super().__init__(message)
        self.returncode = returncode


def gpu_count() -> int:
    """NVIDIA GPUs visible here, without starting jax (which would take their memory)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()])
    try:
        listing = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in listing.splitlines() if line.startswith("GPU "))


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


#: What every rank's jax prints as the coordination service closes (the watch of the other
#: tasks cancelled): the same five lines per rank after the results, never a fault.
SHUTDOWN_CHATTER = re.compile(
    r"WatchTasksAsync failed|Additional GRPC error information from remote target "
    r"coordination_service|^:(CANCELLED|UNAVAILABLE):|=== Source Location Trace: ===|"
    r"distributed_runtime/rpc/grpc_util\.h"
)


def _forward(rank: int, stream, tail: collections.deque, out) -> None:
    """Copies a rank's lines to `out` under its rank, and into `tail`, less the coordination
    service's shutdown chatter (and the blank line that closes each block of it)."""
    chatter = False
    for line in iter(stream.readline, ""):
        if SHUTDOWN_CHATTER.search(line) or (chatter and not line.strip()):
            chatter = bool(line.strip())
            continue
        chatter = False
        tail.append(line.rstrip("\n"))
        out.write(f"[rank {rank}] {line}")
        out.flush()


def _signal_groups(procs: list[subprocess.Popen], sig: int) -> None:
    for proc in procs:
        try:
            os.killpg(proc.pid, sig)  # the rank and everything it started
        except (ProcessLookupError, PermissionError):
            pass


def _stop(procs: list[subprocess.Popen], grace_s: float = GRACE_S) -> None:
    """SIGTERM to every rank's group, SIGKILL to what is left after `grace_s`."""
    _signal_groups(procs, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.05)
    _signal_groups(procs, signal.SIGKILL)
    for proc in procs:
        proc.wait()


def _last_lines(rank: int, tail: collections.deque) -> str:
    lines = "\n".join(f"    {line}" for line in tail) or "    (no output)"
    return f"last output of rank {rank}:\n{lines}"


def launch(
    n: int,
    command: Sequence[str],
    *,
    cpu_devices: int | None = None,
    gpus_per_process: int | None = None,
    timeout_s: float = 600.0,
    coordinator: str | None = None,
    out=None,
) -> int:
    """Runs `command` in `n` processes; returns 0 when all succeed.

    Args:
      n: number of processes (>= 1).
      command: the program and its arguments (e.g. ["python", "train.py"]).
      cpu_devices: virtual CPU devices per process (CPU runs, >= 1); default 8 // n (at least
        1) when no GPU count is given.
      gpus_per_process: GPUs per process (GPU runs): process i gets GPUs i*g .. i*g+g-1.
      timeout_s: the whole run's limit (> 0).
      coordinator: "host:port" of the coordination service (process 0 serves it); default
        127.0.0.1 and a free port, reachable from this machine only.
    Raises:
      LaunchError: naming the first rank that failed, its exit code (`returncode`) and its last
        lines; the ranks still running at a timeout; an interruption; or a rank that did not
        call `commgemm.initialize()` and so ran as an unrelated one-process program.
      ValueError: bad arguments.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n={n!r} must be an int >= 1")
    if not command:
        raise ValueError("no command to launch: pass it after --")
    if cpu_devices is not None and cpu_devices < 1:
        raise ValueError(f"cpu_devices={cpu_devices} must be >= 1")
    if gpus_per_process is not None and gpus_per_process < 1:
        raise ValueError(f"gpus_per_process={gpus_per_process} must be >= 1")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s={timeout_s} must be > 0")
    out = out or sys.stdout
    coordinator = coordinator or f"127.0.0.1:{_free_port('127.0.0.1')}"
    markers = tempfile.TemporaryDirectory(prefix="commgemm-launch-")
    procs: list[subprocess.Popen] = []
    tails: list[collections.deque] = []
    threads: list[threading.Thread] = []
    received: list[int] = []

    def on_signal(signum, _frame) -> None:
        received.append(signum)
        _signal_groups(procs, signum)

    handlers = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            handlers[sig] = signal.signal(sig, on_signal)
    try:
        for rank in range(n):
            env = os.environ | SAFE_ENV
            env |= {
                dist.COORDINATOR: coordinator,
                dist.NUM_PROCESSES: str(n),
                dist.PROCESS_ID: str(rank),
                dist.MARKER_DIR: markers.name,
                "PYTHONUNBUFFERED": "1",
            }
            if gpus_per_process:
                ids = range(rank * gpus_per_process, (rank + 1) * gpus_per_process)
                env[dist.LOCAL_DEVICE_IDS] = ",".join(map(str, ids))
            else:
                env[dist.CPU_DEVICES] = str(cpu_devices or max(1, 8 // n))
                env["JAX_PLATFORMS"] = "cpu"
            proc = subprocess.Popen(
                list(command),
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                errors="backslashreplace",  # a byte that is not UTF-8 must not stop forwarding
                bufsize=1,
                start_new_session=True,  # its own process group: stopped with its children
            )
            tail: collections.deque = collections.deque(maxlen=20)
            thread = threading.Thread(
                target=_forward, args=(rank, proc.stdout, tail, out), daemon=True
            )
            thread.start()
            procs.append(proc)
            tails.append(tail)
            threads.append(thread)
        error = _supervise(procs, tails, threads, timeout_s, received)
    finally:
        _stop(procs)
        for thread in threads:
            thread.join(timeout=5)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    if error is None:
        missing = [r for r in range(n) if not os.path.exists(dist.marker(markers.name, r))]
        if missing:
            error = LaunchError(
                f"rank(s) {missing} never called commgemm.initialize(), so each ran as an "
                "unrelated one-process program: call it before anything else uses jax",
                1,
            )
    markers.cleanup()
    if error is not None:
        raise error
    return 0


def _supervise(procs, tails, threads, timeout_s: float, received) -> LaunchError | None:
    """Waits for every rank; the first failure, timeout or signal as a LaunchError."""
    deadline = time.monotonic() + timeout_s

    def interrupted() -> LaunchError:
        sig = received[0]
        return LaunchError(
            f"interrupted by {signal.Signals(sig).name}; stopped every rank", 128 + sig
        )

    while any(p.poll() is None for p in procs):
        if received:
            return interrupted()
        for rank, proc in enumerate(procs):
            code = _exit_code(proc.poll())
            if code not in (None, 0):
                threads[rank].join(timeout=2)  # its last lines
                print(
                    f"commgemm launch: rank {rank} exited with code {code}; stopping the others",
                    file=sys.stderr,
                    flush=True,
                )
                return LaunchError(
                    f"rank {rank} exited with code {code}; {_last_lines(rank, tails[rank])}", code
                )
        if time.monotonic() > deadline:
            hung = [r for r, p in enumerate(procs) if p.poll() is None]
            shown = "\n".join(_last_lines(r, tails[r]) for r in hung)
            return LaunchError(
                f"timed out after {timeout_s:g} s; rank(s) {hung} still running; {shown}",
                TIMEOUT_CODE,
            )
        time.sleep(0.05)
    if received:
        return interrupted()
    for rank, proc in enumerate(procs):
        if proc.returncode:
            code = _exit_code(proc.returncode)
            return LaunchError(
                f"rank {rank} exited with code {code}; {_last_lines(rank, tails[rank])}", code
            )
    return None


def _exit_code(code: int | None) -> int | None:
    """A rank's exit status as a shell reports it: 128 + N for a rank killed by signal N."""
    return 128 - code if code is not None and code < 0 else code
