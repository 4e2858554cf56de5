"""Quantized collective GEMMs (`scaling=`): every op x method x mode against the float64 product
of the same quantized operands (tight: only the order of float32 accumulation differs, since a
shard's scales are the tensor's) and against the unquantized product (the mode's error, below);
gradients against the straight-through reference; what moves on the wire (the lowered program);
delayed scaling through the ops; the local GEMM, 2-D, gemm and dense; bad input."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import P, config_id, dequantized, mesh1d, mesh2d, shard

import commgemm as cg
from commgemm import scaled
from commgemm.quant import ScalingMode

CUR = ScalingMode.CURRENT_TENSOR_SCALING
MX = ScalingMode.MXFP8_1D_SCALING
NV = ScalingMode.NVFP4_1D_SCALING
MODES = [CUR, MX, NV]

#: Max |error| against the unquantized float64 product, per sqrt(K), for unit-normal operands.
#: e4m3 keeps 3 mantissa bits: a value's relative error is at most 2^-4, a product term's about
#: 2^-3, and K terms of random sign add like sqrt(K) (measured: 0.17 for tensor scaling, 0.21
#: for MXFP8, whose power-of-two scales leave the block's top value anywhere in (224, 448]).
#: NVFP4's e2m1 keeps 1 mantissa bit: relative error up to 1/4 a value (measured 0.53).
TRUE_TOL = {CUR: 0.35, MX: 0.4, NV: 1.0}
#: Against the same quantized operands in float64: float32 accumulation only.
RTOL, ATOL = 1e-5, 2e-5

OPS = {
    "ag": (cg.all_gather_matmul, (P("x", None), P(None, "x")), P(None, "x")),
    "rs": (cg.matmul_reduce_scatter, (P(None, "x"), P("x", None)), P("x", None)),
    "ar": (cg.matmul_all_reduce, (P(None, "x"), P("x", None)), P(None, None)),
}


def _configs(op: str):
    yield cg.OverlapConfig(method="none")
    yield cg.OverlapConfig(method="pipeline", num_splits=2)
    yield cg.OverlapConfig(method="ring_exchange")
    yield cg.OverlapConfig(method="ring_exchange", num_splits=2, bidirectional=True)
    if op == "ag":
        yield cg.OverlapConfig(method="ring_exchange", aggregate=True)


CASES = [(op, cfg) for op in OPS for cfg in _configs(op)]


def _dq(a, mode, axis):
    """a quantized globally in `mode` (blocks along `axis`) and back, in float64."""
    return dequantized(a, mode, axis)


def _problem(rng, size):
    m, k, n = 8 * size, 64 * size, 64 * size  # blocks of 32 in every shard's K and N
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    return x, w


def _fn(op, cfg, mode, size, check_vma=True):
    fn, specs, out = OPS[op]
    body = lambda a, b: fn(a, b, "x", config=cfg, scaling=mode)  # noqa: E731
    return shard(body, mesh1d(size), specs, out, check_vma=check_vma)


#: Every op x method for the tensor mode at P = 4 (and at P = 2 but PIPELINE); the block modes
#: (whose payload takes the same code paths in every method) with serial and ring at P = 4.
FORWARD = (
    [(op, cfg, CUR, 4) for op, cfg in CASES]
    + [(op, cfg, CUR, 2) for op, cfg in CASES if cfg.method.name != "PIPELINE"]
    + [
        (op, cfg, mode, 4)
        for op, cfg in CASES
        for mode in (MX, NV)
        if cfg.method.name == "NONE" or (cfg.method.name == "RING_EXCHANGE" and cfg.num_splits == 1)
    ]
)


@pytest.mark.parametrize(
    "op,cfg,mode,size",
    FORWARD,
    ids=[f"{o}-{config_id(c)}-{m.name}-P{p}" for o, c, m, p in FORWARD],
)
def test_matches_quantized_reference(rng, op, cfg, mode, size):
    x, w = _problem(rng, size)
    out = np.asarray(_fn(op, cfg, mode, size)(x, w), np.float64)
    want = _dq(x, mode, -1) @ _dq(w, mode, 0)
    k = x.shape[1]
    assert out.shape == want.shape
    np.testing.assert_allclose(out, want, rtol=RTOL, atol=ATOL * np.sqrt(k))
    exact = x.astype(np.float64) @ w.astype(np.float64)
    assert np.abs(out - exact).max() <= TRUE_TOL[mode] * np.sqrt(k)


#: Serial and ring methods, every mode, under check_vma=True; the tensor mode also without it.
GRAD_CASES = [
    (op, cfg, mode, vma)
    for op, cfg in CASES
    if cfg.method.name in ("NONE", "RING_EXCHANGE")
    for mode in MODES
    for vma in ((True, False) if mode is CUR else (True,))
]


@pytest.mark.parametrize(
    "op,cfg,mode,check_vma",
    GRAD_CASES,
    ids=[f"{o}-{config_id(c)}-{m.name}-vma{v}" for o, c, m, v in GRAD_CASES],
)
def test_gradients_straight_through(rng, op, cfg, mode, check_vma):
    """dX = q(dY) @ q(W)^T and dW = q(X)^T @ q(dY): dY quantized by current scaling to e5m2
    (block modes: their own format, blocks along N), W again along N for block modes."""
    size = 4
    x, w = _problem(rng, size)
    f = _fn(op, cfg, mode, size, check_vma)
    y, vjp = jax.vjp(f, x, w)
    g = rng.standard_normal(y.shape).astype(np.float32)
    dx, dw = jax.jit(vjp)(g)
    g_mode, g_dtype = (CUR, jnp.float8_e5m2) if mode is CUR else (mode, jnp.float8_e4m3fn)
    qg = dequantized(g, g_mode, -1, g_dtype)
    w_dgrad = _dq(w, mode, 0) if mode is CUR else _dq(w, mode, 1)
    want_dx = qg @ w_dgrad.T
    want_dw = _dq(x, mode, -1).T @ qg
    for got, want, k in ((dx, want_dx, w.shape[1]), (dw, want_dw, x.shape[0])):
        got = np.asarray(got, np.float64)
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL * np.sqrt(k))


def _operand_types(text: str, name: str) -> list[str]:
    """The operand types of every `name` collective in lowered StableHLO, as "8x256xf32"."""
    # `op(%a) <{attrs}> : (types)` on one line, or `op(%a) <{attrs}> ({region}) : (types)`
    pattern = rf'"stablehlo\.{name}"\((?:[^\n]*?\}}> : |.*?\}}\) : )\(tensor<([^>]*)>'
    return re.findall(pattern, text, re.DOTALL)


def _element_types(text: str, name: str) -> list[str]:
    return [t.rsplit("x", 1)[-1] for t in _operand_types(text, name)]


@pytest.mark.parametrize("method", ["none", "pipeline", "ring_exchange"])
@pytest.mark.parametrize("mode,payload", [(CUR, "f8E4M3FN"), (MX, "ui8"), (NV, "ui8")])
def test_quantized_payload_on_the_wire(rng, method, mode, payload):
    """AG + GEMM moves the quantized rows (float8, or values and block scales as bytes), never
    x itself; RS and AR move float32 partial sums, never float8; the only other collective is
    the scalar amax's all-reduce."""
    size = 4
    x, w = _problem(rng, size)
    cfg = cg.OverlapConfig(method=method, num_splits=2 if method == "pipeline" else 1)
    text = _fn("ag", cfg, mode, size).lower(x, w).as_text()
    moved = _element_types(text, "all_gather") + _element_types(text, "collective_permute")
    assert moved and set(moved) == {payload}
    amaxes = set() if mode is MX else {"f32"}  # scalars; MXFP8 shares no scale
    assert set(_operand_types(text, "all_reduce")) == amaxes
    for op in ("rs", "ar"):
        text = _fn(op, cfg, mode, size).lower(x, w).as_text()
        names = ("reduce_scatter", "collective_permute", "all_gather", "all_reduce")
        moved = [t for name in names for t in _operand_types(text, name)]
        partial_sums = {t for t in moved if t != "f32"}
        assert partial_sums and {t.rsplit("x", 1)[-1] for t in partial_sums} == {"f32"}, moved


