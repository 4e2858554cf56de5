"""Measuring tools: `benchmark()`, `benchmark_interleaved()`, `device_spans()`,
`overlap_report()`, presets and method specs."""

from commgemm.bench.overlap import OverlapReport, OverlapRow, overlap_report
from commgemm.bench.problems import PRESETS, make_problem
from commgemm.bench.spans import device_periods, device_periods_interleaved, device_spans
from commgemm.bench.timing import BenchmarkResult, benchmark, benchmark_interleaved

__all__ = [
    "PRESETS",
    "BenchmarkResult",
    "OverlapReport",
    "OverlapRow",
    "benchmark",
    "benchmark_interleaved",
    "device_periods",
    "device_periods_interleaved",
    "device_spans",
    "make_problem",
    "overlap_report",
]
