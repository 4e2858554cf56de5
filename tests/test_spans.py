"""device_spans(): per-call GPU time from a profiler trace (synthetic traces on the CPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import fake_periods, spreads_of
from hypothesis import given, settings
from hypothesis import strategies as st

import commgemm as cg
from commgemm.bench.spans import (
    batches_from_trace,
    busy_ns,
    periods_from_trace,
    spans_from_trace,
    split_calls,
)


def _trace(devices: dict[int, dict[str, list[tuple]]]):
    """A ProfileData with GPU planes: {device: {line name: [(start_ns, duration_ns[, kernel
    name])]}}, plus a host plane whose events must be ignored."""
    planes = [
        'planes { id: 99 name: "/host:CPU" lines { id: 1 name: "python" timestamp_ns: 0 '
        "events { metadata_id: 1 offset_ps: 0 duration_ps: 999000000000 } } "
        'event_metadata { key: 1 value { id: 1 name: "host" } } }'
    ]
    for dev, lines in devices.items():
        names = sorted({e[2] if len(e) > 2 else "kernel" for ev in lines.values() for e in ev})
        ids = {name: i + 1 for i, name in enumerate(names)}
        body = []
        for i, (name, events) in enumerate(lines.items()):
            evs = " ".join(
                f"events {{ metadata_id: {ids[e[2] if len(e) > 2 else 'kernel']} "
                f"offset_ps: {e[0] * 1000} duration_ps: {e[1] * 1000} }}"
                for e in events
            )
            body.append(f'lines {{ id: {i + 1} name: "{name}" timestamp_ns: 0 {evs} }}')
        meta = " ".join(
            f'event_metadata {{ key: {i} value {{ id: {i} name: "{name}" }} }}'
            for name, i in ids.items()
        )
        planes.append(
            f'planes {{ id: {dev + 1} name: "/device:GPU:{dev}" {" ".join(body)} {meta} }}'
        )
    text = "\n".join(planes)
    data = jax.profiler.ProfileData
    return data.from_serialized_xspace(data.text_proto_to_serialized_xspace(text))


def test_split_calls_merges_overlapping_streams():
    # two streams overlapping in call 1, a small gap inside call 2, a big gap between calls
    intervals = [(0, 50), (30, 100), (110, 130), (1000, 1200), (1250, 1300)]
    calls = split_calls(intervals, min_gap_ns=500)
    assert calls == [[(0, 100), (110, 130)], [(1000, 1200), (1250, 1300)]]
    assert [busy_ns(c) for c in calls] == [120, 250]
    assert len(split_calls(intervals, min_gap_ns=5)) == 4
    with pytest.raises(ValueError, match="ends before"):
        split_calls([(5, 1)], min_gap_ns=1)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.lists(st.tuples(st.integers(0, 400), st.integers(1, 300)), min_size=1, max_size=5),
        min_size=1,
        max_size=6,
    ),
    st.randoms(),
)
def test_split_calls_recovers_separated_calls(calls, rnd):
    """Calls laid out 10 us apart, their kernels (start offset, duration) shuffled: each call's
    busy time is the size of the union of its kernels' intervals, whatever their order."""
    intervals, expected, base = [], [], 0
    for kernels in calls:
        covered = set()
        for s, d in kernels:
            intervals.append((base + s, base + s + d))
            covered |= set(range(s, s + d))
        expected.append(len(covered))
        base += 10_000
    rnd.shuffle(intervals)
    found = split_calls(intervals, min_gap_ns=5_000)
    assert [busy_ns(c) for c in found] == expected
    for call in found:  # merged: sorted, disjoint
        assert all(a[1] < b[0] for a, b in zip(call, call[1:], strict=False))


def test_spans_take_the_fastest_device_per_call():
    """The least over devices: the others include waiting for the last one to start."""
    # GPU 0: call 1 busy 0..300 over two streams; call 2 5000..5100
    # GPU 1: call 1 busy 10..210; call 2 5000..5400 with a host gap of 200 inside
    data = _trace(
        {
            0: {"Stream #1(Compute)": [(0, 200), (5000, 100)], "Stream #2(NCCL)": [(100, 200)]},
            1: {"Stream #1(Compute)": [(10, 200), (5000, 100), (5300, 100)]},
        }
    )
    spans = spans_from_trace(data, calls=2, min_gap_ns=1000)
    np.testing.assert_allclose(spans, [200e-6, 100e-6])  # ms
    with pytest.raises(RuntimeError, match="found 2 runs of activity for 3 calls"):
        spans_from_trace(data, calls=3, min_gap_ns=1000)


