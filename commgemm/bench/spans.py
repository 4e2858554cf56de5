"""`device_spans()`: the device time of each call, read from a profiler trace.

`benchmark` infers device time from when the host sees completions. This reads the GPU's own
timestamps instead (CUPTI, through `jax.profiler`): the calls run one at a time with an idle gap
between them, and a call's time is how long its device had at least one kernel or copy running
(the union of their intervals), on the device that took the least (as jax's own
collective-matmul benchmark takes it: the others include waiting for the last device to start,
which a one-process launch staggers). Gaps where a device waited for the host inside a call
(seen on 2xH200: up to 0.5 ms between a Mosaic kernel's setup and its launch, when the host is
not running ahead) are left out; a kernel that spins waiting for a peer counts. It is a
cross-check of `benchmark`, not a replacement: the idle gaps let the GPUs rest, so
sustained-load slowdowns show less here.
"""

from __future__ import annotations

import pathlib
import tempfile
import time
from collections.abc import Callable, Sequence

import jax

#: The trace lines that hold GPU activity (CUPTI names them by stream).
_STREAM_PREFIX = "Stream"


def split_calls(
    intervals: Sequence[tuple[float, float]], min_gap_ns: float
) -> list[list[tuple[float, float]]]:
    """Busy intervals [(start, end)] of one device, in ns, in any order -> for each call, its
    merged (non-overlapping, sorted) intervals; calls are the runs of activity separated by
    idle gaps >= min_gap_ns."""
    calls: list[list[list[float]]] = []
    for start, end in sorted(intervals):
        if end < start:
            raise ValueError(f"interval ({start}, {end}) ends before it starts")
        if not calls or start - calls[-1][-1][1] >= min_gap_ns:
            calls.append([[start, end]])
        elif start <= calls[-1][-1][1]:
            calls[-1][-1][1] = max(calls[-1][-1][1], end)
        else:
            calls[-1].append([start, end])
    return [[(s, e) for s, e in call] for call in calls]


def busy_ns(call: Sequence[tuple[float, float]]) -> float:
    """The length of a call's merged intervals (`split_calls`), in ns."""
    return sum(end - start for start, end in call)


def spans_from_trace(data, calls: int, min_gap_ns: float) -> list[float]:
    """Per-call device times in ms from a `jax.profiler.ProfileData` holding `calls` calls on
    each GPU: for call i, the least over devices of its busy time (`busy_ns`)."""
    per_device: dict[str, list[list[tuple[float, float]]]] = {}
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU:"):
            continue
        lines = list(plane.lines)
        streams = [line for line in lines if line.name.startswith(_STREAM_PREFIX)]
        events = [
            (e.start_ns, e.start_ns + e.duration_ns)
            for line in streams or lines
            for e in line.events
        ]
        if events:
            per_device[plane.name] = split_calls(events, min_gap_ns)
    if not per_device:
        raise RuntimeError(
            "the trace has no GPU activity (device spans need a GPU backend and CUPTI)"
        )
    for name, found in per_device.items():
        if len(found) != calls:
            raise RuntimeError(
                f"{name}: found {len(found)} runs of activity for {calls} calls "
                f"(idle gap threshold {min_gap_ns / 1e3:.0f} us)"
            )
    return [min(busy_ns(found[i]) / 1e6 for found in per_device.values()) for i in range(calls)]


def device_spans(fn: Callable, *args, calls: int = 10, gap_s: float = 5e-3) -> list[float]:
    """Runs `fn(*args)` (jitted, compiled by a first call here) `calls` times under the
    profiler, waiting for each call and then idling gap_s, and returns each call's device time
    in ms (`spans_from_trace`, with gaps of gap_s / 2 or more separating calls). Raises
    RuntimeError where the trace holds no GPU activity (e.g. on a CPU) or the calls cannot be
    told apart."""
    if calls < 1:
        raise ValueError(f"calls={calls} must be >= 1")
    if gap_s <= 0:
        raise ValueError(f"gap_s={gap_s} must be > 0")
    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as folder:
        jax.profiler.start_trace(folder)
        try:
            for _ in range(calls):
                jax.block_until_ready(fn(*args))
                time.sleep(gap_s)
        finally:
            jax.profiler.stop_trace()
        paths = sorted(pathlib.Path(folder).rglob("*.xplane.pb"))
        if not paths:
            raise RuntimeError(f"the profiler wrote no .xplane.pb under {folder}")
        data = jax.profiler.ProfileData.from_file(str(paths[-1]))
        return spans_from_trace(data, calls, min_gap_ns=gap_s * 1e9 / 2)
