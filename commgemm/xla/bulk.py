"""Method.BULK: one GEMM and one independent collective of another buffer, issued together.

This is what the reference uses in the backward pass (e.g. the dW GEMM overlapped with the
all-gather of the next layer's input). With no data dependency between the two, XLA runs the
collective asynchronously beside the GEMM.
"""

from __future__ import annotations

import jax
from jax import lax

from commgemm.config import Collective, OverlapConfig
from commgemm.vma import all_gather_invariant
from commgemm.xla.common import matmul


def bulk_overlap(
    x: jax.Array,
    w: jax.Array,
    comm_operand: jax.Array,
    axis_name: str,
    config: OverlapConfig,
    *,
    collective: Collective,
    comm_axis: int,
    w_transposed: bool,
) -> tuple[jax.Array, jax.Array]:
    """(x @ w, collective(comm_operand)): the GEMM is local; the collective acts on `comm_axis`."""
    out = matmul(x, w, config, w_transposed, result_dtype=config.out_dtype)
    if collective is Collective.ALL_GATHER:
        comm = all_gather_invariant(comm_operand, axis_name, axis=comm_axis)
    elif collective is Collective.REDUCE_SCATTER:
        comm = lax.psum_scatter(comm_operand, axis_name, scatter_dimension=comm_axis, tiled=True)
    else:
        comm = lax.psum(comm_operand, axis_name)
    return out, comm
