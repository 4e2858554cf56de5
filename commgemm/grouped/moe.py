"""The mixture-of-experts block on one shard (inside `jax.shard_map`): top-k routing, the k
copies of each token sorted by expert, dispatched to their experts' shards with the experts'
grouped GEMMs (`grouped.expert_parallel`), back, and the gated combine.

Sorting and unsorting the token copies are row permutations (`grouped.blocks.permuted`), forward
and backward: a token's k copies are its row repeated k times, so the dispatch's gradient is a
gather and a sum over the k copies, and so is the combine, with no scatter-add (a scatter-add of
bf16 rows, the gather's transpose, ran atomics at a fraction of the memory's bandwidth).

Without a capacity nothing is dropped, so every shard must be able to take all m*k copies from
every shard: the exchanges move, and the experts' activations hold, P*m*k rows a shard where
m*k arrive on average. A capacity factor cf caps each expert at c = ceil(cf * m*k / E) copies
from each shard (the first c in token order; the rest dropped, adding nothing to their
tokens' outputs), as GShard and Switch Transformer do, and the rows a shard sends a shard at
e*c: the exchanges and the activations shrink about P / cf times.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from commgemm.grouped.blocks import inverse_permutation, permuted
from commgemm.grouped.scaling import copied_rows
from commgemm.quant import amax


def router_logits(x: jax.Array, router: jax.Array) -> jax.Array:
    """The router's logits of tokens x [m, H]: x @ router [H, E] in x's dtype, [m, E]."""
    return x @ router.astype(x.dtype)


def top_k_routing(logits: jax.Array, k: int):
    """Top-k routing of tokens [m, E] logits: (expert [m*k], gate [m*k], token [m*k]) for each
    token's k choices (token-major), gates the softmax over the chosen k."""
    values, experts = jax.lax.top_k(logits, k)
    gates = jax.nn.softmax(values.astype(jnp.float32), axis=-1)
    tokens = jnp.repeat(jnp.arange(logits.shape[0]), k)
    return experts.reshape(-1), gates.reshape(-1), tokens


