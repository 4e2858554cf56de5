"""`cg.gemm` under `jax.jit` on Auto mesh axes, where only XLA's partitioner knows the operand
shardings: values and gradients against the float64 reference for every layout (1-D, N-D
sequence-parallel, 2-D mesh, and layouts it cannot overlap), the ring's collective-permutes in
the forward and backward programs, shardings propagated from jit's in_shardings, scaling."""

import re

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import P, assert_close, mesh1d, mesh2d, random
from hypothesis import given, settings
from jax.sharding import Mesh, NamedSharding

import commgemm as cg

CONFIGS = {
    "none": cg.OverlapConfig(),
    "pipeline": cg.OverlapConfig(method="pipeline", num_splits=2),
    "ring": cg.OverlapConfig(method="ring_exchange", bidirectional=True),
}


def _mesh(kind: str) -> Mesh:
    if kind == "2d":
        return mesh2d(2, 2)
    if kind == "data_tp":
        return Mesh(mesh2d(2, 2).devices, ("data", "x"))
    if kind == "unit_data":  # a data axis of size 1, which XLA's propagation leaves out
        return Mesh(mesh1d(4).devices.reshape(1, 4), ("data", "x"))
    if kind == "three":  # an axis of a size that is not a power of two
        return mesh1d(3)
    return mesh1d(4)


#: name: (mesh, x shape, x spec, w spec, out spec)
LAYOUTS = {
    "ag": ("1d", (32, 24), P("x", None), P(None, "x"), P(None, "x")),
    "rs": ("1d", (32, 24), P(None, "x"), P("x", None), P("x", None)),
    "ar": ("1d", (32, 24), P(None, "x"), P("x", None), P(None, None)),
    "seq_ag": ("data_tp", (4, 16, 24), P("data", "x", None), P(None, "x"), P("data", None, "x")),
    "seq_rs": ("data_tp", (4, 16, 24), P("data", None, "x"), P("x", None), P("data", "x", None)),
    "unit_seq_ag": (
        "unit_data",
        (4, 16, 24),
        P("data", "x", None),
        P(None, "x"),
        P("data", None, "x"),
    ),
    "unit_seq_rs": (
        "unit_data",
        (4, 16, 24),
        P("data", None, "x"),
        P("x", None),
        P("data", "x", None),
    ),
    "ar_over_data": (  # replicated over a data axis as well: dY divided, dX and dW summed
        "data_tp",
        (4, 16, 24),
        P(None, None, "x"),
        P("x", None),
        P(None, None, None),
    ),
    "ar3": ("three", (30, 24), P(None, "x"), P("x", None), P(None, None)),
    "xla3": ("three", (30, 24), P(None, None), P("x", None), P("x", None)),
    "2d": ("2d", (32, 24), P("x", "y"), P("x", None), P("x", None)),
    "xla": ("1d", (32, 24), P(None, None), P("x", None), P(None, "x")),
}


def _run(rng, layout, cfg, **gemm_kwargs):
    kind, shape, xs, ws, os_ = LAYOUTS[layout]
    mesh = _mesh(kind)
    x, w = random(rng, shape), random(rng, (shape[-1], 16))
    xd = jax.device_put(x, NamedSharding(mesh, xs))
    wd = jax.device_put(w, NamedSharding(mesh, ws))
    out_sharding = NamedSharding(mesh, os_)
    f = jax.jit(lambda a, b: cg.gemm(a, b, out_sharding=out_sharding, config=cfg, **gemm_kwargs))
    return f, x, w, xd, wd, out_sharding


