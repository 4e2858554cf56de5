"""A weight quantized once for several calls (`cg.quantize_weight`, `cg.QuantizedWeight`): every
op and grouped op with it gives the values and gradients of the same calls quantizing w
themselves (the same quantization, so equal to float32 rounding), against the float64 product
of the quantized operands too; the program quantizes w once however many calls use it; and
the mismatches between the weight and the call are refused."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import P, mesh1d, mesh2d, shard
from test_grouped import random_sizes
from test_grouped import reference as grouped_reference
from test_scaled import ATOL, RTOL, _dq

import commgemm as cg
from commgemm.quant import ScalingMode

CUR = ScalingMode.CURRENT_TENSOR_SCALING
MX = ScalingMode.MXFP8_1D_SCALING
NV = ScalingMode.NVFP4_1D_SCALING
#: the same quantized values reach the same computation: only XLA's fusion may differ
SAME = dict(rtol=1e-6, atol=1e-6)

OPS = {
    "ag": (cg.all_gather_matmul, (P("x", None), P(None, "x")), P(None, "x")),
    "rs": (cg.matmul_reduce_scatter, (P(None, "x"), P("x", None)), P("x", None)),
    "ar": (cg.matmul_all_reduce, (P(None, "x"), P("x", None)), P(None, None)),
}


def _two_calls(call, w_arg, scaling, axis_name):
    """[per call, once]: the value and gradients of a loss over two microbatches x, x2 sharing
    w, with w quantized by each call, or once (`quantize_weight`); summed over the axis."""

    def make(once):
        def loss(x, w, x2, g):
            qw = cg.quantize_weight(w, scaling, **w_arg, axis_name=axis_name) if once else w
            total = jnp.sum(call(x, qw) * g) + jnp.sum(jnp.sin(call(x2, qw)))
            return jax.lax.psum(total, axis_name) if axis_name else total

        return lambda *a: jax.value_and_grad(loss, argnums=(0, 1, 2))(*a)

    return [make(False), make(True)]


def _assert_same(a, b):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), **SAME)


#: The tensor mode with every op and both method families (and without check_vma); the block
#: modes, whose weight takes the same path in every method (test_scaled runs each), serially.
CASES = [(op, method, CUR, True) for op in OPS for method in ("none", "ring_exchange")] + [
    (op, "none", mode, vma) for op in OPS for mode, vma in ((CUR, False), (MX, True), (NV, True))
]


@pytest.mark.parametrize("op,method,mode,check_vma", CASES)
def test_ops_as_if_quantizing_each_call(rng, op, method, mode, check_vma):
    size = 4
    fn, (x_spec, w_spec), out_spec = OPS[op]
    cfg = cg.OverlapConfig(method=method)
    m, k, n = 8 * size, 64 * size, 64 * size
    x, x2 = (rng.standard_normal((m, k)).astype(np.float32) for _ in range(2))
    w = rng.standard_normal((k, n)).astype(np.float32)
    g = rng.standard_normal((m, n)).astype(np.float32)
    call = lambda a, b: fn(a, b, "x", config=cfg, scaling=mode)  # noqa: E731
    results = [
        shard(f, mesh1d(size), (x_spec, w_spec, x_spec, out_spec), (P(), (x_spec, w_spec, x_spec)),
              check_vma=check_vma)(x, w, x2, g)
        for f in _two_calls(call, {"axis": 0}, mode, "x")
    ]  # fmt: skip
    _assert_same(*results)
    # and the forward against the float64 product of the quantized operands
    y = shard(lambda a, b: call(a, cg.quantize_weight(b, mode, axis=0, axis_name="x")),
              mesh1d(size), (x_spec, w_spec), out_spec, check_vma=check_vma)(x, w)  # fmt: skip
    want = _dq(x, mode, -1) @ _dq(w, mode, 0)
    np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=RTOL, atol=ATOL * k**0.5)


@pytest.mark.parametrize("mode", [CUR, MX])
def test_transposed_weight(rng, mode):
    """w [N, K] with w_transposed=True, quantized along its K dimension (axis=-1)."""
    size = 2
    x = rng.standard_normal((16, 128)).astype(np.float32)
    w = rng.standard_normal((128, 64 * size)).astype(np.float32)  # [N, K]: K sharded
    specs = (P(None, "x"), P(None, "x"))

    def body(a, b, once):
        b = cg.quantize_weight(b, mode, axis=-1, axis_name="x") if once else b
        return cg.matmul_all_reduce(a, b, "x", w_transposed=True, scaling=mode)

    y1, y2 = (shard(lambda a, b, o=o: body(a, b, o), mesh1d(size), specs, P())(x, w)
              for o in (False, True))  # fmt: skip
    _assert_same(y1, y2)
    want = _dq(x, mode, -1) @ _dq(w, mode, 1).T
    np.testing.assert_allclose(np.asarray(y2, np.float64), want, rtol=RTOL, atol=ATOL * 128**0.5)


def test_delayed_scaling(rng):
    """The recipe's w_state scales the weight quantized once as it scales w in each call."""
    size = 4
    state = cg.ScalingState.create(4).update(jnp.float32(3.0))
    recipe = cg.ScalingRecipe("delayed_tensor_scaling", x_state=state, w_state=state)
    x, x2 = (rng.standard_normal((32, 64)).astype(np.float32) for _ in range(2))
    w = rng.standard_normal((64, 64)).astype(np.float32)
    g = rng.standard_normal((32, 64)).astype(np.float32)
    call = lambda a, b: cg.all_gather_matmul(a, b, "x", scaling=recipe)  # noqa: E731
    specs = (P("x"), P(None, "x"), P("x"), P(None, "x"))
    results = [shard(f, mesh1d(size), specs, (P(), specs[:3]))(x, w, x2, g)
               for f in _two_calls(call, {"axis": 0}, recipe, "x")]  # fmt: skip
    _assert_same(*results)


