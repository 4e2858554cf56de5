"""dense / layernorm_mlp with CollectiveOpSet against their unsharded twins: values and
gradients, every method, both shard_map settings, alone and as the body of a lax.scan over
stacked layers (remat'd and not)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import P, mesh1d, shard

import commgemm as cg
from commgemm.layers import CollectiveOpSet, dense, layernorm, layernorm_mlp

#: the default accumulate_dtype: float64 operands accumulate in float64 all the same
METHODS = [
    cg.OverlapConfig(),
    cg.OverlapConfig(method="pipeline", num_splits=2),
    cg.OverlapConfig(method="ring_exchange"),
]


def test_collective_op_set_pairs():
    ag = CollectiveOpSet.create("all_gather")
    assert (ag.forward, ag.backward) == (cg.Collective.ALL_GATHER, cg.Collective.REDUCE_SCATTER)
    rs = CollectiveOpSet.create(cg.Collective.REDUCE_SCATTER)
    assert rs.backward is cg.Collective.ALL_GATHER
    assert CollectiveOpSet.create("none").backward is cg.Collective.NONE
    with pytest.raises(ValueError, match="no collective op set for ALL_REDUCE"):
        CollectiveOpSet.create("all_reduce")


@pytest.mark.parametrize("cfg", METHODS, ids=lambda c: c.method.name)
@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "novma"])
def test_layernorm_mlp_matches_its_twin(rng, cfg, check_vma):
    """[B, S, H] sequence-parallel over 4 devices: the block's output and gradients equal the
    unsharded block's."""
    size, b, s, h, f = 4, 2, 16, 8, 12
    x = rng.standard_normal((b, s, h))
    gamma, beta = rng.standard_normal(h), rng.standard_normal(h)
    k1, k2 = rng.standard_normal((h, f)), rng.standard_normal((f, h))
    b1, b2 = rng.standard_normal(f), rng.standard_normal(h)
    block = shard(
        lambda x_, g, bt, a, c, d, e: layernorm_mlp(
            x_, g, bt, (a, c), (d, e), axis_name="x", config=cfg
        ),
        mesh1d(size),
        (P(None, "x"), P(), P(), P(None, "x"), P("x"), P("x"), P()),
        P(None, "x"),
        check_vma=check_vma,
    )

    def twin(x_, g, bt, a, c, d, e):
        hidden = jax.nn.gelu(layernorm(x_, g, bt) @ a + d, approximate=False)
        return hidden @ c + e

    args = (x, gamma, beta, k1, k2, b1, b2)
    np.testing.assert_allclose(
        np.asarray(block(*args)), np.asarray(twin(*args)), rtol=1e-9, atol=1e-9
    )
    argnums = tuple(range(7))
    got = jax.jit(jax.grad(lambda *a: jnp.sum(jnp.sin(block(*a))), argnums))(*args)
    want = jax.grad(lambda *a: jnp.sum(jnp.sin(twin(*a))), argnums)(*args)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-8, atol=1e-8)


def test_dense_without_collective_and_errors(rng):
    x, k, bias = rng.standard_normal((2, 3, 4)), rng.standard_normal((4, 5)), rng.standard_normal(5)
    np.testing.assert_allclose(np.asarray(dense(x, k, bias)), x @ k + bias, rtol=1e-12)
    with pytest.raises(ValueError, match="needs the mesh axis_name"):
        dense(x, k, collective_op_set=CollectiveOpSet.create("all_gather"))


@pytest.mark.parametrize("remat", [False, True], ids=["plain", "remat"])
@pytest.mark.parametrize("cfg", METHODS, ids=lambda c: c.method.name)
@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "novma"])
def test_scan_over_layers(rng, cfg, check_vma, remat):
    """A residual stack of 3 MLP blocks as a lax.scan over stacked weights inside shard_map (the
    way scanned transformer layers call the ops), each step jax.checkpoint'ed or not: the loss
    and every gradient equal the unsharded stack's to float64 rounding."""
    size, layers, b, s, h, f = 4, 3, 2, 16, 8, 12
    x = rng.standard_normal((b, s, h))
    params = (
        1 + 0.1 * rng.standard_normal((layers, h)),
        0.1 * rng.standard_normal((layers, h)),
        rng.standard_normal((layers, h, f)) / 3,
        rng.standard_normal((layers, f, h)) / 4,
        0.1 * rng.standard_normal((layers, f)),
        0.1 * rng.standard_normal((layers, h)),
    )

    def stack(block, x_, *ps):
        step = lambda carry, p: (carry + block(carry, *p), None)  # noqa: E731
        return jax.lax.scan(jax.checkpoint(step) if remat else step, x_, ps)[0]

    def sharded_block(x_, g, bt, a, c, d, e):
        return layernorm_mlp(x_, g, bt, (a, c), (d, e), axis_name="x", config=cfg)

    def twin_block(x_, g, bt, a, c, d, e):
        return jax.nn.gelu(layernorm(x_, g, bt) @ a + d, approximate=False) @ c + e

    sharded = jax.shard_map(
        lambda *a: stack(sharded_block, *a),
        mesh=mesh1d(size),
        in_specs=(P(None, "x"), P(), P(), P(None, None, "x"), P(None, "x"), P(None, "x"), P()),
        out_specs=P(None, "x"),
        check_vma=check_vma,
    )
    argnums = tuple(range(7))
    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))  # noqa: E731
    got = jax.jit(jax.value_and_grad(loss(sharded), argnums))(x, *params)
    want = jax.value_and_grad(loss(lambda *a: stack(twin_block, *a)), argnums)(x, *params)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-10, atol=1e-10)