def test_delayed_scaling_through_the_op(rng):
    """The op quantizes with the states' scales (one per tensor, the same on every shard), and
    `state.update(cg.amax(x, axis))` inside the step observes the whole tensor's amax."""
    size = 4
    x, w = _problem(rng, size)
    xs = cg.ScalingState.create(history=4).update(jnp.float32(3.0))
    ws = cg.ScalingState.create(history=4).update(jnp.float32(5.0))

    def step(a, b, sx, sw):
        recipe = cg.ScalingRecipe("delayed_tensor_scaling", x_state=sx, w_state=sw)
        y = cg.all_gather_matmul(a, b, "x", scaling=recipe)
        return y, sx.update(cg.amax(a, "x")), sw.update(cg.amax(b, "x"))

    specs = (P("x", None), P(None, "x"), P(), P())
    f = shard(step, mesh1d(size), specs, (P(None, "x"), P(), P()))
    y, new_x, new_w = f(x, w, xs, ws)
    qx = cg.dequantize(cg.quantize(jnp.asarray(x), "delayed_tensor_scaling", state=xs)[0])
    qw = cg.dequantize(cg.quantize(jnp.asarray(w), "delayed_tensor_scaling", state=ws)[0])
    want = np.asarray(qx, np.float64) @ np.asarray(qw, np.float64)
    np.testing.assert_allclose(np.asarray(y), want, rtol=RTOL, atol=ATOL * np.sqrt(x.shape[1]))
    np.testing.assert_allclose(float(new_x.amax_history[0]), np.abs(x).max(), rtol=1e-6)
    np.testing.assert_allclose(float(new_w.amax_history[0]), np.abs(w).max(), rtol=1e-6)
    np.testing.assert_allclose(float(new_x.scale), 448 / max(3.0, np.abs(x).max()), rtol=1e-6)


