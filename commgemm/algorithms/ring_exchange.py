"""Method.RING_EXCHANGE: point-to-point rings of lax.ppermute; each step's transfer has no data
dependency on that step's GEMM, so XLA overlaps them.

Unidirectional: P-1 transfers. Bidirectional: chunks travel both ways at once, P//2 steps
forward and (P-1)//2 backward. `num_splits` > 1 cuts every step's chunk into that many pieces,
each sent on its own, so the first GEMM of a step can start before the whole chunk arrived.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from commgemm.algorithms.common import matmul, reduce_dtype, send, split_rows
from commgemm.config import OverlapConfig
from commgemm.operands import axis_size


def _steps(size: int, bidirectional: bool) -> tuple[int, int]:
    """Transfers (forward, backward) a ring of `size` devices needs."""
    if not bidirectional:
        return size - 1, 0
    return size // 2, (size - 1) // 2


def all_gather_matmul(
    x: jax.Array,
    w: jax.Array,
    axis_name: str,
    config: OverlapConfig,
    *,
    w_transposed: bool,
    return_gathered: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """x [m, K] local rows of X [P*m, K] -> X @ w [P*m, n] (and X, assembled from the chunks
    that passed through); m divisible by num_splits.

    Starts with the local chunk (no wait), as the reference's ring does.
    """
    size, me = axis_size(axis_name), lax.axis_index(axis_name)
    m = x.shape[0]
    piece = m // config.num_splits
    n = w.shape[0] if w_transposed else w.shape[1]
    out = jnp.zeros((size * m, n), config.out_dtype)
    gathered = jnp.zeros((size * m, x.shape[1]), x.dtype) if return_gathered else None
    n_fwd, n_bwd = _steps(size, config.bidirectional or config.aggregate)

    def write(out: jax.Array, pieces: list[jax.Array], src: jax.Array) -> jax.Array:
        for j, p in enumerate(pieces):
            out = lax.dynamic_update_slice_in_dim(out, p, src * m + j * piece, axis=0)
        return out

    def gemm(pieces: list[jax.Array], step: int) -> list[jax.Array]:
        with jax.named_scope(f"ring_ag_step{step}"):  # visible in `commgemm bench --trace`
            return [matmul(p, w, config, w_transposed).astype(config.out_dtype) for p in pieces]

    fwd = bwd = split_rows(x, config.num_splits)
    for t in range(n_fwd + 1):
        # Issue the next transfers before this step's GEMMs: they depend only on the last ones.
        next_fwd = send(fwd, axis_name, size, +1) if t < n_fwd else None
        next_bwd = send(bwd, axis_name, size, -1) if t < n_bwd else None
        if return_gathered:
            gathered = write(gathered, fwd, (me - t) % size)
            if 0 < t <= n_bwd:
                gathered = write(gathered, bwd, (me + t) % size)
        if t == 0:
            out = write(out, gemm(fwd, t), me)
        elif config.aggregate and t <= n_bwd:
            # One GEMM over the two chunks that arrived this step.
            both = gemm([jnp.concatenate([f, b]) for f, b in zip(fwd, bwd, strict=True)], t)
            out = write(out, [o[:piece] for o in both], (me - t) % size)
            out = write(out, [o[piece:] for o in both], (me + t) % size)
        else:
            out = write(out, gemm(fwd, t), (me - t) % size)
            if t <= n_bwd:
                out = write(out, gemm(bwd, t), (me + t) % size)
        fwd, bwd = next_fwd, next_bwd
    return (out, gathered) if return_gathered else out


def _reduce_scatter_chains(
    x: jax.Array, w: jax.Array, axis_name: str, config: OverlapConfig, w_transposed: bool
) -> jax.Array:
    """Local rows [M/P, n] of sum_devices(x @ w), in the accumulate dtype.

    A chain of partial sums runs round the ring: at step t a device adds its partial product for
    the block the chain will end on, then passes the sum on. The forward chain of block b visits
    b-n_fwd .. b, the backward chain b+n_bwd .. b+1, so each device contributes exactly once.
    """
    size, me = axis_size(axis_name), lax.axis_index(axis_name)
    blocks = x.reshape(size, -1, x.shape[-1])
    n_fwd, n_bwd = _steps(size, config.bidirectional)
    travel = reduce_dtype(config)

    def partial(block: jax.Array, step: int) -> list[jax.Array]:
        rows = lax.dynamic_index_in_dim(blocks, block % size, axis=0, keepdims=False)
        with jax.named_scope(f"ring_rs_step{step}"):  # visible in `commgemm bench --trace`
            return [matmul(p, w, config, w_transposed) for p in split_rows(rows, config.num_splits)]

    def add(received: list[jax.Array] | None, local: list[jax.Array]) -> list[jax.Array]:
        if received is None:
            return local
        return [r.astype(p.dtype) + p for r, p in zip(received, local, strict=True)]

    fwd = bwd = ended_b = None
    for t in range(n_fwd + 1):
        # Both the transfer of the last sums and this step's GEMMs are issued before the add.
        recv_f = None if fwd is None else send([a.astype(travel) for a in fwd], axis_name, size, 1)
        recv_b = None if bwd is None else send([a.astype(travel) for a in bwd], axis_name, size, -1)
        fwd = add(recv_f, partial(me + n_fwd - t, t))
        if t < n_bwd:
            bwd = add(recv_b, partial(me - n_bwd + t, t))
        elif t == n_bwd:
            ended_b, bwd = recv_b, None  # the backward chain ends here, on this device's block
    if ended_b is not None:
        fwd = add(ended_b, fwd)
    return jnp.concatenate(fwd)


def matmul_reduce_scatter(
    x: jax.Array, w: jax.Array, axis_name: str, config: OverlapConfig, *, w_transposed: bool
) -> jax.Array:
    """x [M, k], w [k, n] -> local rows [M/P, n] of the sum; M divisible by P*num_splits."""
    out = _reduce_scatter_chains(x, w, axis_name, config, w_transposed)
    return out.astype(config.out_dtype)


def matmul_all_reduce(
    x: jax.Array, w: jax.Array, axis_name: str, config: OverlapConfig, *, w_transposed: bool
) -> jax.Array:
    """x [M, k], w [k, n] -> the sum [M, n]: the reduce-scatter ring, then an all-gather."""
    block = _reduce_scatter_chains(x, w, axis_name, config, w_transposed)
    gathered = lax.all_gather(block.astype(reduce_dtype(config)), axis_name, axis=0, tiled=True)
    return gathered.astype(config.out_dtype)
