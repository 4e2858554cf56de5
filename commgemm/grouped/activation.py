"""The experts' activation on the rows of a receiving buffer that hold tokens.

An expert-parallel shard receives its experts' rows into a buffer sized for the worst case
(P*C rows: every source's tokens routed here), sorted by expert with the padding last; about
1/P of it holds tokens. The grouped GEMMs skip the padding, but an activation written in jnp
runs over every row, forward and backward. `activation_rows` applies GELU (exact or tanh) to
the first `live` rows only: on a Hopper GPU by a kernel (`mosaic_gpu.rows`) that zeroes the
padding's tiles without reading them, elsewhere by the activation over the whole buffer
(the padding rows come out zeros there too: a grouped GEMM's rows past its groups are zeros,
and GELU(0) = 0).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from commgemm.epilogue import ACTIVATIONS, Activation, gelu
from commgemm.vma import like_primal, varying_like

_SQRT_HALF = 1 / math.sqrt(2)
_INV_SQRT_2PI = 1 / math.sqrt(2 * math.pi)
_SQRT_2_OVER_PI = math.sqrt(2 / math.pi)
_KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def as_function(activation: Activation):
    """The jnp function a name means ("gelu": exact, "gelu_tanh"; None: the identity)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} is not one of {ACTIVATIONS}")
    if activation is None:
        return lambda y: y
    return functools.partial(gelu, approximate=activation == "gelu_tanh")


def kernel_reason(shape: tuple[int, ...], dtype) -> str | None:
    """Why `activation_rows` on a [R, F] buffer of `dtype` runs over every row here, or None
    where the kernel (`mosaic_gpu.rows`) takes it."""
    from commgemm.mosaic_gpu import rows

    if jnp.dtype(dtype) not in _KERNEL_DTYPES:
        return f"the kernel takes bf16 and f16 rows, not {jnp.dtype(dtype).name}"
    return rows.kernel_reason(shape, dtype)


def value_and_slope(x: jax.Array, approximate: bool) -> tuple[jax.Array, jax.Array]:
    """(GELU(x), GELU'(x)) of float32 x, written out: the kernel's math."""
    if approximate:
        t = jnp.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x * x * x))
        du = _SQRT_2_OVER_PI * (1.0 + 3 * 0.044715 * x * x)
        return 0.5 * x * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du
    cdf = 0.5 * (1.0 + lax.erf(x * _SQRT_HALF))
    return x * cdf, cdf + x * _INV_SQRT_2PI * jnp.exp(-0.5 * x * x)


def rows_kernel(y, live, approximate: bool, g=None, fill: bool = True) -> jax.Array:
    """The kernel: GELU(y) on y's [R, F] first `live` rows (g given: g * GELU'(y) there), zeros
    past them (not written unless `fill`), in y's dtype, typed varying as its inputs inside
    shard_map."""
    from commgemm.mosaic_gpu.grouped import stored_apart
    from commgemm.mosaic_gpu.rows import map_rows

    def math_(tiles, _):
        value, slope = value_and_slope(tiles[0], approximate)
        return (value,) if g is None else (slope * tiles[1],)

    ins = (y,) if g is None else (y, g)
    (out,) = map_rows(math_, ins, live, (y.dtype,), fill=fill)
    # the forward's result is used and (for the next GEMM's dW) kept: inside a scan, not
    # launched a second time to write the stacked copy (`stored_apart`)
    out = stored_apart(out) if g is None else out
    return varying_like(out, *ins, live)  # a Pallas result carries no varying axes of its own


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def kernel_gelu(y: jax.Array, live: jax.Array, approximate: bool, fill_grad: bool) -> jax.Array:
    """`rows_kernel`'s GELU, differentiable in y by the backward kernel (its rows past `live`
    not written unless `fill_grad`)."""
    return rows_kernel(y, live, approximate)


def _fwd(y, live, approximate, fill_grad):
    return rows_kernel(y, live, approximate), (y, live)


def _bwd(approximate, fill_grad, residuals, g):
    y, live = residuals
    dy = rows_kernel(y, live, approximate, g.astype(y.dtype), fill_grad)
    return like_primal(dy, y), None


kernel_gelu.defvjp(_fwd, _bwd)


def activation_rows(
    y: jax.Array, live: jax.Array, activation: Activation, *, fill_grad: bool = True
) -> jax.Array:
    """`activation` ("gelu", "gelu_tanh" or None) of y [R, F] (a grouped GEMM's result, rows
    past its groups zeros) whose first `live` rows (int32 scalar) hold tokens: [R, F] in y's
    dtype, zeros past `live`. Differentiable in y (its gradient zeros past `live` too, or, with
    `fill_grad=False` on the kernel, not written there: for readers of the live rows only). On
    a Hopper GPU (bf16 or f16 y; `kernel_reason`) the padding's tiles are not read, forward or
    back; elsewhere the activation runs over every row (the same values: GELU(0) = 0). The
    kernel computes in float32, rounding once to y's dtype."""
    fn = as_function(activation)
    if activation is None or kernel_reason(y.shape, y.dtype) is not None:
        return fn(y)
    return kernel_gelu(y, live, activation == "gelu_tanh", bool(fill_grad))
