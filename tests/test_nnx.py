"""The Flax NNX layers (commgemm.nnx): each layer against the same math written with jnp, for
values and gradients, sequence-parallel and not, several methods; parameters created in their
shards; the training example's losses against its unsharded twin and its checkpoint; bad input."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import P, balance_reference, load_script, mesh2d
from jax.sharding import Mesh, NamedSharding

import commgemm as cg

nnx = pytest.importorskip("flax.nnx")
cgnnx = pytest.importorskip("commgemm.nnx")

METHODS = {
    "none": cg.OverlapConfig(),
    "ring": cg.OverlapConfig(method="ring_exchange", bidirectional=True),
    "auto": cg.OverlapConfig(method="auto"),
}


def _mesh() -> Mesh:
    return Mesh(mesh2d(2, 4).devices, ("data", "tp"))


def _value(p):
    return np.asarray(p[...], np.float64)


def _layernorm(norm, x):
    x = np.asarray(x, np.float64)
    mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + norm.epsilon) * _value(norm.scale) + _value(norm.bias)


def _mlp_reference(mlp, x):
    h = _layernorm(mlp.norm, x)
    up = h @ _value(mlp.up.kernel) + _value(mlp.up.bias)
    up = np.asarray(jax.nn.gelu(jnp.asarray(up, jnp.float64), approximate=False))
    return up @ _value(mlp.down.kernel) + _value(mlp.down.bias)


@pytest.mark.parametrize("sequence_parallel", [True, False])
@pytest.mark.parametrize("method", METHODS)
def test_parallel_mlp(rng, method, sequence_parallel):
    mesh = _mesh()
    mlp = cgnnx.create_sharded(
        lambda: cgnnx.ParallelMLP(16, 64, mesh=mesh, rngs=nnx.Rngs(0), data_axis="data",
                                  sequence_parallel=sequence_parallel, config=METHODS[method]),
        mesh,
    )  # fmt: skip
    assert mlp.up.kernel[...].sharding.spec == P(None, "tp")
    assert mlp.down.kernel[...].sharding.spec == P("tp")
    x = rng.standard_normal((4, 16, 16)).astype(np.float32)
    spec = P("data", "tp", None) if sequence_parallel else P("data", None, None)
    xd = jax.device_put(x, NamedSharding(mesh, spec))
    y = nnx.jit(lambda m, a: m(a))(mlp, xd)
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, spec), 3)
    np.testing.assert_allclose(np.asarray(y), _mlp_reference(mlp, x), rtol=1e-4, atol=1e-4)
    grads = nnx.jit(nnx.grad(lambda m, a: jnp.sum(m(a) ** 2)))(mlp, xd)

    def plain(params, a):  # the same math in jnp, differentiated by jax
        mean, var = a.mean(-1, keepdims=True), a.var(-1, keepdims=True)
        h = (a - mean) * jax.lax.rsqrt(var + mlp.norm.epsilon) * params["scale"] + params["shift"]
        up = jax.nn.gelu(h @ params["up"] + params["up_b"], approximate=False)
        return jnp.sum((up @ params["down"] + params["down_b"]) ** 2)

    params = {"up": mlp.up.kernel[...], "up_b": mlp.up.bias[...],
              "down": mlp.down.kernel[...], "down_b": mlp.down.bias[...],
              "scale": mlp.norm.scale[...], "shift": mlp.norm.bias[...]}  # fmt: skip
    params = jax.device_put(params, jax.devices()[0])
    want = jax.jit(jax.grad(plain))(params, jax.device_put(x, jax.devices()[0]))
    got = {"up": grads.up.kernel[...], "up_b": grads.up.bias[...],
           "down": grads.down.kernel[...], "down_b": grads.down.bias[...],
           "scale": grads.norm.scale[...], "shift": grads.norm.bias[...]}  # fmt: skip
    for name in params:
        scale = float(np.abs(np.asarray(want[name])).max())
        np.testing.assert_allclose(np.asarray(got[name]), np.asarray(want[name]),
                                   rtol=1e-4, atol=1e-4 * scale)  # fmt: skip


@pytest.mark.parametrize("method", ["none", "ring"])
def test_attention_projections(rng, method):
    mesh = _mesh()
    att = cgnnx.create_sharded(
        lambda: cgnnx.ParallelAttentionProjections(32, 8, mesh=mesh, rngs=nnx.Rngs(1),
                                                   data_axis="data", config=METHODS[method]),
        mesh,
    )  # fmt: skip
    x = rng.standard_normal((2, 16, 32)).astype(np.float32)
    xd = jax.device_put(x, NamedSharding(mesh, P("data", "tp", None)))
    y = nnx.jit(lambda m, a: m(a))(att, xd)
    qkv = (x.astype(np.float64) @ _value(att.qkv.kernel) + _value(att.qkv.bias)).reshape(
        2, 16, 8, 3, 4
    )
    q, k, v = (jnp.asarray(qkv[:, :, :, i], jnp.float32) for i in range(3))
    heads = np.asarray(cgnnx.causal_attention(q, k, v), np.float64).reshape(2, 16, 32)
    want = heads @ _value(att.out.kernel) + _value(att.out.bias)
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("method", ["none", "xla"])
def test_attention_keeps_heads_sharded(rng, method):
    """The backward of attention moves no [B, S, heads, d] tensor (XLA gathered dq, dk and dv
    over every head before the layer constrained them), ours and XLA's baseline alike."""
    mesh = _mesh()
    config = None if method == "xla" else METHODS[method]
    att = cgnnx.create_sharded(
        lambda: cgnnx.ParallelAttentionProjections(32, 8, mesh=mesh, rngs=nnx.Rngs(1),
                                                   data_axis="data", config=config),
        mesh,
    )  # fmt: skip
    xd = jax.device_put(rng.standard_normal((2, 16, 32)).astype(np.float32),
                        NamedSharding(mesh, P("data", "tp", None)))  # fmt: skip
    grad = nnx.jit(lambda m, a: nnx.grad(lambda mm: jnp.sum(mm(a) ** 2))(m))
    text = grad.lower(att, xd).compile().as_text()
    moved = re.findall(r"= \S+\[([\d,]+)\]\S* (?:all-gather|all-to-all)(?:-start)?\(", text)
    assert moved and all(len(dims.split(",")) < 4 for dims in moved), moved