#: The ops' layouts with a second, data axis "d" over x's (and dY's) rows: dY differs between
#: the data replicas, so dy_state's amax must cover them too.
DATA_OPS = {
    "ag": (cg.all_gather_matmul, (P(("d", "x"), None), P(None, "x")), P("d", "x")),
    "rs": (cg.matmul_reduce_scatter, (P("d", "x"), P("x", None)), P(("d", "x"), None)),
    "ar": (cg.matmul_all_reduce, (P("d", "x"), P("x", None)), P("d", None)),
}


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("op", ["ag", "rs", "ar", "local", "2d"])
def test_delayed_scaling_of_dy(rng, op, check_vma):
    """With dy_state, the backward quantizes dY (e5m2) by the state's scale, and the gradient of
    dy_state is the state advanced by the whole dY's amax, over the op's axis and a data axis,
    identical on every device, under both shard_map settings; three steps, each taking the
    previous step's state. dX and dW against float64 products of the quantized operands."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("d", "x"))
    m, k, n = 32, 64, 64
    x, w = rng.standard_normal((m, k)), rng.standard_normal((k, n))
    xs = cg.ScalingState.create(history=4).update(jnp.float32(3.0))
    ws = cg.ScalingState.create(history=4).update(jnp.float32(5.0))

    def recipe(sd):
        return cg.ScalingRecipe("delayed_tensor_scaling", x_state=xs, w_state=ws, dy_state=sd)

    if op in DATA_OPS:
        fn, (x_spec, w_spec), out_spec = DATA_OPS[op]
        body = lambda a, b, sd: fn(a, b, "x", scaling=recipe(sd))  # noqa: E731
    elif op == "2d":
        x_spec, w_spec, out_spec = P("x", "d"), P("x", None), P("x", None)
        mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ("x", "d"))
        body = lambda a, b, sd: cg.matmul_2d(a, b, row_axis="x", k_axis="d",  # noqa: E731
                                             scaling=recipe(sd))  # fmt: skip
    else:  # one device's GEMM (scaled.matmul), rows over both axes
        x_spec, w_spec, out_spec = P(("d", "x")), P(), P(("d", "x"))
        body = lambda a, b, sd: scaled.matmul(a, b, recipe(sd))  # noqa: E731
    f = jax.shard_map(body, mesh=mesh, in_specs=(x_spec, w_spec, P()), out_specs=out_spec,
                      check_vma=check_vma)  # fmt: skip
    state = cg.ScalingState.create(history=4).update(jnp.float32(2.0))
    amaxes = [2.0]
    qx = np.asarray(cg.dequantize(cg.quantize(jnp.asarray(x), "delayed_tensor_scaling",
                                              state=xs)[0], jnp.float64))  # fmt: skip
    qw = np.asarray(cg.dequantize(cg.quantize(jnp.asarray(w), "delayed_tensor_scaling",
                                              state=ws)[0], jnp.float64))  # fmt: skip
    for step in range(3):
        g = rng.standard_normal((m, n)) * 10.0 ** (step - 2)  # dY's scale moves each step
        loss = lambda a, b, sd, g=g: jnp.sum(f(a, b, sd) * g)  # noqa: E731
        grads = jax.jit(jax.grad(loss, (0, 1, 2)))(x, w, state)
        e5m2 = cg.quantize(jnp.asarray(g), "delayed_tensor_scaling", dtype=jnp.float8_e5m2,
                           state=state)[0]  # fmt: skip
        qdy = np.asarray(cg.dequantize(e5m2, jnp.float64))
        np.testing.assert_allclose(np.asarray(grads[0]), qdy @ qw.T, rtol=1e-5, atol=1e-5 * m)
        np.testing.assert_allclose(np.asarray(grads[1]), qx.T @ qdy, rtol=1e-5, atol=1e-5 * m)
        state, amaxes = grads[2], [float(np.abs(g).max()), *amaxes]
        want = np.array((amaxes + [0.0] * 4)[:4], np.float32)
        np.testing.assert_allclose(np.asarray(state.amax_history), want, rtol=1e-6)
        np.testing.assert_allclose(float(state.scale), 57344.0 / max(amaxes), rtol=1e-6)


def test_dy_state_needs_delayed_scaling():
    state = cg.ScalingState.create()
    with pytest.raises(ValueError, match="dy_state"):
        cg.ScalingRecipe("current_tensor_scaling", dy_state=state)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_local_matmul_and_dense(rng, mode):
    x, w = _problem(rng, 1)
    want = _dq(x, mode, -1) @ _dq(w, mode, 0)
    out = jax.jit(lambda a, b: scaled.matmul(a, b, mode))(x, w)
    np.testing.assert_allclose(np.asarray(out), want, rtol=RTOL, atol=ATOL * np.sqrt(64))
    x3 = x.reshape(2, 4, 64)
    out3 = jax.jit(lambda a, b: cg.dense(a, b, scaling=mode))(x3, w)
    np.testing.assert_allclose(np.asarray(out3).reshape(8, -1), want, rtol=RTOL, atol=1e-3)
    dx = jax.jit(jax.grad(lambda a: jnp.sum(scaled.matmul(a, w, mode))))(x)
    assert dx.shape == x.shape and np.isfinite(np.asarray(dx)).all()


#: (mode, rows x k mesh, method, check_vma): the tensor mode with every method on both 2 x 4
#: and 4 x 2 meshes and both settings; the block modes serial and ring on 2 x 2.
CASES_2D = [
    (CUR, mesh, method, vma)
    for mesh in ((2, 4), (4, 2))
    for method in ("none", "pipeline", "ring_exchange")
    for vma in (True, False)
] + [(mode, (2, 2), method, True) for mode in (MX, NV) for method in ("none", "ring_exchange")]


def _fn_2d(mode, mesh, method, check_vma=True):
    cfg = cg.OverlapConfig(method=method, num_splits=2 if method == "pipeline" else 1)
    body = lambda a, b: cg.matmul_2d(a, b, row_axis="x", k_axis="y", config=cfg, scaling=mode)  # noqa: E731
    return shard(body, mesh2d(*mesh), (P("x", "y"), P("x", None)), P("x", None), check_vma)


@pytest.mark.parametrize(
    "mode,mesh,method,check_vma",
    CASES_2D,
    ids=[f"{m.name}-{r}x{c}-{me}-vma{v}" for m, (r, c), me, v in CASES_2D],
)
def test_matmul_2d_quantized(rng, mode, mesh, method, check_vma):
    """The 2-D case against the float64 product of x and W quantized whole (one tensor scale
    each, or blocks along K), and its gradients against the straight-through reference (block
    modes: W's values requantized with blocks along N for dX)."""
    rows, cols = mesh
    x = rng.standard_normal((8 * rows, 64 * rows * cols)).astype(np.float32)
    w = rng.standard_normal((x.shape[1], 128)).astype(np.float32)
    f = _fn_2d(mode, mesh, method, check_vma)
    y, vjp = jax.vjp(f, x, w)
    k = x.shape[1]
    want = _dq(x, mode, -1) @ _dq(w, mode, 0)
    np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=RTOL, atol=ATOL * np.sqrt(k))
    exact = x.astype(np.float64) @ w.astype(np.float64)
    assert np.abs(np.asarray(y) - exact).max() <= TRUE_TOL[mode] * np.sqrt(k)
    g = rng.standard_normal(y.shape).astype(np.float32)
    dx, dw = jax.jit(vjp)(g)
    g_mode, g_dtype = (CUR, jnp.float8_e5m2) if mode is CUR else (mode, jnp.float8_e4m3fn)
    qg = dequantized(g, g_mode, -1, g_dtype)
    w_dgrad = _dq(w, mode, 0) if mode is CUR else _dq(_dq(w, mode, 0).astype(np.float32), mode, 1)
    for got, want, depth in (
        (dx, qg @ w_dgrad.T, w.shape[1]),
        (dw, _dq(x, mode, -1).T @ qg, x.shape[0]),
    ):
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=RTOL,
                                   atol=ATOL * np.sqrt(depth))  # fmt: skip


