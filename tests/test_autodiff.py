"""Gradients of every op x method against jax.grad of the unsharded plain composition."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import P, config_id, mesh1d, shard
from jax._src.ad_checkpoint import saved_residuals
from jax.sharding import NamedSharding
from jax.test_util import check_grads

import commgemm as cg
from commgemm.cli.specs import parse_method

F64 = dict(accumulate_dtype="float64")
CONFIGS = [
    cg.OverlapConfig(**F64),
    cg.OverlapConfig(method="pipeline", num_splits=2, **F64),
    cg.OverlapConfig(method="ring_exchange", **F64),
    cg.OverlapConfig(method="ring_exchange", bidirectional=True, num_splits=2, **F64),
]
AG_CONFIGS = CONFIGS + [
    cg.OverlapConfig(method="ring_exchange", aggregate=True, **F64),
    cg.OverlapConfig(method="ring_exchange", save_gathered_input=False, **F64),
    cg.OverlapConfig(method="pipeline", num_splits=2, save_gathered_input=False, **F64),
]
SPECS = {  # op: (x spec, w spec, bias spec, out spec)
    "ag": (P("x", None), P(None, "x"), P("x"), P(None, "x")),
    "rs": (P(None, "x"), P("x", None), P(), P("x", None)),
    "ar": (P(None, "x"), P("x", None), P(), P(None, None)),
}
OPS = {"ag": cg.all_gather_matmul, "rs": cg.matmul_reduce_scatter, "ar": cg.matmul_all_reduce}


def plain(x, w, b, activation):
    z = jnp.dot(x, w, precision="highest") + b
    return jax.nn.gelu(z, approximate=activation == "gelu_tanh") if activation else z


def sharded(op, cfg, size, activation, check_vma=True):
    xs, ws, bs, os = SPECS[op]
    return shard(
        lambda a, b, c: OPS[op](a, b, "x", config=cfg, bias=c, activation=activation),
        mesh1d(size),
        (xs, ws, bs),
        os,
        check_vma=check_vma,
    )


def _data(rng, size, dtype=np.float64):
    m, k, n = size * 4, size * 6, size * 2
    return (
        rng.standard_normal((m, k)).astype(dtype),
        rng.standard_normal((k, n)).astype(dtype),
        rng.standard_normal(n).astype(dtype),
    )


def _loss(fn):
    return lambda x, w, b: jnp.sum(jnp.sin(fn(x, w, b)))


def _cases():
    for op in OPS:
        for cfg in AG_CONFIGS if op == "ag" else CONFIGS:
            yield pytest.param(
                op,
                cfg,
                id=f"{op}-{config_id(cfg)}" + ("" if cfg.save_gathered_input else "-regather"),
            )


@pytest.mark.parametrize("op,cfg", list(_cases()))
@pytest.mark.parametrize("activation", [None, "gelu_tanh"])
@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "novma"])
def test_gradients_match_plain_composition(rng, op, cfg, activation, check_vma):
    """jit(grad) under shard_map's default check_vma=True and with the check off: the same
    gradients as jax.grad of the unsharded composition (an all-reduce's transpose differs
    between the two settings, as lax.psum's does)."""
    size = 4
    x, w, b = _data(rng, size)
    loss = _loss(sharded(op, cfg, size, activation, check_vma))
    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, w, b)
    want = jax.grad(_loss(lambda *a: plain(*a, activation)), argnums=(0, 1, 2))(x, w, b)
    for name, g, r in zip("xwb", got, want, strict=True):
        np.testing.assert_allclose(
            np.asarray(g), np.asarray(r), rtol=1e-9, atol=1e-9, err_msg=f"d{name}"
        )


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("size", [2, 8])
def test_check_grads_float64(rng, op, size):
    x, w, b = _data(rng, size)
    cfg = cg.OverlapConfig(method="ring_exchange", bidirectional=True, **F64)
    check_grads(sharded(op, cfg, size, "gelu"), (x, w, b), order=1, modes=["rev"])


