"""Measuring tools: `benchmark()`, `benchmark_interleaved()`, `device_spans()`,
`batch_spans_interleaved()`, `overlap_report()`, presets and method specs."""

from commgemm.bench.overlap import OverlapReport, OverlapRow, overlap_report
from commgemm.bench.problems import PRESETS, make_problem
from commgemm.bench.spans import (
    batch_spans_interleaved,
    device_periods,
    device_periods_interleaved,
    device_spans,
)
from commgemm.bench.timing import BenchmarkResult, benchmark, benchmark_interleaved

__all__ = [
    "PRESETS",
    "BenchmarkResult",
    "OverlapReport",
    "OverlapRow",
    "benchmark",
    "batch_spans_interleaved",
    "benchmark_interleaved",
    "device_periods",
    "device_periods_interleaved",
    "device_spans",
    "make_problem",
    "overlap_report",
]