@pytest.mark.parametrize("cfg", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("layout", LAYOUTS)
def test_values_and_gradients(rng, layout, cfg):
    f, x, w, xd, wd, out_sharding = _run(rng, layout, cfg)
    out = f(xd, wd)
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    assert_close(out, want, np.float32, x.shape[-1])
    assert out.sharding.is_equivalent_to(out_sharding, x.ndim)
    g = random(rng, want.shape)
    dx, dw = jax.jit(jax.grad(lambda a, b: jnp.sum(f(a, b) * g), (0, 1)))(xd, wd)
    g64 = g.astype(np.float64).reshape(-1, g.shape[-1])
    assert_close(dx, (g64 @ w.T.astype(np.float64)).reshape(x.shape), np.float32, w.shape[1])
    x64 = x.astype(np.float64).reshape(-1, x.shape[-1])
    assert_close(dw, x64.T @ g64, np.float32, x64.shape[0])


@pytest.mark.parametrize("layout", ["ag", "unit_seq_ag"])
def test_ring_overlaps_forward_and_backward(rng, layout):
    """The (bidirectional, P = 4: three transfers) ring AG moves x by collective-permutes, no
    all-gather; its gradient's dX is the ring RS: permutes again, no reduce-scatter. Also with
    a mesh axis of size 1 in the specs (it used to fall back to a local GEMM on W gathered)."""
    f, x, w, xd, wd, _ = _run(rng, layout, CONFIGS["ring"])
    forward = f.lower(xd, wd).compile().as_text()
    assert forward.count("collective-permute(") + forward.count("collective-permute-start(") >= 3
    assert "all-gather(" not in forward and "all-gather-start(" not in forward
    grad = jax.jit(jax.grad(lambda a, b: jnp.sum(f(a, b)), 0)).lower(xd, wd).compile().as_text()
    assert grad.count("collective-permute(") + grad.count("collective-permute-start(") >= 3
    assert "reduce-scatter" not in grad


#: x spec, w spec, out spec of the 1-D layouts, on an axis "x"
SPECS_1D = {
    "ag": (P("x", None), P(None, "x"), P(None, "x")),
    "rs": (P(None, "x"), P("x", None), P("x", None)),
    "ar": (P(None, "x"), P("x", None), P(None, None)),
    "xla": (P(None, None), P("x", None), P("x", None)),  # x replicated: XLA's fall-back
}


@settings(max_examples=10, deadline=None)
@given(
    size=st.sampled_from([2, 3, 4]),
    layout=st.sampled_from(sorted(SPECS_1D)),
    method=st.sampled_from(["none", "ring_exchange"]),
    dims=st.tuples(*[st.integers(1, 5)] * 3),
    seed=st.integers(0, 2**16),
)
def test_layouts_shapes_and_sizes(size, layout, method, dims, seed):
    """Any 1-D layout, axis size (3 too: dY divided and summed back where it is replicated) and
    shape: values and gradients against the float64 reference."""
    rng = np.random.default_rng(seed)
    m, k, n = (size * d for d in dims)
    mesh, (xs, ws, os_) = mesh1d(size), SPECS_1D[layout]
    x, w, g = random(rng, (m, k)), random(rng, (k, n)), random(rng, (m, n))
    xd = jax.device_put(x, NamedSharding(mesh, xs))
    wd = jax.device_put(w, NamedSharding(mesh, ws))
    cfg = cg.OverlapConfig(method=method)
    f = lambda a, b: cg.gemm(a, b, out_sharding=NamedSharding(mesh, os_), config=cfg)  # noqa: E731
    out, vjp = jax.vjp(jax.jit(f), xd, wd)
    dx, dw = vjp(jnp.asarray(g))
    x64, w64, g64 = (a.astype(np.float64) for a in (x, w, g))
    assert_close(out, x64 @ w64, np.float32, k)
    assert_close(dx, g64 @ w64.T, np.float32, n)
    assert_close(dw, x64.T @ g64, np.float32, m)


@pytest.mark.parametrize("layout", ["ag", "rs", "ar"])
def test_under_remat_and_scan(rng, layout):
    """The two partitioned ops inside jax.checkpoint and a lax.scan over stacked weights (a
    model's layers): gradients against the float64 reference."""
    kind, shape, xs, ws, os_ = LAYOUTS[layout]
    mesh = _mesh(kind)
    x, stack = random(rng, (32, 24)), random(rng, (3, 24, 24)) / 5
    xd = jax.device_put(x, NamedSharding(mesh, xs))
    sd = jax.device_put(stack, NamedSharding(mesh, P(None, *ws)))
    ring = CONFIGS["ring"]

    def model(a, weights, gemm):
        def layer(c, b):
            c = jax.lax.with_sharding_constraint(c, NamedSharding(mesh, xs)) if gemm else c
            y = gemm(c, b) if gemm else c @ b
            return jnp.tanh(y), None

        return jnp.sum(jax.lax.scan(jax.checkpoint(layer), a, weights)[0] ** 2)

    ours = lambda c, b: cg.gemm(c, b, out_sharding=NamedSharding(mesh, os_), config=ring)  # noqa: E731
    got = jax.jit(jax.grad(lambda a, s: model(a, s, ours), (0, 1)))(xd, sd)
    want = jax.grad(lambda a, s: model(a, s, None), (0, 1))(x.astype(np.float64),
                                                             stack.astype(np.float64))  # fmt: skip
    for g, r in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-4)


