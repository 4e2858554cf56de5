"""A mixture-of-experts feed-forward block with expert parallelism, written with commgemm's
grouped GEMMs: top-1 routing, tokens sorted by expert, dispatched to their experts' shards while
the expert GEMMs run (`cg.all_to_all_grouped_matmul`), GELU, and the way back
(`cg.grouped_matmul_all_to_all`), checked against the same block without sharding.

    python examples/moe_block.py          # 8 virtual CPU devices without an accelerator
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import commgemm as cg


def route(x: jax.Array, router: jax.Array, experts: int):
    """Top-1 routing: (order that sorts the tokens by expert, counts per expert, gate)."""
    logits = x @ router  # [m, E]
    expert = jnp.argmax(logits, axis=-1)
    gate = jax.nn.softmax(logits, axis=-1)[jnp.arange(x.shape[0]), expert]
    order = jnp.argsort(expert, stable=True)
    return order, jnp.bincount(expert, length=experts).astype(jnp.int32), gate


def moe_shard(x, router, w1, w2, axis_name: str, config=None):
    """Per shard: x [m, H] this shard's tokens; w1 [e, H, F], w2 [e, F, H] this shard's experts."""
    experts = router.shape[1]
    order, counts, gate = route(x, router, experts)
    y, received = cg.all_to_all_grouped_matmul(x[order], w1, counts, axis_name, config=config)
    out = cg.grouped_matmul_all_to_all(
        jax.nn.gelu(y), w2, received, counts, axis_name, config=config
    )
    return jnp.zeros_like(out).at[order].set(out) * gate[:, None]


def moe_reference(x, router, w1, w2):
    """The same block on one device (every expert's weights in one array)."""
    order, counts, gate = route(x, router, router.shape[1])
    h = jax.nn.gelu(jax.lax.ragged_dot(x[order], w1, counts))
    out = jax.lax.ragged_dot(h, w2, counts)
    return jnp.zeros_like(out).at[order].set(out) * gate[:, None]


def check(devices=None, tokens: int = 64, hidden: int = 32, ffn: int = 48, seed: int = 0):
    """Runs the sharded block on `devices` (one expert pair per device) against the reference;
    returns the largest difference (float32)."""
    devices = devices or jax.devices()
    size = len(devices)
    mesh = Mesh(np.array(devices), ("ep",))
    rng = np.random.default_rng(seed)
    experts = 2 * size
    x = rng.standard_normal((size * tokens, hidden)).astype(np.float32)
    router = rng.standard_normal((hidden, experts)).astype(np.float32)
    w1 = (rng.standard_normal((experts, hidden, ffn)) / hidden**0.5).astype(np.float32)
    w2 = (rng.standard_normal((experts, ffn, hidden)) / ffn**0.5).astype(np.float32)
    ring = cg.OverlapConfig(method="ring_exchange")
    sharded = jax.jit(
        jax.shard_map(
            lambda a, r, b, c: moe_shard(a, r, b, c, "ep", config=ring),
            mesh=mesh,
            in_specs=(P("ep"), P(), P("ep"), P("ep")),
            out_specs=P("ep"),
        )
    )
    got = sharded(x, router, w1, w2)
    want = jnp.concatenate(
        [moe_reference(x[s * tokens : (s + 1) * tokens], router, w1, w2) for s in range(size)]
    )
    return float(jnp.abs(got - want).max())


if __name__ == "__main__":
    from commgemm.devices import setup_devices

    setup_devices()  # 8 virtual CPU devices where there is no accelerator
    print(f"MoE block on {len(jax.devices())} devices: max |difference| {check():.2e}")
