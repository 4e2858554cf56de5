"""Measuring tools: `benchmark()`, `overlap_report()`, presets and method specs."""

from commgemm.bench.overlap import OverlapReport, OverlapRow, overlap_report
from commgemm.bench.problems import PRESETS, make_problem, parse_method, parse_shape
from commgemm.bench.timing import BenchmarkResult, benchmark

__all__ = [
    "PRESETS",
    "BenchmarkResult",
    "OverlapReport",
    "OverlapRow",
    "benchmark",
    "make_problem",
    "overlap_report",
    "parse_method",
    "parse_shape",
]
