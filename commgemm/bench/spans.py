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


def periods_from_trace(data, calls: int) -> dict:
    """Steady-state device time per call from a `jax.profiler.ProfileData` of `calls` calls run
    back to back: on each GPU, the call's main kernel is the kernel name seen at least `calls`
    times with the most total time; a call's period is from one main kernel's start to the
    next's, so it counts everything the device did or waited for in between (setup kernels,
    barriers, idle gaps). Returns {"periods": per-call periods in ms averaged over GPUs
    (calls - 1 of them), "idle": per-call idle time in ms inside each period (most over GPUs),
    "main": the main kernel's name, "kernels": [(name, start offset us, duration us)] of one
    middle period on the first GPU}."""
    per_device = []
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU:"):
            continue
        lines = list(plane.lines)
        streams = [line for line in lines if line.name.startswith(_STREAM_PREFIX)] or lines
        events = sorted(
            (e.start_ns, e.start_ns + e.duration_ns, e.name)
            for line in streams
            for e in line.events
        )
        if events:
            per_device.append(events)
    if not per_device:
        raise RuntimeError(
            "the trace has no GPU activity (device periods need a GPU backend and CUPTI)"
        )
    periods, idles, main, kernels = [], [], "", []
    for d, events in enumerate(per_device):
        totals: dict[str, list[float]] = {}
        for start, end, name in events:
            totals.setdefault(name, []).append(end - start)
        candidates = {name: sum(t) for name, t in totals.items() if len(t) >= calls}
        if not candidates:
            raise RuntimeError(f"no kernel ran {calls} times on GPU {d}: {sorted(totals)[:5]}")
        main = max(candidates, key=candidates.get)
        starts = [start for start, _, name in events if name == main]
        if len(starts) != calls:
            raise RuntimeError(f"{main!r} ran {len(starts)} times for {calls} calls on GPU {d}")
        periods.append([(b - a) / 1e6 for a, b in zip(starts, starts[1:], strict=False)])
        idle = []
        for a, b in zip(starts, starts[1:], strict=False):
            inside = [(max(s, a), min(e, b)) for s, e, _ in events if e > a and s < b]
            idle.append((b - a - busy_ns(split_calls(inside, min_gap_ns=float("inf"))[0])) / 1e6)
        idles.append(idle)
        if d == 0:
            mid = calls // 2
            a, b = starts[mid - 1], starts[mid]
            kernels = [(name, (s - a) / 1e3, (e - s) / 1e3) for s, e, name in events if a <= s < b]
    return {
        "periods": [sum(p) / len(p) for p in zip(*periods, strict=True)],
        "idle": [max(i) for i in zip(*idles, strict=True)],
        "main": main,
        "kernels": kernels,
    }


def device_periods(fn: Callable, *args, calls: int = 16) -> dict:
    """Runs `fn(*args)` (jitted, compiled by a first call here) `calls` times back to back
    under the profiler (the host enqueues them all, then waits) and returns
    `periods_from_trace`: the device time per call in steady state, with the GPUs' own
    timestamps, gaps and setup kernels included (unlike `device_spans`, which idles between
    calls and counts only busy time). Raises RuntimeError without GPU activity."""
    if calls < 3:
        raise ValueError(f"calls={calls} must be >= 3")
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as folder:
        jax.profiler.start_trace(folder)
        try:
            jax.block_until_ready([fn(*args) for _ in range(calls)])
        finally:
            jax.profiler.stop_trace()
        paths = sorted(pathlib.Path(folder).rglob("*.xplane.pb"))
        if not paths:
            raise RuntimeError(f"the profiler wrote no .xplane.pb under {folder}")
        return periods_from_trace(jax.profiler.ProfileData.from_file(str(paths[-1])), calls)