def test_pre_activation_is_returned(rng):
    size, cfg = 4, cg.OverlapConfig(method="ring_exchange", **F64)
    x, w, b = _data(rng, size)
    xs, ws, bs, os = SPECS["ag"]
    f = shard(
        lambda a, c, d: cg.all_gather_matmul(
            a, c, "x", config=cfg, bias=d, activation="gelu", return_pre_activation=True
        ),
        mesh1d(size),
        (xs, ws, bs),
        (os, os),
    )
    y, z = f(x, w, b)
    np.testing.assert_allclose(np.asarray(z), x @ w + b, rtol=1e-12)
    np.testing.assert_allclose(
        np.asarray(y), np.asarray(jax.nn.gelu(z, approximate=False)), rtol=1e-12
    )


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "novma"])
@pytest.mark.parametrize("op", ["ag", "rs"])
@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh"])
def test_epilogue_backward_keeps_the_operands_dtype(rng, op, activation, check_vma):
    """bf16 operands, bias and GELU: every tensor the backward keeps is bf16 (the GEMM's output
    and the bias, from which the GELU's derivative is recomputed in the pass over dY), so no
    float32 copy of the pre-activation is written in the forward and read back."""
    size = 4
    x, w, b = (a.astype(ml_dtypes.bfloat16) for a in _data(rng, size))
    loss = _loss(sharded(op, cg.OverlapConfig(), size, activation, check_vma))
    kept = [aval for aval, _ in saved_residuals(loss, x, w, b)]
    assert kept and all(aval.dtype == jnp.bfloat16 for aval in kept), kept
    want = jax.grad(_loss(lambda *a: plain(*a, activation)), argnums=(0, 1, 2))(
        *(a.astype(np.float32) for a in (x, w, b))
    )
    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, w, b)
    for name, g, r in zip("xwb", got, want, strict=True):  # bf16 rounds y, dY and each GEMM's
        scale = float(np.max(np.abs(r)))  # result: up to 4.9% of the largest value (100 draws)
        np.testing.assert_allclose(
            np.asarray(g, np.float32), np.asarray(r), atol=8e-2 * scale, err_msg=f"d{name}"
        )


def test_bias_added_once_after_reduction(rng):
    size = 8
    x, w, b = _data(rng, size)
    for op in ("rs", "ar"):
        out = sharded(op, cg.OverlapConfig(method="ring_exchange", **F64), size, None)(x, w, b)
        np.testing.assert_allclose(np.asarray(out), x @ w + b, rtol=1e-12, atol=1e-12)


def _backward_hlo(op, cfg, size=4):
    x, w, b = _data(np.random.default_rng(0), size, np.float32)
    grad = jax.jit(jax.grad(_loss(sharded(op, cfg, size, None)), argnums=(0, 1)))
    return grad.lower(x, w, b).compile().as_text()


@pytest.mark.parametrize("op", ["ag", "rs"])
def test_ring_backward_uses_collective_permutes_only(op):
    text = _backward_hlo(op, cg.OverlapConfig(method="ring_exchange"))
    assert "collective-permute" in text
    for collective in ("all-gather", "reduce-scatter", "all-reduce"):
        assert f" {collective}(" not in text and f" {collective}-start(" not in text, collective


def test_regather_backward_is_one_bulk_all_gather():
    text = _backward_hlo("ag", cg.OverlapConfig(method="ring_exchange", save_gathered_input=False))
    assert text.count(" all-gather(") + text.count(" all-gather-start(") == 1
    assert " reduce-scatter(" not in text


def test_remat_and_bf16_params(rng):
    """jax.checkpoint around the op; bf16 params with float32 accumulation."""
    size, bf16 = 4, ml_dtypes.bfloat16
    x, w, b = (a.astype(bf16) for a in _data(rng, size, np.float32))
    f = jax.checkpoint(sharded("ag", cg.OverlapConfig(method="ring_exchange"), size, "gelu"))
    got = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), (0, 1, 2)))(x, w, b)
    xf, wf, bf = (np.asarray(a, np.float64) for a in (x, w, b))
    want = jax.grad(lambda *a: jnp.sum(plain(*a, "gelu")), (0, 1, 2))(xf, wf, bf)
    for g, r in zip(got, want, strict=True):
        assert g.dtype == bf16
        np.testing.assert_allclose(np.asarray(g, np.float64), r, rtol=5e-2, atol=5e-2)