@pytest.mark.parametrize("mode", [CUR, MX])
def test_matmul_2d(rng, mode):
    """The 2-D op quantizes W over both of its axes: so does the weight quantized once."""
    mesh = mesh2d(2, 2)
    x = rng.standard_normal((16, 128)).astype(np.float32)
    w = rng.standard_normal((128, 64)).astype(np.float32)
    specs = (P("x", "y"), P("x", None))

    def body(a, b, once):
        b = cg.quantize_weight(b, mode, axis=0, axis_name=("x", "y")) if once else b
        return cg.matmul_2d(a, b, row_axis="x", k_axis="y", scaling=mode)

    y1, y2 = (shard(lambda a, b, o=o: body(a, b, o), mesh, specs, P("x", None))(x, w)
              for o in (False, True))  # fmt: skip
    _assert_same(y1, y2)
    want = _dq(x, mode, -1) @ _dq(w, mode, 0)
    np.testing.assert_allclose(np.asarray(y2, np.float64), want, rtol=RTOL, atol=ATOL * 128**0.5)


@pytest.mark.parametrize("mode", [CUR, MX, NV])
def test_grouped_local(rng, mode):
    groups, m, k, n = 3, 40, 64, 32
    x, x2 = (rng.standard_normal((m, k)).astype(np.float32) for _ in range(2))
    w = rng.standard_normal((groups, k, n)).astype(np.float32)
    g = rng.standard_normal((m, n)).astype(np.float32)
    sizes = jnp.asarray(random_sizes(rng, groups, m))
    call = lambda a, b: cg.grouped_matmul(a, b, sizes, scaling=mode)  # noqa: E731
    results = [jax.jit(f)(x, w, x2, g) for f in _two_calls(call, {"axis": 1}, mode, None)]
    _assert_same(*results)
    y = cg.grouped_matmul(x, cg.quantize_weight(w, mode, axis=1), sizes, scaling=mode)
    want = grouped_reference(_dq(x, mode, -1), _dq(w, mode, 1), sizes)
    np.testing.assert_allclose(y, want, rtol=RTOL, atol=ATOL * k**0.5)


@pytest.mark.parametrize("method", ["none", "ring_exchange"])
@pytest.mark.parametrize("op", ["ag", "rs"])
def test_grouped_collective(rng, op, method):
    size, m, groups, mode = 4, 8, 3, MX
    cfg = cg.OverlapConfig(method=method)
    if op == "ag":
        x, x2 = (rng.standard_normal((size * m, 64)).astype(np.float32) for _ in range(2))
        w = rng.standard_normal((groups, 64, 32 * size)).astype(np.float32)
        sizes = random_sizes(rng, groups, m)  # the same counts on every shard
        specs, out = (P("x"), P(None, None, "x"), P("x")), P(None, "x")
        call = lambda a, b: cg.all_gather_grouped_matmul(  # noqa: E731
            a, b, jnp.asarray(sizes), "x", config=cfg, scaling=mode
        )
        g = rng.standard_normal((size * m, 32 * size)).astype(np.float32)
    else:
        x, x2 = (rng.standard_normal((size * m, 32 * size)).astype(np.float32) for _ in range(2))
        w = rng.standard_normal((groups, 32 * size, 32)).astype(np.float32)
        sizes = random_sizes(rng, groups, size * m)
        specs, out = (P(None, "x"), P(None, "x", None), P(None, "x")), P("x")
        call = lambda a, b: cg.grouped_matmul_reduce_scatter(  # noqa: E731
            a, b, jnp.asarray(sizes), "x", config=cfg, scaling=mode
        )
        g = rng.standard_normal((size * m, 32)).astype(np.float32)
    results = [shard(f, mesh1d(size), (*specs, out), (P(), specs))(x, w, x2, g)
               for f in _two_calls(call, {"axis": 1}, mode, "x")]  # fmt: skip
    _assert_same(*results)


