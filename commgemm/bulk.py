"""`bulk_overlap`: Method.BULK, a local GEMM and an independent collective of another buffer,
run together (the reference system's bulk overlap), per shard inside `jax.shard_map`."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from commgemm.config import Collective
from commgemm.operands import (
    axis_size,
    check_divisible,
    check_dtypes,
    check_matmul_shapes,
    collapse_rows,
)
from commgemm.ops import ConfigLike
from commgemm.plan import with_dtypes
from commgemm.registry import resolve
from commgemm.xla.bulk import bulk_overlap as _bulk
from commgemm.xla.common import matmul


def bulk_overlap(
    x: jax.Array,
    w: jax.Array,
    comm_operand: jax.Array,
    axis_name: str,
    *,
    collective: Collective | str,
    comm_axis: int = 0,
    config: ConfigLike = None,
    w_transposed: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """BULK overlap: a local GEMM x @ w and an independent collective of `comm_operand`, together.

    Args:
      x: [..., K]; w: [K, n] (or [n, K] with w_transposed).
      comm_operand: any array; gathered (ALL_GATHER, tiled along comm_axis), reduce-scattered
        (REDUCE_SCATTER, tiled along comm_axis) or summed (ALL_REDUCE) over `axis_name`. The
        gathered and summed results are the same on every device, and typed so under
        shard_map's check_vma (invariant over `axis_name`, as `lax.psum`'s result is).
    Returns:
      (x @ w [..., n] in config.out_dtype or x's dtype, the collective's result).
    """
    cfg, _ = resolve(config)
    collective = Collective(collective)
    if collective is Collective.NONE:
        raise ValueError(
            "bulk_overlap needs a collective: ALL_GATHER, REDUCE_SCATTER or ALL_REDUCE"
        )
    check_dtypes(x, w)
    check_matmul_shapes(x, w, w_transposed=w_transposed)
    size = axis_size(axis_name)
    if not -comm_operand.ndim <= comm_axis < comm_operand.ndim:
        raise ValueError(f"comm_axis={comm_axis} is out of range for shape {comm_operand.shape}")
    if collective is Collective.REDUCE_SCATTER:
        check_divisible(comm_operand.shape[comm_axis], size, "comm_operand's comm_axis", "P")
    cfg = with_dtypes(cfg, x.dtype).replace(collective=None)
    x2d, restore = collapse_rows(x, 0)
    if comm_operand.size == 0:  # nothing to move: the collective's (empty) result
        axis = comm_axis % comm_operand.ndim
        shape = list(comm_operand.shape)
        if collective is Collective.ALL_GATHER:
            shape[axis] *= size
        elif collective is Collective.REDUCE_SCATTER:
            shape[axis] //= size
        out = matmul(x2d, w, cfg, w_transposed, result_dtype=cfg.out_dtype)
        return restore(out), jnp.zeros(shape, comm_operand.dtype)
    out, comm = _bulk(
        x2d,
        w,
        comm_operand,
        axis_name,
        cfg,
        collective=collective,
        comm_axis=comm_axis % comm_operand.ndim,
        w_transposed=w_transposed,
    )
    return restore(out), comm
