"""`benchmark()`: device-side timing of a JAX callable without timing Python dispatch."""

from __future__ import annotations

import collections
import dataclasses
import random
import statistics
import time
from collections.abc import Callable, Mapping

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class BenchmarkResult:
    """Per-call device times in milliseconds."""

    mean: float
    median: float
    stdev: float
    min: float
    max: float
    p95: float
    p99: float
    iters: int
    warmup: int
    group: int
    samples: tuple[float, ...]
    dispatch_bound: bool
    dispatch_ms: float | None = None  # host time to enqueue one call (benchmark_interleaved)
    head: int | None = None  # calls enqueued ahead of each sample (benchmark_interleaved)

    def __repr__(self) -> str:
        flag = " (dispatch-bound: times include launch gaps)" if self.dispatch_bound else ""
        return (
            f"BenchmarkResult(median={self.median:.4f} ms, mean={self.mean:.4f}, "
            f"stdev={self.stdev:.4f}, min={self.min:.4f}, max={self.max:.4f}, p95={self.p95:.4f}, "
            f"p99={self.p99:.4f}, iters={self.iters}x{self.group}){flag}"
        )

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def benchmark(
    fn: Callable, *args, iters: int = 50, warmup: int = 3, in_flight: int = 8, group: int = 4
) -> BenchmarkResult:
    """Times `fn(*args)` (a jitted function): `iters` samples, each the mean over `group` calls,
    after `warmup` calls.

    How: JAX dispatches asynchronously, so the calls are enqueued ahead (up to `in_flight` at a
    time) and the device runs them back to back. A sample is the time between the completion
    (`block_until_ready` on every output shard) of call i and of call i+group, divided by
    group: the device time per call, with the Python dispatch of later calls happening meanwhile
    and so not timed. On several GPUs the host sees
    completions late and sometimes in bursts, so single deltas jitter (on 2 GPUs some fell far
    below the bound); averaging over a group narrows that, without removing it, so use the
    median, not the minimum.
    If dispatching fell behind the device (the queue ran dry), `dispatch_bound` is set and the
    samples include launch gaps: use bigger problems.
    """
    if iters < 2:
        raise ValueError(f"iters={iters} must be >= 2")
    if warmup < 1:
        raise ValueError(f"warmup={warmup} must be >= 1 (the first call compiles)")
    if group < 1:
        raise ValueError(f"group={group} must be >= 1")
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    calls = iters * group + 1  # the first completion is the start mark of the first sample
    pending: collections.deque = collections.deque()
    done_at: list[float] = []
    dispatched = 0
    queue_ran_dry = 0
    while len(done_at) < calls:
        while dispatched < calls and len(pending) < in_flight:
            pending.append(fn(*args))
            dispatched += 1
        jax.block_until_ready(pending.popleft())
        done_at.append(time.perf_counter())
        if not pending and dispatched < calls:
            queue_ran_dry += 1
    marks = np.array(done_at[::group])
    samples = np.diff(marks) * 1e3 / group
    return summarize(
        samples, warmup=warmup, group=group, dispatch_bound=queue_ran_dry > (calls - 1) // 10
    )


#: The most calls `benchmark_interleaved` enqueues ahead of a sample's start mark.
MAX_HEAD = 16