def test_spans_ignore_derived_lines_when_streams_exist():
    data = _trace({0: {"Stream #1": [(0, 100), (5000, 100)], "XLA Modules": [(0, 6000)]}})
    np.testing.assert_allclose(spans_from_trace(data, calls=2, min_gap_ns=1000), [1e-4, 1e-4])


def test_device_spans_on_cpu_say_why():
    f = jax.jit(lambda a: a @ a)
    with pytest.raises(RuntimeError, match="no GPU activity"):
        cg.bench.device_spans(f, jnp.ones((32, 32)), calls=2)
    with pytest.raises(ValueError, match="calls=0"):
        cg.bench.device_spans(f, jnp.ones((32, 32)), calls=0)
    with pytest.raises(ValueError, match="gap_s=0"):
        cg.bench.device_spans(f, jnp.ones((32, 32)), gap_s=0)


@settings(max_examples=25, deadline=None)
@given(
    st.integers(3, 8),
    st.integers(100, 2000),
    st.integers(0, 99),  # setup kernels shorter than the main one
    st.integers(0, 50),
    st.integers(0, 500),
)
def test_periods_count_setup_kernels_and_gaps(calls, main_ns, setup_ns, gap_ns, skew_ns):
    """Calls back to back, each a setup kernel, a gap, then the main kernel: the period is the
    whole cycle on every GPU, its idle part the gaps; the main kernel is found by name."""
    cycle = setup_ns + gap_ns + main_ns + gap_ns
    devices = {}
    for dev in (0, 1):
        events = []
        for i in range(calls):
            base = dev * skew_ns + i * cycle
            if setup_ns:
                events.append((base, setup_ns, "barrier"))
            events.append((base + setup_ns + gap_ns, main_ns, "gemm"))
        devices[dev] = {"Stream #1": events}
    found = periods_from_trace(_trace(devices), calls)
    assert found["main"] == "gemm"
    np.testing.assert_allclose(found["periods"], [cycle / 1e6] * (calls - 1))
    np.testing.assert_allclose(found["idle"], [2 * gap_ns / 1e6] * (calls - 1))
    assert [k[0] for k in found["kernels"]] == ["gemm"] + (["barrier"] if setup_ns else [])


def test_periods_say_why():
    data = _trace({0: {"Stream #1": [(0, 100, "a"), (200, 100, "b")]}})
    with pytest.raises(RuntimeError, match="no kernel ran a multiple of 3 times"):
        periods_from_trace(data, 3)
    with pytest.raises(RuntimeError, match="no GPU activity"):
        cg.bench.device_periods(jax.jit(lambda a: a @ a), jnp.ones((32, 32)), calls=3)
    with pytest.raises(ValueError, match="calls=2"):
        cg.bench.device_periods(jax.jit(lambda a: a @ a), jnp.ones((32, 32)), calls=2)