@pytest.mark.parametrize("method", ["none", "pipeline", "ring_exchange"])
@pytest.mark.parametrize(
    "mode,moved", [(CUR, {"f8E4M3FN"}), (MX, {"f8E4M3FN", "ui8"}), (NV, {"f8E4M3FN", "ui8"})]
)
def test_matmul_2d_gathers_quantized_w(rng, method, mode, moved):
    """W's rows move over the row axis as float8 values (and block scales as bytes), never in
    W's dtype; over k_axis only float32 partial sums and scalar amaxes are reduced."""
    x = rng.standard_normal((16, 256)).astype(np.float32)
    w = rng.standard_normal((256, 128)).astype(np.float32)
    text = _fn_2d(mode, (2, 2), method).lower(x, w).as_text()
    gathers = [t.split("x") for t in _operand_types(text, "all_gather")]
    # rows of this device's output (8; the ring all-reduce gathers them) or W's payload
    assert {t[-1] for t in gathers if int(t[0]) > 8} == moved
    assert {t[-1] for t in gathers if int(t[0]) <= 8} <= {"f32"}
    reduced = [
        t
        for name in ("all_reduce", "reduce_scatter", "collective_permute")
        for t in _operand_types(text, name)
    ]
    assert reduced and {t.rsplit("x", 1)[-1] for t in reduced} == {"f32"}


