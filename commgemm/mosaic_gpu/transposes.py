"""Transposes of 1-byte (float8) operands on CUDA GPUs: Hopper's float8 wgmma reads both
operands K-major only, so the float8 GEMMs need copies with the last two axes swapped (the
experts' and dense weights' values [..., N, K] for the forward, the tokens' rows [K, M] and
dY's [N, M] for dW).

Each is one Pallas Triton kernel (`triton_transposed`) on CUDA GPUs, XLA's transpose elsewhere:
the kernel is a custom call, which XLA neither fuses into the operand's producer nor lays the
producer out for. XLA's own transpose of a float8 operand fuses its producer into a pass that
reads it at transposed addresses (the quantizing convert of a 16-bit weight, the row gather of
the MoE block's rows), several times slower than a copy; the kernel reads and writes each byte
once."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from commgemm.vma import out_struct

#: The kernel's tile (TILE x TILE bytes a program); its operands' minor dimension is whole TILEs.
TILE = 128


def swapped(q: jax.Array) -> jax.Array:
    """q [..., M, C] -> [..., C, M], `jnp.swapaxes(q, -1, -2)`: on CUDA GPUs the Pallas Triton
    kernel where q is 1-byte with M and C whole TILEs, XLA's transpose elsewhere."""
    whole = q.ndim >= 2 and q.size and not (q.shape[-1] % TILE or q.shape[-2] % TILE)
    by_xla = functools.partial(jnp.swapaxes, axis1=-1, axis2=-2)
    return _on_cuda(q, q.shape[-2] if whole else None, by_xla)


def padded_rows_transposed(q: jax.Array) -> jax.Array:
    """q [M, C] -> [C, M'] (M' = M rounded up to TILE, zeros past M): the float8 dW kernel's
    operands, its K loops over whole TILEs of tokens. On CUDA GPUs, for C whole TILEs, the
    Pallas Triton kernel; elsewhere XLA's transpose and pad."""
    m, c = q.shape
    cols = -(-m // TILE) * TILE

    def by_xla(q):
        return jnp.pad(q.T, ((0, 0), (0, cols - m)))

    return _on_cuda(q, cols if m and not c % TILE else None, by_xla)


def _on_cuda(q: jax.Array, cols: int | None, by_xla):
    """`triton_transposed(q, cols)` on CUDA GPUs and by_xla(q) elsewhere, or by_xla(q) wherever
    the kernel does not take q (cols None, or q not 1-byte)."""
    if cols is None or q.dtype.itemsize != 1:
        return by_xla(q)
    kernel = functools.partial(triton_transposed, cols=cols)
    return lax.platform_dependent(q, cuda=kernel, default=by_xla)


def triton_transposed(q: jax.Array, cols: int, interpret: bool = False) -> jax.Array:
    """q [..., M, C] (any 1-byte dtype, C whole TILEs) -> [..., C, cols] (cols >= M, whole
    TILEs, zeros past M) in a Pallas Triton kernel: one program per TILE x TILE tile of one
    leading index, its rows past M masked off the load."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    shape = q.shape if q.ndim >= 2 else (0, 1)  # a vector: C 1, refused below
    *lead, m, c = shape
    if q.ndim < 2 or q.dtype.itemsize != 1 or c % TILE or cols % TILE or cols < m:
        raise ValueError(
            f"triton_transposed: q {q.dtype}{list(q.shape)} must be 1-byte [..., M, C] with C "
            f"whole {TILE}s, cols={cols} whole {TILE}s and >= M"
        )
    batch = math.prod(lead)

    def kernel(q_ref, out_ref):
        rows = pl.program_id(1) * TILE + lax.broadcasted_iota(jnp.int32, (TILE, TILE), 0)
        out_ref[...] = plt.load(q_ref, mask=rows < m, other=0).T

    flat = lax.bitcast_convert_type(q, jnp.uint8).reshape(batch, m, c)
    out = pl.pallas_call(
        kernel,
        grid=(batch, cols // TILE, c // TILE),
        in_specs=[pl.BlockSpec((None, TILE, TILE), lambda b, i, j: (b, i, j))],
        out_specs=pl.BlockSpec((None, TILE, TILE), lambda b, i, j: (b, j, i)),
        out_shape=out_struct((batch, c, cols), jnp.uint8, (q,)),
        compiler_params=plt.CompilerParams(num_warps=4),
        interpret=interpret,
    )(flat)
    return lax.bitcast_convert_type(out.reshape(*lead, c, cols), q.dtype)
