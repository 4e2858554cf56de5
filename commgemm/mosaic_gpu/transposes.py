"""Transposes of 1-byte (float8) operands on CUDA GPUs: Hopper's float8 wgmma reads both
operands K-major only, so the float8 GEMMs need copies with the last two axes swapped (the
experts' and dense weights' values [..., N, K] for the forward, the tokens' rows [K, M] and
dY's [N, M] for dW).

Each is one Pallas Triton kernel on CUDA GPUs, XLA's transpose elsewhere: `triton_transposed`
copies float8 values transposed; `triton_quantized_swapped` quantizes a 16-bit weight and
writes its float8 values in both layouts, reading the weight once (a weight's forward and dX
read both). The kernels are custom calls, which XLA neither fuses into the operand's producer
nor lays the producer out for. XLA's own transpose of a float8 operand fuses its producer into
a pass that reads it at transposed addresses (the quantizing convert of a 16-bit weight, the
row gather of the MoE block's rows), several times slower than a copy; the kernels read and
write each byte once."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from commgemm.quant import clip_cast
from commgemm.vma import out_struct, varying_like

#: The kernels' tile (TILE x TILE elements a program); their operands' last two dimensions are
#: whole TILEs (`padded_rows_transposed`'s rows: any number).
TILE = 128
#: Warps a program of `triton_quantized_swapped` runs on.
QUANTIZE_WARPS = 8


def swapped(q: jax.Array) -> jax.Array:
    """q [..., M, C] -> [..., C, M], `jnp.swapaxes(q, -1, -2)`: on CUDA GPUs the Pallas Triton
    kernel where q is 1-byte with M and C whole TILEs, XLA's transpose elsewhere."""
    whole = q.ndim >= 2 and q.size and not (q.shape[-1] % TILE or q.shape[-2] % TILE)
    by_xla = functools.partial(jnp.swapaxes, axis1=-1, axis2=-2)
    return _on_cuda((q,), _transpose_kernel(q, q.shape[-2] if whole else None), by_xla)


