"""One module per overlap method; each exposes the same per-shard functions."""

from types import ModuleType

from commgemm.algorithms import no_overlap, pipeline, ring_exchange
from commgemm.config import Method

#: Method -> module with all_gather_matmul / matmul_reduce_scatter / matmul_all_reduce.
BY_METHOD: dict[Method, ModuleType] = {
    Method.NONE: no_overlap,
    Method.PIPELINE: pipeline,
    Method.RING_EXCHANGE: ring_exchange,
}
