"""commgemm: collective GEMMs for JAX with their communication overlapped."""

from commgemm.config import (
    Algorithm,
    Collective,
    FusedTiles,
    Method,
    OverlapConfig,
    select_algorithm,
)
from commgemm.distributed import initialize
from commgemm.flags import xla_flags
from commgemm.gemm import gemm
from commgemm.launch import launch
from commgemm.ops import (
    all_gather_matmul,
    bulk_overlap,
    matmul_2d,
    matmul_all_reduce,
    matmul_reduce_scatter,
)
from commgemm.registry import (
    OverlapBuffer,
    create_overlap_buffer,
    destroy_all_overlap_buffers,
    destroy_overlap_buffer,
    get_overlap_buffer,
)

__version__ = "0.1.0"


def __getattr__(name: str):
    """`cg.bench` and `cg.numerics`, the measuring tools, imported on first use (they import
    the ops, so importing them here would be a cycle)."""
    if name in ("bench", "numerics"):
        import importlib

        return importlib.import_module(f"commgemm.{name}")
    raise AttributeError(f"module 'commgemm' has no attribute {name!r}")


__all__ = [
    "Algorithm",
    "Collective",
    "FusedTiles",
    "Method",
    "OverlapBuffer",
    "OverlapConfig",
    "all_gather_matmul",
    "bench",
    "bulk_overlap",
    "create_overlap_buffer",
    "destroy_all_overlap_buffers",
    "destroy_overlap_buffer",
    "gemm",
    "initialize",
    "launch",
    "get_overlap_buffer",
    "matmul_2d",
    "matmul_all_reduce",
    "matmul_reduce_scatter",
    "numerics",
    "select_algorithm",
    "xla_flags",
]
