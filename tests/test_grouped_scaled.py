"""Quantized grouped GEMMs (`scaling=`, emulated): each grouped op x mode against the float64
reference on the same quantized operands (shards share the tensor's scales, so per-shard
quantization is the global one), and the straight-through gradients with dY quantized; the
all-gather's rows and the dispatch's tokens moving quantized (the lowered program's types)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import P, dequantized, mesh1d, shard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_grouped import random_sizes, reference

import commgemm as cg

MODES = ["current_tensor_scaling", "mxfp8_1d_scaling", "nvfp4_1d_scaling"]
TOL = 1e-5  # float32 accumulation of values that are exact after quantization


def _dq(a, mode, axis):
    return dequantized(a, mode, axis)


def _grad_dq(g, mode):
    """dY as the backward quantizes it: e5m2 current scaling, or the block mode along N."""
    if mode == "current_tensor_scaling":
        return _dq_dtype(g, mode, jnp.float8_e5m2)
    return _dq(g, mode, -1)


def _dq_dtype(a, mode, dtype):
    return dequantized(a, mode, -1, dtype)


@pytest.mark.parametrize("mode", MODES)
def test_local_values_and_gradients(rng, mode):
    x = rng.standard_normal((48, 64)).astype(np.float32)
    w = rng.standard_normal((3, 64, 32)).astype(np.float32)
    sizes = random_sizes(rng, 3, 48)
    out, vjp = jax.vjp(lambda a, b: cg.grouped_matmul(a, b, sizes, scaling=mode), x, w)
    qx, qw = _dq(x, mode, -1), _dq(w, mode, 1)
    np.testing.assert_allclose(out, reference(qx, qw, sizes), rtol=TOL, atol=TOL * 8)
    g = rng.standard_normal(out.shape).astype(np.float32)
    dx, dw = vjp(g)
    _, ref_vjp = jax.vjp(lambda a, b: reference(a, b, sizes), qx, qw)
    want_dx, want_dw = ref_vjp(_grad_dq(g, mode))
    np.testing.assert_allclose(dx, want_dx, rtol=TOL, atol=TOL * 8)
    np.testing.assert_allclose(dw, want_dw, rtol=TOL, atol=TOL * 8)


@pytest.mark.parametrize("mode", MODES[:2])
@pytest.mark.parametrize("method", ["none", "ring"])
def test_collective_forms(rng, mode, method):
    size, m = 4, 8
    cfg = cg.OverlapConfig(method="ring_exchange" if method == "ring" else "none")
    x = rng.standard_normal((size * m, 64)).astype(np.float32)
    w = rng.standard_normal((3, 64, 32 * size)).astype(np.float32)
    sizes = np.stack([random_sizes(rng, 3, m) for _ in range(size)])
    ag = shard(
        lambda a, b, s: cg.all_gather_grouped_matmul(a, b, s[0], "x", config=cfg, scaling=mode),
        mesh1d(size), (P("x"), P(None, None, "x"), P("x")), P(None, "x"),
    )(x, w, sizes)  # fmt: skip
    qx, qw = _dq(x, mode, -1), _dq(w, mode, 1)
    want = np.concatenate([reference(qx[s * m : (s + 1) * m], qw, sizes[s]) for s in range(size)])
    np.testing.assert_allclose(ag, want, rtol=TOL, atol=TOL * 8)
    xk = rng.standard_normal((size * m, 32 * size)).astype(np.float32)
    wk = rng.standard_normal((3, 32 * size, 32)).astype(np.float32)
    one = random_sizes(rng, 3, size * m)
    rs = shard(
        lambda a, b: cg.grouped_matmul_reduce_scatter(a, b, jnp.asarray(one), "x", config=cfg,
                                                      scaling=mode),
        mesh1d(size), (P(None, "x"), P(None, "x", None)), P("x"),
    )(xk, wk)  # fmt: skip
    want = reference(_dq(xk, mode, -1), _dq(wk, mode, 1), one)
    np.testing.assert_allclose(rs, want, rtol=TOL, atol=TOL * 16)


@pytest.mark.parametrize("mode", ["current_tensor_scaling", "mxfp8_1d_scaling", "nvfp4_1d_scaling"])
def test_expert_parallel_pair(rng, mode):
    """Dispatch, experts, return, quantized: against the same composition on one device with
    the quantized operands (the hidden activation, [P, m, K] on each shard, quantized again by
    the second op: block modes send its rows with their scales)."""
    size, m, per_shard = 4, 8, 2
    experts = size * per_shard
    x = rng.standard_normal((size * m, 32)).astype(np.float32)
    w1 = rng.standard_normal((experts, 32, 64)).astype(np.float32)  # K, N: whole blocks
    w2 = rng.standard_normal((experts, 64, 32)).astype(np.float32)
    tokens = [rng.integers(0, experts, size=m) for _ in range(size)]
    sizes = np.stack([np.bincount(t, minlength=experts) for t in tokens]).astype(np.int32)

    def body(a, b, c, g):
        y, received = cg.all_to_all_grouped_matmul(a, b, g[0], "x", scaling=mode)
        return cg.grouped_matmul_all_to_all(y, c, received, g[0], "x", scaling=mode)

    got = shard(body, mesh1d(size), (P("x"), P("x"), P("x"), P("x")), P("x"))(x, w1, w2, sizes)
    qx, q1, q2 = _dq(x, mode, -1), _dq(w1, mode, 1), _dq(w2, mode, 1)
    hidden = np.concatenate([reference(qx[s * m : (s + 1) * m], q1, sizes[s]) for s in range(size)])
    qh = _dq(hidden, mode, -1)  # the second op quantizes its input, all shards sharing a scale
    want = np.concatenate([reference(qh[s * m : (s + 1) * m], q2, sizes[s]) for s in range(size)])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("w_nk", [False, True], ids=["w_gkn", "w_gnk"])
@pytest.mark.parametrize("mode", ["current_tensor_scaling", "mxfp8_1d_scaling"])
def test_prequantized_operands(rng, mode, w_nk):
    """x and w quantized by the caller (w [G, K, N] along axis 1, or [G, N, K] along axis 2):
    the float64 ragged dot of their dequantized values (float32 accumulation: 1e-5), rows past
    the groups' sum zero, bf16 by default; mixed or misshapen operands raise."""
    m, k, n = 24, 64, 16
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((3, k, n)), jnp.float32)
    sizes = jnp.array([10, 0, 11], jnp.int32)  # an empty group; 3 rows past the sum
    qx = cg.quantize(x, mode)
    qw = cg.quantize(jnp.swapaxes(w, 1, 2), mode, axis=2) if w_nk else cg.quantize(w, mode, axis=1)
    got = jax.jit(lambda a, b: cg.grouped_matmul(a, b, sizes, out_dtype="float32"))(qx, qw)
    ws = cg.dequantize(qw, jnp.float64)
    want = jax.lax.ragged_dot(cg.dequantize(qx, jnp.float64),
                              jnp.swapaxes(ws, 1, 2) if w_nk else ws, sizes)  # fmt: skip
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))
    assert not np.asarray(got[21:]).any()
    assert cg.grouped_matmul(qx, qw, sizes).dtype == jnp.bfloat16
    with pytest.raises(TypeError, match="quantize both x and w"):
        cg.grouped_matmul(x, qw, sizes)
    with pytest.raises(ValueError, match="takes no bias"):
        cg.grouped_matmul(qx, qw, sizes, bias=jnp.zeros((3, n)))
    with pytest.raises(ValueError, match="quantized along axis 1 or"):
        cg.grouped_matmul(qx, cg.quantize(w[0], mode, axis=0), sizes)
    with pytest.raises(ValueError, match="contracting dimensions differ"):
        cg.grouped_matmul(cg.quantize(x[:, :32], mode), qw, sizes)


