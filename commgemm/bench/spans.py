"""`device_spans()`: the device time of each call, read from a profiler trace.

`benchmark` infers device time from when the host sees completions. This reads the GPU's own
timestamps instead (CUPTI, through `jax.profiler`): the calls run one at a time with an idle gap
between them, and a call's time is how long its device had at least one kernel or copy running
(the union of their intervals), on the device that took the least (as jax's own
collective-matmul benchmark takes it: the others include waiting for the last device to start,
which a one-process launch staggers). Gaps where a device waited for the host inside a call (between
a Mosaic kernel's setup and its launch, when the host is not running ahead) are left out; a kernel
that spins waiting for a peer counts. It is a cross-check of `benchmark`, not a replacement: the
idle gaps let the GPUs rest, so sustained-load slowdowns show less here.
"""

from __future__ import annotations

import pathlib
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence

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
    per_device = [
        split_calls([(start, end) for start, end, _ in events], min_gap_ns)
        for events in _gpu_events(data)
    ]
    for d, found in enumerate(per_device):
        if len(found) != calls:
            raise RuntimeError(
                f"GPU {d}: found {len(found)} runs of activity for {calls} calls "
                f"(idle gap threshold {min_gap_ns / 1e3:.0f} us)"
            )
    return [min(busy_ns(found[i]) / 1e6 for found in per_device) for i in range(calls)]


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

    def work():
        for _ in range(calls):
            jax.block_until_ready(fn(*args))
            time.sleep(gap_s)

    return spans_from_trace(_trace(work), calls, min_gap_ns=gap_s * 1e9 / 2)


def _gpu_events(data) -> list[list[tuple[float, float, str]]]:
    """Per GPU plane of a ProfileData: its kernels and copies as sorted (start, end, name) in
    ns, from the CUPTI stream lines (or every line where there are none)."""
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
            "the trace has no GPU activity (device timing needs a GPU backend and CUPTI)"
        )
    return per_device


