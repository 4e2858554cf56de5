"""Method.PIPELINE: the operand in `num_splits` chunks, each with its own collective, so that one
chunk's collective overlaps the neighbouring chunk's GEMM (XLA runs the collectives async)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from commgemm.algorithms.common import after, matmul, reduce_dtype, split_rows
from commgemm.config import OverlapConfig
from commgemm.operands import axis_size


def all_gather_matmul(
    x: jax.Array, w: jax.Array, axis_name: str, config: OverlapConfig, *, w_transposed: bool
) -> jax.Array:
    """x [m, K] local rows of X [P*m, K] -> X @ w [P*m, n]; m divisible by num_splits."""
    size, splits = axis_size(axis_name), config.num_splits
    outs, gathered = [], None
    for chunk in split_rows(x, splits):
        gathered = lax.all_gather(after(chunk, gathered), axis_name, axis=0, tiled=True)
        outs.append(matmul(gathered, w, config, w_transposed).astype(config.out_dtype))
    # outs[c] holds chunk c of every device: [s, P, m/s, n] -> device-major [P*m, n].
    out = jnp.stack(outs).reshape(splits, size, -1, outs[0].shape[-1])
    return out.transpose(1, 0, 2, 3).reshape(-1, outs[0].shape[-1])


def matmul_reduce_scatter(
    x: jax.Array, w: jax.Array, axis_name: str, config: OverlapConfig, *, w_transposed: bool
) -> jax.Array:
    """x [M, k], w [k, n] -> local rows [M/P, n] of the sum; M divisible by P*num_splits."""
    size, splits = axis_size(axis_name), config.num_splits
    # Row block b of the output is [s, r] sub-blocks; chunk c takes sub-block c of every block.
    blocks = x.reshape(size, splits, -1, x.shape[-1])
    outs: list[jax.Array] = []
    for c in range(splits):
        chunk = blocks[:, c].reshape(-1, x.shape[-1])
        partial = matmul(chunk, w, config, w_transposed).astype(reduce_dtype(config))
        partial = after(partial, outs[-1] if outs else None)
        outs.append(lax.psum_scatter(partial, axis_name, scatter_dimension=0, tiled=True))
    return jnp.concatenate(outs).astype(config.out_dtype)


def matmul_all_reduce(
    x: jax.Array, w: jax.Array, axis_name: str, config: OverlapConfig, *, w_transposed: bool
) -> jax.Array:
    """x [M, k], w [k, n] -> the sum [M, n]; M divisible by num_splits."""
    outs: list[jax.Array] = []
    for chunk in split_rows(x, config.num_splits):
        partial = matmul(chunk, w, config, w_transposed).astype(reduce_dtype(config))
        outs.append(lax.psum(after(partial, outs[-1] if outs else None), axis_name))
    return jnp.concatenate(outs).astype(config.out_dtype)