def benchmark_interleaved(
    variants: Mapping[str, tuple[Callable, tuple]],
    *,
    iters: int = 30,
    warmup: int = 3,
    group: int = 4,
    seed: int = 0,
) -> dict[str, BenchmarkResult]:
    """Times several jitted functions against each other: {name: (fn, args)} -> {name: result}.

    Each of `iters` cycles takes one sample of every variant, in an order shuffled per cycle
    (seeded, so every process of a multi-process run agrees on it). Sample i of every variant
    comes from cycle i, a fraction of a second wide, so a slow drift of the GPUs' speed (seen on
    2 GPUs: up to 18% over a minute under load) reaches every variant alike.

    A sample enqueues `head` calls and then `group` more, and is the time from the completion
    of the last head call (the start mark) to that of the last call, over group: the device time
    per call, the dispatch of the group having happened while the head ran. If the start mark
    had already completed when the last call was enqueued, the host would take it late and the
    sample would come out short, so that sample is dropped and the variant's head doubled (up
    to MAX_HEAD). `dispatch_bound` is set when even MAX_HEAD calls were not enough in over a
    tenth of the samples: enqueuing a call takes about as long as running it. `dispatch_ms`
    is the median host time to enqueue one call. With several processes the head is MAX_HEAD
    throughout, the same on every process, so that all enqueue the same collectives.
    """
    if iters < 2:
        raise ValueError(f"iters={iters} must be >= 2")
    if warmup < 1:
        raise ValueError(f"warmup={warmup} must be >= 1 (the first call compiles)")
    if group < 1:
        raise ValueError(f"group={group} must be >= 1")
    if not variants:
        raise ValueError("variants is empty: give at least one {name: (fn, args)}")
    for fn, args in variants.values():
        for _ in range(warmup):
            jax.block_until_ready(fn(*args))
    samples: dict[str, list[float]] = {name: [] for name in variants}
    dispatch: dict[str, list[float]] = {name: [] for name in variants}
    late = dict.fromkeys(variants, 0)
    # several processes enqueue the same calls (each holds a collective its peers wait for), so
    # none adapts its head on its own clock: a fixed head, as deep as the adaptive one may grow
    several = jax.process_count() > 1
    head = dict.fromkeys(variants, MAX_HEAD if several else 1)
    names = list(variants)
    for cycle in range(iters):
        order = list(names)
        random.Random(seed * 1_000_003 + cycle).shuffle(order)
        for name in order:
            fn, args = variants[name]
            while True:
                calls = head[name] + group
                enqueue = time.perf_counter()
                outs = [fn(*args) for _ in range(calls)]
                dispatch[name].append((time.perf_counter() - enqueue) * 1e3 / calls)
                mark = outs[head[name] - 1]
                if several or not _is_ready(mark) or head[name] >= MAX_HEAD:
                    break
                jax.block_until_ready(outs[-1])
                head[name] *= 2
            late[name] += _is_ready(mark)
            jax.block_until_ready(mark)
            start = time.perf_counter()
            jax.block_until_ready(outs[-1])
            samples[name].append((time.perf_counter() - start) * 1e3 / group)
    return {
        name: dataclasses.replace(
            summarize(
                samples[name], warmup=warmup, group=group, dispatch_bound=late[name] > iters // 10
            ),
            dispatch_ms=float(np.median(dispatch[name])),
            head=head[name],
        )
        for name in names
    }


def _is_ready(out) -> bool:
    leaves = jax.tree.leaves(out)
    return all(leaf.is_ready() for leaf in leaves if hasattr(leaf, "is_ready"))


def summarize(samples, *, warmup: int, group: int, dispatch_bound: bool = False) -> BenchmarkResult:
    """A `BenchmarkResult` of per-call times in ms (samples)."""
    samples = np.asarray(samples, dtype=float)
    return BenchmarkResult(
        mean=float(np.mean(samples)),
        median=float(np.median(samples)),
        stdev=float(statistics.stdev(samples)),
        min=float(np.min(samples)),
        max=float(np.max(samples)),
        p95=float(np.percentile(samples, 95)),
        p99=float(np.percentile(samples, 99)),
        iters=len(samples),
        warmup=warmup,
        group=group,
        samples=tuple(float(s) for s in samples),
        dispatch_bound=dispatch_bound,
    )


def pool(results: list[BenchmarkResult]) -> BenchmarkResult:
    """One result from several runs of the same function (their samples together)."""
    return summarize(
        [s for r in results for s in r.samples],
        warmup=results[0].warmup,
        group=results[0].group,
        dispatch_bound=any(r.dispatch_bound for r in results),
    )