def test_expert_parallel_pair(rng):
    size, m, per_shard, mode = 4, 8, 2, CUR
    experts = size * per_shard
    x = rng.standard_normal((size * m, 32)).astype(np.float32)
    w1 = rng.standard_normal((experts, 32, 48)).astype(np.float32)
    w2 = rng.standard_normal((experts, 48, 32)).astype(np.float32)
    sizes = np.stack([random_sizes(rng, experts, m) for _ in range(size)])

    def body(a, b1, b2, s, once):
        if once:
            b1 = cg.quantize_weight(b1, mode, axis=1, axis_name="x")
            b2 = cg.quantize_weight(b2, mode, axis=1, axis_name="x")
        y, recv = cg.all_to_all_grouped_matmul(a, b1, s[0], "x", scaling=mode)
        return cg.grouped_matmul_all_to_all(jnp.tanh(y), b2, recv, s[0], "x", scaling=mode)

    def grads(once):
        f = lambda *a: jnp.sum(jnp.sin(body(*a, once)))  # noqa: E731
        specs = (P("x"), P("x"), P("x"), P("x"))
        return shard(jax.grad(f, argnums=(0, 1, 2)), mesh1d(size), specs, specs[:3])(
            x, w1, w2, sizes
        )

    _assert_same(grads(False), grads(True))


def _f8_converts(jaxpr, shape) -> int:
    """How many conversions to a float8 type of `shape` the jaxpr holds, sub-jaxprs included."""
    count = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "convert_element_type":
            aval = eqn.outvars[0].aval
            count += aval.shape == shape and "float8" in aval.dtype.name
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    count += _f8_converts(inner, shape)
    return count


@pytest.mark.parametrize("grouped", [False, True])
def test_the_step_quantizes_w_once(rng, grouped):
    """Four microbatches' forward and backward: w converted to float8 once with a
    QuantizedWeight, once per call without."""
    mode, k, n = CUR, 64, 32
    w_shape = (3, k, n) if grouped else (k, n)
    w = jnp.asarray(rng.standard_normal(w_shape), jnp.float32)
    xs = jnp.asarray(rng.standard_normal((4, 24, k)), jnp.float32)
    sizes = jnp.asarray([10, 0, 14], jnp.int32)

    def call(a, b):
        if grouped:
            return cg.grouped_matmul(a, b, sizes, scaling=mode)
        return cg.all_gather_matmul(a, b, "x", scaling=mode)

    def step(w, xs, once):
        def loss(w):
            axis_name = None if grouped else "x"
            qw = cg.quantize_weight(w, mode, axis=-2, axis_name=axis_name) if once else w
            return sum(jnp.sum(call(xs[i], qw) ** 2) for i in range(xs.shape[0]))

        return jax.grad(loss)(w)

    for once, want in ((True, 1), (False, xs.shape[0])):
        fn = lambda a, b, o=once: step(a, b, o)  # noqa: E731
        if not grouped:
            fn = jax.shard_map(fn, mesh=mesh1d(1), in_specs=(P(), P()), out_specs=P())
        assert _f8_converts(jax.make_jaxpr(fn)(w, xs).jaxpr, w_shape) == want


