"""The XLA-scheduled methods, one module each (NONE, PIPELINE, RING_EXCHANGE, BULK); each
exposes the same per-shard functions."""

from types import ModuleType

from commgemm.config import Method, OverlapConfig
from commgemm.xla import no_overlap, pipeline, ring_exchange

#: Method -> module with all_gather_matmul / matmul_reduce_scatter / matmul_all_reduce.
BY_METHOD: dict[Method, ModuleType] = {
    Method.NONE: no_overlap,
    Method.PIPELINE: pipeline,
    Method.RING_EXCHANGE: ring_exchange,
}


def module_for(config: OverlapConfig) -> ModuleType:
    """The module that runs `config`: the fused kernels for atomic_gemm, else its method's."""
    if config.atomic_gemm:
        from commgemm.config import uses_tpu_kernels

        if uses_tpu_kernels(config):
            from commgemm.pallas_tpu import ops

            return ops
        from commgemm.mosaic_gpu import fused  # imports Pallas lazily

        return fused
    return BY_METHOD[config.method]
