"""Where a fused kernel's cycles go, from a Mosaic GPU profiler trace.

Mosaic GPU's on-device profiler (`plgpu.CompilerParams(profile_space=..., profile_dir=...)`)
writes a Chrome trace per call: for every warpgroup ("tid") the begin ("B") and end ("E") of
each named scope the kernel entered, stamped with the SM's cycle counter (the trace's "ts" is
cycles / 1000 within a warpgroup). The direct RS kernel (`direct_rs`) names its compute
warpgroups' phases "zero", "epilogue" and "landed"; what lies between two epilogues is a
tile's K loop. With DirectRSConfig.zero_ahead its load warpgroups name theirs too ("ahead_signal",
"ahead_zero", "ahead_wait", once a tile). `phase_summary` turns one trace into medians over the
warpgroups.
"""

from __future__ import annotations

import statistics

import numpy as np

#: dense bf16 FLOPs an H100 / H200 SM's tensor cores do per cycle (989 TFLOP/s, 132 SMs,
#: 1.83 GHz)
PEAK_FLOP_PER_CYCLE = 4096


def phase_ranges(events: list[dict]) -> dict[int, list[tuple[str, float, float]]]:
    """(name, begin, end) of each phase per warpgroup ("tid"), in cycles, in begin order. An
    end with no begin (a truncated trace) is dropped."""
    out: dict[int, list[tuple[str, float, float]]] = {}
    opened: dict[tuple[int, str], float] = {}
    for event in events:
        key = (event["tid"], event["name"])
        if event["ph"] == "B":
            opened[key] = event["ts"]
        elif key in opened:
            begin = opened.pop(key)
            out.setdefault(event["tid"], []).append((event["name"], begin * 1e3, event["ts"] * 1e3))
    for items in out.values():
        items.sort(key=lambda item: item[1])
    return out


def phase_summary(events: list[dict], tile_flops: float) -> dict:
    """Medians over the warpgroups that ran epilogues (the compute warpgroups), in cycles: a
    warpgroup's span (first phase's begin to last phase's end), its zeroing, its first K loop
    (from the zeroing's end to the first epilogue; 0 where there is no zero phase, as the
    trace then starts at the first epilogue), the later K loops and epilogues (over all tiles),
    the end's wait ("landed"), each phase's share of the span, the ideal K loop (`tile_flops` at
    PEAK_FLOP_PER_CYCLE), and the median and p90 of each of the load warpgroups' zero_ahead
    phases over all their occurrences (empty without zero_ahead)."""
    per_wg = []
    for items in phase_ranges(events).values():
        epilogues = [(b, e) for name, b, e in items if name == "epilogue"]
        if not epilogues:
            continue
        zero = [(b, e) for name, b, e in items if name == "zero"]
        landed = [e - b for name, b, e in items if name == "landed"]
        prev = zero[0][1] if zero else items[0][1]
        kloops = []
        for b, e in epilogues:
            kloops.append(b - prev)
            prev = e
        per_wg.append(
            {
                "span": items[-1][2] - items[0][1],
                "zero": sum(e - b for b, e in zero),
                "kloop": kloops,
                "epilogue": [e - b for b, e in epilogues],
                "landed": sum(landed),
            }
        )
    if not per_wg:
        raise ValueError("the trace has no epilogue phases (was the kernel profiled?)")

    def med(values) -> float:
        return float(statistics.median(values)) if values else 0.0

    def share(key: str) -> float:
        return med([np.sum(w[key]) / w["span"] for w in per_wg])

    later = [k for w in per_wg for k in w["kloop"][1:]]
    load = {}  # the load warpgroups' zero_ahead phases, each occurrence
    for items in phase_ranges(events).values():
        for name, b, e in items:
            if name.startswith("ahead_"):
                load.setdefault(name, []).append(e - b)
    return {
        "warpgroups": len(per_wg),
        "tiles_per_warpgroup": med([len(w["epilogue"]) for w in per_wg]),
        "span_cycles": med([w["span"] for w in per_wg]),
        "zero_cycles": med([w["zero"] for w in per_wg]),
        "first_kloop_cycles": med([w["kloop"][0] for w in per_wg]),
        "kloop_cycles": med(later),
        "kloop_p90_cycles": float(np.percentile(later, 90)) if later else 0.0,
        "ideal_kloop_cycles": tile_flops / PEAK_FLOP_PER_CYCLE,
        "first_epilogue_cycles": med([w["epilogue"][0] for w in per_wg]),
        "epilogue_cycles": med([e for w in per_wg for e in w["epilogue"][1:]]),
        "landed_cycles": med([w["landed"] for w in per_wg]),
        "share": {key: share(key) for key in ("zero", "kloop", "epilogue", "landed")},
        "span_spread_cycles": max(w["span"] for w in per_wg) - min(w["span"] for w in per_wg),
        "load_phase_cycles": {
            name: {"median": med(v), "p90": float(np.percentile(v, 90))}
            for name, v in sorted(load.items())
        },
    }