def test_bad_input():
    mesh = _mesh()
    with pytest.raises(ValueError, match="axis_name='model' is not an axis"):
        cgnnx.ColumnParallelLinear(8, 8, mesh=mesh, axis_name="model", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="num_heads of the tensor axis"):
        cgnnx.ParallelAttentionProjections(24, 6, mesh=mesh, rngs=nnx.Rngs(0))
    # the unquantized baseline would drop the scaling silently
    with pytest.raises(ValueError, match="config=None"):
        cgnnx.RowParallelLinear(8, 8, mesh=mesh, config=None, scaling="current_tensor_scaling",
                                rngs=nnx.Rngs(0))  # fmt: skip
    cgnnx.RowParallelLinear(8, 8, mesh=mesh, config=None, scaling="no_scaling", rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def example():
    return load_script("examples/train_transformer.py", "train_transformer")


@pytest.mark.parametrize("method", ["auto"])
def test_training_example_matches_its_twin(example, method):
    """Twenty steps of the example: the loss falls, every step's loss is its unsharded twin's
    to float32 precision, and (ring) the sharded checkpoint round-trips (checked inside)."""
    argv = ["--steps", "20", "--layers", "1", "--method", method, "--quiet"]
    summary = example.main(argv + ([] if method == "ring_exchange" else ["--no-checkpoint"]))
    assert summary["mesh"] == {"data": 2, "tp": 4} and summary["size"] == "cpu"
    assert summary["last_loss"] < summary["first_loss"] - 0.5
    assert summary["max_gap_to_twin"] < 1e-3


@pytest.mark.parametrize("devices", [1, 2, 4, 8])
def test_example_gpu_size_builds_on_every_mesh(example, devices):
    """The example's default on GPUs is its "gpu" size (elsewhere "cpu"); that model's
    parameters are laid out on the (data, tp) mesh of 1, 2, 4 and 8 devices (shapes only), each
    dimension the tensor axis splits whole, and the batch whole on the data axis."""
    assert [example.size_for(b) for b in ("gpu", "cpu", "tpu")] == ["gpu", "cpu", "cpu"]
    shape = example.SIZES["gpu"]
    mesh = example.make_mesh(jax.devices()[:devices])
    config = cg.OverlapConfig()
    abstract = nnx.eval_shape(
        lambda: example.Decoder(shape, mesh=mesh, config=config, rngs=nnx.Rngs(0))
    )
    params = nnx.state(abstract, nnx.Param)
    count = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(params))
    assert 0.6e9 < count < 0.7e9  # 2 blocks of 8B-like size, embedding and head of 32768
    tp, data = mesh.shape["tp"], mesh.shape["data"]
    assert shape.batch % data == 0 and shape.seq % tp == 0
    specs = jax.tree.leaves(nnx.get_partition_spec(params))
    for leaf, spec in zip(jax.tree.leaves(params), specs, strict=True):
        for dim, axis in zip(leaf.shape, spec, strict=False):
            assert axis is None or dim % mesh.shape[axis] == 0, (leaf.shape, spec)


