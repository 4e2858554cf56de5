"""Rematerialization: every op family under `jax.checkpoint` (inside shard_map, as a remat'd
layer of a sharded model calls it), with the default policy (everything recomputed) and with
dots saved, gives the values and gradients of the same op without it: the overlapped ops, the
quantized ops (tensor and block modes, a weight quantized once inside the remat'd function),
and the grouped ops (local, all-gather, reduce-scatter, the expert-parallel dispatch and
return), under both shard_map settings."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import P, mesh1d, shard
from test_grouped import random_sizes

import commgemm as cg

POLICIES = {
    "recompute": None,
    "dots_saved": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}
SIZE = 4


def _value_and_grads(body, specs, out_spec, args, argnums, check_vma, policy):
    """The sharded body's value and the gradients of sum(sin(.)) w.r.t. `argnums`, with the
    body remat'd under `policy` ("plain": not remat'd)."""
    if policy != "plain":
        body = jax.checkpoint(body, policy=POLICIES[policy])
    f = shard(body, mesh1d(SIZE), specs, out_spec, check_vma=check_vma)
    loss = lambda *a: jnp.sum(jnp.sin(f(*a).astype(jnp.float64)))  # noqa: E731
    return f(*args), jax.jit(jax.grad(loss, argnums=argnums))(*args)


def _check(body, specs, out_spec, args, argnums, check_vma, tol, twin=None):
    """Each policy's value and gradients against the body not remat'd, or where given against
    `twin`, the unsharded jnp composition on the global arrays."""
    if twin is None:
        want = _value_and_grads(body, specs, out_spec, args, argnums, check_vma, "plain")
    else:
        loss = lambda *a: jnp.sum(jnp.sin(twin(*a)))  # noqa: E731
        want = twin(*args), jax.grad(loss, argnums=argnums)(*args)
    for policy in POLICIES:
        got = _value_and_grads(body, specs, out_spec, args, argnums, check_vma, policy)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=tol, atol=tol,
                                       err_msg=policy)  # fmt: skip


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("method", ["none", "pipeline", "ring_exchange"])
@pytest.mark.parametrize("op", ["ag", "rs", "ar"])
def test_overlapped_ops(rng, op, method, check_vma):
    """float64: values and gradients, recomputed or with dots saved, equal the unsharded jnp
    composition's to float64 rounding."""
    cfg = cg.OverlapConfig(method=method, num_splits=2 if method == "pipeline" else 1)
    if op == "ag":
        x, w = rng.standard_normal((SIZE * 4, 8)), rng.standard_normal((8, SIZE * 3))
        body = lambda a, b: jnp.tanh(cg.all_gather_matmul(a, b, "x", config=cfg))  # noqa: E731
        specs, out = (P("x"), P(None, "x")), P(None, "x")
    else:
        x, w = rng.standard_normal((SIZE * 2, SIZE * 4)), rng.standard_normal((SIZE * 4, 6))
        fn = cg.matmul_reduce_scatter if op == "rs" else cg.matmul_all_reduce
        body = lambda a, b: jnp.tanh(fn(a, b, "x", config=cfg))  # noqa: E731
        specs, out = (P(None, "x"), P("x")), P("x") if op == "rs" else P()
    twin = lambda a, b: jnp.tanh(a @ b)  # noqa: E731
    _check(body, specs, out, (x, w), (0, 1), check_vma, 1e-12, twin)


#: every mode under the default check_vma=True, quantizing w in the call and once (the block
#: modes one each per op); the tensor mode also without check_vma
QUANTIZED = [
    (op, mode, once, vma)
    for op in ("ag", "rs")
    for mode, once, vma in (
        ("current_tensor_scaling", False, True),
        ("current_tensor_scaling", True, True),
        ("current_tensor_scaling", False, False),
        ("mxfp8_1d_scaling", op == "rs", True),
        ("nvfp4_1d_scaling", op == "ag", True),
    )
]


