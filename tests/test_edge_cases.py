"""Inputs that once gave wrong numbers or unhelpful crashes: uneven shards and empty operands
under jit, token counts past the rows, per-shard FP8 scales, non-finite and tiny values in the
quantizers, op sets built by hand, mesh axis orders in the TPU interpreter, damaged tune-cache
entries, a launcher rank printing bytes that are not UTF-8, and the CLI's errors."""

import json
import subprocess
import sys
import warnings

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import P, assert_close, mesh1d, shard
from hypothesis import given, settings
from jax.sharding import AxisType, Mesh, NamedSharding

import commgemm as cg

CLI = (sys.executable, "-c", "import sys; from commgemm.cli import main; sys.exit(main())")


def _mesh(kind: str, size: int):
    types = (AxisType.Explicit if kind == "explicit" else AxisType.Auto,)
    return jax.make_mesh((size,), ("t",), axis_types=types, devices=jax.devices()[:size])


#: (x spec, w spec, out spec): RS, AR, AG and two layouts gemm does not overlap
UNEVEN_LAYOUTS = [
    (P(None, "t"), P("t", None), P("t", None)),
    (P(None, "t"), P("t", None), P(None, None)),
    (P("t", None), P(None, "t"), P(None, "t")),
    (P(None, "t"), P(None, "t"), P(None, "t")),
    (P("t", None), P(None, "t"), P("t", None)),
]