def _moved_types(text: str, width: int) -> list[str]:
    """Element types of the rows the forward program moves (collective-permute, all-gather and
    all-to-all operands whose last dimension is at least `width`, the rows' K)."""
    from test_scaled import _operand_types

    ops = ("collective_permute", "all_gather", "all_to_all")
    types = [t for op in ops for t in _operand_types(text, op)]
    return [t.rsplit("x", 1)[-1] for t in types if "x" in t and int(t.split("x")[-2]) >= width]


CONFIGS = {
    "none": cg.OverlapConfig(method="none"),
    "pipeline": cg.OverlapConfig(method="pipeline", num_splits=2),
    "ring": cg.OverlapConfig(method="ring_exchange"),
}
WIRE_TYPE = {"current_tensor_scaling": "f8E4M3FN", "mxfp8_1d_scaling": "ui8",
             "nvfp4_1d_scaling": "ui8"}  # fmt: skip
#: every method with the tensor and MXFP8 modes; NVFP4 and unchecked shard_map on the ring
MOVES = [(mode, method, True) for mode in MODES[:2] for method in CONFIGS] + [
    ("nvfp4_1d_scaling", "ring", True),
    ("current_tensor_scaling", "ring", False),
]


@pytest.mark.parametrize(("mode", "method", "check_vma"), MOVES)
def test_all_gather_moves_quantized_rows(rng, mode, method, check_vma):
    """The AG's rows travel quantized (float8 values, or bytes of values and block scales),
    never in x's dtype; values and straight-through gradients as the float64 composition of
    the quantized operands: dX = q(dY) @ q(w)^T over the column shards, dW = q(x)^T q(dY)."""
    size, m, groups, k = 4, 8, 3, 64
    x = rng.standard_normal((size * m, k)).astype(np.float32)
    w = rng.standard_normal((groups, k, 32 * size)).astype(np.float32)
    sizes = np.stack([random_sizes(rng, groups, m) for _ in range(size)])
    f = shard(
        lambda a, b, s: cg.all_gather_grouped_matmul(a, b, s[0], "x", config=CONFIGS[method],
                                                     scaling=mode),
        mesh1d(size), (P("x"), P(None, None, "x"), P("x")), P(None, "x"), check_vma=check_vma,
    )  # fmt: skip
    moved = _moved_types(f.lower(x, w, sizes).as_text(), k)
    assert moved and set(moved) == {WIRE_TYPE[mode]}, moved
    y, vjp = jax.vjp(lambda a, b: f(a, b, sizes), x, w)
    g = rng.standard_normal(y.shape).astype(np.float32)
    dx, dw = vjp(g)

    def ref(a, b):
        return jnp.concatenate([reference(a[s * m : (s + 1) * m], b, sizes[s])
                                for s in range(size)])  # fmt: skip

    want, ref_vjp = jax.vjp(ref, _dq(x, mode, -1), _dq(w, mode, 1))
    np.testing.assert_allclose(y, want, rtol=TOL, atol=TOL * 8)
    for got, expected in zip((dx, dw), ref_vjp(_grad_dq(g, mode)), strict=True):
        np.testing.assert_allclose(got, expected, rtol=TOL, atol=TOL * 8)