@settings(max_examples=20, deadline=None)
@given(st.lists(st.integers(200, 900), min_size=1, max_size=5), st.integers(3, 6))
def test_batches_split_on_idle_gaps(cycles, calls):
    """Batches of back-to-back calls, 100 us apart, each with its own cycle time: one result
    per batch, in order, each with that batch's period."""
    events, base = [], 0
    for cycle in cycles:
        for i in range(calls):
            events.append((base + i * cycle, cycle - 20, f"k{cycle}"))
            events.append((base + i * cycle + cycle - 15, 5, "memset"))
        base += calls * cycle + 100_000
    found = batches_from_trace(_trace({0: {"Stream #1": events}}), len(cycles), calls, 50_000)
    assert [f["main"] for f in found] == [f"k{c}" for c in cycles]
    for f, cycle in zip(found, cycles, strict=True):
        np.testing.assert_allclose(f["periods"], [cycle / 1e6] * (calls - 1))
        np.testing.assert_allclose(f["idle"], [15 / 1e6] * (calls - 1))  # 5 + 10 ns
    # a GEMM in two pieces a call: a call starts at its first piece
    pieces = [(i * 1000 + j * 400, 300, "gemm") for i in range(4) for j in (0, 1)]
    found = batches_from_trace(_trace({0: {"Stream #1": pieces}}), 1, 4, 50_000)
    np.testing.assert_allclose(found[0]["periods"], [1e-3] * 3)
    assert (
        "ran a multiple of 3"
        in batches_from_trace(_trace({0: {"S": pieces}}), 1, 3, 50_000)[0]["error"]
    )
    with pytest.raises(RuntimeError, match=f"found {len(cycles)} runs of activity for 9 batches"):
        batches_from_trace(_trace({0: {"Stream #1": events}}), 9, calls, 50_000)
    # a host stall inside the first batch (an idle gap over the threshold, shorter than the
    # gaps between batches): the longest gaps still separate the batches
    stalled = [(s + 60_000 * (i >= 2), n, k) for i, (s, n, k) in enumerate(events)]
    found = batches_from_trace(_trace({0: {"Stream #1": stalled}}), len(cycles), calls, 50_000)
    assert [f["main"] for f in found] == [f"k{c}" for c in cycles]
    # host-bound calls: gaps inside every batch about as long as between them: no guessing
    host_bound = [(s + 800_000 * (i // 2), n, k) for i, (s, n, k) in enumerate(events)]
    found = batches_from_trace(_trace({0: {"S": host_bound}}), len(cycles), calls, 50_000)
    if len(cycles) > 1:
        assert all("host-bound or stalled" in f["error"] for f in found)


def test_interleaved_periods_say_why():
    f = jax.jit(lambda a: a @ a)
    variants = {"a": (f, (jnp.ones((32, 32)),))}
    with pytest.raises(RuntimeError, match="no GPU activity"):
        cg.bench.device_periods_interleaved(variants, rounds=1, calls=3)
    with pytest.raises(ValueError, match="rounds=0"):
        cg.bench.device_periods_interleaved(variants, rounds=0)
    with pytest.raises(ValueError, match="gap_s=0"):
        cg.bench.device_periods_interleaved(variants, gap_s=0)


def test_report_periods_leave_torch_out(monkeypatch):
    """`overlap_report`'s device periods trace the jax programs only: torch's GEMM runs no
    kernel in jax's profiler trace, and with it in the trace every round had one batch too few
    (no variant got a period on 2 x H200). The others' periods still give the bound."""
    from commgemm.bench import overlap

    traced = []

    def fake(variants, rounds):
        traced.extend(variants)
        return {name: {"median": 1.0 + i, "rounds": [1.0 + i]} for i, name in enumerate(variants)}

    monkeypatch.setattr(overlap, "device_periods_interleaved", fake)
    names = [*overlap.GEMM_ALONE.values(), *overlap.OTHER_GEMMS, "collective alone", "ring"]
    timed = {name: (None, ()) for name in names}
    out, spread, error = overlap._periods(timed, 2, lambda _: None)
    torch_gemm = overlap.OTHER_GEMMS[1]
    assert torch_gemm not in traced and set(traced) == set(names) - {torch_gemm}
    assert error is None and set(out) == set(spread) == set(traced)


def test_round_spread():
    from commgemm.bench.overlap import round_spread

    assert round_spread([2.0]) == 0.0
    assert round_spread([1.0, 1.2, 1.1]) == pytest.approx(0.2 / 1.1)
    with pytest.raises(ValueError, match="no rounds"):
        round_spread([])


def test_report_carries_each_variants_round_spread(monkeypatch, rng, capsys):
    """With device periods, every row and every GEMM alone carry how far apart their rounds
    fell, period_noise names the widest, and the CLI says that differences below it are not
    established by the run."""
    from commgemm.bench import overlap
    from commgemm.cli import main
    from commgemm.cli.specs import parse_method

    fake = fake_periods(rng)
    monkeypatch.setattr(overlap, "device_periods_interleaved", fake)
    methods = {m: parse_method(m) for m in ("none", "ring")}
    report = overlap.overlap_report("ag", (256, 64, 64), methods=methods, iters=2, periods=4)
    expected = spreads_of(fake.found)
    assert report.period_spread == pytest.approx(expected)
    for row in report.rows:
        assert row.period_spread == pytest.approx(expected[row.name])
    widest = max(expected, key=expected.__getitem__)
    assert report.period_noise == (widest, pytest.approx(expected[widest]))
    assert report.as_dict()["period_spread"] == pytest.approx(expected)

    code = main(["bench", "--shape", "256,64,64", "--iters", "2", "--methods", "none",
                 "--periods", "3"])  # fmt: skip
    out = " ".join(capsys.readouterr().out.split())  # rich folds long lines
    spreads = spreads_of(fake.found)
    widest = max(spreads, key=spreads.__getitem__)
    assert code == 0 and "rounds spread up to" in out and widest in out
    assert "rows closer than that are not told apart" in out


def test_batch_spans_time_steps_with_idle_inside(monkeypatch):
    """`batch_spans_interleaved` on a synthetic trace of two variants on two GPUs: a batch is
    the run between the longest gaps, its span (idle time inside included) / calls the time per
    call, the busy fraction the union of its kernels over the span; medians over rounds of the
    median over GPUs."""
    import random

    from commgemm.bench import spans

    rounds, calls = 3, 4
    # per call: (busy ns, idle ns after it) on GPU 0; GPU 1 takes 10% longer
    shapes = {"a": (700, 300), "b": (2000, 0)}
    order = []
    rng = random.Random(0)
    for _ in range(rounds):
        names = list(shapes)
        rng.shuffle(names)
        order += names
    devices = {}
    for dev, stretch in ((0, 1.0), (1, 1.1)):
        events, t = [], 0
        for name in order:
            busy, idle = (int(v * stretch) for v in shapes[name])
            for _ in range(calls):
                events.append((t, busy // 2, f"{name}-gemm"))  # two kernels a call, one after
                events.append((t + busy // 2, busy - busy // 2, "nccl_all_gather"))
                t += busy + idle
            t += 1_000_000
        devices[dev] = {"Stream #1": events}
    monkeypatch.setattr(spans, "_trace", lambda work: _trace(devices))
    f = jax.jit(lambda a: a + 1)
    found = cg.bench.batch_spans_interleaved(
        {"a": (f, (jnp.ones(2),)), "b": (f, (jnp.ones(2),))}, rounds=rounds, calls=calls
    )
    for name, (busy, idle) in shapes.items():
        # the batch's span: calls - 1 whole periods and the last call's busy time
        per_call = [((calls - 1) * s * (busy + idle) + s * busy) / calls / 1e6 for s in (1, 1.1)]
        np.testing.assert_allclose(found[name]["median"], np.median(per_call), rtol=1e-3)
        assert len(found[name]["rounds"]) == rounds
        span = (calls - 1) * (busy + idle) + busy
        np.testing.assert_allclose(found[name]["busy"], calls * busy / span, rtol=2e-2)
        assert {n for _, _, n in found[name]["events"]} == {f"{name}-gemm", "nccl_all_gather"}
    with pytest.raises(ValueError, match="rounds=0"):
        cg.bench.batch_spans_interleaved({"a": (f, (jnp.ones(2),))}, rounds=0)


@pytest.mark.parametrize(
    "stall_ns, merged, match",
    [(900_000, False, "nearly as long"), (3_000_000, False, "nearly as long"),
     (3_000_000, True, "different kernel counts")],
    ids=["near", "longer", "cut-inside"],
)  # fmt: skip
def test_batch_spans_refuse_a_split_in_doubt(monkeypatch, stall_ns, merged, match):
    """A host stall inside one batch nearly as long as the gaps between batches, or longer; or
    one where two batches ran with no gap between them (the cut then lands inside a batch, one
    batch taking another's kernels): traced again with longer gaps, and where the trace stays
    so, refused, not misread; where the next trace is clean, its figures."""
    import random

    from commgemm.bench import spans

    rounds, calls = 3, 4
    order, rng = [], random.Random(0)
    for _ in range(rounds):
        names = ["a", "b"]
        rng.shuffle(names)
        order += names
    events, t = [], 0
    for i, name in enumerate(order):
        for c in range(calls):
            events.append((t, 500, f"{name}-gemm"))
            t += 600 + (stall_ns if (i, c) == (2, 1) else 0)
        t += 0 if merged and i == 3 else 1_000_000
    clean = [(i * 10_000_000 + c * 600, 500, f"{n}-gemm") for i, n in enumerate(order)
             for c in range(calls)]  # fmt: skip
    traces, gaps = [], []
    monkeypatch.setattr(spans, "_trace", lambda work: _trace({0: {"Stream #1": traces.pop(0)}}))
    traced = spans._interleaved_trace

    def recorded(variants, rounds, calls, gap_s, seed):
        gaps.append(gap_s)
        return traced(variants, rounds, calls, gap_s, seed)

    monkeypatch.setattr(spans, "_interleaved_trace", recorded)
    f = jax.jit(lambda a: a + 1)
    variants = {"a": (f, (jnp.ones(2),)), "b": (f, (jnp.ones(2),))}
    traces += [events] * 3
    with pytest.raises(spans.SplitInDoubt, match=match):
        cg.bench.batch_spans_interleaved(variants, rounds=rounds, calls=calls, gap_s=0.01)
    assert gaps == pytest.approx([0.01, 0.04, 0.16])  # two retries, gaps 4x longer
    traces += [events, clean]
    found = cg.bench.batch_spans_interleaved(variants, rounds=rounds, calls=calls)
    assert found["a"]["median"] == pytest.approx((3 * 600 + 500) / calls / 1e6)
    with pytest.raises(ValueError, match="retries"):
        cg.bench.batch_spans_interleaved(variants, retries=-1)


def test_report_times_by_spans_where_periods_fail(monkeypatch):
    """Where device periods cannot tell a variant's calls apart (host-paced calls on 4 GPUs),
    `overlap_report` times those variants by device spans instead and says so; where spans fail
    too and a bound's term is missing, no figure is given."""
    from commgemm.bench import overlap

    names = [*overlap.GEMM_ALONE.values(), "collective alone", "ring"]
    timed = {name: (None, ()) for name in names}
    failing = {"ring", "collective alone"}

    def periods(variants, rounds):
        return {n: {"error": "host-bound"} if n in failing else {"median": 1.0, "rounds": [1.0]}
                for n in variants}  # fmt: skip

    spanned = []

    def spans(variants, rounds, calls):
        spanned.extend(variants)
        return {n: {"median": 2.0, "rounds": [2.0, 2.2]} for n in variants}

    monkeypatch.setattr(overlap, "device_periods_interleaved", periods)
    monkeypatch.setattr(overlap, "batch_spans_interleaved", spans)
    out, spread, error = overlap._periods(timed, 2, lambda _: None)
    assert set(spanned) == failing and set(out) == set(names)
    assert out["ring"] == 2.0 and out[overlap.GEMM_ALONE[False]] == 1.0
    assert "device spans instead" in error and spread["ring"] == pytest.approx(0.2 / 2.1)

    def no_spans(variants, rounds, calls):
        raise RuntimeError("the trace has no GPU activity")

    monkeypatch.setattr(overlap, "batch_spans_interleaved", no_spans)
    out, spread, error = overlap._periods(timed, 2, lambda _: None)
    assert out == {} and "device spans: the trace has no GPU activity" in error


def test_report_times_by_spans_what_any_process_could_not_read(monkeypatch):
    """With several processes each reads its own trace, but they must go on alike (a process
    that timed a variant by spans alone would wait forever on the others' collectives): a
    variant another process could not read is timed by spans here too, and where another
    process could not read its trace at all, no process gives periods."""
    from commgemm.bench import overlap

    names = [*overlap.GEMM_ALONE.values(), "collective alone", "ring", "none"]
    timed = {name: (None, ()) for name in names}
    monkeypatch.setattr(
        overlap,
        "device_periods_interleaved",
        lambda variants, rounds: {n: {"median": 1.0, "rounds": [1.0]} for n in variants},
    )
    spanned = []

    def spans(variants, rounds, calls):
        spanned.extend(variants)
        return {n: {"median": 2.0, "rounds": [2.0]} for n in variants}

    monkeypatch.setattr(overlap, "batch_spans_interleaved", spans)
    asked = []

    def another_missed(other):  # what `agreed` answers when another process missed `other`
        def agreed(all_names, mine, *, every):
            asked.append((list(all_names), set(mine), every))
            return set(mine) | other

        return agreed

    monkeypatch.setattr(overlap, "agreed", another_missed({"ring"}))
    out, _, error = overlap._periods(timed, 2, lambda _: None)
    ((all_names, mine, every),) = asked
    assert mine == set() and not every and set(names) < set(all_names)
    assert spanned == ["ring"] and out["ring"] == 2.0 and out["none"] == 1.0 and error is None

    (unread,) = set(all_names) - set(names)
    monkeypatch.setattr(overlap, "agreed", another_missed({unread}))
    out, spread, error = overlap._periods(timed, 2, lambda _: None)
    assert out == spread == {} and error == "another process could not read its trace"


def test_report_leaves_out_a_best_gemm_another_process_could_not_run(monkeypatch):
    """The best-GEMM candidates (Mosaic GPU, torch) run where they can; with several processes,
    one that another process could not run is left out everywhere (the interleaved timing
    runs the same variants in the same order on every process) and the report says why."""
    from commgemm.bench import overlap, problems

    mosaic = overlap.OTHER_GEMMS[0]
    monkeypatch.setattr(
        problems.Problem, "gemm_alone_mosaic", lambda self: self.gemm_alone(), raising=True
    )
    report = overlap.overlap_report("ag", (64, 32, 32), methods={}, iters=2)
    assert mosaic in report.gemm_ms  # one process: it ran, so it is timed

    monkeypatch.setattr(overlap, "agreed", lambda names, mine, *, every: set())
    report = overlap.overlap_report("ag", (64, 32, 32), methods={}, iters=2)
    assert mosaic not in report.gemm_ms
    assert (mosaic, "it could not run on another process") in report.failures