def test_gemm_global_gradients(rng):
    mesh = mesh1d(4)
    x, w, b = _data(rng, 4)
    xd = jax.device_put(x, NamedSharding(mesh, P(None, "x")))
    wd = jax.device_put(w, NamedSharding(mesh, P("x", None)))
    cfg = cg.OverlapConfig(method="ring_exchange", **F64)

    def loss(a, c, d):
        y = cg.gemm(
            a,
            c,
            out_sharding=NamedSharding(mesh, P("x", None)),
            config=cfg,
            x_spec=P(None, "x"),
            w_spec=P("x", None),
            bias=d,
            activation="gelu",
        )
        return jnp.sum(jnp.sin(y))

    got = jax.jit(jax.grad(loss, (0, 1, 2)))(xd, wd, b)
    want = jax.grad(_loss(lambda *a: plain(*a, "gelu")), (0, 1, 2))(x, w, b)
    for g, r in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-9, atol=1e-9)


def test_sgd_mlp_sequence_parallel_matches_unsharded(rng):
    """20 SGD steps of AG+GEMM -> GELU -> GEMM+RS on 8 devices vs the unsharded model."""
    size, s, h, f, lr = 8, 64, 16, 32, 0.05
    x = rng.standard_normal((s, h))
    target = rng.standard_normal((s, h))
    params = (rng.standard_normal((h, f)) / 4, np.zeros(f), rng.standard_normal((f, h)) / 6)
    cfg = cg.OverlapConfig(method="ring_exchange", bidirectional=True, **F64)

    def body(xs, w1, b1, w2):
        hid = cg.all_gather_matmul(xs, w1, "x", config=cfg, bias=b1, activation="gelu_tanh")
        return cg.matmul_reduce_scatter(hid, w2, "x", config=cfg)

    mlp = shard(
        body, mesh1d(size), (P("x", None), P(None, "x"), P("x"), P("x", None)), P("x", None)
    )

    def reference_mlp(xs, w1, b1, w2):
        return jax.nn.gelu(xs @ w1 + b1, approximate=True) @ w2

    def train(model):
        loss = lambda p: jnp.mean((model(x, *p) - target) ** 2)  # noqa: E731
        step = jax.jit(jax.value_and_grad(loss))
        p, losses = tuple(map(jnp.asarray, params)), []
        for _ in range(20):
            value, grads = step(p)
            p = tuple(a - lr * g for a, g in zip(p, grads, strict=True))
            losses.append(float(value))
        return np.array(losses)

    sharded_losses, plain_losses = train(mlp), train(reference_mlp)
    assert plain_losses[-1] < plain_losses[0]
    np.testing.assert_allclose(sharded_losses, plain_losses, rtol=1e-10)


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize(
    ("op", "spec"), [("ag", "fused-w8"), ("rs", "fused-w8"), ("rs", "fused-direct")]
)
def test_fused_forward_and_backward_plumbing(rng, monkeypatch, op, spec, check_vma):
    """The fused kernels run only on Hopper GPUs (tests/gpu checks them there). Here stand-ins
    with the kernels' contract (the ring's result; AG's gathered x) check the plumbing around
    them: dispatch on atomic_gemm, dX on the other collective's kernel (the same method family;
    an AG on the ring kernel, 4 devices here), dW from the gathered rows, in float64 against the
    plain composition."""
    from commgemm.mosaic_gpu import fused
    from commgemm.xla import ring_exchange

    calls = []

    def ag_stand_in(x, w, axis_name, config, *, w_transposed, return_gathered=False):
        assert config.atomic_gemm
        calls.append(("ag", config.method, config.kernel))
        plain_cfg = config.replace(atomic_gemm=False, kernel=None)
        return ring_exchange.all_gather_matmul(
            x, w, axis_name, plain_cfg, w_transposed=w_transposed, return_gathered=return_gathered
        )

    def rs_stand_in(x, w, axis_name, config, *, w_transposed):
        assert config.atomic_gemm
        calls.append(("rs", config.method, config.kernel))
        plain_cfg = config.replace(atomic_gemm=False, kernel=None)
        return ring_exchange.matmul_reduce_scatter(
            x, w, axis_name, plain_cfg, w_transposed=w_transposed
        )

    monkeypatch.setattr(fused, "unsupported_reason", lambda *a, **k: None)
    monkeypatch.setattr(fused, "all_gather_matmul", ag_stand_in)
    monkeypatch.setattr(fused, "matmul_reduce_scatter", rs_stand_in)
    cfg = parse_method(spec, op).replace(**F64)
    x, w, b = _data(rng, 4)
    got = jax.grad(_loss(sharded(op, cfg, 4, None, check_vma)), argnums=(0, 1))(x, w, b)
    want = jax.grad(_loss(lambda x, w, b: plain(x, w, b, None)), argnums=(0, 1))(x, w, b)
    for g, r in zip(got, want, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-9, atol=1e-9)
    *forward, backward = calls  # the forward may be traced more than once
    assert forward and all(c == (op, cfg.method, cfg.kernel) for c in forward)
    # dX's AG on 4 devices runs the ring kernel (as AUTO on more than 2 GPUs)
    method = cg.Method.RING_EXCHANGE if op == "rs" else cfg.method
    assert backward[:2] == ("rs" if op == "ag" else "ag", method)
    if method is cg.Method.RING_EXCHANGE:
        assert backward[2] is None  # the ring family's default tiling
    else:  # the cost model's tiling of the dX problem
        assert backward[2] is not None


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("method", ["pipeline", "ring_exchange"])
def test_second_order_reverse_mode(rng, op, method):
    """grad of grad (a Hessian-vector product through the op, whose backward is made of the
    ops again) equals the plain composition's in float64; forward mode raises JAX's error."""
    size = 4
    cfg = cg.OverlapConfig(method=method, num_splits=2 if method == "pipeline" else 1)
    f, g = _loss(sharded(op, cfg, size, "gelu_tanh")), _loss(lambda *a: plain(*a, "gelu_tanh"))
    x, w, b = _data(rng, size)
    v = rng.standard_normal(x.shape)

    def hvp(loss):
        return jax.grad(lambda a: jnp.vdot(jax.grad(loss)(a, w, b), v))(x)

    np.testing.assert_allclose(jax.jit(lambda: hvp(f))(), hvp(g), rtol=1e-10, atol=1e-10)
    with pytest.raises(TypeError, match="forward-mode"):
        jax.jvp(lambda a: f(a, w, b), (x,), (v,))