def test_training_example_with_delayed_scaling(example):
    """The example's blocks in float8 with delayed scaling (dY's states written back from their
    gradients each step): the loss falls as in bf16, and the sharded model stays within float8's
    rounding of its unsharded twin (both quantize by the same states)."""
    argv = ["--steps", "12", "--layers", "1", "--scaling", "delayed", "--quiet", "--no-checkpoint"]
    summary = example.main(argv)
    assert summary["scaling"] == "delayed"
    assert summary["last_loss"] < summary["first_loss"] - 0.5
    assert summary["max_gap_to_twin"] < 0.05
    with pytest.raises(SystemExit):  # XLA's plain dots take no scaling
        example.main(["--method", "xla", "--scaling", "current", "--quiet"])


def test_parallel_mlp_with_fp8(rng):
    """scaling= on the layers: the MLP's output within FP8's error of the unquantized one,
    gradients finite and within it too (a linear loss)."""
    mesh = _mesh()
    make = lambda scaling: cgnnx.create_sharded(  # noqa: E731
        lambda: cgnnx.ParallelMLP(32, 64, mesh=mesh, rngs=nnx.Rngs(0), data_axis="data",
                                  config=METHODS["ring"], scaling=scaling),
        mesh,
    )  # fmt: skip
    fp8, plain = make("current_tensor_scaling"), make(None)
    x = rng.standard_normal((4, 16, 32)).astype(np.float32)
    xd = jax.device_put(x, NamedSharding(mesh, P("data", "tp", None)))
    g = jax.device_put(rng.standard_normal((4, 16, 32)).astype(np.float32), xd.sharding)
    run = nnx.jit(lambda m, a: m(a))
    y8, y = np.asarray(run(fp8, xd)), np.asarray(run(plain, xd))
    assert np.abs(y8 - y).max() <= 0.1 * np.abs(y).max()
    grad = nnx.jit(nnx.grad(lambda m, a: jnp.sum(m(a) * g)))
    k8, k = grad(fp8, xd).up.kernel[...], grad(plain, xd).up.kernel[...]
    assert np.isfinite(np.asarray(k8)).all()
    assert np.abs(np.asarray(k8) - np.asarray(k)).max() <= 0.15 * np.abs(np.asarray(k)).max()


@functools.partial(jax.jit, static_argnames=("k", "capacity_factor", "activation"))
def _moe_reference(x, router, w1, w2, k, capacity_factor=None, activation="gelu"):
    """Every token's top-k experts on one device, weighted by the softmax of their logits; with
    `capacity_factor`, per shard of `_mesh()` (x [B, S, H] sharded [data, tp]): each expert's
    copies from the shard past the first ceil(capacity_factor * copies / E) in token order
    dropped. Jitted: run eagerly, each of its ops would compile on its own."""
    if capacity_factor is not None and capacity_factor > 0:  # each shard's tokens alone
        rows = [jnp.split(b, 4, axis=1) for b in jnp.split(x, 2, axis=0)]
        return jnp.concatenate([
            jnp.concatenate([_moe_reference(t, router, w1, w2, k, -capacity_factor, activation)
                             for t in row], axis=1)
            for row in rows
        ], axis=0)  # fmt: skip
    flat = x.reshape(-1, x.shape[-1])
    expert, gate, token = cgnnx.top_k_routing(flat @ router, k)
    h = jnp.einsum("th,thf->tf", flat[token], w1[expert])
    if activation is not None:
        h = jax.nn.gelu(h, approximate=activation == "gelu_tanh")
    out = jnp.einsum("tf,tfh->th", h, w2[expert]) * gate[:, None]
    if capacity_factor is not None:  # negative: this shard's, capped
        experts = w1.shape[0]
        before = jnp.cumsum(jax.nn.one_hot(expert, experts), axis=0) - 1  # earlier copies
        rank = jnp.take_along_axis(before, expert[:, None], axis=1)
        out = out * (rank < np.ceil(-capacity_factor * expert.shape[0] / experts))
    return jnp.zeros_like(flat).at[token].add(out).reshape(x.shape)


