"""Method.PIPELINE: the operand in `num_splits` chunks, each with its own collective, so that one
chunk's collective overlaps the neighbouring chunk's GEMM (XLA runs the collectives async)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from commgemm.config import OverlapConfig
from commgemm.operands import axis_size
from commgemm.xla.common import after, matmul, reduce_dtype, split_rows


def all_gather_matmul(
    x: jax.Array,
    w: jax.Array,
    axis_name: str,
    config: OverlapConfig,
    *,
    w_transposed: bool,
    return_gathered: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """x [m, K] local rows of X [P*m, K] -> X @ w [P*m, n] (and X); m divisible by num_splits."""
    size, splits = axis_size(axis_name), config.num_splits
    outs, gathered = [], []
    for chunk in split_rows(x, splits):
        # Chunk c's gather waits for gather c-1 (so XLA cannot combine them) and for GEMM c-2
        # (so the scheduler runs GEMM c-1 beside it rather than all gathers first).
        previous = (gathered[-1:], outs[-2:-1])
        gathered.append(lax.all_gather(after(chunk, previous), axis_name, axis=0, tiled=True))
        outs.append(matmul(gathered[-1], w, config, w_transposed, result_dtype=config.out_dtype))
    out = _device_major(outs, size)
    return (out, _device_major(gathered, size)) if return_gathered else out


def _device_major(chunks: list[jax.Array], size: int) -> jax.Array:
    """chunks[c] holds chunk c of every device, [P*r, d] -> device-major rows [P*s*r, d]."""
    stacked = jnp.stack(chunks).reshape(len(chunks), size, -1, chunks[0].shape[-1])
    return stacked.transpose(1, 0, 2, 3).reshape(-1, chunks[0].shape[-1])


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
        partial = matmul(chunk, w, config, w_transposed, result_dtype=reduce_dtype(config))
        partial = after(partial, outs[-1:])
        outs.append(lax.psum_scatter(partial, axis_name, scatter_dimension=0, tiled=True))
    return jnp.concatenate(outs).astype(config.out_dtype)


def matmul_all_reduce(
    x: jax.Array, w: jax.Array, axis_name: str, config: OverlapConfig, *, w_transposed: bool
) -> jax.Array:
    """x [M, k], w [k, n] -> the sum [M, n]; M divisible by num_splits."""
    outs: list[jax.Array] = []
    for chunk in split_rows(x, config.num_splits):
        partial = matmul(chunk, w, config, w_transposed, result_dtype=reduce_dtype(config))
        outs.append(lax.psum(after(partial, outs[-1:]), axis_name))
    return jnp.concatenate(outs).astype(config.out_dtype)
