"""Method.NONE: the lax collective, then one GEMM (or the GEMM, then the collective).

The serial baseline every other method is measured against.
"""

from __future__ import annotations

import jax
from jax import lax

from commgemm.config import OverlapConfig
from commgemm.xla.common import matmul, reduce_dtype


def all_gather_matmul(
    x: jax.Array,
    w: jax.Array,
    axis_name: str,
    config: OverlapConfig,
    *,
    w_transposed: bool,
    return_gathered: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """x [m, K] local rows of X [P*m, K]; w [K, n] -> all_gather(x) @ w [P*m, n] (and X)."""
    gathered = lax.all_gather(x, axis_name, axis=0, tiled=True)
    out = matmul(gathered, w, config, w_transposed, result_dtype=config.out_dtype)
    return (out, gathered) if return_gathered else out


def matmul_reduce_scatter(
    x: jax.Array, w: jax.Array, axis_name: str, config: OverlapConfig, *, w_transposed: bool
) -> jax.Array:
    """x [M, k], w [k, n] (K sharded) -> local rows [M/P, n] of sum_devices(x @ w)."""
    partial = matmul(x, w, config, w_transposed, result_dtype=reduce_dtype(config))
    out = lax.psum_scatter(partial, axis_name, scatter_dimension=0, tiled=True)
    return out.astype(config.out_dtype)


def matmul_all_reduce(
    x: jax.Array, w: jax.Array, axis_name: str, config: OverlapConfig, *, w_transposed: bool
) -> jax.Array:
    """x [M, k], w [k, n] (K sharded) -> sum_devices(x @ w) [M, n] on every device."""
    partial = matmul(x, w, config, w_transposed, result_dtype=reduce_dtype(config))
    return lax.psum(partial, axis_name).astype(config.out_dtype)
