"""dense / layernorm_mlp with CollectiveOpSet against their unsharded twins: values and
gradients, every method, both shard_map settings."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import P, mesh1d, shard

import commgemm as cg
from commgemm.layers import CollectiveOpSet, dense, layernorm, layernorm_mlp

METHODS = [
    cg.OverlapConfig(accumulate_dtype="float64"),
    cg.OverlapConfig(method="pipeline", num_splits=2, accumulate_dtype="float64"),
    cg.OverlapConfig(method="ring_exchange", accumulate_dtype="float64"),
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
