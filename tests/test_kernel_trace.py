"""commgemm.bench.kernel_trace: phase summaries of Mosaic GPU profiler traces, checked on
synthetic traces built from known phase durations."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from commgemm.bench.kernel_trace import PEAK_FLOP_PER_CYCLE, phase_ranges, phase_summary


def trace(warpgroups: list[dict], start: float = 5e6, load: dict | None = None) -> list[dict]:
    """Chrome-trace events (ts: cycles / 1000) of warpgroups with the given phase durations,
    plus a memory warpgroup with an "Init" phase and, in turn, the `load` phases' durations
    (name -> list of cycles; zero_ahead's)."""
    events = []
    for tid, wg in enumerate(warpgroups, start=1):
        t = start

        def phase(name, cycles, tid=tid):
            nonlocal t
            events.append({"name": name, "ph": "B", "ts": t / 1e3, "tid": tid, "pid": 1})
            t += cycles
            events.append({"name": name, "ph": "E", "ts": t / 1e3, "tid": tid, "pid": 1})

        if wg["zero"]:
            phase("zero", wg["zero"])
        for kloop, epilogue in zip(wg["kloop"], wg["epilogue"], strict=True):
            t += kloop
            phase("epilogue", epilogue)
        phase("landed", wg["landed"])
    events.append({"name": "Init", "ph": "B", "ts": start / 1e3, "tid": 99, "pid": 1})
    events.append({"name": "Init", "ph": "E", "ts": start / 1e3 + 1, "tid": 99, "pid": 1})
    t = start + 2e3
    for name, durations in (load or {}).items():
        for cycles in durations:
            events.append({"name": name, "ph": "B", "ts": t / 1e3, "tid": 99, "pid": 1})
            t += cycles
            events.append({"name": name, "ph": "E", "ts": t / 1e3, "tid": 99, "pid": 1})
    return events


@settings(max_examples=30, deadline=None)
@given(
    data=st.lists(
        st.tuples(
            st.integers(0, 60_000),  # zero
            st.lists(st.integers(30_000, 40_000), min_size=2, max_size=6),  # K loops
            st.lists(st.integers(1_000, 5_000), min_size=6, max_size=6),  # epilogues
            st.integers(1, 10_000),  # landed
        ),
        min_size=1,
        max_size=6,
    )
)
def test_summary_recovers_the_phases(data):
    wgs = [
        {"zero": z, "kloop": ks, "epilogue": es[: len(ks)], "landed": land}
        for z, ks, es, land in data
    ]
    tile_flops = 2.0 * 128 * 256 * 2048
    got = phase_summary(trace(wgs), tile_flops=tile_flops)

    def med(values):
        return pytest.approx(float(np.median(values)), abs=1)

    assert got["warpgroups"] == len(wgs)
    assert got["zero_cycles"] == med([w["zero"] for w in wgs])
    # without a zero phase the trace starts at the first epilogue: the first K loop is unseen
    seen = [w["kloop"][0] if w["zero"] else 0 for w in wgs]
    assert got["first_kloop_cycles"] == med(seen)
    assert got["kloop_cycles"] == med([k for w in wgs for k in w["kloop"][1:]])
    assert got["first_epilogue_cycles"] == med([w["epilogue"][0] for w in wgs])
    assert got["epilogue_cycles"] == med([e for w in wgs for e in w["epilogue"][1:]])
    assert got["landed_cycles"] == med([w["landed"] for w in wgs])
    unseen = [w["kloop"][0] - first for w, first in zip(wgs, seen, strict=True)]
    spans = [
        w["zero"] + sum(w["kloop"]) + sum(w["epilogue"]) + w["landed"] - u
        for w, u in zip(wgs, unseen, strict=True)
    ]
    assert got["span_cycles"] == med(spans)
    if len(wgs) == 1:  # one warpgroup: the phases tile its span
        assert sum(got["share"].values()) == pytest.approx(1.0, abs=1e-6)
    assert got["ideal_kloop_cycles"] == tile_flops / PEAK_FLOP_PER_CYCLE == 32768
    assert got["load_phase_cycles"] == {}


@settings(max_examples=20, deadline=None)
@given(
    signal=st.lists(st.integers(100, 20_000), min_size=1, max_size=30),
    zero=st.lists(st.integers(100, 3_000), min_size=1, max_size=30),
)
def test_load_warpgroup_phases(signal, zero):
    """zero_ahead's load-warpgroup phases: medians and p90s over their occurrences; the compute
    warpgroups' figures do not change."""
    wgs = [{"zero": 100, "kloop": [30_000, 30_000], "epilogue": [2_000, 2_000], "landed": 10}]
    plain = phase_summary(trace(wgs), tile_flops=1.0)
    got = phase_summary(trace(wgs, load={"ahead_signal": signal, "ahead_zero": zero}), 1.0)
    assert sorted(got["load_phase_cycles"]) == ["ahead_signal", "ahead_zero"]
    for name, values in (("ahead_signal", signal), ("ahead_zero", zero)):
        figures = got["load_phase_cycles"][name]
        assert figures["median"] == pytest.approx(float(np.median(values)), abs=1)
        assert figures["p90"] == pytest.approx(float(np.percentile(values, 90)), abs=1)
    assert {k: v for k, v in got.items() if k != "load_phase_cycles"} == {
        k: v for k, v in plain.items() if k != "load_phase_cycles"
    }


def test_truncated_trace_drops_unmatched_ends():
    events = trace([{"zero": 10, "kloop": [100, 100], "epilogue": [5, 5], "landed": 1}])
    assert len(phase_ranges(events)[1]) == 4
    assert len(phase_ranges(events[1:])[1]) == 3  # the zero's end without its begin: dropped
    with pytest.raises(ValueError, match="no epilogue phases"):
        phase_summary(events[:2], tile_flops=1.0)
