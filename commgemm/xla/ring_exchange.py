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

from commgemm.config import OverlapConfig
from commgemm.operands import axis_size
from commgemm.vma import all_gather_invariant
from commgemm.xla.common import after, matmul, reduce_dtype, send_one, split_rows


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
    in_order = after if config.chain_gemms else (lambda value, _: value)

    def write(out: jax.Array, pieces: list[jax.Array], src: jax.Array) -> jax.Array:
        for j, p in enumerate(pieces):
            out = lax.dynamic_update_slice_in_dim(out, p, src * m + j * piece, axis=0)
        return out

    def gemm(rows: jax.Array, step: int) -> jax.Array:
        with jax.named_scope(f"ring_ag_step{step}"):  # visible in `commgemm bench --trace`
            return matmul(rows, w, config, w_transposed, result_dtype=config.out_dtype)

    fwd = bwd = split_rows(x, config.num_splits)
    last = None  # the latest GEMM output; the next transfer waits for it (see below)
    for t in range(n_fwd + 1):
        if return_gathered:
            gathered = write(gathered, fwd, (me - t) % size)
            if 0 < t <= n_bwd:
                gathered = write(gathered, bwd, (me + t) % size)
        next_fwd, next_bwd = [], []
        for j in range(config.num_splits):
            # Piece j's transfer has no data dependency on this step's GEMMs, but it is held
            # until the previous piece's GEMM is done: XLA's GPU scheduler keeps one
            # collective-permute in flight and otherwise ran the first transfer alone.
            if t < n_fwd:
                next_fwd.append(send_one(after(fwd[j], last), axis_name, size, +1))
            if t < n_bwd:
                next_bwd.append(send_one(after(bwd[j], last), axis_name, size, -1))
            # GEMMs are chained in order too: otherwise XLA's dot merger fuses the pieces'
            # GEMMs (they share w) into one that waits for every piece.
            if t == 0:
                results = [(gemm(in_order(fwd[j], last), t), me)]
            elif config.aggregate and t <= n_bwd:
                both = gemm(in_order(jnp.concatenate([fwd[j], bwd[j]]), last), t)  # two chunks
                results = [(both[:piece], (me - t) % size), (both[piece:], (me + t) % size)]
            else:
                results = [(gemm(in_order(fwd[j], last), t), (me - t) % size)]
                if t <= n_bwd:
                    results.append((gemm(in_order(bwd[j], results[0][0]), t), (me + t) % size))
            for result, src in results:
                out = lax.dynamic_update_slice_in_dim(out, result, src * m + j * piece, axis=0)
            last = results[-1][0]
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
    in_order = after if config.chain_gemms else (lambda value, _: value)

    def pieces(block: jax.Array) -> list[jax.Array]:
        rows = lax.dynamic_index_in_dim(blocks, block % size, axis=0, keepdims=False)
        return split_rows(rows, config.num_splits)

    def partial(rows: jax.Array, step: int, last) -> jax.Array:
        # Chained after the previous GEMM: keeps XLA's dot merger from fusing the pieces.
        with jax.named_scope(f"ring_rs_step{step}"):  # visible in `commgemm bench --trace`
            return matmul(in_order(rows, last), w, config, w_transposed, result_dtype=travel)

    def add(received: jax.Array | None, local: jax.Array) -> jax.Array:
        """The running sum, kept in the accumulate dtype between transfers."""
        acc = jnp.dtype(config.accumulate_dtype)
        return local.astype(acc) if received is None else received.astype(acc) + local.astype(acc)

    def transfer(acc: list[jax.Array] | None, j: int, last, shift: int) -> jax.Array | None:
        # Held until the previous GEMM is done, as in all_gather_matmul.
        if acc is None:
            return None
        return send_one(after(acc[j].astype(travel), last), axis_name, size, shift)

    fwd = bwd = ended_b = None
    last = None
    for t in range(n_fwd + 1):
        rows_f = pieces(me + n_fwd - t)
        rows_b = pieces(me - n_bwd + t) if t < n_bwd else None
        new_f, new_b, ended = [], [], []
        for j in range(config.num_splits):
            recv_f, recv_b = transfer(fwd, j, last, +1), transfer(bwd, j, last, -1)
            last = partial(rows_f[j], t, last)
            new_f.append(add(recv_f, last))
            if rows_b is not None:
                last = partial(rows_b[j], t, last)
                new_b.append(add(recv_b, last))
            elif recv_b is not None:
                ended.append(recv_b)  # the backward chain ends here, on this device's block
        fwd, bwd = new_f, (new_b or None)
        ended_b = ended or ended_b
    if ended_b is not None:
        fwd = [add(e, f) for e, f in zip(ended_b, fwd, strict=True)]
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
    gathered = all_gather_invariant(block.astype(reduce_dtype(config)), axis_name)
    return gathered.astype(config.out_dtype)