@pytest.mark.parametrize("method", ["none", "ring", "auto"])  # auto: the default
@pytest.mark.parametrize("top_k", [1, 2])
def test_parallel_moe(rng, method, top_k):
    """The MoE block (8 experts over the 4-way tensor axis, a data axis of 2) against the same
    routing and experts on one device: values and gradients of x, the router and the experts."""
    mesh = _mesh()
    moe = cgnnx.create_sharded(
        lambda: cgnnx.ParallelMoE(16, 24, 8, mesh=mesh, rngs=nnx.Rngs(2), top_k=top_k,
                                  data_axis="data", config=METHODS[method]),
        mesh,
    )  # fmt: skip
    assert moe.w1[...].sharding.spec == P("tp")
    x = rng.standard_normal((4, 16, 16)).astype(np.float32)
    xd = jax.device_put(x, NamedSharding(mesh, P("data", "tp", None)))
    params = [jax.device_put(p[...], jax.devices()[0]) for p in (moe.router, moe.w1, moe.w2)]
    want = _moe_reference(jax.device_put(x, jax.devices()[0]), *params, top_k)
    np.testing.assert_allclose(np.asarray(nnx.jit(lambda m, a: m(a))(moe, xd)), want,
                               rtol=1e-4, atol=1e-5)  # fmt: skip
    g = rng.standard_normal(x.shape).astype(np.float32)
    grads = nnx.jit(nnx.grad(lambda m, a: jnp.sum(m(a) * g)))(moe, xd)
    ref = jax.grad(lambda r, a, b: jnp.sum(_moe_reference(x, r, a, b, top_k) * g), (0, 1, 2))(
        *params
    )
    for got, r in zip((grads.router, grads.w1, grads.w2), ref, strict=True):
        np.testing.assert_allclose(np.asarray(got[...]), np.asarray(r), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("activation", ["gelu_tanh", None])
def test_parallel_moe_activation(rng, activation):
    """ParallelMoE's activation by name ("gelu" above): the tanh form and none, values and the
    experts' gradients against the one-device reference."""
    mesh = _mesh()
    moe = cgnnx.create_sharded(
        lambda: cgnnx.ParallelMoE(16, 24, 8, mesh=mesh, rngs=nnx.Rngs(3), data_axis="data",
                                  activation=activation),
        mesh,
    )  # fmt: skip
    x = rng.standard_normal((4, 16, 16)).astype(np.float32)
    xd = jax.device_put(x, NamedSharding(mesh, P("data", "tp", None)))
    params = [jax.device_put(p[...], jax.devices()[0]) for p in (moe.router, moe.w1, moe.w2)]
    ref = lambda r, a, b: _moe_reference(x, r, a, b, 2, activation=activation)  # noqa: E731
    np.testing.assert_allclose(np.asarray(nnx.jit(lambda m, a: m(a))(moe, xd)), ref(*params),
                               rtol=1e-4, atol=1e-5)  # fmt: skip
    g = rng.standard_normal(x.shape).astype(np.float32)
    grads = nnx.jit(nnx.grad(lambda m, a: jnp.sum(m(a) * g)))(moe, xd)
    want = jax.grad(lambda a, b: jnp.sum(ref(params[0], a, b) * g), (0, 1))(*params[1:])
    for got, r in zip((grads.w1, grads.w2), want, strict=True):
        np.testing.assert_allclose(np.asarray(got[...]), np.asarray(r), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("method", ["none", "auto"])
def test_parallel_moe_load_balancing_loss(rng, method):
    """ParallelMoE(load_balancing=True) sows the routing's auxiliary loss over every token of
    the (data 2, tp 4) mesh (against float64 numpy) and leaves the output as it was; the loss's
    gradient reaches the router (against the unsplit loss's) and not the experts; without the
    flag nothing is sown."""
    if not hasattr(nnx, "capture"):
        pytest.skip("this flax has no nnx.capture")
    mesh, k = _mesh(), 2
    make = lambda lb: cgnnx.create_sharded(  # noqa: E731
        lambda: cgnnx.ParallelMoE(16, 24, 8, mesh=mesh, rngs=nnx.Rngs(4), top_k=k,
                                  data_axis="data", config=METHODS[method], load_balancing=lb),
        mesh,
    )  # fmt: skip
    moe, plain = make(True), make(False)
    x = rng.standard_normal((4, 16, 16))
    xd = jax.device_put(x, NamedSharding(mesh, P("data", "tp", None)))
    run = nnx.jit(nnx.capture(nnx.Intermediate)(lambda m, a: m(a)))
    out, found = run(moe, xd)
    aux = found["load_balancing_loss"].get_value()
    assert len(aux) == 1
    router = _value(moe.router)
    want = balance_reference(x.reshape(-1, 16) @ router, k)
    np.testing.assert_allclose(float(aux[0]), want, rtol=1e-10)
    out_plain, nothing = run(plain, xd)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(out_plain))
    assert "load_balancing_loss" not in nothing

    def loss(m, a):  # the auxiliary loss alone: its gradient reaches the router, not the experts
        _, seen = nnx.capture(nnx.Intermediate)(lambda m, a: m(a))(m, a)
        return seen["load_balancing_loss"].get_value()[0]

    grads = nnx.jit(nnx.grad(loss))(moe, xd)
    want = jax.grad(lambda r: cgnnx.load_balancing_loss(x.reshape(-1, 16) @ r, k))(router)
    assert np.abs(want).max() > 1e-3
    np.testing.assert_allclose(np.asarray(grads.router[...]), want, rtol=1e-6, atol=1e-12)
    assert not np.any(np.asarray(grads.w1[...])) and not np.any(np.asarray(grads.w2[...]))


@pytest.mark.parametrize("method", ["none", "ring"])
@pytest.mark.parametrize("capacity_factor", [0.5, 1.0, 1.25, 8.0])  # 8: nothing dropped
def test_parallel_moe_capacity(rng, method, capacity_factor):
    """ParallelMoE with a capacity factor against the same block on one device with each
    shard's copies past each expert's capacity dropped (8 tokens a shard, top-2 of 8 experts:
    1, 2, 3 and 16 copies an expert): values and gradients; a factor <= 0 is refused."""
    mesh = _mesh()
    moe = cgnnx.create_sharded(
        lambda: cgnnx.ParallelMoE(16, 24, 8, mesh=mesh, rngs=nnx.Rngs(3), data_axis="data",
                                  config=METHODS[method], capacity_factor=capacity_factor),
        mesh,
    )  # fmt: skip
    x = rng.standard_normal((4, 16, 16)).astype(np.float32)
    xd = jax.device_put(x, NamedSharding(mesh, P("data", "tp", None)))
    params = [jax.device_put(p[...], jax.devices()[0]) for p in (moe.router, moe.w1, moe.w2)]
    ref = functools.partial(_moe_reference, k=2, capacity_factor=capacity_factor)
    got = np.asarray(nnx.jit(lambda m, a: m(a))(moe, xd))
    np.testing.assert_allclose(got, ref(x, *params), rtol=1e-4, atol=1e-5)
    full = _moe_reference(x, *params, 2)
    assert (capacity_factor < 8) != np.allclose(got, full, rtol=1e-4, atol=1e-5)
    g = rng.standard_normal(x.shape).astype(np.float32)
    grads = nnx.jit(nnx.grad(lambda m, a: jnp.sum(m(a) * g)))(moe, xd)
    want = jax.grad(lambda *p: jnp.sum(ref(x, *p) * g), (0, 1, 2))(*params)
    for got, r in zip((grads.router, grads.w1, grads.w2), want, strict=True):
        np.testing.assert_allclose(np.asarray(got[...]), np.asarray(r), rtol=1e-4, atol=1e-5)
    for bad in (0, -1.0, True, "1.25"):
        with pytest.raises(ValueError, match="capacity_factor must be a number > 0"):
            cgnnx.ParallelMoE(16, 24, 8, mesh=mesh, rngs=nnx.Rngs(3), capacity_factor=bad)


@pytest.mark.parametrize("method", ["ring", "none"])
def test_parallel_moe_delayed_scaling(rng, method):
    """Delayed scaling in the MoE block: each call quantizes its two grouped GEMMs' operands by
    their own states (the tokens and w1: "up"; the hidden activation and w2: "down"; the output
    against the float64 product of the operands so quantized), then advances each state by its
    operand's amax over the whole mesh; dY's states come back as gradients, advanced by the
    cotangents' amax (the return's dY: the output's cotangent times each copy's gate)."""
    mesh, k = _mesh(), 2
    start = cg.ScalingState.create(history=2)
    recipe = cg.ScalingRecipe("delayed_tensor_scaling", x_state=start, w_state=start,
                              dy_state=start)  # fmt: skip
    moe = cgnnx.create_sharded(
        lambda: cgnnx.ParallelMoE(16, 24, 8, mesh=mesh, rngs=nnx.Rngs(2), top_k=k,
                                  data_axis="data", config=METHODS[method], scaling=recipe),
        mesh,
    )  # fmt: skip
    x = rng.standard_normal((4, 16, 16)).astype(np.float32) * 3
    xd = jax.device_put(x, NamedSharding(mesh, P("data", "tp", None)))
    router, w1, w2 = (_value(p) for p in (moe.router, moe.w1, moe.w2))
    flat = x.reshape(-1, 16).astype(np.float64)
    expert, gate, token = (np.asarray(a) for a in cgnnx.top_k_routing(flat @ router, k))
    run = nnx.jit(lambda m, a: m(a))
    before = dict.fromkeys([("up", "x"), ("up", "w"), ("down", "x"), ("down", "w")], 0.0)
    for _ in range(2):
        states = moe.float8.get_value()
        up, down = states["up"], states["down"]
        h = np.einsum("th,thf->tf", _dq_delayed(flat[token], up["x"]),
                      _dq_delayed(w1, up["w"])[expert])  # fmt: skip
        h = np.asarray(jax.nn.gelu(h.astype(np.float32), approximate=False), np.float64)
        z = np.einsum("tf,tfh->th", _dq_delayed(h, down["x"]), _dq_delayed(w2, down["w"])[expert])
        want = np.zeros_like(flat)
        np.add.at(want, token, z * gate[:, None])
        got = np.asarray(run(moe, xd)).reshape(-1, 16)
        # the hidden activation's float8 rounding follows its float32 last bits
        np.testing.assert_allclose(got, want, atol=2e-2 * np.abs(want).max())
        new = moe.float8.get_value()
        seen = {"up": {"x": x, "w": w1}, "down": {"x": h, "w": w2}}
        for part, kind in before:  # the hidden activation's amax follows the "up" states
            history = np.asarray(new[part][kind].amax_history)
            want_amax = np.abs(seen[part][kind]).max()
            np.testing.assert_allclose(history, [want_amax, before[part, kind]], rtol=1e-3)
            before[part, kind] = history[0]
    g = rng.standard_normal(x.shape).astype(np.float32)
    gd = jax.device_put(g, NamedSharding(mesh, P("data", "tp", None)))
    diff = nnx.DiffState(0, (nnx.Param, cgnnx.Float8GradState))
    grads = nnx.jit(nnx.grad(lambda m, a: jnp.sum(m(a) * gd), argnums=diff))(moe, xd)
    params = cgnnx.apply_float8_grads(moe, grads)
    assert {path[0] for path, _ in params.flat_state()} == {"router", "w1", "w2"}, params
    dy = moe.float8_dy.get_value()
    want_dy = np.abs(g.reshape(-1, 16)[token] * gate[:, None]).max()
    np.testing.assert_allclose(dy["down"].amax_history, [want_dy, 0.0], rtol=1e-5)
    assert dy["up"].amax_history[0] > 0 and dy["up"].amax_history[1] == 0, dy["up"]


@pytest.mark.parametrize("remat", [False, True], ids=["plain", "remat"])
def test_scanned_stack(rng, remat):
    """Three ParallelMLP blocks made by nnx.vmap and run by nnx.scan (each step nnx.remat'ed or
    not), the way scanned transformer stacks are built: the loss and every gradient equal the
    same stack's with XLA's own partitioning (config=None), to float32 rounding."""
    mesh, layers = _mesh(), 3

    def stack(config):
        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
        def make(rngs):
            return cgnnx.ParallelMLP(16, 64, mesh=mesh, rngs=rngs, data_axis="data",
                                     config=config)  # fmt: skip

        with jax.set_mesh(mesh):
            return make(nnx.Rngs(0))

    def loss(blocks, x):
        step = lambda block, h: h + block(h)  # noqa: E731
        step = nnx.remat(step) if remat else step
        scan = nnx.scan(step, in_axes=(0, nnx.Carry), out_axes=nnx.Carry,
                        transform_metadata={nnx.PARTITION_NAME: None})  # fmt: skip
        return jnp.sum(jnp.sin(scan(blocks, x)))

    x = rng.standard_normal((4, 16, 16)).astype(np.float32)
    xd = jax.device_put(x, NamedSharding(mesh, P("data", "tp", None)))
    step = nnx.jit(nnx.value_and_grad(loss))
    got = step(stack(METHODS["ring"]), xd)
    want = step(stack(None), xd)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5)