def _collectives(text: str) -> dict[str, int]:
    kinds = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all")
    return {k: len(re.findall(rf"= \S+ {k}(-start)?\(", text)) for k in kinds}


@pytest.mark.parametrize(
    "layout, want",
    [
        ("ag", {"all-gather": 1, "reduce-scatter": 1}),  # x gathered for dW; dX reduce-scattered
        ("rs", {"all-gather": 1}),  # dY gathered once, for dX and dW alike
        ("ar", {}),  # dX and dW are local
        ("seq_rs", {"all-gather": 1, "all-reduce": 1}),  # and dW summed over the data axis
    ],
)
def test_backward_collectives(rng, layout, want):
    """The gradient program's collectives (config NONE, a cotangent from outside): dX and dW come
    from one partitioned op, which gathers each tensor once (XLA's partitioner, which had dW,
    gathered dY a second time for the RS layout and all-gathered for the AR one). Its two GEMMs
    are the program's only ones: the forward the op's VJP traces again is dead code, removed."""
    f, x, w, xd, wd, out_sharding = _run(rng, layout, CONFIGS["none"])
    g = jax.device_put(random(rng, x.shape[:-1] + (w.shape[1],)), out_sharding)
    grad = jax.jit(jax.grad(lambda a, b, c: jnp.sum(f(a, b) * c), (0, 1)))
    text = grad.lower(xd, wd, g).compile().as_text()
    found = _collectives(text)
    assert {k: v for k, v in found.items() if v} == want
    assert len(re.findall(r"= \S+ dot\(", text)) == 2  # dX and dW


@pytest.mark.parametrize("layout", ["ag", "rs", "ar", "2d", "seq_ag"])
@pytest.mark.parametrize("cfg", ["none", "ring"])
def test_scaled_gradients_match_the_ops(rng, layout, cfg):
    """Under scaling, the partitioned gemm's gradients are the shard_map op's (dY quantized to
    the recipe's grad_dtype, float8_e5m2, dW from float8 operands): it used to quantize dY as a
    forward operand (e4m3) and multiply dW unquantized."""
    kind, shape, xs, ws, os_ = LAYOUTS[layout]
    mesh = _mesh(kind)
    x, w = random(rng, shape), random(rng, (shape[-1], 16))
    xd = jax.device_put(x, NamedSharding(mesh, xs))
    wd = jax.device_put(w, NamedSharding(mesh, ws))
    g = jax.device_put(random(rng, shape[:-1] + (16,)), NamedSharding(mesh, os_))
    kwargs = dict(out_sharding=NamedSharding(mesh, os_), config=CONFIGS[cfg],
                  scaling="current_tensor_scaling")  # fmt: skip

    def grads(**specs):
        f = lambda a, b, c: jnp.sum(cg.gemm(a, b, **kwargs, **specs) * c)  # noqa: E731
        return jax.jit(jax.grad(f, (0, 1)))

    partitioned = grads()
    dx, dw = partitioned(xd, wd, g)
    want_dx, want_dw = grads(x_spec=xs, w_spec=ws)(xd, wd, g)  # the shard_map op
    np.testing.assert_allclose(np.asarray(dx), np.asarray(want_dx), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dw), np.asarray(want_dw), rtol=1e-5, atol=1e-5)
    assert "f8e5m2" in partitioned.lower(xd, wd, g).compile().as_text()


