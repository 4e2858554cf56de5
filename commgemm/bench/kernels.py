"""Where a step's device time goes: the kernels of a traced batch of steps by kind (GEMM,
collective, attention, sort, scatter, other), the collectives' exposed time (the part no other
kernel ran beside) and the longest kernels, from the GPU's own timestamps (`bench.spans`).
Kinds are read from kernel names, first match wins; a fused kernel that moves data and
multiplies (commgemm's Mosaic GPU kernels) counts as a GEMM."""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence

import jax

from commgemm.bench import spans

KINDS = {  # substrings of lower-cased kernel names
    "collective": (
        "nccl",
        "all_gather",
        "allgather",
        "reduce_scatter",
        "reducescatter",
        "all_reduce",
        "allreduce",
        "sendrecv",
        "permute",
    ),  # fmt: skip
    "gemm": ("gemm", "xmma", "nvjet", "cutlass", "cublas", "matmul", "dot", "mosaic"),
    "attention": ("softmax", "attention", "flash", "cudnn"),
    "sort": ("sort", "radix"),
    "scatter": ("scatter",),
}

Event = tuple[float, float, str]  # (start ns, end ns, kernel name)


def kind(name: str) -> str:
    """The kind of a kernel by its name: a key of `KINDS`, or "other"."""
    low = name.lower()
    return next((k for k, subs in KINDS.items() if any(s in low for s in subs)), "other")


def exposed_ms(events: Sequence[Event], steps: int) -> float:
    """Collective kernels' time with no other kernel beside them, ms per step."""
    compute = [(s, e) for s, e, n in events if kind(n) != "collective"]
    total = 0.0
    for s, e, n in events:
        if kind(n) == "collective":
            covered = sum(max(0.0, min(e, ce) - max(s, cs)) for cs, ce in compute)
            total += max(0.0, (e - s) - covered)
    return total / steps / 1e6


def breakdown(events: Sequence[Event], steps: int, top: int = 10) -> dict:
    """One GPU's kernels of `steps` steps -> {"ms_by_kind", "collective_exposed_ms",
    "top_kernels_ms" (the `top` longest by total time, names cut at 90 characters)}, ms per
    step."""
    by_kind, by_name = collections.Counter(), collections.Counter()
    for start, end, name in events:
        by_kind[kind(name)] += end - start
        by_name[name[:90]] += end - start
    per = lambda ns: round(ns / steps / 1e6, 3)  # noqa: E731
    return {
        "ms_by_kind": {k: per(v) for k, v in by_kind.items()},
        "collective_exposed_ms": round(exposed_ms(events, steps), 3),
        "top_kernels_ms": {n: per(v) for n, v in by_name.most_common(top)},
    }


def profile(fn: Callable, args: Sequence, steps: int = 4, top: int = 10) -> dict:
    """`breakdown` of `steps` calls of fn(*args) back to back (run twice first), traced on the
    process's first GPU. Raises RuntimeError without GPU activity."""
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    run = lambda: jax.block_until_ready([fn(*args) for _ in range(steps)])  # noqa: E731
    return breakdown(spans._gpu_events(spans._trace(run))[0], steps, top)