def padded_rows_transposed(q: jax.Array) -> jax.Array:
    """q [M, C] -> [C, M'] (M' = M rounded up to TILE, zeros past M): the float8 dW kernel's
    operands, its K loops over whole TILEs of tokens. On CUDA GPUs, for C whole TILEs, the
    Pallas Triton kernel; elsewhere XLA's transpose and pad."""
    m, c = q.shape
    cols = -(-m // TILE) * TILE

    def by_xla(q):
        return jnp.pad(q.T, ((0, 0), (0, cols - m)))

    return _on_cuda((q,), _transpose_kernel(q, cols if m and not c % TILE else None), by_xla)


def _transpose_kernel(q: jax.Array, cols: int | None):
    """`triton_transposed` with `cols`, or None where it does not take q (cols None, or q not
    1-byte)."""
    if cols is None or q.dtype.itemsize != 1:
        return None
    return functools.partial(triton_transposed, cols=cols)


def _on_cuda(operands: tuple, kernel, by_xla):
    """kernel(*operands) on CUDA GPUs and by_xla(*operands) elsewhere; by_xla everywhere where
    kernel is None (the kernel does not take the operands)."""
    if kernel is None:
        return by_xla(*operands)
    return lax.platform_dependent(*operands, cuda=kernel, default=by_xla)


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


def quantized_swapped(x: jax.Array, scale: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """x [..., M, C] quantized by a tensor `scale` (float32, the factor that quantizes) to the
    float8 `dtype` as `quant.quantize` rounds (`quant.clip_cast(x * scale)`), and the same
    values with the last two dimensions swapped [..., C, M]: on CUDA GPUs, for 16-bit x with M
    and C whole TILEs, one Pallas Triton kernel that reads x once and writes both; elsewhere
    XLA's quantize and transpose. No gradient reaches x or `scale` (float8 values carry none;
    the ops pass w's gradient straight through, and the kernel has no derivative rule)."""

    def by_xla(x, scale):
        q = clip_cast(x.astype(jnp.float32) * scale, dtype)
        return q, jnp.swapaxes(q, -1, -2)

    x, scale = lax.stop_gradient(x), lax.stop_gradient(jnp.asarray(scale, jnp.float32))
    whole = x.ndim >= 2 and x.size and not (x.shape[-1] % TILE or x.shape[-2] % TILE)
    takes = whole and x.dtype.itemsize == 2 and scale.size == 1 and kernels_cast_float8()
    kernel = functools.partial(triton_quantized_swapped, dtype=dtype) if takes else None
    return _on_cuda((x, scale), kernel, by_xla)


def kernels_cast_float8() -> bool:
    """False where this process's devices are NVIDIA GPUs older than compute capability 8.9
    (Ada, Hopper), whose kernels convert to no float8 type (Triton refuses the cast there);
    True elsewhere (a program lowered for CUDA from a machine without a GPU included)."""
    device = jax.devices()[0]
    capability = str(getattr(device, "compute_capability", "") or "")
    if device.platform != "gpu" or not capability.replace(".", "").isdigit():
        return True
    major, _, minor = capability.partition(".")
    return (int(major), int(minor or 0)) >= (8, 9)


def triton_quantized_swapped(
    x: jax.Array, scale: jax.Array, dtype, interpret: bool = False
) -> tuple[jax.Array, jax.Array]:
    """x [..., M, C] (16-bit, M and C whole TILEs) times `scale` (float32, one element) clipped
    and cast to the float8 `dtype` (`quant.clip_cast`) -> (values [..., M, C], values
    [..., C, M]) in a Pallas Triton kernel: one program per TILE x TILE tile of one leading
    index reads the tile once and stores it in both layouts."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    *lead, m, c = x.shape if x.ndim >= 2 else (0, 1)
    dtype = jnp.dtype(dtype)
    ok = x.ndim >= 2 and x.dtype.itemsize == 2 and jnp.issubdtype(x.dtype, jnp.floating)
    if not ok or m % TILE or c % TILE or dtype.itemsize != 1 or jnp.size(scale) != 1:
        raise ValueError(
            f"triton_quantized_swapped: x {x.dtype}{list(x.shape)} must be 16-bit [..., M, C] "
            f"with M and C whole {TILE}s, scale one number, dtype a float8 type (got {dtype})"
        )
    batch = math.prod(lead)

    def kernel(scale_ref, x_ref, q_ref, t_ref):
        q = clip_cast(x_ref[...].astype(jnp.float32) * scale_ref[0], dtype)
        bits = lax.bitcast_convert_type(q, jnp.uint8)
        q_ref[...] = bits
        t_ref[...] = bits.T

    flat = x.reshape(batch, m, c)
    scale = varying_like(jnp.asarray(scale, jnp.float32).reshape(1), flat)
    flat = varying_like(flat, scale)
    tile = pl.BlockSpec((None, TILE, TILE), lambda b, i, j: (b, i, j))
    q, t = pl.pallas_call(
        kernel,
        grid=(batch, m // TILE, c // TILE),
        in_specs=[pl.BlockSpec((1,), lambda b, i, j: (0,)), tile],
        out_specs=[tile, pl.BlockSpec((None, TILE, TILE), lambda b, i, j: (b, j, i))],
        out_shape=[
            out_struct((batch, m, c), jnp.uint8, (flat,)),
            out_struct((batch, c, m), jnp.uint8, (flat,)),
        ],
        compiler_params=plt.CompilerParams(num_warps=QUANTIZE_WARPS),
        interpret=interpret,
    )(scale, flat)
    return (
        lax.bitcast_convert_type(q.reshape(*lead, m, c), dtype),
        lax.bitcast_convert_type(t.reshape(*lead, c, m), dtype),
    )
