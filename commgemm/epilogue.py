"""The GEMM epilogue: bias, then an optional GELU, computed in (at least) float32, cast once."""

from __future__ import annotations

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
    """y = activation(z + bias). With return_pre_activation, (y, z + bias): the pre-GELU tensor
    the backward pass needs (the reference's aux output). JAX differentiates this part; XLA fuses
    the bias gradient and the GELU derivative into one pass over dY."""
    if bias is None and activation is None:
        return (z, z) if return_pre_activation else z
    wide = jnp.promote_types(z.dtype, jnp.float32)  # float32, or float64 for float64 data
    acc = z.astype(wide)
    if bias is not None:
        acc = acc + bias.astype(wide)
    pre = acc.astype(z.dtype)
    if activation is not None:
        acc = jax.nn.gelu(acc, approximate=activation == "gelu_tanh")
    y = acc.astype(z.dtype)
    return (y, pre) if return_pre_activation else y
