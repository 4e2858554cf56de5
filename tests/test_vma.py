"""Values and gradients under both shard_map settings (check_vma True, the default, and False)
against the float64 reference and the plain lax composition: the 2-D case, bulk overlap, and a
hypothesis search over ops, methods, shapes and the setting."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import P, mesh1d, mesh2d, shard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax import lax

import commgemm as cg
from commgemm.vma import all_gather_invariant

F64 = dict(accumulate_dtype="float64")
METHODS = {
    "none": cg.OverlapConfig(**F64),
    "pipeline2": cg.OverlapConfig(method="pipeline", num_splits=2, **F64),
    "ring": cg.OverlapConfig(method="ring_exchange", **F64),
    "ring-bidi2": cg.OverlapConfig(method="ring_exchange", bidirectional=True, num_splits=2, **F64),
}
SETTINGS = pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "novma"])


def _grads(fn, *args):
    """Value and jit(grad) of sum(sin(fn(...))) with respect to every argument."""
    loss = lambda *a: jnp.sum(jnp.sin(fn(*a)))  # noqa: E731
    return fn(*args), jax.jit(jax.grad(loss, argnums=tuple(range(len(args)))))(*args)


def _assert_same(got, want, rtol=1e-9, atol=1e-9):
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=rtol, atol=atol)


@SETTINGS
@pytest.mark.parametrize("rows,cols", [(2, 2), (2, 4)])
@pytest.mark.parametrize("method", list(METHODS))
def test_matmul_2d(rng, rows, cols, method, check_vma):
    """x P('x','y') @ w P('x', None) -> P('x', None): values and gradients as the unsharded
    product's."""
    x = rng.standard_normal((rows * 8, rows * cols * 3))
    w = rng.standard_normal((rows * cols * 3, 8))
    f = shard(
        lambda a, b: cg.matmul_2d(a, b, row_axis="x", k_axis="y", config=METHODS[method]),
        mesh2d(rows, cols),
        (P("x", "y"), P("x", None)),
        P("x", None),
        check_vma=check_vma,
    )
    _assert_same(_grads(f, x, w), _grads(lambda a, b: a @ b, x, w))


@SETTINGS
@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter", "all_reduce"])
def test_bulk_overlap_matches_lax(rng, collective, check_vma):
    """bulk_overlap's GEMM and collective against the same lax collective, values and
    gradients, under one shard_map setting."""
    size = 4
    x, w = rng.standard_normal((size * 4, 6)), rng.standard_normal((6, 5))
    c = rng.standard_normal((size * 4, 3))
    lax_collective = {
        "all_gather": lambda a: all_gather_invariant(a, "x"),
        "reduce_scatter": lambda a: lax.psum_scatter(a, "x", tiled=True),
        "all_reduce": lambda a: lax.psum(a, "x"),
    }[collective]
    in_c = P("x", None) if collective == "all_gather" else P(None, None)
    out_c = P("x", None) if collective == "reduce_scatter" else P(None, None)

    def run(body):
        f = shard(
            body,
            mesh1d(size),
            (P("x", None), P(None, None), in_c),
            (P("x", None), out_c),
            check_vma=check_vma,
        )
        loss = lambda *a: sum(jnp.sum(jnp.sin(o)) for o in f(*a))  # noqa: E731
        return f(x, w, c), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, w, c)

    got = run(
        lambda a, b, d: cg.bulk_overlap(
            a, b, d, "x", collective=collective, config=cg.OverlapConfig(**F64)
        )
    )
    want = run(lambda a, b, d: (a @ b, lax_collective(d)))
    _assert_same(got, want)
    expected = c if collective == "all_gather" else size * c
    np.testing.assert_allclose(np.asarray(got[0][1]), expected, rtol=1e-12)


OPS = {
    "ag": (cg.all_gather_matmul, P("x", None), P(None, "x"), P(None, "x")),
    "rs": (cg.matmul_reduce_scatter, P(None, "x"), P("x", None), P("x", None)),
    "ar": (cg.matmul_all_reduce, P(None, "x"), P("x", None), P(None, None)),
}


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    check_vma=st.booleans(),
    size=st.sampled_from([2, 4, 8]),
    op=st.sampled_from(sorted(OPS)),
    method=st.sampled_from(sorted(METHODS)),
    m=st.integers(1, 3),
    k=st.integers(1, 5),
    n=st.integers(1, 4),
    seed=st.integers(0, 2**31 - 1),
)
def test_values_and_gradients_any_setting(check_vma, size, op, method, m, k, n, seed):
    """Any op x method x shape x shard_map setting: the float64 reference's values and
    gradients (rows and K are multiples of P and num_splits where the method needs it)."""
    rng = np.random.default_rng(seed)
    fn, xs, ws, os = OPS[op]
    rows = size * 2 * m  # divisible by P * num_splits for every method here
    x = rng.standard_normal((rows, size * k))
    w = rng.standard_normal((size * k, size * n))
    f = shard(
        lambda a, b: fn(a, b, "x", config=METHODS[method]),
        mesh1d(size),
        (xs, ws),
        os,
        check_vma=check_vma,
    )
    _assert_same(_grads(f, x, w), _grads(lambda a, b: a @ b, x, w))