def test_shardings_from_jit_in_shardings(rng):
    """No placed arrays: the shardings come from jit's in_shardings through propagation."""
    mesh = mesh1d(4)
    x, w = random(rng, (32, 24)), random(rng, (24, 16))
    f = jax.jit(
        lambda a, b: cg.gemm(a, b, out_sharding=NamedSharding(mesh, P("x", None)),
                             config=CONFIGS["ring"]),
        in_shardings=(NamedSharding(mesh, P(None, "x")), NamedSharding(mesh, P("x", None))),
    )  # fmt: skip
    assert_close(f(x, w), np.asarray(x, np.float64) @ w, np.float32, 24)
    text = f.lower(x, w).compile().as_text()
    assert "collective-permute" in text  # the ring RS ran, not XLA's reduce-scatter


def test_scaling_under_jit(rng):
    mesh = mesh1d(4)
    x, w = random(rng, (32, 128)), random(rng, (128, 128))
    xd = jax.device_put(x, NamedSharding(mesh, P("x", None)))
    wd = jax.device_put(w, NamedSharding(mesh, P(None, "x")))
    out_sharding = NamedSharding(mesh, P(None, "x"))
    f = jax.jit(lambda a, b: cg.gemm(a, b, out_sharding=out_sharding,
                                     scaling="current_tensor_scaling"))  # fmt: skip
    q = lambda a, axis: np.asarray(  # noqa: E731
        cg.dequantize(cg.quantize(jnp.asarray(a), "current_tensor_scaling", axis=axis)),
        np.float64,
    )
    np.testing.assert_allclose(np.asarray(f(xd, wd)), q(x, -1) @ q(w, 0), rtol=1e-5, atol=1e-4)
    # a layout gemm cannot overlap (x replicated): XLA's fall-back GEMM quantizes too (it
    # used to drop scaling there); x is one row shard here, so its scale is the tensor's
    fallback = jax.device_put(x, NamedSharding(mesh, P()))
    np.testing.assert_allclose(np.asarray(f(fallback, wd)), q(x, -1) @ q(w, 0), rtol=1e-5,
                               atol=1e-4)  # fmt: skip


@pytest.mark.parametrize("layout", ["seq_ag", "seq_rs", "unit_seq_ag"])
def test_mixed_mesh(rng, layout):
    """An Explicit data axis beside an Auto tensor axis: the data axis rides in the types, the
    tensor axis's layout is read at partitioning time; values, gradients, the ring's permutes."""
    from jax.sharding import AxisType

    kind, shape, xs, ws, os_ = LAYOUTS[layout]
    dims = (1, 4) if kind == "unit_data" else (2, 4)
    mesh = jax.make_mesh(dims, ("data", "x"), axis_types=(AxisType.Explicit, AxisType.Auto),
                         devices=jax.devices()[: dims[0] * dims[1]])  # fmt: skip
    x, w = random(rng, shape), random(rng, (shape[-1], 16))
    xd = jax.device_put(x, NamedSharding(mesh, xs))
    wd = jax.device_put(w, NamedSharding(mesh, ws))
    out_sharding = NamedSharding(mesh, os_)
    f = jax.jit(lambda a, b: cg.gemm(a, b, out_sharding=out_sharding, config=CONFIGS["ring"]))
    out = f(xd, wd)
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    assert_close(out, want, np.float32, shape[-1])
    assert out.sharding.is_equivalent_to(out_sharding, 3)
    assert "collective-permute" in f.lower(xd, wd).compile().as_text()
    g = random(rng, want.shape)
    dx, dw = jax.jit(jax.grad(lambda a, b: jnp.sum(f(a, b) * g), (0, 1)))(xd, wd)
    g64 = g.astype(np.float64).reshape(-1, 16)
    assert_close(dx, (g64 @ w.T.astype(np.float64)).reshape(x.shape), np.float32, 16)
    assert_close(dw, x.astype(np.float64).reshape(-1, shape[-1]).T @ g64, np.float32, 64)