LAYERS = {
    "mlp": (lambda mesh, c: cgnnx.ParallelMLP(16, 64, mesh=mesh, rngs=nnx.Rngs(0),
                                               data_axis="data", config=c), 16, True),
    "mlp_replicated": (lambda mesh, c: cgnnx.ParallelMLP(16, 64, mesh=mesh, rngs=nnx.Rngs(0),
                                                          data_axis="data", config=c,
                                                          sequence_parallel=False), 16, False),
    "attention": (lambda mesh, c: cgnnx.ParallelAttentionProjections(
        32, 8, mesh=mesh, rngs=nnx.Rngs(0), data_axis="data", config=c), 32, True),
    "moe": (lambda mesh, c: cgnnx.ParallelMoE(16, 32, 8, mesh=mesh, rngs=nnx.Rngs(0),
                                               data_axis="data", config=c), 16, True),
}  # fmt: skip


@pytest.mark.parametrize("config", ["ring", "xla"])
@pytest.mark.parametrize("layer", list(LAYERS))
def test_explicit_mesh_axes(rng, layer, config):
    """Every layer on a mesh of Explicit axes (jax.sharding.AxisType) gives the values and
    gradients it gives on the same mesh with Auto axes; config=None (XLA's partitioning of plain
    dots; the MoE block's serial ops) too."""
    from jax.sharding import AxisType

    make, hidden, sequence_parallel = LAYERS[layer]
    cfg = METHODS["ring"] if config == "ring" else (cg.OverlapConfig() if layer == "moe" else None)
    x = rng.standard_normal((4, 16, hidden)).astype(np.float32)
    results = []
    for kind in (AxisType.Auto, AxisType.Explicit):
        mesh = jax.make_mesh((2, 4), ("data", "tp"), axis_types=(kind, kind))
        model = cgnnx.create_sharded(lambda mesh=mesh: make(mesh, cfg), mesh)
        spec = P("data", "tp" if sequence_parallel else None, None)
        xd = jax.device_put(x, NamedSharding(mesh, spec))
        with jax.set_mesh(mesh):
            step = nnx.jit(nnx.value_and_grad(lambda m, a: jnp.sum(jnp.sin(m(a)))))
            results.append(step(model, xd))
    for got, want in zip(jax.tree.leaves(results[1]), jax.tree.leaves(results[0]), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def _dq_delayed(a, state, dtype=jnp.float8_e4m3fn):
    q = cg.quantize(jnp.asarray(a), "delayed_tensor_scaling", dtype=dtype, state=state)[0]
    return np.asarray(cg.dequantize(q, jnp.float64))


def test_delayed_scaling_on_explicit_axes(rng):
    """A delayed-scaling MLP on a mesh of Explicit axes: two steps give the values, gradients
    and states the same MLP gives on Auto axes."""
    from jax.sharding import AxisType

    x = rng.standard_normal((4, 16, 16)).astype(np.float32)
    results = []
    for kind in (AxisType.Auto, AxisType.Explicit):
        mesh = jax.make_mesh((2, 4), ("data", "tp"), axis_types=(kind, kind))
        mlp = cgnnx.create_sharded(
            lambda mesh=mesh: cgnnx.ParallelMLP(16, 64, mesh=mesh, rngs=nnx.Rngs(0),
                                                data_axis="data", config=METHODS["ring"],
                                                scaling="delayed_tensor_scaling"),
            mesh,
        )  # fmt: skip
        xd = jax.device_put(x, NamedSharding(mesh, P("data", "tp", None)))
        with jax.set_mesh(mesh):
            step = nnx.jit(nnx.value_and_grad(lambda m, a: jnp.sum(jnp.sin(m(a)))))
            out = [step(mlp, xd) for _ in range(2)][-1]
        results.append((out, mlp.up.float8.get_value(), mlp.down.float8.get_value()))
    for got, want in zip(jax.tree.leaves(results[1]), jax.tree.leaves(results[0]), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dy", [False, True], ids=["dy-current", "dy-state"])
def test_delayed_scaling(rng, dy):
    """Delayed scaling on a layer (GEMM + reduce-scatter, jitted): each call quantizes x and w
    by the layer's Float8State (the output against the float64 product of the operands so
    quantized, bias added) and then advances both by their amax (the next call uses the new
    scales); with a dy_state, the gradient of the layer's Float8GradState is that state
    advanced by dY's amax, with dW from dY quantized by the old one, and apply_float8_grads
    writes it into the layer and returns the parameters' gradients."""
    mesh = _mesh()
    start = cg.ScalingState.create(history=2)
    recipe = cg.ScalingRecipe("delayed_tensor_scaling", x_state=start, w_state=start,
                              dy_state=start if dy else None)  # fmt: skip
    layer = cgnnx.create_sharded(
        lambda: cgnnx.RowParallelLinear(64, 32, mesh=mesh, rngs=nnx.Rngs(0), data_axis="data",
                                        config=METHODS["ring"], scaling=recipe),
        mesh,
    )  # fmt: skip
    x = rng.standard_normal((4, 16, 64)).astype(np.float32) * 3
    xd = jax.device_put(x, NamedSharding(mesh, P("data", None, "tp")))
    w, bias = _value(layer.kernel), _value(layer.bias)
    run = nnx.jit(lambda m, a: m(a))
    for call in range(2):
        states = layer.float8.get_value()
        want = _dq_delayed(x, states["x"]) @ _dq_delayed(w, states["w"]) + bias
        np.testing.assert_allclose(np.asarray(run(layer, xd)), want, rtol=1e-5, atol=1e-5)
        new = layer.float8.get_value()
        for name, seen in (("x", x), ("w", w)):
            np.testing.assert_allclose(new[name].amax_history[0], np.abs(seen).max(), rtol=1e-6)
            np.testing.assert_allclose(new[name].amax_history[1], [0.0, np.abs(seen).max()][call],
                                       rtol=1e-6)  # fmt: skip
    g = rng.standard_normal((4, 16, 32)).astype(np.float32)
    gd = jax.device_put(g, NamedSharding(mesh, P("data", "tp", None)))
    states = layer.float8.get_value()
    diff = nnx.DiffState(0, (nnx.Param, cgnnx.Float8GradState))
    grads = nnx.jit(nnx.grad(lambda m, a: jnp.sum(m(a) * gd), argnums=diff))(layer, xd)
    if not dy:
        assert layer.float8_dy is None
        return
    params = cgnnx.apply_float8_grads(layer, grads)
    assert {path for path, _ in params.flat_state()} == {("kernel",), ("bias",)}, params
    np.testing.assert_allclose(layer.float8_dy.get_value().amax_history, [np.abs(g).max(), 0.0],
                               rtol=1e-6)  # fmt: skip
    qdy = _dq_delayed(g, start, jnp.float8_e5m2).reshape(-1, 32)
    want_dw = _dq_delayed(x, states["x"]).reshape(-1, 64).T @ qdy
    np.testing.assert_allclose(params["kernel"][...], want_dw, rtol=1e-4, atol=1e-4)


def test_training_example_state_keeps_its_shardings(example):
    """The example's model and optimizer state come back from a step with the shardings they
    went in with, so the second step reuses the first's program (no recompile)."""
    shape = example.Shape(layers=1)
    mesh = example.make_mesh(jax.devices())
    model, optimizer = example.build(shape, mesh, None)

    def shardings():
        return [(a.sharding, a.ndim) for a in jax.tree.leaves(nnx.state((model, optimizer)))]

    before = shardings()
    example.train_step(model, optimizer, next(example.batches(shape)))
    after = shardings()
    assert all(isinstance(s, jax.sharding.NamedSharding) for s, _ in before)
    assert all(b.is_equivalent_to(a, n) for (b, n), (a, _) in zip(before, after, strict=True))