def test_matmul_2d_delayed_scaling(rng):
    """DELAYED takes both tensors' scales from the states, the same on every device."""
    x = rng.standard_normal((16, 256)).astype(np.float32)
    w = rng.standard_normal((256, 64)).astype(np.float32)
    xs = cg.ScalingState.create(history=4).update(jnp.float32(3.0))
    ws = cg.ScalingState.create(history=4).update(jnp.float32(5.0))

    def body(a, b, sx, sw):
        recipe = cg.ScalingRecipe("delayed_tensor_scaling", x_state=sx, w_state=sw)
        return cg.matmul_2d(a, b, row_axis="x", k_axis="y", scaling=recipe)

    specs = (P("x", "y"), P("x", None), P(), P())
    y = shard(body, mesh2d(2, 4), specs, P("x", None))(x, w, xs, ws)
    qx = cg.dequantize(cg.quantize(jnp.asarray(x), "delayed_tensor_scaling", state=xs)[0])
    qw = cg.dequantize(cg.quantize(jnp.asarray(w), "delayed_tensor_scaling", state=ws)[0])
    want = np.asarray(qx, np.float64) @ np.asarray(qw, np.float64)
    np.testing.assert_allclose(np.asarray(y), want, rtol=RTOL, atol=ATOL * np.sqrt(256))