@pytest.mark.parametrize("layout", ["ag", "rs", "ar", "2d", "seq_ag", "unit_seq_ag"])
def test_explicit_mesh_under_jit(rng, layout):
    """Explicit axes: the shardings ride in the types, so gemm reads them under jit and runs
    the op (no custom partitioning); values and gradients."""
    from jax.sharding import AxisType

    kind, shape, xs, ws, os_ = LAYOUTS[layout]
    names = {"1d": ("x",), "2d": ("x", "y")}.get(kind, ("data", "x"))
    dims = {"1d": (4,), "2d": (2, 2), "data_tp": (2, 2), "unit_data": (1, 4)}[kind]
    mesh = jax.make_mesh(dims, names, axis_types=(AxisType.Explicit,) * len(dims),
                         devices=jax.devices()[: int(np.prod(dims))])  # fmt: skip
    x, w = random(rng, shape), random(rng, (shape[-1], 16))
    xd = jax.device_put(x, NamedSharding(mesh, xs))
    wd = jax.device_put(w, NamedSharding(mesh, ws))
    f = jax.jit(lambda a, b: cg.gemm(a, b, out_sharding=os_, config=CONFIGS["ring"]))
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    assert_close(f(xd, wd), want, np.float32, shape[-1])
    dx = jax.jit(jax.grad(lambda a, b: jnp.sum(f(a, b)), 0))(xd, wd)
    g64 = np.ones(want.shape).reshape(-1, 16)
    assert_close(dx, (g64 @ w.T.astype(np.float64)).reshape(x.shape), np.float32, 16)


def test_inside_a_larger_jitted_model(rng):
    """An MLP written with plain jnp around two gemm calls (AG then RS on sequence-parallel
    activations): the elementwise ops shard by propagation, the GEMMs run the ring; values and
    gradients against the unsharded float64 composition."""
    mesh = Mesh(mesh2d(2, 4).devices, ("data", "tp"))
    x = random(rng, (4, 16, 8))
    w1, w2 = random(rng, (8, 32)) / 3, random(rng, (32, 8)) / 6
    xd = jax.device_put(x, NamedSharding(mesh, P("data", "tp", None)))
    w1d = jax.device_put(w1, NamedSharding(mesh, P(None, "tp")))
    w2d = jax.device_put(w2, NamedSharding(mesh, P("tp", None)))
    ring = CONFIGS["ring"]

    def model(a, b1, b2):
        h = cg.gemm(jnp.tanh(a) * 2.0, b1, out_sharding=NamedSharding(mesh, P("data", None, "tp")),
                    config=ring)  # fmt: skip
        y = cg.gemm(jax.nn.relu(h), b2, out_sharding=NamedSharding(mesh, P("data", "tp", None)),
                    config=ring)  # fmt: skip
        return jnp.sum((y + a) ** 2)

    def plain(a, b1, b2):
        return jnp.sum((jax.nn.relu((jnp.tanh(a) * 2.0) @ b1) @ b2 + a) ** 2)

    value, grads = jax.jit(jax.value_and_grad(model, (0, 1, 2)))(xd, w1d, w2d)
    args64 = [np.asarray(a, np.float64) for a in (x, w1, w2)]
    want, want_grads = jax.value_and_grad(plain, (0, 1, 2))(*args64)
    np.testing.assert_allclose(float(value), float(want), rtol=1e-5)
    for got, ref in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-4, atol=1e-4)
    text = jax.jit(model).lower(xd, w1d, w2d).compile().as_text()
    assert "collective-permute" in text
