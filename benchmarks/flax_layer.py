"""`step.py`'s layer as Flax NNX modules, for its variants nnx and flax: the layer a user writes
with commgemm's layers, and the same layer in plain Flax.

  nnx:   LayerNorm, `commgemm.nnx.ParallelAttentionProjections`, `commgemm.nnx.ParallelMLP`
         (AUTO; FP8 rows: the row's scaling) with residuals, on every device of the mesh
         (sequence-parallel), float32 parameters, bf16 compute
  flax:  the same layer in `flax.nnx.Linear` and `flax.nnx.LayerNorm` on one device with the
         per-device sizes (as `local`): at P = 1 the plain-Flax baseline of nnx (bf16 rows)

Both start from step.py's weights (`init`: biases zero, norms' scales one), so their losses
match the other variants'. The step: loss, grad and AdamW over the modules' `nnx.Param`s.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from commgemm import nnx as cgnnx


class FlaxLayer(nnx.Module):
    """The layer in plain Flax: x [B, S, H] -> [B, S, H]."""

    def __init__(self, hidden: int, heads: int, head_dim: int, ffn: int, *, rngs, dtype):
        linear = functools.partial(nnx.Linear, rngs=rngs, dtype=dtype)
        norm = functools.partial(nnx.LayerNorm, hidden, rngs=rngs, dtype=dtype)
        self.heads, self.head_dim = heads, head_dim
        self.ln1, self.ln2 = norm(), norm()
        self.qkv, self.out = linear(hidden, 3 * heads * head_dim), linear(heads * head_dim, hidden)
        self.up, self.down = linear(hidden, ffn), linear(ffn, hidden)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, s, _ = x.shape
        qkv = self.qkv(self.ln1(x)).reshape(b, s, self.heads, 3, self.head_dim)
        a = jax.nn.dot_product_attention(*(qkv[:, :, :, i] for i in range(3)), is_causal=True)
        x = x + self.out(a.reshape(b, s, -1))
        return x + self.down(jax.nn.gelu(self.up(self.ln2(x)), approximate=True))


class CommgemmLayer(nnx.Module):
    """The layer in commgemm's Flax layers on `mesh` ("tp"): x [B, S, H], S sharded."""

    def __init__(self, hidden: int, heads: int, ffn: int, *, mesh, rngs, dtype, scaling):
        kw = dict(mesh=mesh, rngs=rngs, dtype=dtype, scaling=scaling)
        self.ln1 = nnx.LayerNorm(hidden, rngs=rngs, dtype=dtype)
        self.attn = cgnnx.ParallelAttentionProjections(hidden, heads, **kw)
        self.mlp = cgnnx.ParallelMLP(hidden, ffn, activation="gelu_tanh", **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(x)


def _load(param: nnx.Param, value) -> None:
    """value into `param`, in the parameter's dtype and sharding."""
    param.value = jax.device_put(jnp.asarray(value, param.value.dtype), param.value.sharding)


def flax_variant(size, params: dict, x: jax.Array, dtype, device) -> tuple:
    """(step, args) of the plain-Flax layer holding `params` (step.py's `init` for its heads
    and ffn columns) on `device`; x [tokens, H]."""
    d = size.hidden // size.heads
    heads, ffn = params["w_qkv"].shape[1] // (3 * d), params["w1"].shape[1]
    model = FlaxLayer(size.hidden, heads, d, ffn, rngs=nnx.Rngs(0), dtype=dtype)
    for name, w in (("qkv", "w_qkv"), ("out", "w_o"), ("up", "w1"), ("down", "w2")):
        _load(getattr(model, name).kernel, params[w])
    xs = x.reshape(size.batch, size.seq, size.hidden)
    return _step(model, xs, lambda a: jax.device_put(a, device))


#: commgemm's layers' kernels: (block, layer, step.py's weight)
KERNELS = (("attn", "qkv", "w_qkv"), ("attn", "out", "w_o"), ("mlp", "up", "w1"),
           ("mlp", "down", "w2"))  # fmt: skip


def nnx_variant(size, mesh: Mesh, params: dict, x: jax.Array, dtype, scaling) -> tuple:
    """(step, args) of commgemm's Flax layer on `mesh` holding `params` (step.py's `init`, all
    heads and ffn columns); x [tokens, H]."""
    model = CommgemmLayer(size.hidden, size.heads, size.ffn, mesh=mesh, rngs=nnx.Rngs(0),
                          dtype=dtype, scaling=scaling)  # fmt: skip
    for block, name, w in KERNELS:
        _load(getattr(getattr(model, block), name).kernel, params[w])

    def place(a):  # the layers' parameters as they laid them out, the norms replicated
        on_mesh = isinstance(a.sharding, NamedSharding) and a.sharding.mesh == mesh
        return a if on_mesh else jax.device_put(a, NamedSharding(mesh, P()))

    xs = jax.device_put(x.reshape(size.batch, size.seq, size.hidden),
                        NamedSharding(mesh, P(None, "tp", None)))  # fmt: skip
    return _step(model, xs, place)


def _step(model: nnx.Module, x: jax.Array, place) -> tuple:
    """(step: loss, grad and AdamW over the model's parameters, to be jitted; its args
    (params, opt_state, x)), as step.py's `train_step` takes them; place(array) puts each of
    the model's arrays."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    params, rest = jax.tree.map(place, params), jax.tree.map(place, rest)
    opt = optax.adamw(1e-4)

    def step(p, opt_state, x):
        def loss_fn(q):
            return jnp.mean(jnp.square(nnx.merge(graphdef, q, rest)(x).astype(jnp.float32)))

        loss, grads = jax.value_and_grad(loss_fn)(p)
        updates, opt_state = opt.update(grads, opt_state, p)
        return optax.apply_updates(p, updates), opt_state, loss

    return step, (params, opt.init(params), x)