@pytest.mark.parametrize("approximate", [False, True])
@pytest.mark.parametrize("dtype", [np.float64, jnp.bfloat16])
def test_gelu_keeps_its_input_alone(rng, approximate, dtype):
    """`epilogue.gelu`: jax.nn.gelu's values and gradients (first and second order; bf16 within
    an ulp: the backward is jax's own, recomputed), under jit, vmap, remat and shard_map with
    check_vma; its backward keeps x alone, where jax.nn.gelu's keeps several arrays of its
    size."""
    from commgemm.epilogue import gelu

    x = jnp.asarray(rng.standard_normal((4, 6)) * 3, dtype)
    plain = lambda a: jax.nn.gelu(a, approximate=approximate)  # noqa: E731
    ours = lambda a: gelu(a, approximate)  # noqa: E731
    loss = lambda f: lambda a: jnp.sum(jnp.sin(f(a)))  # noqa: E731
    np.testing.assert_array_equal(np.asarray(ours(x)), np.asarray(plain(x)))
    want = jax.grad(loss(plain))(x)
    scalar = lambda a: jnp.sin(ours(a))  # noqa: E731
    grads = {"grad": jax.grad(loss(ours))(x), "jit": jax.jit(jax.grad(loss(ours)))(x),
             "vmap": jax.vmap(jax.grad(scalar))(x.reshape(-1)).reshape(x.shape),
             "remat": jax.grad(jax.checkpoint(loss(ours)))(x)}  # fmt: skip
    tol = dict(rtol=0, atol=0) if dtype == np.float64 else dict(rtol=2**-7, atol=1e-9)
    for name, got in grads.items():  # bf16: XLA's fusion under jit rounds within an ulp
        np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64),
                                   err_msg=name, **tol)  # fmt: skip
    if dtype == np.float64:
        hess = lambda f: jax.grad(lambda a: jnp.sum(jax.grad(loss(f))(a)))  # noqa: E731
        np.testing.assert_allclose(hess(ours)(x), hess(plain)(x), rtol=1e-10, atol=1e-12)
    mapped = jax.shard_map(jax.grad(loss(ours)), mesh=mesh1d(2), in_specs=P("x"),
                           out_specs=P("x"))  # check_vma=True, the default  # fmt: skip
    np.testing.assert_allclose(np.asarray(mapped(x), np.float64), np.asarray(want, np.float64),
                               **tol)  # fmt: skip
    kept = {name: [aval.shape for aval, _ in saved_residuals(lambda a, f=f: jnp.sum(f(a)), x)]
            for name, f in (("ours", ours), ("plain", plain))}  # fmt: skip
    assert kept["ours"] == [x.shape] and kept["plain"].count(x.shape) > 1, kept