#: op -> (x spec, w spec, out spec) on a ("data", "tp") mesh: activations sharded over both,
#: weights over the tensor axis only (replicated over data, as in data + tensor parallelism).
DATA_TP = {
    "ag": (P("data", "tp", None), P(None, "tp"), P("data", None, "tp")),
    "rs": (P("data", None, "tp"), P("tp", None), P("data", "tp", None)),
    "ar": (P("data", None, "tp"), P("tp", None), P("data", None, None)),
}


@SETTINGS
@pytest.mark.parametrize("op", list(DATA_TP))
@pytest.mark.parametrize("method", ["none", "ring"])
@pytest.mark.parametrize("scaling", [None, "current_tensor_scaling"])
def test_weights_replicated_over_a_data_axis(rng, op, method, check_vma, scaling):
    """dW sums over the data axis its weights are replicated over (under check_vma the custom
    VJP types its cotangents as the primal inputs; unchecked shard_map sums): gradients equal
    the unsharded composition's (float64; FP8: the same op's bf16 gradients to FP8's error)."""
    mesh = jax.sharding.Mesh(mesh2d(2, 4).devices, ("data", "tp"))
    x, w = rng.standard_normal((4, 16, 64)), rng.standard_normal((64, 32))
    fn = {"ag": cg.all_gather_matmul, "rs": cg.matmul_reduce_scatter,
          "ar": cg.matmul_all_reduce}[op]  # fmt: skip
    cfg = METHODS[method]
    if scaling:
        x, w = x.astype(np.float32), w.astype(np.float32)
        cfg = cfg.replace(accumulate_dtype="float32")
    xs, ws, os_ = DATA_TP[op]
    f = shard(lambda a, b: fn(a, b, "tp", axis=1, config=cfg, scaling=scaling), mesh, (xs, ws),
              os_, check_vma=check_vma)  # fmt: skip
    if scaling is None:
        _assert_same(_grads(f, x, w), _grads(lambda a, b: jnp.einsum("bsk,kn->bsn", a, b), x, w))
        return
    # FP8: a linear loss, so the gradients' error is the quantization's (e5m2 dY: 2^-3 of a
    # value at most), far below the half of dW a missing sum over the data axis would lose
    g = rng.standard_normal((4, 16, 32)).astype(np.float32)
    got = jax.jit(jax.grad(lambda a, b: jnp.sum(f(a, b) * g), (0, 1)))(x, w)
    want = jax.grad(lambda a, b: jnp.sum(jnp.einsum("bsk,kn->bsn", a, b) * g), (0, 1))(
        x.astype(np.float64), w.astype(np.float64)
    )
    for gt, r in zip(got, want, strict=True):
        scale = float(np.abs(np.asarray(r)).max())
        np.testing.assert_allclose(np.asarray(gt), np.asarray(r), atol=0.1 * scale)


def test_varying_like_types_a_kernel_result_as_its_inputs():
    """vma.varying_like marks a value varying over the axes its inputs vary over (a Pallas
    result's type), and leaves an already varying value and unchecked maps alone."""
    from commgemm.vma import varying_axes, varying_like

    mesh = mesh2d(2, 4)

    def body(a, b):
        fresh = jnp.zeros((2, 2), a.dtype)  # invariant, as a kernel result is typed
        typed = varying_like(fresh, a, b)
        assert varying_axes(fresh) == frozenset()
        assert varying_axes(typed) == frozenset({"x", "y"})
        assert varying_like(typed, a) is typed
        return typed + a[:2, :2] + b[:2, :2]

    a, b = jnp.ones((8, 8)), jnp.ones((8, 8))
    out = shard(body, mesh, (P("x"), P(None, "y")), P("x", "y"))(a, b)
    np.testing.assert_array_equal(np.asarray(out), np.full((4, 8), 2.0))  # [2, 2] a shard
    unchecked = shard(lambda a: varying_like(jnp.zeros(2), a), mesh, P("x"), P(), check_vma=False)
    np.testing.assert_array_equal(np.asarray(unchecked(a)), np.zeros(2))