def moe_per_shard(x, router, w1, w2, *, k, axis_name, config, scaling, activation="gelu",
                  amax_over=None, capacity_factor: float | None = None):  # fmt: skip
    """The MoE block on one shard's tokens x [m, H] with its experts w1 [e, H, F], w2 [e, F, H]
    (experts sharded over `axis_name`, P*e in all; router [H, P*e] replicated): route, sort the
    k copies of each token by expert, dispatch them to their experts' shards with the expert
    GEMMs (`config`'s method; `grouped.expert_parallel.expert_mlp`), back, combine: [m, H] in
    x's dtype. `scaling`: the two grouped GEMMs' (one for both, or a pair: up, down).
    `activation`: between them, by name ("gelu": exact, "gelu_tanh", None). With
    `amax_over` (the mesh axes the tokens are sharded over) also returns each GEMM's operands'
    amax over the whole tensors ({"up": {"x", "w"}, "down": {"x", "w"}}: delayed scaling's
    next states). `capacity_factor` (> 0; default none: no token dropped): each expert takes at
    most ceil(capacity_factor * m*k / E) copies from this shard, the first in token order
    (module docstring)."""
    from commgemm.grouped.expert_parallel import expert_mlp

    (m, h), size, e = x.shape, jax.lax.axis_size(axis_name), w1.shape[0]
    expert, gate, _ = top_k_routing(router_logits(x, router), k)
    order = jnp.argsort(expert, stable=True)  # copy i of the sorted rows is copy order[i]
    counts = jnp.bincount(expert, length=size * e).astype(jnp.int32)
    capacity = None
    if capacity_factor is not None:
        order, counts, capacity = _capped_order(order, expert, counts, capacity_factor, e)
    inverse = inverse_permutation(order)
    copies = jnp.repeat(x, k, axis=0)  # [m*k, H], token-major as the routing's rows
    up = scaling[0] if isinstance(scaling, tuple) else scaling
    quantized = copied_rows(x, order // k, up, axis_name)  # each token quantized once
    out, y = expert_mlp(permuted(copies, order, inverse), w1, w2, counts, axis_name,
                        activation=activation, config=config, scaling=scaling,
                        capacity=capacity, x_quantized=quantized)  # fmt: skip
    per_token = permuted(out, inverse, order).reshape(m, k, h)  # back in token-major order
    out = _combined(per_token, gate.reshape(m, k, 1)).astype(x.dtype)
    if amax_over is None:
        return out
    seen = lambda a: amax(jax.lax.stop_gradient(a), amax_over)  # noqa: E731
    return out, {"up": {"x": seen(x), "w": seen(w1)}, "down": {"x": seen(y), "w": seen(w2)}}


@functools.partial(jax.checkpoint, prevent_cse=False)
def _combined(per_token: jax.Array, gate: jax.Array) -> jax.Array:
    """The k expert outputs of each token [m, k, H] weighted by its gates [m, k, 1] (float32)
    and added: [m, H] float32. Rematerialized, so that autodiff keeps per_token in its own
    dtype for the gates' gradient, not its float32 copy (twice the bytes, kept per layer or
    per step of a scan); without the optimization barrier, so XLA fuses as before."""
    return jnp.sum(per_token.astype(jnp.float32) * gate, axis=1)


def load_balancing_loss(
    logits: jax.Array, k: int, axis_names: str | tuple[str, ...] = ()
) -> jax.Array:
    """Switch Transformer's auxiliary load-balancing loss of top-k routing: E * sum_e f_e * p_e,
    f_e the fraction of the token copies (k a token) routed to expert e, p_e the router's mean
    softmax probability of expert e. logits: the router's [..., E], any float dtype; the loss is
    a float32 scalar (float64 for float64 logits). Inside `jax.shard_map`, `axis_names` are the
    mesh axes the tokens are split over: the shards' counts and sums are added over them, and
    every shard returns the loss of all tokens. 1 where the copies and the probabilities are
    spread evenly, up to E where every token picks one expert with certainty. Differentiable in
    p_e (f_e counts discrete choices): add it, scaled (about 0.01), to the training loss to keep
    the experts' loads even."""
    if not 1 <= k <= logits.shape[-1]:
        raise ValueError(f"k={k} must be between 1 and the experts' count {logits.shape[-1]}")
    experts = logits.shape[-1]
    logits = logits.reshape(-1, experts).astype(jnp.promote_types(logits.dtype, jnp.float32))
    chosen = jax.lax.top_k(logits, k)[1]
    copies = jnp.sum(jax.nn.one_hot(chosen, experts, dtype=logits.dtype), axis=(0, 1))
    probabilities = jnp.sum(jax.nn.softmax(logits, axis=-1), axis=0)
    sums = (copies, probabilities, jnp.asarray(logits.shape[0], logits.dtype))
    if axis_names:
        sums = jax.lax.psum(sums, axis_names)
    copies, probabilities, tokens = sums
    return experts * jnp.sum(copies / (tokens * k) * probabilities / tokens)


def expert_capacity(copies: int, experts: int, capacity_factor: float) -> int:
    """The copies each expert takes from a shard of `copies` token copies (m*k): at least 1."""
    bad = isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float))
    if bad or not capacity_factor > 0:
        raise ValueError(f"capacity_factor must be a number > 0, got {capacity_factor!r}")
    return max(1, math.ceil(capacity_factor * copies / experts))


def _capped_order(order, expert, counts, capacity_factor: float, per_shard: int):
    """The expert-sorted order with each expert's copies past its capacity c moved to the end:
    (order [m*k], counts [E] at most c, the rows a shard sends a shard: per_shard * c, in 8s)."""
    n, experts = order.shape[0], counts.shape[0]
    c = expert_capacity(n, experts, capacity_factor)
    first = jnp.cumsum(counts) - counts
    rank = jnp.arange(n, dtype=jnp.int32) - first[expert[order]]  # within its expert
    kept_first = jnp.argsort(rank >= c, stable=True)
    rows = min(n, -(-per_shard * c // 8) * 8)
    return order[kept_first], jnp.minimum(counts, c), rows
