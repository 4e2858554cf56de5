"""commgemm: collective GEMMs for JAX with their communication overlapped.

The ops (per shard, inside `jax.shard_map`): `all_gather_matmul`, `matmul_reduce_scatter`,
`matmul_all_reduce`, `matmul_2d`, `bulk_overlap`, and for grouped GEMMs (mixture-of-experts)
`grouped_matmul`, `all_gather_grouped_matmul`, `grouped_matmul_reduce_scatter`, and for expert
parallelism `all_to_all_grouped_matmul` / `grouped_matmul_all_to_all`; the global
entry `gemm`; how each is
overlapped: `OverlapConfig` (`Method`, `Collective`, `Algorithm`), or a registered overlap
buffer's id. The fused kernels' configs: `commgemm.mosaic_gpu`. Measuring: `commgemm.bench`,
`commgemm.numerics`. Several processes: `initialize`, `launch`. Layers in Transformer
Engine's style: `dense`, `layernorm_mlp` with a `CollectiveOpSet` per GEMM; Flax NNX layers:
`commgemm.nnx` (needs flax). Quantized
operands (every op's `scaling=`): `ScalingMode`, `ScalingRecipe`, `ScalingState`, `quantize`,
`dequantize`, `ScaledTensor`, `amax`; a weight quantized once for several calls:
`quantize_weight`, `QuantizedWeight`.
"""

from commgemm.bulk import bulk_overlap
from commgemm.config import Algorithm, Collective, Method, OverlapConfig
from commgemm.distributed import initialize
from commgemm.gemm import gemm
from commgemm.grouped.collective import (
    all_gather_grouped_matmul,
    grouped_matmul_reduce_scatter,
)
from commgemm.grouped.expert_parallel import (
    all_to_all_grouped_matmul,
    grouped_matmul_all_to_all,
)
from commgemm.grouped.local import grouped_matmul
from commgemm.launch import launch
from commgemm.layers import CollectiveOpSet, dense, layernorm_mlp
from commgemm.operand_scaling import quantize_weight
from commgemm.ops import (
    all_gather_matmul,
    matmul_2d,
    matmul_all_reduce,
    matmul_reduce_scatter,
)
from commgemm.quant import (
    QuantizedWeight,
    ScaledTensor,
    ScalingMode,
    ScalingRecipe,
    ScalingState,
    amax,
    dequantize,
    quantize,
)
from commgemm.registry import (
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
    "quantize",
    "quantize_weight",
    "QuantizedWeight",
    "dequantize",
    "amax",
    "ScalingState",
    "ScalingRecipe",
    "ScalingMode",
    "ScaledTensor",
    "Algorithm",
    "Collective",
    "CollectiveOpSet",
    "Method",
    "OverlapConfig",
    "all_gather_grouped_matmul",
    "all_gather_matmul",
    "all_to_all_grouped_matmul",
    "bulk_overlap",
    "create_overlap_buffer",
    "destroy_all_overlap_buffers",
    "dense",
    "destroy_overlap_buffer",
    "gemm",
    "get_overlap_buffer",
    "grouped_matmul",
    "grouped_matmul_all_to_all",
    "grouped_matmul_reduce_scatter",
    "initialize",
    "launch",
    "layernorm_mlp",
    "matmul_2d",
    "matmul_all_reduce",
    "matmul_reduce_scatter",
]