def test_gemm_passes_scaling(rng):
    """gemm passes scaling to the op it picks (here the all-gather) and to XLA's fall-back."""
    mode = CUR
    x = rng.standard_normal((16, 64)).astype(np.float32)
    w = rng.standard_normal((64, 64)).astype(np.float32)
    mesh = mesh1d(4)
    xs = jax.device_put(x, jax.NamedSharding(mesh, P("x", None)))
    ws = jax.device_put(w, jax.NamedSharding(mesh, P(None, "x")))
    want = _dq(x, mode, -1) @ _dq(w, mode, 0)
    for cfg in (cg.OverlapConfig(), cg.OverlapConfig(method="ring_exchange")):
        out = cg.gemm(xs, ws, out_sharding=P(None, "x"), config=cfg, scaling=mode)
        np.testing.assert_allclose(np.asarray(out), want, rtol=RTOL, atol=ATOL * 8)
    replicated = jax.device_put(x, jax.NamedSharding(mesh, P()))
    out = cg.gemm(replicated, ws, out_sharding=P(None, "x"), scaling=mode)  # XLA's fall-back
    np.testing.assert_allclose(np.asarray(out), want, rtol=RTOL, atol=ATOL * 8)


def test_non_finite_stays_local(rng):
    """One inf in x spoils only the output rows it touches, as in jnp, not the whole result."""
    x, w = _problem(rng, 2)
    x[3, 5] = np.inf
    out = np.asarray(_fn("ag", cg.OverlapConfig(), CUR, 2)(x, w))
    assert not np.isfinite(out[3]).any()
    assert np.isfinite(np.delete(out, 3, axis=0)).all()


