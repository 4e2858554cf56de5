"""Transformer Engine-style functional layers over the collective GEMMs, per shard inside
`jax.shard_map`: `dense` and `layernorm_mlp`, each GEMM paired with its collective by a
`CollectiveOpSet` (an all-gather forward has a reduce-scatter backward and the reverse, which
the ops' custom VJPs already run)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from commgemm.config import Collective, OverlapConfig
from commgemm.epilogue import Activation
from commgemm.operands import dot
from commgemm.ops import all_gather_matmul, matmul_reduce_scatter
from commgemm.quant import Scaling, as_recipe
from commgemm.scaled import matmul as quantized_matmul

_BACKWARD = {
    Collective.NONE: Collective.NONE,
    Collective.ALL_GATHER: Collective.REDUCE_SCATTER,
    Collective.REDUCE_SCATTER: Collective.ALL_GATHER,
}


@dataclasses.dataclass(frozen=True)
class CollectiveOpSet:
    """A GEMM's collective in the forward pass and the complementary one of its backward."""

    forward: Collective
    backward: Collective

    def __post_init__(self) -> None:
        forward, backward = Collective(self.forward), Collective(self.backward)
        if forward not in _BACKWARD or backward is not _BACKWARD[forward]:
            pairs = ", ".join(f"({f.name}, {b.name})" for f, b in _BACKWARD.items())
            raise ValueError(
                f"CollectiveOpSet({forward.name}, {backward.name}) is no pair the layers run: "
                f"use one of {pairs}, e.g. CollectiveOpSet.create({forward.name!r})"
            )
        object.__setattr__(self, "forward", forward)
        object.__setattr__(self, "backward", backward)

    @classmethod
    def create(cls, forward_collective: Collective | str) -> CollectiveOpSet:
        """The pair for `forward_collective`: ALL_GATHER <-> REDUCE_SCATTER, NONE <-> NONE
        (an all-reduce has no sequence-parallel pair: use `matmul_all_reduce`)."""
        forward = Collective(forward_collective)
        if forward not in _BACKWARD:
            raise ValueError(
                f"no collective op set for {forward.name}: use ALL_GATHER, REDUCE_SCATTER or NONE"
            )
        return cls(forward, _BACKWARD[forward])


NO_COLLECTIVE = CollectiveOpSet.create(Collective.NONE)


def dense(
    x: jax.Array,
    kernel: jax.Array,
    bias: jax.Array | None = None,
    *,
    collective_op_set: CollectiveOpSet = NO_COLLECTIVE,
    axis_name: str | None = None,
    sequence_axis: int = 1,
    config: OverlapConfig | int | None = None,
    activation: Activation = None,
    scaling: Scaling = None,
) -> jax.Array:
    """x @ kernel (+ bias, activation) with the op set's collective along the sequence.

    Args:
      x: [B, S/P, H] sequence-parallel rows (ALL_GATHER), or [B, S, F/P] (REDUCE_SCATTER), or any
        [..., K] (NONE).
      kernel: [H, F/P] column shard (ALL_GATHER), [F/P, H] row shard (REDUCE_SCATTER), [K, N].
      bias: [N] (the output's last dimension; sharded like it).
      sequence_axis: x's sequence dimension (gathered or scattered).
      scaling: quantized operands (FP8 and the block modes; see commgemm.scaled).
    Returns:
      [B, S, F/P] (ALL_GATHER), [B, S/P, H] (REDUCE_SCATTER), [..., N] (NONE).
    """
    forward = collective_op_set.forward
    if forward is Collective.NONE:
        if as_recipe(scaling) is None:
            wide = jnp.promote_types(x.dtype, jnp.float32).name  # float32 (float64 for float64)
            out = dot(x, kernel, ((x.ndim - 1,), (0,)), accumulate_dtype=wide, result_dtype=wide)
        else:
            out = quantized_matmul(x, kernel, scaling)
        out = out if bias is None else out + bias.astype(out.dtype)
        out = out.astype(x.dtype)
        if activation is not None:
            out = jax.nn.gelu(out, approximate=activation == "gelu_tanh")
        return out
    if axis_name is None:
        raise ValueError(f"dense with {forward.name} needs the mesh axis_name of its collective")
    op = all_gather_matmul if forward is Collective.ALL_GATHER else matmul_reduce_scatter
    return op(
        x,
        kernel,
        axis_name,
        config=config,
        axis=sequence_axis,
        bias=bias,
        activation=activation,
        scaling=scaling,
    )


def layernorm(x: jax.Array, gamma: jax.Array, beta: jax.Array, eps: float = 1e-6) -> jax.Array:
    """LayerNorm over the last dimension, in float32, cast back to x's dtype."""
    wide = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    mean = wide.mean(-1, keepdims=True)
    var = ((wide - mean) ** 2).mean(-1, keepdims=True)
    y = (wide - mean) * jax.lax.rsqrt(var + eps) * gamma + beta
    return y.astype(x.dtype)


def layernorm_mlp(
    x: jax.Array,
    gamma: jax.Array,
    beta: jax.Array,
    kernels: tuple[jax.Array, jax.Array],
    biases: tuple[jax.Array | None, jax.Array | None] = (None, None),
    *,
    collective_op_sets: tuple[CollectiveOpSet, CollectiveOpSet] = (
        CollectiveOpSet.create(Collective.ALL_GATHER),
        CollectiveOpSet.create(Collective.REDUCE_SCATTER),
    ),
    axis_name: str,
    activation: Activation = "gelu",
    sequence_axis: int = 1,
    config: OverlapConfig | int | None = None,
    scaling: Scaling = None,
) -> jax.Array:
    """LayerNorm, then dense (column-parallel, all-gather + GEMM, bias, activation), then dense
    (row-parallel, GEMM + reduce-scatter, bias): a sequence-parallel MLP block.

    Args:
      x: [B, S/P, H] this shard's rows of the sequence; gamma, beta: [H].
      kernels: ([H, F/P], [F/P, H]); biases: ([F/P] or None, [H] or None).
    Returns:
      [B, S/P, H], the block's output for this shard's rows (no residual added).
    """
    shared = dict(axis_name=axis_name, sequence_axis=sequence_axis, config=config, scaling=scaling)
    h = layernorm(x, gamma, beta)
    h = dense(
        h,
        kernels[0],
        biases[0],
        collective_op_set=collective_op_sets[0],
        activation=activation,
        **shared,
    )
    return dense(h, kernels[1], biases[1], collective_op_set=collective_op_sets[1], **shared)
