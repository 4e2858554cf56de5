"""Peer memory with one process per GPU: what the fused kernels need there.

With one process driving all GPUs, a Mosaic GPU kernel reaches a peer's buffers through CUDA
peer access. With several processes (`commgemm launch -n P`, any `jax.distributed` job) XLA
maps the peers' buffers through NCCL symmetric-memory windows and asks NCCL for each peer's
address (`ncclGetPeerDevicePointer`, NCCL >= 2.29.2). An older NCCL lacks that function, and
every kernel with remote references then fails at its first call ("unhandled system error").
So the fused kernels run with several processes where the NCCL this process calls is new
enough and every process runs on one machine (peers reachable by load and store over NVLink);
`multiprocess_reason` says why not otherwise, and the plan keeps to the XLA methods.
"""

from __future__ import annotations

import ctypes
import warnings

from commgemm import distributed

#: The oldest NCCL whose windows give peer addresses (`ncclGetPeerDevicePointer`).
MIN_NCCL = (2, 29, 2)

#: This process's answer once NCCL is loaded (plans ask for every fused candidate; the NCCL a
#: process calls and where the processes run do not change).
_answer: list[str | None] = []


def decode_version(code: int) -> tuple[int, int, int]:
    """NCCL_VERSION_CODE as (major, minor, patch): 22907 -> (2, 29, 7); before 2.9, 2708 ->
    (2, 7, 8)."""
    if code >= 20900:
        return code // 10000, code // 100 % 100, code % 100
    return code // 1000, code // 100 % 10, code % 100


def _library_version(library: ctypes.CDLL) -> tuple[int, int, int] | None:
    try:
        get = library.ncclGetVersion
    except AttributeError:
        return None
    code = ctypes.c_int(0)
    if get(ctypes.byref(code)) != 0:
        return None
    return decode_version(code.value)


def _mapped_libraries() -> list[str]:
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libnccl.so" in line}
    except OSError:  # not Linux
        return []
    return sorted(p for p in paths if p.startswith("/"))


def nccl_version() -> tuple[int, int, int] | None:
    """The version of the NCCL library this process calls, or None where none is loaded.

    The library in the global symbol scope where there is one (a preloaded libnccl.so.2, or
    one loaded with RTLD_GLOBAL); otherwise the libraries mapped into the process (jax's CUDA
    plugin loads NCCL's wheel when its backend starts), the oldest where there are several.
    """
    try:
        scope = ctypes.CDLL(None)
    except (OSError, TypeError):  # no global scope to ask (Windows)
        scope = None
    if scope is not None and (version := _library_version(scope)) is not None:
        return version
    versions = []
    for path in _mapped_libraries():
        try:
            library = ctypes.CDLL(path)
        except OSError:  # gone from the disk since it was mapped
            continue
        if (version := _library_version(library)) is not None:
            versions.append(version)
    return min(versions) if versions else None


def version_text(version: tuple[int, int, int]) -> str:
    """(2, 29, 7) -> "2.29.7"."""
    return ".".join(map(str, version))


def multiprocess_reason() -> str | None:
    """Why the fused kernels cannot run in this job of several processes, or None.

    Every process must call it (the first call learns where the others run: `distributed.
    machines`); each gets the same answer where their NCCL libraries agree. The answer is kept
    for the process's life once NCCL is loaded. An NCCL too old also warns, once: AUTO then
    leaves the fused kernels out without an error.
    """
    if _answer:
        return _answer[0]
    version = nccl_version()
    if version is None:
        return "with several processes it needs NCCL's peer addresses, and no NCCL is loaded"
    if version < MIN_NCCL:
        need, have = version_text(MIN_NCCL), version_text(version)
        reason = (
            f"with several processes it needs NCCL >= {need} for the peers' addresses "
            f"(ncclGetPeerDevicePointer); this process calls NCCL {have}: install "
            f"nvidia-nccl-cu13>={need} (the commgemm[multiprocess-cuda13] extra; -cu12 for CUDA "
            "12), or preload such a libnccl.so.2"
        )
        warnings.warn(f"commgemm's fused kernels are off in this job: {reason}", stacklevel=2)
        _answer.append(reason)
        return reason
    try:
        machines = distributed.machines()
    except TimeoutError as err:  # not kept: a later plan asks again
        return f"with several processes it needs them all on one machine, and {err}"
    reason = None
    if len(set(machines)) != 1:
        reason = (
            "with several processes it needs them all on one machine (peer memory over "
            f"NVLink); they run on {len(set(machines))}"
        )
    _answer.append(reason)
    return reason