@settings(max_examples=10, deadline=None)
@given(
    kind=st.sampled_from(["auto", "explicit"]),
    size=st.sampled_from([2, 3, 4]),
    layout=st.sampled_from(UNEVEN_LAYOUTS),
    m=st.integers(1, 11),
    k=st.integers(1, 11),
    n=st.integers(1, 11),
    method=st.sampled_from(["none", "ring_exchange"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_gemm_on_uneven_shapes_under_jit(kind, size, layout, m, k, n, method, seed):
    """M, K, N need not divide the axis: operands computed inside the jitted function (so
    XLA's padding of their shards is not zeros), values and gradients against float64."""
    rng = np.random.default_rng(seed)
    mesh = _mesh(kind, size)
    xs, ws, os_ = layout
    a, b = rng.standard_normal((m, k)), rng.standard_normal((k, n))
    cfg = cg.OverlapConfig(method=method)

    def place(v, spec):
        if kind == "explicit":
            return jax.sharding.reshard(v, NamedSharding(mesh, spec))
        return jax.lax.with_sharding_constraint(v, NamedSharding(mesh, spec))

    def f(a, b):
        x, w = place(jnp.exp(a * 0.1) + 1, xs), place(jnp.cos(b) + 2, ws)
        return cg.gemm(x, w, out_sharding=NamedSharding(mesh, os_), config=cfg)

    try:  # jax itself may refuse a layout (Explicit axes: any uneven one): nothing to test
        with jax.set_mesh(mesh):
            jax.jit(lambda a, b: (place(a, xs), place(b, ws), place(a @ b, os_)))(a, b)
    except ValueError:
        return

    def plain(a, b):
        return (jnp.exp(a * 0.1) + 1) @ (jnp.cos(b) + 2)

    with warnings.catch_warnings(), jax.set_mesh(mesh):
        warnings.simplefilter("ignore")  # on Auto axes a method the shards refuse runs serial
        try:
            got = jax.jit(f)(a, b)
            grads = jax.jit(jax.grad(lambda a, b: jnp.sum(jnp.sin(f(a, b))), (0, 1)))(a, b)
        except ValueError as err:  # Explicit axes: the plan refuses what the shards' rows
            assert kind == "explicit" and "must be divisible" in str(err), err  # cannot take
            return
    loss = lambda a, b: jnp.sum(jnp.sin(plain(a, b)))  # noqa: E731
    value, want = jax.jit(lambda a, b: (plain(a, b), jax.grad(loss, (0, 1))(a, b)))(a, b)
    np.testing.assert_allclose(np.asarray(got), np.asarray(value), rtol=1e-10, atol=1e-9)
    for g, w in zip(grads, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("shape", [(0, 8, 8), (8, 0, 8)])
def test_gemm_on_empty_operands_under_jit(shape):
    m, k, n = shape
    mesh = _mesh("auto", 4)
    f = jax.jit(lambda a, b: cg.gemm(a, b, out_sharding=NamedSharding(mesh, P("t", None))))
    out = f(jnp.ones((m, k)), jnp.ones((k, n)))
    assert out.shape == (m, n) and not np.asarray(out).any()


def test_gemm_config_the_layout_refuses_warns_and_computes():
    """A num_splits the shards' rows do not take: a warning that names it, and x @ w."""
    mesh = _mesh("auto", 4)
    cfg = cg.OverlapConfig(method="pipeline", num_splits=3)
    a, b = np.arange(64.0).reshape(8, 8), np.ones((8, 8))

    def f(a, b):
        x = jax.lax.with_sharding_constraint(a * 1.0, NamedSharding(mesh, P("t", None)))
        w = jax.lax.with_sharding_constraint(b * 1.0, NamedSharding(mesh, P(None, "t")))
        return cg.gemm(x, w, out_sharding=NamedSharding(mesh, P(None, "t")), config=cfg)

    with pytest.warns(UserWarning, match="num_splits"):
        out = jax.jit(f)(a, b)
    np.testing.assert_allclose(np.asarray(out), a @ b)


def test_vmap_over_partitioned_gemm_says_what_to_do():
    mesh = _mesh("auto", 4)
    f = jax.vmap(lambda x, w: cg.gemm(x, w, out_sharding=NamedSharding(mesh, P(None, "t"))),
                 in_axes=(0, None))  # fmt: skip
    with pytest.raises(NotImplementedError, match="fold the batch"):
        jax.jit(f)(jnp.ones((2, 8, 8)), jnp.ones((8, 8)))


@pytest.mark.parametrize("scaling", [None, "current_tensor_scaling"])
@pytest.mark.parametrize("layout", ["data_parallel", "replicated_x_columns", "k_to_columns"])
def test_explicit_mesh_layouts_gemm_does_not_overlap(rng, layout, scaling):
    """On Explicit axes the layouts without a collective of gemm's run as XLA's dot (the
    quantized one too), values and gradients."""
    mesh = _mesh("explicit", 4)
    xs, ws, os_ = {
        "data_parallel": (P("t", None), P(None, None), P("t", None)),
        "replicated_x_columns": (P(None, None), P(None, "t"), P(None, "t")),
        "k_to_columns": (P(None, "t"), P("t", None), P(None, "t")),
    }[layout]
    a, b = rng.standard_normal((16, 8)), rng.standard_normal((8, 12))
    x = jax.device_put(a.astype(np.float32), NamedSharding(mesh, xs))
    w = jax.device_put(b.astype(np.float32), NamedSharding(mesh, ws))

    def f(x, w):
        return cg.gemm(x, w, out_sharding=NamedSharding(mesh, os_), scaling=scaling)

    tol = 1e-5 if scaling is None else 0.1  # float8_e4m3fn: 3 mantissa bits on each operand
    out = jax.jit(f)(x, w)
    np.testing.assert_allclose(np.asarray(out), a @ b, rtol=tol, atol=tol * np.abs(a @ b).max())
    gx, gw = jax.jit(jax.grad(lambda x, w: jnp.sum(f(x, w)), (0, 1)))(x, w)
    ones = np.ones((16, 12))
    np.testing.assert_allclose(np.asarray(gx), ones @ b.T, rtol=tol, atol=tol * 12)
    np.testing.assert_allclose(np.asarray(gw), a.T @ ones, rtol=tol, atol=tol * 16)


@pytest.mark.parametrize("dims,heads,with_mesh", [((2, 4), 4, False), ((4, 1), 1, True)])
def test_attention_projections_on_explicit_mesh(rng, dims, heads, with_mesh):
    """With and without jax.set_mesh, a tensor axis of size 1 and one head included: the
    layer equals the same layer on an unsharded copy of its parameters."""
    import contextlib

    from flax import nnx

    import commgemm.nnx as cgnnx

    mesh = jax.make_mesh(dims, ("data", "tp"), axis_types=(AxisType.Explicit,) * 2,
                         devices=jax.devices()[: int(np.prod(dims))])  # fmt: skip
    ctx = jax.set_mesh(mesh) if with_mesh else contextlib.nullcontext()
    x = rng.standard_normal((4, 8, 16)).astype(np.float32)
    with ctx:
        layer = cgnnx.ParallelAttentionProjections(16, heads, mesh=mesh, rngs=nnx.Rngs(0),
                                                   data_axis="data", config=None)  # fmt: skip
        out = layer(jax.device_put(x, NamedSharding(mesh, P("data", None, None))))
    qkv = (x @ np.asarray(layer.qkv.kernel[...])).reshape(4, 8, heads, 3, 16 // heads)
    att = jax.nn.dot_product_attention(*(qkv[:, :, :, i] for i in range(3)), is_causal=True)
    want = np.asarray(att).reshape(4, 8, 16) @ np.asarray(layer.out.kernel[...])
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-4, atol=1e-4)


@settings(max_examples=6, deadline=None)
@given(
    method=st.sampled_from(["none", "ring_exchange", "auto"]),
    extra=st.integers(-3, 4),
    seed=st.integers(0, 2**31 - 1),
)
def test_all_to_all_counts_below_at_and_past_the_rows(method, extra, seed):
    """Traced counts whose sum is below, equal to or past the m local rows: the tokens past
    row m are dropped, as grouped_matmul drops them, and no token gets another's result."""
    rng = np.random.default_rng(seed)
    size, m, e = 2, 4, 2
    x = rng.standard_normal((size * m, 3))
    w = rng.standard_normal((size * e, 3, 2))
    sizes = np.zeros((size, size * e), np.int32)
    for s in range(size):
        sizes[s, rng.integers(size * e)] = max(0, m + extra)
    cfg = cg.OverlapConfig(method=method)

    def body(a, b, g):
        y, recv = cg.all_to_all_grouped_matmul(a, b, g[0], "x", config=cfg)
        return y[None], recv[None]

    f = shard(body, mesh1d(size), (P("x"), P("x"), P("x")), (P("x"), P("x")))
    y, _ = f(x, w, sizes)
    y = np.asarray(y)  # [src shard d, dest s, m, N]: shard d's experts on shard s's tokens
    for s in range(size):
        tokens = x[s * m : (s + 1) * m]
        group = int(np.argmax(sizes[s]))
        count = min(m, int(sizes[s, group]))
        owner = group // e
        want = np.zeros((m, 2))
        want[:count] = tokens[:count] @ w[group]
        np.testing.assert_allclose(y[owner, s], want, rtol=1e-10, atol=1e-10)
        other = y[1 - owner, s]
        assert not other.any()


def _ragged(x, w, sizes):
    """float64 ragged_dot: rows past the counts' sum are zero, the counts cut at the rows."""
    out, start = np.zeros((x.shape[0], w.shape[2])), 0
    for g, c in enumerate(sizes):
        end = min(start + int(c), x.shape[0])
        out[start:end] = x[start:end] @ w[g]
        start = end
    return out


@settings(max_examples=8, deadline=None)
@given(
    op=st.sampled_from(["local", "all_gather", "reduce_scatter"]),
    method=st.sampled_from(["none", "ring_exchange", "pipeline"]),
    extra=st.integers(-3, 4),
    seed=st.integers(0, 2**31 - 1),
)
def test_grouped_ops_counts_below_at_and_past_the_rows(op, method, extra, seed):
    """grouped_matmul and the AG / RS grouped ops with traced counts summing below, to and
    past the rows: the groups cut at the last row, against float64."""
    rng = np.random.default_rng(seed)
    size, m, groups = 2, 4, 3
    w = rng.standard_normal((groups, 6, 4))
    total = max(0, m + extra)
    cuts = np.sort(rng.integers(0, total + 1, groups - 1))
    counts = np.diff(np.concatenate([[0], cuts, [total]])).astype(np.int32)
    cfg = cg.OverlapConfig(method=method, num_splits=2 if method == "pipeline" else 1)
    if op == "local":
        x = rng.standard_normal((m, 6))
        got = jax.jit(cg.grouped_matmul)(x, w, counts)
        want = _ragged(x, w, counts)
    elif op == "all_gather":
        x = rng.standard_normal((size * m, 6))
        f = shard(lambda a, b, g: cg.all_gather_grouped_matmul(a, b, g, "x", config=cfg),
                  mesh1d(size), (P("x"), P(None, None, "x"), P()), P(None, "x"))  # fmt: skip
        got = f(x, w, counts)
        want = np.concatenate([_ragged(x[s * m : (s + 1) * m], w, counts) for s in range(size)])
    else:
        x = rng.standard_normal((m * size, 6))
        f = shard(lambda a, b, g: cg.grouped_matmul_reduce_scatter(a, b, g, "x", config=cfg),
                  mesh1d(size), (P(None, "x"), P(None, "x"), P()), P("x"))  # fmt: skip
        got = f(x, w, counts)
        want = _ragged(x, w, counts)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("mode", ["current_tensor_scaling", "nvfp4_1d_scaling"])
def test_all_gather_of_per_shard_scales(rng, mode, check_vma):
    """x quantized by each shard with its own scale (no shared amax): every row comes back
    at its own scale (rows of shards 10x and 100x larger included)."""
    mesh = mesh1d(4)
    x = rng.standard_normal((32, 64)) * np.repeat([1, 10, 100, 0.1], 8)[:, None]
    w = rng.standard_normal((64, 32))

    def body(a, b):
        qa = cg.quantize(a, mode)
        qb = cg.quantize(b, mode, axis=0, amax=cg.amax(b, "x"))
        return cg.all_gather_matmul(qa, qb, "x")

    f = shard(body, mesh, (P("x", None), P(None, "x")), P(None, "x"), check_vma=check_vma)
    out, ref = np.asarray(f(x.astype(np.float32), w.astype(np.float32))), x @ w
    for s in range(4):  # each shard's rows against their own size
        rows = slice(8 * s, 8 * (s + 1))
        err = np.abs(out[rows] - ref[rows]).max() / np.abs(ref[rows]).max()
        assert err < (0.3 if mode.startswith("nvfp4") else 0.1), (s, err)  # was 92-103x off


def test_nvfp4_keeps_non_finite_values_non_finite():
    x = jnp.ones((2, 32)).at[0, 3].set(jnp.nan).at[1, 20].set(jnp.inf)
    back = np.asarray(cg.dequantize(cg.quantize(x, "nvfp4_1d_scaling")))
    assert np.isnan(back[0, :16]).all() and np.isfinite(back[0, 16:]).all()
    assert not np.isfinite(back[1, 16:]).any() and np.isfinite(back[1, :16]).all()
    np.testing.assert_array_equal(back[0, 16:], 1.0)


@pytest.mark.parametrize(
    "mode,dtype",
    [("current_tensor_scaling", jnp.float8_e4m3fn), ("current_tensor_scaling", jnp.float8_e5m2),
     ("nvfp4_1d_scaling", None), ("mxfp8_1d_scaling", None)],
)  # fmt: skip
@pytest.mark.parametrize("amax", [1e-30, 1e-36, 1e-38, 1e-44])
def test_tiny_values_quantize_to_finite_values(mode, dtype, amax):
    x = jnp.asarray(np.linspace(-1, 1, 64, dtype=np.float32) * np.float32(amax)).reshape(2, 32)
    q = cg.quantize(x, mode, **({} if dtype is None else {"dtype": dtype}))
    back = np.asarray(cg.dequantize(q))
    assert np.isfinite(back).all()
    assert np.abs(back).max() <= 2 * amax


def test_delayed_state_after_a_tiny_amax_stays_finite():
    state = cg.ScalingState.create(history=1).update(jnp.float32(1e-40))
    assert np.isfinite(float(state.scale))
    q, _ = cg.quantize(jnp.zeros((4, 4)), "delayed_tensor_scaling", state=state)
    assert np.isfinite(np.asarray(cg.dequantize(q))).all()


@pytest.mark.parametrize(
    "forward,backward",
    [("all_gather", "all_gather"), (cg.Collective.ALL_REDUCE, cg.Collective.REDUCE_SCATTER),
     (cg.Collective.ALL_GATHER, cg.Collective.NONE)],
)  # fmt: skip
def test_collective_op_set_built_directly_is_checked(forward, backward):
    with pytest.raises(ValueError, match="CollectiveOpSet.create"):
        cg.layers.CollectiveOpSet(forward, backward)


def test_collective_op_set_built_directly_from_names():
    ops = cg.layers.CollectiveOpSet("all_gather", "reduce_scatter")
    assert ops == cg.layers.CollectiveOpSet.create(cg.Collective.ALL_GATHER)


def test_tpu_kernel_config_on_an_axis_of_one_device(rng):
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(1, 4), ("a", "t"))
    cfg = cg.OverlapConfig(method="ring_exchange", atomic_gemm=True, interpret=True)
    x, w = rng.standard_normal((8, 128)), rng.standard_normal((128, 128))
    f = shard(lambda a, b: cg.all_gather_matmul(a, b, "a", config=cfg), mesh,
              (P("a", None), P(None, None)), P("a", None))  # fmt: skip
    assert_close(f(x.astype(np.float32), w.astype(np.float32)), x @ w, np.float32, 128)


def _interpreted_ag(mesh: Mesh):
    cfg = cg.OverlapConfig(method="ring_exchange", atomic_gemm=True, interpret=True)
    x = np.arange(32 * 128, dtype=np.float32).reshape(32, 128) / 4096
    w = np.ones((128, 256), np.float32)
    f = shard(lambda a, b: cg.all_gather_matmul(a, b, "t", config=cfg), mesh,
              (P("t", None), P(None, "t")), P(None, "t"))  # fmt: skip
    np.testing.assert_allclose(np.asarray(f(x, w)), x @ w, rtol=1e-5)


def test_interpreter_refuses_a_second_axis_order_until_caches_are_cleared():
    """In a fresh process: the TPU interpreter's kernels on ('d', 't'), then on the same
    devices as ('t', 'd'): a clear error rather than wrong values, and right after
    jax.clear_caches()."""
    code = f"""
import sys; sys.path.insert(0, {str(__import__("pathlib").Path(__file__).parent)!r})
import conftest, jax, numpy as np, pytest
from jax.sharding import Mesh
from test_edge_cases import _interpreted_ag
devices = np.array(jax.devices()[:4]).reshape(2, 2)
_interpreted_ag(Mesh(devices, ("d", "t")))
with pytest.raises(ValueError, match="jax.clear_caches"):
    _interpreted_ag(Mesh(devices, ("t", "d")))
jax.clear_caches()
_interpreted_ag(Mesh(devices, ("t", "d")))
print("ok")
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert run.stdout.strip().endswith("ok"), run.stderr[-3000:]


def _cache_with(tmp_path, monkeypatch, entry: dict, op: str, shape, size: int = 4):
    from commgemm.autotune import cache

    kind = jax.devices()[0].device_kind
    key = cache.plan_key(kind, size, op, shape, "float32")
    path = tmp_path / "tune.json"
    path.write_text(json.dumps({"version": cache.VERSION, "plans": {key: entry}}))
    monkeypatch.setenv("COMMGEMM_TUNE_CACHE", str(path))
    return path


@pytest.mark.parametrize(
    "op,fields",
    [("ag", {"method": "pipeline", "num_splits": 3}), ("rs", {"method": "ring_exchange",
      "aggregate": True}), ("ag", {"method": "auto"}), ("ag", {"method": "bulk"})],
)  # fmt: skip
def test_tune_cache_entries_that_cannot_run_are_skipped(rng, tmp_path, monkeypatch, op, fields):
    from commgemm.autotune import cache

    cache._warned.clear()
    m, k, n = 32, 16, 16
    _cache_with(tmp_path, monkeypatch, {"config": fields}, op, (m, k, n))
    auto = cg.OverlapConfig(method="auto")
    x, w = rng.standard_normal((m, k), np.float32), rng.standard_normal((k, n), np.float32)
    if op == "ag":
        f = shard(lambda a, b: cg.all_gather_matmul(a, b, "x", config=auto), mesh1d(4),
                  (P("x", None), P(None, "x")), P(None, "x"))  # fmt: skip
    else:
        f = shard(lambda a, b: cg.matmul_reduce_scatter(a, b, "x", config=auto), mesh1d(4),
                  (P(None, "x"), P("x", None)), P("x", None))  # fmt: skip
    with pytest.warns(UserWarning, match="tune"):
        out = f(x, w)
    np.testing.assert_allclose(np.asarray(out), x @ w, rtol=1e-5, atol=1e-5)


def test_tune_cache_nested_too_deeply(tmp_path, monkeypatch):
    from commgemm.autotune import cache

    cache._warned.clear()
    path = tmp_path / "tune.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    monkeypatch.setenv("COMMGEMM_TUNE_CACHE", str(path))
    with pytest.warns(UserWarning, match="nested too deeply"):
        assert cache.load().plans == {}


#: One rank's output at the end of a 4-process run on 4 x H100 (jax 0.11.2), as printed.
_SHUTDOWN = """bench rs: none (compile, check)
W1127 18:04:32.234017    2127 pjrt_client.cc:1605] WatchTasksAsync failed for task 0: CANCELLED: CANCELLED
Additional GRPC error information from remote target coordination_service while calling /xla.coordination.CoordinationService/WatchTasks:
:CANCELLED:CANCELLED [type.googleapis.com/tensorflow.DerivedStatus='']
=== Source Location Trace: ===
external/xla+/xla/tsl/distributed_runtime/rpc/grpc_util.h:89

a result line

after a blank line
"""  # noqa: E501


def test_launcher_drops_the_coordination_services_shutdown_chatter():
    import collections
    import importlib
    import io

    launch = importlib.import_module("commgemm.launch")  # `commgemm.launch` is the function
    out, tail = io.StringIO(), collections.deque(maxlen=20)
    launch._forward(3, io.StringIO(_SHUTDOWN), tail, out)
    assert out.getvalue() == (
        "[rank 3] bench rs: none (compile, check)\n[rank 3] a result line\n[rank 3] \n"
        "[rank 3] after a blank line\n"
    )
    assert "WatchTasks" not in " ".join(tail)


def test_launcher_forwards_bytes_that_are_not_utf8():
    code = "import sys; sys.stdout.buffer.write(b'bad \\xff byte\\n'); sys.stdout.flush()"
    run = subprocess.run(
        [*CLI, "launch", "-n", "1", "--timeout", "60", "--",
         sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert "bad \\xff byte" in run.stdout + run.stderr


@pytest.mark.parametrize(
    "argv,says",
    [(["launch", "-n", "1", "--", "/nonexistent"], "No such file"),
     (["bench", "--shape", "9,8,8", "--iters", "2"], "9"),
     (["tune", "--shape", "64,64,64", "--methods", "fused", "--iters", "2"], "no candidate")],
)  # fmt: skip
def test_cli_errors_are_one_line(argv, says):
    run = subprocess.run([*CLI, *argv], capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert run.returncode == 2, run.stderr[-2000:]
    assert "Traceback" not in run.stderr and says in run.stderr
    assert run.stderr.strip().splitlines()[-1].startswith(f"commgemm {argv[0]}: error:")


def test_example_refuses_an_unknown_method():
    import pathlib

    path = pathlib.Path(__file__).parent.parent / "examples" / "train_transformer.py"
    run = subprocess.run([sys.executable, str(path), "--method", "bogus"], capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert run.returncode == 2 and "invalid choice" in run.stderr and "BULK" not in run.stderr