def _batch_periods(events: list[tuple[float, float, str]], calls: int) -> dict:
    """One GPU's events of `calls` calls run back to back -> {"periods", "idle" (ms, calls - 1
    each), "main", "kernels"} as `periods_from_trace` describes them. The main kernel may run
    several times a call (a method's GEMM pieces): a call starts at its first."""
    totals: dict[str, list[float]] = {}
    for start, end, name in events:
        totals.setdefault(name, []).append(end - start)
    candidates = {name: sum(t) for name, t in totals.items() if len(t) % calls == 0}
    if not candidates:
        raise RuntimeError(f"no kernel ran a multiple of {calls} times: {sorted(totals)[:5]}")
    main = max(candidates, key=candidates.get)
    starts = [start for start, _, name in events if name == main]
    starts = starts[:: len(starts) // calls]
    periods, idle = [], []
    for a, b in zip(starts, starts[1:], strict=False):
        inside = [(max(s, a), min(e, b)) for s, e, _ in events if e > a and s < b]
        periods.append((b - a) / 1e6)
        idle.append((b - a - busy_ns(split_calls(inside, min_gap_ns=float("inf"))[0])) / 1e6)
    a, b = starts[calls // 2 - 1], starts[calls // 2]
    kernels = [(name, (s - a) / 1e3, (e - s) / 1e3) for s, e, name in events if a <= s < b]
    return {"periods": periods, "idle": idle, "main": main, "kernels": kernels}


def _merge_devices(found: list[dict]) -> dict:
    """Per-GPU `_batch_periods` of one batch -> periods averaged over GPUs, idle the most."""
    return {
        "periods": [sum(p) / len(p) for p in zip(*(f["periods"] for f in found), strict=True)],
        "idle": [max(i) for i in zip(*(f["idle"] for f in found), strict=True)],
        "main": found[0]["main"],
        "kernels": found[0]["kernels"],
    }


def periods_from_trace(data, calls: int) -> dict:
    """Steady-state device time per call from a `jax.profiler.ProfileData` of `calls` calls run
    back to back: on each GPU, the call's main kernel is the kernel name seen at least `calls`
    times with the most total time; a call's period is from one main kernel's start to the
    next's, so it counts everything the device did or waited for in between (setup kernels,
    barriers, idle gaps). Returns {"periods": per-call periods in ms averaged over GPUs
    (calls - 1 of them), "idle": per-call idle time in ms inside each period (most over GPUs),
    "main": the main kernel's name, "kernels": [(name, start offset us, duration us)] of one
    middle period on the first GPU}."""
    found = []
    for d, events in enumerate(_gpu_events(data)):
        try:
            found.append(_batch_periods(events, calls))
        except RuntimeError as err:
            raise RuntimeError(f"GPU {d}: {err}") from None
    return _merge_devices(found)


#: The batches' separating gaps must be this many times longer than any idle gap inside them.
AMBIGUOUS_GAPS = 1.25


def batches_from_trace(data, batches: int, calls: int, min_gap_ns: float) -> list[dict]:
    """`periods_from_trace` for a trace of `batches` runs of `calls` back-to-back calls each,
    the runs separated by idle gaps of min_gap_ns or more: one result per run, in order, or
    {"error": why} for a run whose calls cannot be told apart. Where more such gaps are found
    than batches - 1 (a host stall within a batch), the batches - 1 longest separate them,
    if they are clearly the longest (AMBIGUOUS_GAPS); otherwise every run gets the error (calls
    slower to issue than to run leave gaps inside the batches: the splits would be guesses)."""
    per_batch: list[list[dict]] = [[] for _ in range(batches)]
    for d, events in enumerate(_gpu_events(data)):
        gaps = []  # (idle ns, index of the event after the gap)
        last_end = events[0][1] if events else 0.0
        for i in range(1, len(events)):
            if events[i][0] - last_end >= min_gap_ns:
                gaps.append((events[i][0] - last_end, i))
            last_end = max(last_end, events[i][1])
        if not events or len(gaps) < batches - 1:
            raise RuntimeError(
                f"GPU {d}: found {len(gaps) + bool(events)} runs of activity for {batches} "
                f"batches (idle gap threshold {min_gap_ns / 1e3:.0f} us)"
            )
        ranked = sorted(gaps, reverse=True)
        if batches > 1 and len(gaps) >= batches:
            cut, kept = ranked[batches - 2][0], ranked[batches - 1][0]
            if cut < AMBIGUOUS_GAPS * kept:  # no clear split: every batch would be misread
                why = (
                    f"GPU {d}: idle gaps inside the batches ({kept / 1e3:.0f} us) nearly as long "
                    f"as those between them ({cut / 1e3:.0f} us): the calls are host-bound or "
                    "stalled; time them on the host or with a longer gap_s"
                )
                return [{"error": why} for _ in range(batches)]
        cuts = sorted(i for _, i in ranked[: batches - 1])
        runs = [events[a:b] for a, b in zip([0, *cuts], [*cuts, len(events)], strict=True)]
        for i, run in enumerate(runs):
            try:
                per_batch[i].append(_batch_periods(run, calls))
            except RuntimeError as err:
                per_batch[i].append({"error": f"GPU {d}, batch {i}: {err}"})
    return [
        next((f for f in found if "error" in f), None) or _merge_devices(found)
        for found in per_batch
    ]


def _trace(work: Callable[[], None]):
    """Runs work() under the profiler and returns the trace's ProfileData."""
    with tempfile.TemporaryDirectory() as folder:
        jax.profiler.start_trace(folder)
        try:
            work()
        finally:
            jax.profiler.stop_trace()
        paths = sorted(pathlib.Path(folder).rglob("*.xplane.pb"))
        if not paths:
            raise RuntimeError(f"the profiler wrote no .xplane.pb under {folder}")
        return jax.profiler.ProfileData.from_file(str(paths[-1]))


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
    data = _trace(lambda: jax.block_until_ready([fn(*args) for _ in range(calls)]))
    return periods_from_trace(data, calls)


def _interleaved_trace(variants, rounds: int, calls: int, gap_s: float, seed: int):
    """Every variant compiled and run twice, then traced: `rounds` rounds, each running every
    variant's `calls` calls back to back in a shuffled order, batches gap_s apart. Returns
    (the variants' names in the order their batches ran, the trace's ProfileData)."""
    for fn, args in variants.values():
        jax.block_until_ready(fn(*args))
        jax.block_until_ready(fn(*args))
    rng = random.Random(seed)
    order = []
    for _ in range(rounds):
        names = list(variants)
        rng.shuffle(names)
        order += names

    def work():
        for name in order:
            fn, args = variants[name]
            jax.block_until_ready([fn(*args) for _ in range(calls)])
            time.sleep(gap_s)

    return order, _trace(work)


def device_periods_interleaved(
    variants: Mapping[str, tuple[Callable, tuple]],
    *,
    rounds: int = 6,
    calls: int = 8,
    gap_s: float = 2e-3,
    seed: int = 0,
) -> dict[str, dict]:
    """`device_periods` for several variants at once, interleaved so that the GPUs' drift
    (clocks, temperature) reaches all alike: one trace of `rounds` rounds, each running every
    variant's `calls` calls back to back, variants in a shuffled order, batches gap_s apart.
    Returns {name: {"median": median period in ms over every round, "rounds": each round's
    median, "periods": all periods, "idle": median idle ms per call, "main", "kernels"}}, or
    {name: {"error": why}} for a variant whose calls cannot be told apart in the trace."""
    if rounds < 1 or calls < 3:
        raise ValueError(f"rounds={rounds} must be >= 1 and calls={calls} >= 3")
    if gap_s <= 0:
        raise ValueError(f"gap_s={gap_s} must be > 0")
    order, data = _interleaved_trace(variants, rounds, calls, gap_s, seed)
    found = batches_from_trace(data, len(order), calls, min_gap_ns=gap_s * 1e9 / 2)
    out = {}
    for name in variants:
        mine = [f for n, f in zip(order, found, strict=True) if n == name]
        if errors := [f["error"] for f in mine if "error" in f]:
            out[name] = {"error": errors[0]}
            continue
        periods = [p for f in mine for p in f["periods"]]
        out[name] = {
            "median": statistics.median(periods),
            "rounds": [statistics.median(f["periods"]) for f in mine],
            "periods": periods,
            "idle": statistics.median(i for f in mine for i in f["idle"]),
            "main": mine[0]["main"],
            "kernels": mine[0]["kernels"],
        }
    return out


def _batch_spans(d: int, events, order: list[str], calls: int) -> list[tuple]:
    """GPU d's events cut into len(order) batches at the longest gaps: [(ms per call, busy
    fraction, events)] in order; SplitInDoubt where the cut is in doubt."""
    gaps, last_end = [], events[0][1]
    for i in range(1, len(events)):
        gaps.append((events[i][0] - last_end, i))
        last_end = max(last_end, events[i][1])
    if len(gaps) < len(order) - 1:
        raise RuntimeError(f"GPU {d}: {len(events)} kernels for {len(order)} batches")
    ranked = sorted(gaps, reverse=True)
    if len(ranked) >= len(order) > 1:
        cut, kept = ranked[len(order) - 2][0], ranked[len(order) - 1][0]
        if cut < AMBIGUOUS_GAPS * kept:
            raise SplitInDoubt(
                f"GPU {d}: an idle gap inside a batch ({kept / 1e6:.1f} ms) nearly as long as "
                f"those between batches ({cut / 1e6:.1f} ms)"
            )
    cuts = sorted(i for _, i in ranked[: len(order) - 1])
    counts = {}
    for name, a, b in zip(order, [0, *cuts], [*cuts, len(events)], strict=True):
        counts.setdefault(name, set()).add(b - a)
    if mixed := {name: sorted(c) for name, c in counts.items() if len(c) > 1}:
        raise SplitInDoubt(f"GPU {d}: batches of one variant hold different kernel counts {mixed}")
    batches = []
    for a, b in zip([0, *cuts], [*cuts, len(events)], strict=True):
        run = events[a:b]
        span = max(e for _, e, _ in run) - run[0][0]
        busy = busy_ns(split_calls([(s, e) for s, e, _ in run], float("inf"))[0])
        batches.append((span / calls / 1e6, busy / span, run))
    return batches


class SplitInDoubt(RuntimeError):
    """A trace whose batches cannot be told apart for sure (`batch_spans_interleaved`)."""


def batch_spans_interleaved(
    variants: Mapping[str, tuple[Callable, tuple]],
    *,
    rounds: int = 5,
    calls: int = 4,
    gap_s: float = 0.05,
    seed: int = 0,
    retries: int = 2,
) -> dict[str, dict]:
    """Device time per call where `device_periods_interleaved` cannot split calls (a training
    step has no one main kernel; host-paced steps leave gaps inside a batch): `rounds` rounds,
    each running every variant's `calls` calls back to back in a shuffled order, batches gap_s
    apart. On each GPU a batch is the run between the longest gaps; its span (first kernel's
    start to last's end, idle time inside included) / calls is the time per call, its busy
    fraction the union of its kernels over the span. Returns {name: {"median": median over
    rounds of the median over GPUs of ms per call, "rounds", "busy": median busy fraction,
    "events": GPU 0's (start, end, name) of one middle batch, in ns}}. Where the split is in
    doubt (a gap inside a batch nearly as long as those between them, AMBIGUOUS_GAPS; or one
    variant's batches of different kernel counts: a cut in the wrong place gives one batch
    another's kernels, where a variant runs the same kernels every call) it traces again with
    gaps 4x longer, up to `retries` times, then raises SplitInDoubt (a RuntimeError)."""
    if rounds < 1 or calls < 1 or retries < 0:
        raise ValueError(f"rounds={rounds} and calls={calls} must be >= 1, retries={retries} >= 0")
    for attempt in range(retries + 1):
        order, data = _interleaved_trace(variants, rounds, calls, gap_s, seed)
        try:
            per_device = [_batch_spans(d, events, order, calls)
                          for d, events in enumerate(_gpu_events(data))]  # fmt: skip
            break
        except SplitInDoubt as err:
            if attempt == retries:
                raise SplitInDoubt(
                    f"{err} (gaps of {gap_s * 1e3:.0f} ms; give a longer gap_s)"
                ) from None
            gap_s *= 4
    out = {}
    for name in variants:
        index = [i for i, n in enumerate(order) if n == name]
        per_round = [statistics.median(dev[i][0] for dev in per_device) for i in index]
        out[name] = {
            "median": statistics.median(per_round),
            "rounds": per_round,
            "busy": statistics.median(dev[i][1] for dev in per_device for i in index),
            "events": per_device[0][index[len(index) // 2]][2],
        }
    return out