def test_bad_input(rng):
    x, w = _problem(rng, 2)
    with pytest.raises(ValueError, match="multiples of 32"):
        _fn("ag", cg.OverlapConfig(), MX, 2)(x[:, :48], w[:48])
    with pytest.raises(ValueError, match="x_state= and w_state="):
        cg.ScalingRecipe("delayed_tensor_scaling")
    with pytest.raises(ValueError, match="keeps state"):
        _fn("ag", cg.OverlapConfig(), "delayed_tensor_scaling", 2)(x, w)
    with pytest.raises(ValueError, match="must be one of"):
        cg.ScalingRecipe(dtype="bfloat16")
    with pytest.raises(ValueError, match="not a valid ScalingMode"):
        _fn("ag", cg.OverlapConfig(), "fp3", 2)(x, w)
    # the fused kernels: tensor modes, Hopper
    ring = cg.OverlapConfig(method="ring_exchange", atomic_gemm=True)
    direct = cg.OverlapConfig(method="pipeline", atomic_gemm=True)
    for op, cfg, scaling, why in [
        ("ag", ring, MX, "no Hopper tensor-core path"),
        ("rs", direct, MX, "no Hopper tensor-core path"),
        ("ag", ring, CUR, "cannot run this call"),  # the plan's own checks (dtype, GPU)
        ("rs", direct, CUR, "cannot run this call"),
    ]:
        with pytest.raises(ValueError, match=why):
            _fn(op, cfg, scaling, 2)(x, w)
    # NO_SCALING is the unquantized op
    out = _fn("ag", cg.OverlapConfig(), "no_scaling", 2)(x, w)
    np.testing.assert_allclose(np.asarray(out), x.astype(np.float64) @ w, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("op", ["ag", "rs"])
def test_prequantized_operands(rng, op, mode):
    """ScaledTensor operands quantized by the caller with the shared amax give what scaling=
    gives (forward)."""
    size = 4
    x, w = _problem(rng, size)
    fn, specs, out_spec = OPS[op]
    cfg = cg.OverlapConfig(method="ring_exchange", out_dtype="float32")

    def body(a, b):
        amax = lambda t: None if mode is MX else cg.amax(t, "x")  # noqa: E731
        qa = cg.quantize(a, mode, amax=amax(a))
        qb = cg.quantize(b, mode, axis=0, amax=amax(b))
        return fn(qa, qb, "x", config=cfg), fn(a, b, "x", config=cfg, scaling=mode)

    mine, inside = shard(body, mesh1d(size), specs, (out_spec, out_spec))(x, w)
    np.testing.assert_allclose(np.asarray(mine), np.asarray(inside), rtol=1e-6, atol=1e-5)


def test_prequantized_bad_input(rng):
    x, w = _problem(rng, 2)

    def run(make_x, make_w):
        body = lambda a, b: cg.all_gather_matmul(make_x(a), make_w(b), "x")  # noqa: E731
        return shard(body, mesh1d(2), (P("x", None), P(None, "x")), P(None, "x"))(x, w)

    with pytest.raises(ValueError, match="quantize both alike"):
        run(lambda a: cg.quantize(a, CUR), lambda b: cg.quantize(b, MX, axis=0))
    with pytest.raises(TypeError, match="quantize both x and w"):
        run(lambda a: cg.quantize(a, CUR), lambda b: b)
    with pytest.raises(ValueError, match="quantize w with axis=0"):
        run(lambda a: cg.quantize(a, MX), lambda b: cg.quantize(b, MX, axis=1))


def test_scales_and_dtypes_checked(rng):
    """Scales that do not fit their values, and formats a mode cannot quantize to, are clear
    errors, not a wrong product."""
    x, w = _problem(rng, 2)
    with pytest.raises(ValueError, match="quantizes to float8_e4m3fn or float8_e5m2"):
        cg.quantize(jnp.asarray(x), CUR, dtype=jnp.bfloat16)
    with pytest.raises(TypeError, match="floating x"):
        cg.quantize(jnp.ones((4, 32), jnp.int32), MX)

    def run(make_x):
        body = lambda a, b: cg.all_gather_matmul(  # noqa: E731
            make_x(a), cg.quantize(b, MX, axis=0), "x"
        )
        return shard(body, mesh1d(2), (P("x", None), P(None, "x")), P(None, "x"))(x, w)

    def wrong_scales(a):
        t = cg.quantize(a, MX)
        return dataclasses.replace(t, scale_inv=t.scale_inv[:, :1])

    with pytest.raises(ValueError, match="scales have shape"):
        run(wrong_scales)