def test_mismatches_refused(rng):
    x = jnp.asarray(rng.standard_normal((16, 64)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((64, 64)), jnp.float32)
    ag = lambda b, s, vma=True: shard(  # noqa: E731
        lambda a, b: cg.all_gather_matmul(a, b, "x", scaling=s),
        mesh1d(2), (P("x"), P(None, "x")), P(None, "x"), check_vma=vma,
    )(x, b)  # fmt: skip

    def once(mode, *, scaling=None, axis=0, axis_name="x", dtype=None, vma=True):
        def body(a, b):
            recipe = cg.ScalingRecipe(mode, dtype=dtype) if dtype else mode
            qb = cg.quantize_weight(b, recipe, axis=axis, axis_name=axis_name)
            return cg.all_gather_matmul(a, qb, "x", scaling=scaling)

        return shard(body, mesh1d(2), (P("x"), P(None, "x")), P(None, "x"), check_vma=vma)(x, w)

    with pytest.raises(ValueError, match="pass scaling="):
        once(CUR)
    with pytest.raises(ValueError, match="pass scaling="):
        once(CUR, scaling="no_scaling")
    with pytest.raises(ValueError, match="quantized as MXFP8_1D_SCALING, but scaling= asks"):
        once(MX, scaling=CUR)
    with pytest.raises(ValueError, match="quantized to float8_e5m2, but scaling= asks"):
        once(CUR, scaling=CUR, dtype="float8_e5m2")
    with pytest.raises(ValueError, match="blocks run along its dimension 1.*axis=0"):
        once(MX, scaling=MX, axis=1)
    with pytest.raises(ValueError, match="tensor scale differs between the shards"):
        once(CUR, scaling=CUR, axis_name=None)
    with pytest.raises(ValueError, match="needs a scaling mode"):
        cg.quantize_weight(w, None)
    assert ag(w, CUR).shape == (16, 64)  # the op itself takes the same call
    w3, one_group = w[None], jnp.asarray([16], jnp.int32)
    bad = cg.QuantizedWeight(w3[:, :, :32], cg.quantize(w3, CUR))
    with pytest.raises(ValueError, match="quantized values have shape"):
        cg.grouped_matmul(x, bad, one_group, scaling=CUR)
    with pytest.raises(ValueError, match="grouped_matmul: w is a QuantizedWeight"):
        cg.grouped_matmul(x, cg.quantize_weight(w3, CUR), one_group)
    # the kept transposed values: tensor scaling only, and they must be the values swapped
    with pytest.raises(ValueError, match="keep_transposed .* needs tensor scaling"):
        cg.quantize_weight(w3, MX, axis=1, keep_transposed=True)
    kept = cg.quantize_weight(w3, CUR, axis=1, keep_transposed=True)
    assert kept.transposed.shape == (1, 64, 64) and kept.transposed.dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(np.float32(kept.transposed),
                                  np.float32(jnp.swapaxes(kept.quantized.data, 1, 2)))  # fmt: skip
    for damaged in (kept.transposed[:, :32], kept.transposed.astype(jnp.float8_e5m2)):
        bad = cg.QuantizedWeight(kept.value, kept.quantized, damaged)
        with pytest.raises(ValueError, match="transposed values .* must be its tensor-scaled"):
            cg.grouped_matmul(x, bad, one_group, scaling=CUR)
    mesh = mesh1d(2)
    with pytest.raises(TypeError, match="gemm takes w itself"):
        cg.gemm(x, cg.quantize_weight(w, CUR), out_sharding=jax.NamedSharding(mesh, P(None, "x")),
                x_spec=P("x"), w_spec=P(None, "x"), scaling=CUR)  # fmt: skip


@pytest.mark.parametrize("w_transposed", [False, True])
@pytest.mark.parametrize(
    "op,method,check_vma",
    [("ag", "none", True), ("ag", "ring_exchange", True), ("rs", "pipeline", True),
     ("ar", "none", True), ("ag", "ring_exchange", False)],
)  # fmt: skip
def test_kept_transposed_dense(rng, op, method, check_vma, w_transposed):
    """A QuantizedWeight with its values kept transposed (`keep_transposed=True`) in the dense
    ops: values and gradients as without it; the float8 GEMM that would transpose w's values
    reads the kept copy instead (marked here by negating it): the forward where w is [K, n],
    dX where it is [n, K] (`w_transposed`)."""
    size = 2
    fn, (x_spec, w_spec), out_spec = OPS[op]
    w_spec = P(*reversed(w_spec)) if w_transposed else w_spec
    cfg = cg.OverlapConfig(method=method, num_splits=2 if method == "pipeline" else 1)
    m, k, n = 8 * size, 64 * size, 64 * size
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k) if w_transposed else (k, n)).astype(np.float32)
    g = rng.standard_normal((m, n)).astype(np.float32)

    def run(how):
        def body(a, b, c):
            def loss(a, b):
                qb = cg.quantize_weight(b, CUR, axis=1 if w_transposed else 0, axis_name="x",
                                        keep_transposed=how != "plain")  # fmt: skip
                if how == "marked":
                    qb = dataclasses.replace(qb, transposed=-qb.transposed)
                y = fn(a, qb, "x", config=cfg, w_transposed=w_transposed, scaling=CUR)
                return jax.lax.psum(jnp.sum(y * c), "x"), y

            return jax.grad(loss, (0, 1), has_aux=True)(a, b)

        f = shard(
            body,
            mesh1d(size),
            (x_spec, w_spec, out_spec),
            ((x_spec, w_spec), out_spec),
            check_vma=check_vma,
        )
        (dx, dw), y = f(x, w, g)
        return np.asarray(y), np.asarray(dx), np.asarray(dw)

    plain, kept, marked = run("plain"), run("kept"), run("marked")
    for a, b in zip(plain, kept, strict=True):
        np.testing.assert_array_equal(a, b)
    y, dx, dw = marked
    np.testing.assert_array_equal(y, plain[0] if w_transposed else -plain[0])
    np.testing.assert_array_equal(dx, -plain[1] if w_transposed else plain[1])
    np.testing.assert_array_equal(dw, plain[2])  # dW reads no w