@pytest.mark.parametrize(
    "op,mode,once,check_vma",
    QUANTIZED,
    ids=[f"{o}-{m}-{'weight' if w else 'call'}-vma{v}" for o, m, w, v in QUANTIZED],
)
def test_quantized_ops(rng, op, mode, once, check_vma):
    """Quantizing is deterministic, so the recomputed forward quantizes to the same bits and
    the straight-through gradients agree to float32 rounding."""
    cfg = cg.OverlapConfig(method="ring_exchange")
    fn = cg.all_gather_matmul if op == "ag" else cg.matmul_reduce_scatter
    if op == "ag":
        x = rng.standard_normal((SIZE * 8, 64)).astype(np.float32)
        w = rng.standard_normal((64, SIZE * 32)).astype(np.float32)
        specs, out = (P("x"), P(None, "x")), P(None, "x")
    else:
        x = rng.standard_normal((SIZE * 8, SIZE * 64)).astype(np.float32)
        w = rng.standard_normal((SIZE * 64, 32)).astype(np.float32)
        specs, out = (P(None, "x"), P("x")), P("x")

    def body(a, b):
        if once:
            b = cg.quantize_weight(b, mode, axis_name="x")  # w is sharded in both forms
        return jnp.tanh(fn(a, b, "x", config=cfg, scaling=mode))

    _check(body, specs, out, (x, w), (0, 1), check_vma, 1e-5)


@pytest.mark.parametrize(
    ("scaling", "check_vma"),
    [(None, True), (None, False), ("current_tensor_scaling", True)],  # float8: default vma
)
@pytest.mark.parametrize("form", ["local", "ag", "rs"])
def test_grouped_ops(rng, form, scaling, check_vma):
    """The local grouped GEMM with bias (on each shard's rows), the all-gather form (each
    shard's rows sorted by its own groups) and the reduce-scatter form (the same rows and
    sizes on every shard, K sharded); random sizes with empty groups."""
    groups, m = 3, 8
    cfg = cg.OverlapConfig(method="ring_exchange")
    if form == "rs":
        x = rng.standard_normal((SIZE * m, SIZE * 16)).astype(np.float32)
        w = rng.standard_normal((groups, SIZE * 16, 16)).astype(np.float32)
        sizes = random_sizes(rng, groups, SIZE * m)

        def body(a, b, s):
            return jnp.tanh(cg.grouped_matmul_reduce_scatter(a, b, s, "x", config=cfg,
                                                             scaling=scaling))  # fmt: skip

        specs, out = (P(None, "x"), P(None, "x", None), P()), P("x")
    else:
        x = rng.standard_normal((SIZE * m, 16)).astype(np.float32)
        w = rng.standard_normal((groups, 16, SIZE * 16)).astype(np.float32)
        bias = rng.standard_normal((groups, SIZE * 16)).astype(np.float32)
        sizes = np.stack([random_sizes(rng, groups, m) for _ in range(SIZE)])

        def body(a, b, s):
            if form == "local":
                return jnp.tanh(cg.grouped_matmul(a, b, s[0], bias=bias, scaling=scaling))
            return jnp.tanh(cg.all_gather_grouped_matmul(a, b, s[0], "x", config=cfg,
                                                         scaling=scaling))  # fmt: skip

        w_spec = P() if form == "local" else P(None, None, "x")
        specs, out = (P("x"), w_spec, P("x")), P("x") if form == "local" else P(None, "x")
    _check(body, specs, out, (x, w, sizes), (0, 1), check_vma, 1e-5)


@pytest.mark.parametrize("scaling,check_vma", [(None, True), ("mxfp8_1d_scaling", True)])
def test_expert_parallel(rng, scaling, check_vma):
    """Tokens dispatched to their experts' shards and back, an activation between."""
    per_shard, m = 2, 8
    experts = SIZE * per_shard
    x = rng.standard_normal((SIZE * m, 32)).astype(np.float32)
    w1 = rng.standard_normal((experts, 32, 64)).astype(np.float32)
    w2 = rng.standard_normal((experts, 64, 32)).astype(np.float32)
    sizes = np.stack([random_sizes(rng, experts, m) for _ in range(SIZE)])
    cfg = cg.OverlapConfig(method="ring_exchange")

    def body(a, b1, b2, s):
        y, recv = cg.all_to_all_grouped_matmul(a, b1, s[0], "x", config=cfg, scaling=scaling)
        return cg.grouped_matmul_all_to_all(jnp.tanh(y), b2, recv, s[0], "x", config=cfg,
                                            scaling=scaling)  # fmt: skip

    specs = (P("x"), P("x"), P("x"), P("x"))
    _check(body, specs, P("x"), (x, w1, w2, sizes), (0, 1, 2), check_vma, 1e-5)
