"""The XLA-scheduled methods, one module each (NONE, PIPELINE, RING_EXCHANGE); each exposes the
same per-shard functions (`commgemm.backend.Backend`)."""

from types import ModuleType

from commgemm.config import Method
from commgemm.xla import no_overlap, pipeline, ring_exchange

#: Method -> module with all_gather_matmul / matmul_reduce_scatter / matmul_all_reduce.
BY_METHOD: dict[Method, ModuleType] = {
    Method.NONE: no_overlap,
    Method.PIPELINE: pipeline,
    Method.RING_EXCHANGE: ring_exchange,
}
