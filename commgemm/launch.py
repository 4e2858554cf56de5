"""`commgemm launch -n N -- CMD...`: N local processes under jax.distributed, one coordinator.

Each process gets COMMGEMM_COORDINATOR / _NUM_PROCESSES / _PROCESS_ID and either
COMMGEMM_CPU_DEVICES (CPU: virtual devices per process, gloo collectives) or
COMMGEMM_LOCAL_DEVICE_IDS (GPU: its own GPUs); the program calls `commgemm.initialize()` first
(the demo and `commgemm bench` do). Output is forwarded line by line with a "[rank i]" prefix.
If a process fails, the others are stopped and the launcher reports the rank, its exit code and
its last lines; a run longer than `timeout_s` is stopped the same way. Nothing hangs.
"""

from __future__ import annotations

import collections
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from commgemm import distributed as dist

SAFE_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


class LaunchError(RuntimeError):
    """A launched process failed or the run timed out."""


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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _forward(rank: int, stream, tail: collections.deque, out) -> None:
    for line in iter(stream.readline, ""):
        tail.append(line.rstrip("\n"))
        out.write(f"[rank {rank}] {line}")
        out.flush()


def launch(
    n: int,
    command: Sequence[str],
    *,
    cpu_devices: int | None = None,
    gpus_per_process: int | None = None,
    timeout_s: float = 600.0,
    out=None,
) -> int:
    """Runs `command` in `n` processes; returns 0 when all succeed.

    Args:
      n: number of processes.
      command: the program and its arguments (e.g. ["python", "train.py"]).
      cpu_devices: virtual CPU devices per process (CPU runs); default 8 // n (at least 1) when
        no GPU count is given.
      gpus_per_process: GPUs per process (GPU runs): process i gets GPUs i*g .. i*g+g-1.
      timeout_s: the whole run's limit.
    Raises:
      LaunchError: naming the first rank that failed, its exit code and its last lines, or the
        timeout.
    """
    if n < 1:
        raise ValueError(f"n={n} must be >= 1")
    if not command:
        raise ValueError("no command to launch: pass it after --")
    out = out or sys.stdout
    coordinator = f"127.0.0.1:{_free_port()}"
    procs, tails, threads = [], [], []
    for rank in range(n):
        env = (
            os.environ
            | SAFE_ENV
            | {
                dist.COORDINATOR: coordinator,
                dist.NUM_PROCESSES: str(n),
                dist.PROCESS_ID: str(rank),
                "PYTHONUNBUFFERED": "1",
            }
        )
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
            bufsize=1,
        )
        tail: collections.deque = collections.deque(maxlen=20)
        thread = threading.Thread(target=_forward, args=(rank, proc.stdout, tail, out), daemon=True)
        thread.start()
        procs.append(proc)
        tails.append(tail)
        threads.append(thread)
    deadline = time.monotonic() + timeout_s
    failure: str | None = None
    while failure is None and any(p.poll() is None for p in procs):
        for rank, proc in enumerate(procs):
            code = proc.poll()
            if code not in (None, 0):
                failure = f"rank {rank} exited with code {code}"
                break
        if failure is None and time.monotonic() > deadline:
            failure = f"timed out after {timeout_s:.0f} s"
        time.sleep(0.05)
    if failure is None:
        failed = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode]
        if failed:
            failure = f"rank {failed[0][0]} exited with code {failed[0][1]}"
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc, thread in zip(procs, threads, strict=True):
        proc.wait()
        thread.join(timeout=5)
    if failure is None:
        return 0
    rank = int(failure.split()[1]) if failure.startswith("rank") else 0
    last = "\n".join(f"    {line}" for line in tails[rank]) or "    (no output)"
    raise LaunchError(f"{failure}; last output of rank {rank}:\n{last}")
