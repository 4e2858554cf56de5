"""The GEMM epilogue: bias, then an optional GELU, computed in (at least) float32, cast once."""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp

Activation = Literal["gelu", "gelu_tanh"] | None
ACTIVATIONS = (None, "gelu", "gelu_tanh")


def check_epilogue(bias: jax.Array | None, activation: Activation, n: int, dtype) -> None:
    """Raises before any collective: bias must be [n] of the operands' dtype."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} is not one of {ACTIVATIONS}")
    if bias is None:
        return
    if bias.shape != (n,):
        raise ValueError(
            f"bias must have shape ({n},) (the output's last dimension), got {bias.shape}"
        )
    if bias.dtype != dtype:
        raise TypeError(f"bias has dtype {bias.dtype} but the operands have {dtype}: cast it")


def apply_epilogue(
    z: jax.Array,
    bias: jax.Array | None,
    activation: Activation,
    return_pre_activation: bool,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """y = activation(z + bias), computed in float32 (float64 for float64 data) and cast once to
    z's dtype. With return_pre_activation, (y, z + bias): the pre-GELU tensor the fused backward
    needs (the reference's aux output). JAX differentiates this part; its backward keeps z and
    bias alone (z's dtype) and recomputes the sum and GELU's derivative in the one pass over dY
    that XLA fuses it into, rather than saving float32 intermediates of z's size."""
    if bias is None and activation is None:
        return (z, z) if return_pre_activation else z
    y = jax.checkpoint(_epilogue, static_argnums=2)(z, bias, activation)
    if not return_pre_activation:
        return y
    return y, _widened_sum(z, bias).astype(z.dtype)


def _widened_sum(z: jax.Array, bias: jax.Array | None) -> jax.Array:
    """z + bias in float32 (or float64 for float64 data)."""
    acc = z.astype(jnp.promote_types(z.dtype, jnp.float32))
    return acc if bias is None else acc + bias.astype(acc.dtype)


def _epilogue(z: jax.Array, bias: jax.Array | None, activation: Activation) -> jax.Array:
    acc = _widened_sum(z, bias)
    if activation is not None:
        acc = jax.nn.gelu(acc, approximate=activation == "gelu_tanh")
    return acc.astype(z.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def gelu(x: jax.Array, approximate: bool = True) -> jax.Array:
    """jax.nn.gelu(x, approximate) of any shape, whose backward keeps x alone: the derivative is
    recomputed from x in the pass over the output's gradient (the same values as jax's autodiff
    of jax.nn.gelu), where autodiff would keep four arrays of x's size (for a grouped GEMM's
    [rows, F] activations, per layer or per step of a scan)."""
    return jax.nn.gelu(x, approximate=approximate)


def _gelu_fwd(x: jax.Array, approximate: bool):
    return gelu(x, approximate), x


def _gelu_bwd(approximate: bool, x: jax.Array, g: jax.Array):
    return jax.vjp(functools.partial(jax.nn.gelu, approximate=approximate), x)[1](g)


gelu.defvjp(_gelu_fwd, _gelu_bwd)
