"""Operand checks, the N-D -> 2-D collapse at the axis boundary, and the local GEMM."""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax


def axis_size(axis_name: str) -> int:
    """The size of mesh axis `axis_name`; a clear error when it is not bound (not in shard_map)."""
    try:
        return lax.axis_size(axis_name)
    except NameError as err:
        raise ValueError(
            f"axis_name={axis_name!r} is not a mesh axis bound here: call the op inside "
            f"jax.shard_map over a mesh that has an axis named {axis_name!r}"
        ) from err


def check_dtypes(x: jax.Array, w: jax.Array) -> None:
    """Both operands floating and of one dtype (no silent promotion)."""
    for name, a in (("x", x), ("w", w)):
        if not jnp.issubdtype(a.dtype, jnp.floating):
            raise TypeError(f"{name} has dtype {a.dtype}; commgemm GEMMs need floating operands")
    if x.dtype != w.dtype:
        raise TypeError(f"x has dtype {x.dtype} but w has dtype {w.dtype}: cast one so both match")


def check_matmul_shapes(
    x: jax.Array, w: jax.Array, *, w_transposed: bool = False
) -> tuple[int, int]:
    """x [..., K] and w [K, n] (or [n, K] when w_transposed); returns (K, n)."""
    if x.ndim < 2:
        raise ValueError(f"x must have at least 2 dimensions [..., rows, K], got shape {x.shape}")
    if w.ndim != 2:
        raise ValueError(f"w must be 2-D [K, n], got shape {w.shape}")
    k_w, n = (w.shape[1], w.shape[0]) if w_transposed else w.shape
    if x.shape[-1] != k_w:
        layout = "[n, K] (w_transposed)" if w_transposed else "[K, n]"
        raise ValueError(
            f"contracting dimensions differ: x {x.shape} has K={x.shape[-1]}, "
            f"w {w.shape} as {layout} has K={k_w}"
        )
    return k_w, n


def check_divisible(size: int, by: int, what: str, why: str) -> None:
    if size % by:
        raise ValueError(f"{what}={size} must be divisible by {why}={by}")


def normalize_axis(axis: int, ndim: int) -> int:
    """`axis` of x as a non-negative index; it must be a row dimension, not the last (K)."""
    if not -ndim <= axis < ndim or axis % ndim == ndim - 1:
        raise ValueError(
            f"axis={axis} must name a row dimension of x, one of 0..{ndim - 2} "
            f"(x has {ndim} dimensions; the last is the contracting one)"
        )
    return axis % ndim


def collapse_rows(x: jax.Array, axis: int) -> tuple[jax.Array, Callable[[jax.Array], jax.Array]]:
    """x [..., K] -> x2d [rows, K] with dimension `axis` outermost, and the inverse for a result.

    The inverse takes a 2-D result [rows', n] whose rows' is a multiple of x2d's rows (gathered)
    or a divisor of it (scattered) and restores x's other row dimensions around `axis`.
    """
    moved = jnp.moveaxis(x, axis, 0)
    inner = moved.shape[1:-1]
    x2d = moved.reshape(math.prod(moved.shape[:-1]), x.shape[-1])  # -1 is ambiguous at K = 0

    def restore(out2d: jax.Array) -> jax.Array:
        lead = out2d.shape[0] // math.prod(inner) if math.prod(inner) else 0
        out = out2d.reshape(lead, *inner, out2d.shape[-1])
        return jnp.moveaxis(out, 0, axis)

    return x2d, restore


def dot(
    lhs: jax.Array, rhs: jax.Array, dims, *, accumulate_dtype: str, result_dtype, out_sharding=None
) -> jax.Array:
    """lax.dot_general(lhs, rhs, (dims, no batch)) accumulated in `accumulate_dtype`, returned
    in `result_dtype` (and `out_sharding`, for operands on Explicit mesh axes).

    A float32 accumulator with a 16-bit result is asked of XLA as a dot with a 16-bit result:
    its bf16/fp16 dots accumulate in float32 on CPU and GPU (cuBLAS compute type 32F) and round
    once at the end, the same as accumulating in float32 and casting, but without writing a
    float32 result and reading it back (on 2 GPUs that separate cast made the serial llama70b
    GEMM+RS 10% slower; docs/performance.md).
    """
    result = jnp.dtype(result_dtype)
    direct = (
        jnp.dtype(accumulate_dtype) == jnp.float32
        and result.itemsize == 2
        and jnp.issubdtype(result, jnp.floating)
    )
    out = lax.dot_general(
        lhs,
        rhs,
        (dims, ((), ())),
        preferred_element_type=result if direct else accumulate_dtype,
        out_sharding=out_sharding,
    )
    return out.astype(result)