@pytest.mark.parametrize("mode", MODES[:2])
@pytest.mark.parametrize("method", ["none", "ring"])
def test_dispatch_moves_quantized_tokens(rng, mode, method):
    """The expert-parallel dispatch sends the tokens quantized; its values and gradients are
    those of the unquantized op on the quantized operands with dY quantized (straight-through:
    the op itself is checked against the float64 reference in test_grouped)."""
    size, m, per_shard, k = 4, 8, 2, 64
    experts = size * per_shard
    x = rng.standard_normal((size * m, k)).astype(np.float32)
    w = rng.standard_normal((experts, k, 32)).astype(np.float32)
    sizes = np.stack([np.bincount(rng.integers(0, experts, size=m), minlength=experts)
                      for _ in range(size)]).astype(np.int32)  # fmt: skip
    cfg = CONFIGS[method]

    def run(scaling):
        return shard(
            lambda a, b, s: cg.all_to_all_grouped_matmul(a, b, s[0], "x", config=cfg,
                                                         scaling=scaling)[0],
            mesh1d(size), (P("x"), P("x"), P("x")), P("x"),
        )  # fmt: skip

    moved = _moved_types(run(mode).lower(x, w, sizes).as_text(), k)
    assert moved and set(moved) == {WIRE_TYPE[mode]}, moved
    y, vjp = jax.vjp(lambda a, b: run(mode)(a, b, sizes), x, w)
    g = rng.standard_normal(y.shape).astype(np.float32)
    qx, qw = _dq(x, mode, -1).astype(np.float32), _dq(w, mode, 1).astype(np.float32)
    want, ref_vjp = jax.vjp(lambda a, b: run(None)(a, b, sizes), qx, qw)
    np.testing.assert_allclose(y, want, rtol=TOL, atol=TOL * 8)
    qg = _grad_dq(g.reshape(-1, g.shape[-1]), mode).reshape(g.shape).astype(np.float32)
    for got, expected in zip(vjp(g), ref_vjp(qg), strict=True):
        np.testing.assert_allclose(got, expected, rtol=TOL, atol=TOL * 8)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    mode=st.sampled_from(MODES[:2]),
    method=st.sampled_from(list(CONFIGS)),
    size=st.sampled_from([1, 2, 4]),
    groups=st.integers(1, 5),
    m=st.sampled_from([2, 6, 10]),
    seed=st.integers(0, 2**31 - 1),
)
def test_all_gather_any_groups(mode, method, size, groups, m, seed):
    """Any mesh size, group count (empty groups, one group taking every row) and row count:
    the quantized rows' all-gather gives the float64 composition of the quantized operands."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((size * m, 32)).astype(np.float32)
    w = rng.standard_normal((groups, 32, 32 * size)).astype(np.float32)
    sizes = np.stack([random_sizes(rng, groups, m) for _ in range(size)])
    got = shard(
        lambda a, b, s: cg.all_gather_grouped_matmul(a, b, s[0], "x", config=CONFIGS[method],
                                                     scaling=mode),
        mesh1d(size), (P("x"), P(None, None, "x"), P("x")), P(None, "x"),
    )(x, w, sizes)  # fmt: skip
    qx, qw = _dq(x, mode, -1), _dq(w, mode, 1)
    want = np.concatenate([reference(qx[s * m : (s + 1) * m], qw, sizes[s]) for s in range(size)])
    np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL * 8)


def _dq_delayed(a, state, dtype=jnp.float8_e4m3fn):
    q = cg.quantize(jnp.asarray(a), "delayed_tensor_scaling", dtype=dtype, state=state)[0]
    return np.asarray(cg.dequantize(q, jnp.float64))


@pytest.mark.parametrize(
    "op,check_vma", [("local", True), ("ag", True), ("ag", False), ("rs", True)]
)  # fmt: skip
def test_delayed_scaling_with_dy_state(rng, op, check_vma):
    """Delayed scaling on the grouped ops, dy_state included: x and w by their states' scales,
    the backward's dY (e5m2) by dy_state's, and the gradient of dy_state the state advanced by
    the whole dY's amax (identical on every device; the AG under both shard_map settings),
    over two steps that each take the previous step's state; dX and dW against float64
    products of the quantized operands."""
    size, m, groups = 4, 8, 3
    xs = cg.ScalingState.create(history=4).update(jnp.float32(3.0))
    ws = cg.ScalingState.create(history=4).update(jnp.float32(5.0))

    def recipe(sd):
        return cg.ScalingRecipe("delayed_tensor_scaling", x_state=xs, w_state=ws, dy_state=sd)

    mesh, cfg = mesh1d(size), cg.OverlapConfig(method="ring_exchange")
    if op in ("ag", "local"):  # the local op on each device's rows, with all the experts
        n = 16 * size if op == "ag" else 16
        x, w = rng.standard_normal((size * m, 64)), rng.standard_normal((groups, 64, n))
        sizes = np.stack([random_sizes(rng, groups, m) for _ in range(size)])
        if op == "ag":
            body = lambda a, b, s, sd: cg.all_gather_grouped_matmul(  # noqa: E731
                a, b, s[0], "x", config=cfg, scaling=recipe(sd))  # fmt: skip
            specs, out_spec = (P("x"), P(None, None, "x"), P("x"), P()), P(None, "x")
        else:
            body = lambda a, b, s, sd: cg.grouped_matmul(a, b, s[0], scaling=recipe(sd))  # noqa: E731
            specs, out_spec = (P("x"), P(), P("x"), P()), P("x")

        def ref(a, b):
            return jnp.concatenate([reference(a[s * m : (s + 1) * m], b, sizes[s])
                                    for s in range(size)])  # fmt: skip
    else:
        x, w = (
            rng.standard_normal((size * m, 16 * size)),
            rng.standard_normal((groups, 16 * size, 32)),
        )
        sizes = np.broadcast_to(random_sizes(rng, groups, size * m), (size, groups))
        ref = lambda a, b: reference(a, b, sizes[0])  # noqa: E731
        body = lambda a, b, s, sd: cg.grouped_matmul_reduce_scatter(  # noqa: E731
            a, b, s[0], "x", config=cfg, scaling=recipe(sd))  # fmt: skip
        specs, out_spec = (P(None, "x"), P(None, "x", None), P("x"), P()), P("x")
    f = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=out_spec, check_vma=check_vma)
    qx, qw = _dq_delayed(x, xs), _dq_delayed(w, ws)
    state, amaxes = cg.ScalingState.create(history=4).update(jnp.float32(2.0)), [2.0]
    for step in range(2):
        out_shape = jax.eval_shape(f, x, w, sizes, state).shape
        g = rng.standard_normal(out_shape) * 10.0 ** (step - 1)  # dY's scale moves each step
        loss = lambda a, b, sd, g=g: jnp.sum(f(a, b, sizes, sd) * g)  # noqa: E731
        value, grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2)))(x, w, state)
        np.testing.assert_allclose(value, np.sum(np.asarray(ref(qx, qw)) * g), rtol=1e-6)
        qdy = _dq_delayed(g, state, jnp.float8_e5m2)
        want_dx, want_dw = jax.vjp(ref, qx, qw)[1](jnp.asarray(qdy))
        np.testing.assert_allclose(grads[0], want_dx, rtol=TOL, atol=TOL * 8)
        np.testing.assert_allclose(grads[1], want_dw, rtol=TOL, atol=TOL * 8)
        state, amaxes = grads[2], [float(np.abs(g).max()), *amaxes]
        np.testing.assert_allclose(state.amax_history, (amaxes + [0.0] * 4)[:4], rtol=1e-6)
        np.testing.assert_allclose(float(state.scale), 57344.0 / max(amaxes), rtol=1e-6)


def test_expert_parallel_pair_delayed(rng):
    """Dispatch, experts and return under delayed scaling, each op with its own dy_state: the
    values against the one-device composition of the operands quantized by their states; each
    op's dy_state comes back advanced by the amax of its whole dY (the dispatch's: the return
    op's cotangent for its input)."""
    size, m, per_shard = 4, 8, 2
    experts = size * per_shard
    x = rng.standard_normal((size * m, 32)).astype(np.float32)
    w1 = rng.standard_normal((experts, 32, 64)).astype(np.float32)
    w2 = rng.standard_normal((experts, 64, 32)).astype(np.float32)
    tokens = [rng.integers(0, experts, size=m) for _ in range(size)]
    sizes = np.stack([np.bincount(t, minlength=experts) for t in tokens]).astype(np.int32)
    st = lambda a: cg.ScalingState.create(history=2).update(jnp.float32(a))  # noqa: E731
    xs, w1s, hs, w2s = st(3.0), st(4.0), st(40.0), st(5.0)

    def dispatch(a, b, g, d1):
        r1 = cg.ScalingRecipe("delayed_tensor_scaling", x_state=xs, w_state=w1s, dy_state=d1)
        return cg.all_to_all_grouped_matmul(a, b, g[0], "x", scaling=r1)

    def back(y, received, c, g, d2):
        r2 = cg.ScalingRecipe("delayed_tensor_scaling", x_state=hs, w_state=w2s, dy_state=d2)
        return cg.grouped_matmul_all_to_all(y, c, received, g[0], "x", scaling=r2)

    def body(a, b, c, g, d1, d2):
        return back(*dispatch(a, b, g, d1), c, g, d2)

    specs = (P("x"), P("x"), P("x"), P("x"), P(), P())
    f = shard(body, mesh1d(size), specs, P("x"))
    d1 = d2 = st(1.0)
    got = f(x, w1, w2, sizes, d1, d2)
    qx, q1, q2 = _dq_delayed(x, xs), _dq_delayed(w1, w1s), _dq_delayed(w2, w2s)
    hidden = np.concatenate([reference(qx[s * m : (s + 1) * m], q1, sizes[s]) for s in range(size)])
    qh = _dq_delayed(hidden, hs)
    want = np.concatenate([reference(qh[s * m : (s + 1) * m], q2, sizes[s]) for s in range(size)])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    g = rng.standard_normal(got.shape).astype(np.float32)
    loss = lambda *a: jnp.sum(f(*a) * g)  # noqa: E731
    new1, new2 = jax.grad(loss, (4, 5))(x, w1, w2, sizes, d1, d2)
    np.testing.assert_allclose(new2.amax_history, [np.abs(g).max(), 1.0], rtol=1e-6)
    # the dispatch's dY: the return op's cotangent for its input y, over every shard
    mesh = mesh1d(size)
    y, received = shard(dispatch, mesh, specs[:2] + specs[3:5], (P("x"), P("x")))(
        x, w1, sizes, d1
    )  # fmt: skip
    second = shard(back, mesh, (P("x"), P("x"), P("x"), P("x"), P()), P("x"))
    dy = jax.vjp(lambda v: second(v, received, w2, sizes, d2), y)[1](jnp.asarray(g))[0]
    np.testing.assert_allclose(new1.amax_history, [np.abs(dy).max(), 1.0], rtol=1e-6)
