"""FP8 on one Hopper GPU: the tensor-scaled GEMM reaches cuBLASLt's FP8 GEMM (no dequantized
copy of an operand), agrees with the float32 product of the same quantized operands with either
accumulation, and the ops on a one-device axis (the local GEMM) do too."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import commgemm as cg
from commgemm import quantized_gemm, scaled


def _operands(m=512, k=1024, n=768):
    ka, kb = jax.random.split(jax.random.key(0))
    return (jax.random.normal(ka, (m, k), jnp.bfloat16),
            (jax.random.normal(kb, (k, n), jnp.float32) / k**0.5).astype(jnp.bfloat16))  # fmt: skip


def _reference(x, w, mode):
    qx = cg.dequantize(cg.quantize(x, mode), jnp.float32)
    qw = cg.dequantize(cg.quantize(w, mode, axis=0), jnp.float32)
    return jnp.dot(qx, qw, precision="highest")


@pytest.mark.parametrize("split", [False, True])
def test_tensor_scaled_gemm_runs_fp8(split):
    x, w = _operands()
    recipe = cg.ScalingRecipe(split_accumulator=(split, True, True))
    f = jax.jit(lambda a, b: scaled.matmul(a, b, recipe))
    text = f.lower(x, w).compile().as_text()
    assert "f8e4m3fn" in text and "cublas$lt$matmul$f8" in text, text[-2000:]
    out = f(x, w).astype(jnp.float32)
    ref = _reference(x, w, "current_tensor_scaling")
    err = float(jnp.abs(out - ref).max() / jnp.abs(ref).max())
    assert err < 1e-2, err  # the bf16 output's rounding, plus fast accumulation's loss


@pytest.mark.parametrize("mode", ["mxfp8_1d_scaling", "nvfp4_1d_scaling"])
def test_block_modes_emulated(mode):
    x, w = _operands()
    out = jax.jit(lambda a, b: scaled.matmul(a, b, mode))(x, w).astype(jnp.float32)
    ref = _reference(x, w, mode)
    assert float(jnp.abs(out - ref).max() / jnp.abs(ref).max()) < 1e-2


@pytest.mark.parametrize("op", ["ag", "rs"])
def test_ops_on_one_gpu(op):
    x, w = _operands()
    mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
    fn = cg.all_gather_matmul if op == "ag" else cg.matmul_reduce_scatter
    specs = (P("x"), P(None, "x")) if op == "ag" else (P(None, "x"), P("x"))
    out_spec = P(None, "x") if op == "ag" else P("x")
    f = jax.jit(jax.shard_map(lambda a, b: fn(a, b, "x", scaling="current_tensor_scaling"),
                              mesh=mesh, in_specs=specs, out_specs=out_spec))  # fmt: skip
    out = f(x, w).astype(jnp.float32)
    ref = _reference(x, w, "current_tensor_scaling")
    assert float(jnp.abs(out - ref).max() / jnp.abs(ref).max()) < 1e-2
    dx, dw = jax.jit(jax.grad(lambda a, b: jnp.sum(f(a, b).astype(jnp.float32)), (0, 1)))(x, w)
    want_dx = jnp.ones((x.shape[0], w.shape[1])) @ w.astype(jnp.float32).T
    assert float(jnp.abs(dx - want_dx).max() / jnp.abs(want_dx).max()) < 0.1  # e5m2 dY, e4m3 W
    assert dw.shape == w.shape and bool(jnp.isfinite(dw).all())


def _gemm_core(op, tiles, float8):
    """The kernel of `op` and `tiles` (a direct or ring family) with no mesh axis: its GEMM
    core on this GPU, nothing to send."""
    from commgemm.mosaic_gpu import direct_ag, direct_rs, fused, ring_rs

    ring = type(tiles).__name__.startswith("Ring")
    method = "ring_exchange" if ring else "pipeline"
    cfg = cg.OverlapConfig(method=method, atomic_gemm=True, kernel=tiles)
    if float8:  # the ops' path: a QuantizedRhs, w stored [n, K]
        if op == "ag":
            return jax.jit(lambda a, r: fused.all_gather_matmul(a, r, None, cfg, w_transposed=True))
        return jax.jit(lambda a, r: fused.matmul_reduce_scatter(a, r, None, cfg, w_transposed=True))
    # bf16 w laid out [n, K]: the transposed right operand
    if op == "ag":
        return jax.jit(lambda a, b: direct_ag.all_gather_matmul(a, b, None, cfg.kernel, w_nk=True))
    kernel = ring_rs if ring else direct_rs
    return jax.jit(lambda a, b: kernel.matmul_reduce_scatter(a, b, None, cfg.kernel, w_nk=True))


@pytest.mark.skipif(jax.__version_info__ < (0, 11), reason="the fused kernels need jax >= 0.11")
@pytest.mark.parametrize("k", [1024, 1088])  # 1088: not whole 128-element K-steps, 64 stay
@pytest.mark.parametrize("op", ["ag", "rs"])
@pytest.mark.parametrize("family", ["direct", "ring"])
def test_fused_kernels_float8_core(family, op, k):
    """The direct and ring kernels' float8 wgmma (w [n, K], scales in the epilogue) and their
    bf16 transposed-w path agree with the float32 product of the same operands."""
    from commgemm import mosaic_gpu

    x, w = _operands(m=512, k=k, n=1024)
    tiles = getattr(mosaic_gpu, f"{family.capitalize()}{op.upper()}Config")()
    qx = cg.quantize(x, "current_tensor_scaling")
    qw = cg.quantize(w, "current_tensor_scaling", axis=0)
    rhs = quantized_gemm.QuantizedRhs(cg.ScaledTensor(qw.data.T, qw.scale_inv), qx.scale_inv, k,
                              "bfloat16", False)  # fmt: skip
    out = _gemm_core(op, tiles, True)(qx.data, rhs)
    assert out.dtype == jnp.bfloat16
    ref = _reference(x, w, "current_tensor_scaling")
    err = float(jnp.abs(out.astype(jnp.float32) - ref).max() / jnp.abs(ref).max())
    assert err < 1e-2, err  # bf16 rounding of the unscaled product, fast accumulation
    if k == 1088:
        out = _gemm_core(op, tiles, False)(x, w.T).astype(jnp.float32)
        ref = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32), precision="highest")
        assert float(jnp.abs(out - ref).max() / jnp.abs(ref).max()) < 1e-2


@pytest.mark.parametrize("op", ["grouped", "ag"])
def test_weight_quantized_once(op):
    """A `cg.QuantizedWeight` on Hopper's float8 paths (commgemm's grouped kernel; cuBLASLt's
    FP8 GEMM for an op on a one-device axis) gives the values and gradients of two calls that
    quantize w themselves, and the program still multiplies float8 operands."""
    m, k, n, groups, mode = 1024, 512, 512, 4, "current_tensor_scaling"
    kx, kw, kg = jax.random.split(jax.random.key(7), 3)
    xs = jax.random.normal(kx, (2, m, k), jnp.bfloat16)
    g = jax.random.normal(kg, (m, n), jnp.float32)
    w_shape = (groups, k, n) if op == "grouped" else (k, n)
    w = (jax.random.normal(kw, w_shape, jnp.float32) / k**0.5).astype(jnp.bfloat16)
    sizes = jnp.asarray([300, 0, 500, 100], jnp.int32)

    def two_calls(b, xs, once: bool):
        axis_name = None if op == "grouped" else "x"
        qb = cg.quantize_weight(b, mode, axis_name=axis_name) if once else b
        if op == "grouped":
            ys = [cg.grouped_matmul(xs[i], qb, sizes, scaling=mode) for i in range(2)]
        else:
            ys = [cg.all_gather_matmul(xs[i], qb, "x", scaling=mode) for i in range(2)]
        ys = [y.astype(jnp.float32) for y in ys]
        total = jnp.sum(ys[0] * g) + jnp.sum(jnp.sin(ys[1]))
        return total if op == "grouped" else jax.lax.psum(total, "x")

    def run(once: bool):
        f = lambda b, a: jax.value_and_grad(two_calls)(b, a, once)  # noqa: E731
        if op == "ag":
            mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
            f = jax.shard_map(f, mesh=mesh, in_specs=(P(None, "x"), P(None, "x")),
                              out_specs=(P(), P(None, "x")))  # fmt: skip
        return jax.jit(f)

    text = run(True).lower(w, xs).compile().as_text().lower()
    assert "f8e4m3fn" in text
    assert ("mosaic" if op == "grouped" else "cublas$lt$matmul$f8") in text
    (v1, d1), (v2, d2) = (run(once)(w, xs) for once in (False, True))
    assert abs(float(v1) - float(v2)) <= 1e-6 * abs(float(v1))
    d1, d2 = d1.astype(jnp.float32), d2.astype(jnp.float32)
    assert float(jnp.abs(d1 - d2).max()) <= 1e-6 * float(jnp.abs(d1).max())


@pytest.mark.parametrize("op", ["grouped", "ag"])
def test_kept_transposed_experts(op):
    """Experts quantized once with their float8 values kept transposed (`keep_transposed=True`,
    as for serving: the weight an argument of the forward's program) give the forward of the
    same weight without the kept copy, bit for bit, and its compiled program makes no float8
    [G, N, K] array (the per-call transpose), which the program without the copy does."""
    devices = jax.devices()
    size, m, k, groups, mode = len(devices), 1024, 512, 4, "current_tensor_scaling"
    n = 768 if op == "grouped" else 256 * size
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((size * m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((groups, k, n)) / k**0.5, jnp.bfloat16)
    counts = [np.bincount(rng.integers(0, groups, m), minlength=groups) for _ in range(size)]
    sizes = jnp.asarray(np.stack(counts), jnp.int32)
    mesh = Mesh(np.array(devices), ("x",))

    def run(keep: bool):
        if op == "grouped":
            qw = cg.quantize_weight(w, mode, axis=1, keep_transposed=keep)
            f = jax.jit(lambda a, b: cg.grouped_matmul(a, b, sizes[0], scaling=mode))
            return f, x[:m], qw, n
        spec = P(None, None, "x")
        t_spec = P(None, "x", None) if keep else None
        quantized = cg.ScaledTensor(spec, P(), mode=cg.ScalingMode(mode), axis=1)
        specs = cg.QuantizedWeight(spec, quantized, t_spec)
        quantize = jax.shard_map(
            lambda b: cg.quantize_weight(b, mode, axis=1, axis_name="x", keep_transposed=keep),
            mesh=mesh, in_specs=spec, out_specs=specs)  # fmt: skip
        f = jax.shard_map(
            lambda a, b, s: cg.all_gather_grouped_matmul(a, b, s[0], "x", scaling=mode),
            mesh=mesh,
            in_specs=(P("x"), specs, P("x")),
            out_specs=P(None, "x"),
        )
        return jax.jit(lambda a, b: f(a, b, sizes)), x, jax.jit(quantize)(w), n // size

    outs = []
    for keep in (False, True):
        f, a, qw, n_local = run(keep)
        text = f.lower(a, qw).compile().as_text()
        made = [ln for ln in text.splitlines() if f"= f8e4m3fn[{groups},{n_local},{k}]" in ln
                and "parameter(" not in ln]  # fmt: skip
        assert bool(made) is not keep, made
        assert "mosaic" in text
        outs.append(np.float32(f(a, qw)))
    np.testing.assert_array_equal(outs[1], outs[0])


@pytest.mark.parametrize("local_gemm", ["xla", "mosaic"])
def test_kept_transposed_dense(local_gemm):
    """A dense op's float8 forward on w [K, n] quantized before (passed in, as for serving),
    on one GPU (XLA's FP8 GEMM, or commgemm's Mosaic GEMM): with the values kept transposed
    the compiled program moves no float8 operand (no transpose, copy or Triton transpose),
    without them it does; the results are equal bit for bit."""
    import re

    m, k, n, mode = 1024, 512, 768, "current_tensor_scaling"
    x = jax.random.normal(jax.random.key(0), (m, k), jnp.bfloat16)
    w = (jax.random.normal(jax.random.key(1), (k, n), jnp.float32) / k**0.5).astype(jnp.bfloat16)
    mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
    cfg = cg.OverlapConfig(local_gemm=local_gemm)
    outs = []
    for keep in (False, True):
        qw = cg.quantize_weight(w, mode, keep_transposed=keep)
        specs = jax.tree.map(lambda _: P(), qw)
        f = jax.jit(jax.shard_map(
            lambda a, b: cg.all_gather_matmul(a, b, "x", config=cfg, scaling=mode),
            mesh=mesh, in_specs=(P("x"), specs), out_specs=P("x")))  # fmt: skip
        text = f.lower(x, qw).compile().as_text()
        moved = re.findall(r"= f8e4m3fn\[[^\]]*\][^ ]* (?:transpose|copy)\(", text)
        moved += [ln for ln in text.splitlines() if "xla.gpu.triton" in ln]  # `swapped`
        assert bool(moved) is not keep, moved
        assert ("mosaic" if local_gemm == "mosaic" else "cublas$lt$matmul$f8") in text
        outs.append(np.float32(f(x, qw)))
    np.testing.assert_array_equal(outs[1], outs[0])


@pytest.mark.parametrize("wgrad", ["split", "fast"])
@pytest.mark.parametrize("method", ["none", "ring_exchange"])
@pytest.mark.parametrize("op", ["ag", "rs", "dispatch"])
def test_collective_grouped_float8_blocks(op, method, wgrad):
    """The collective grouped ops under tensor scaling, on every GPU of the machine: each
    block's forward GEMM runs commgemm's float8 grouped kernel on the rows as they travelled
    (f8 operands in the compiled program), within float8 accumulation of the emulated path
    (the same quantized values on the 16-bit kernels); dX runs on the float8 kernel too (e5m2
    dY beside e4m3 w in a Mosaic GPU call of the gradient's program), the gradients within
    float8 noise of the emulated ones. With a fast wgrad the blocks take dW on the float8 dW
    kernel (these hold 256 rows a group or more), its operands transposed by Triton calls."""
    import re

    from commgemm.grouped import scaling

    devices = jax.devices()
    size, m, groups = len(devices), 1024, 4
    mesh = Mesh(np.array(devices), ("x",))
    rng = np.random.default_rng(1)
    cfg = cg.OverlapConfig(method=method)
    normal = lambda shape, s=1.0: jnp.asarray(rng.standard_normal(shape) * s, jnp.bfloat16)  # noqa: E731
    if op == "ag":
        x, w = normal((size * m, 512)), normal((groups, 512, 256 * size), 512**-0.5)
        sizes = jnp.asarray(np.stack([np.bincount(rng.integers(0, groups, m), minlength=groups)
                                      for _ in range(size)]), jnp.int32)  # fmt: skip
        body = lambda a, b, s, sc: cg.all_gather_grouped_matmul(a, b, s[0], "x", config=cfg,  # noqa: E731
                                                                scaling=sc)  # fmt: skip
        specs, out_spec = (P("x"), P(None, None, "x"), P("x")), P(None, "x")
    elif op == "rs":
        x, w = normal((size * m, 256 * size)), normal((groups, 256 * size, 512), 512**-0.5)
        sizes = jnp.asarray(np.bincount(rng.integers(0, groups, size * m), minlength=groups),
                            jnp.int32)[None].repeat(size, 0)  # fmt: skip
        body = lambda a, b, s, sc: cg.grouped_matmul_reduce_scatter(  # noqa: E731
            a, b, s[0], "x", config=cfg, scaling=sc)  # fmt: skip
        specs, out_spec = (P(None, "x"), P(None, "x", None), P("x")), P("x")
    else:
        experts = groups * size
        x, w = normal((size * m, 512)), normal((experts, 512, 512), 512**-0.5)
        sizes = jnp.asarray(np.stack([np.bincount(rng.integers(0, experts, m), minlength=experts)
                                      for _ in range(size)]), jnp.int32)  # fmt: skip
        body = lambda a, b, s, sc: cg.all_to_all_grouped_matmul(  # noqa: E731
            a, b, s[0], "x", config=cfg, scaling=sc)[0]  # fmt: skip
        specs, out_spec = (P("x"), P("x"), P("x")), P("x")

    recipe = cg.ScalingRecipe(split_accumulator=(False, True, wgrad == "split"))

    def run(emulated: bool):
        f = jax.shard_map(lambda a, b, s: body(a, b, s, recipe), mesh=mesh,
                          in_specs=specs, out_specs=out_spec)  # fmt: skip
        loss = lambda a, b: jnp.sum(f(a, b, sizes).astype(jnp.float32) ** 2)  # noqa: E731
        with pytest.MonkeyPatch.context() as patch:
            if emulated:
                patch.setattr(scaling, "float8_experts", lambda *_: None)
            fwd = jax.jit(lambda a, b: f(a, b, sizes))
            text = fwd.lower(x, w).compile().as_text()
            grad = jax.jit(jax.grad(loss, (0, 1)))
            lowered = grad.lower(x, w)
            # dW's transposes: Triton calls on rows [1, M, C] (the experts' values: [G, K, N])
            triton = any("xla.gpu.triton" in ln and re.search(r": \(tensor<1x\d+x\d+xui8>\)", ln)
                         for ln in lowered.as_text().splitlines())  # fmt: skip
            lines = lowered.compile().as_text().splitlines()
            dx_calls = [ln for ln in lines if "custom-call" in ln and "mosaic" in ln
                        and "f8e5m2[" in ln and "f8e4m3fn[" in ln]  # fmt: skip
            return fwd(x, w), grad(x, w), text, dx_calls, triton

    out, grads, text, dx_calls, triton = run(False)
    want, want_grads, emulated_text, emulated_dx, _ = run(True)
    assert "f8e4m3fn" in text and "mosaic" in text
    assert dx_calls and not emulated_dx, (dx_calls, emulated_dx)
    assert triton == (wgrad == "fast")
    rel = float(jnp.abs(out.astype(jnp.float32) - want).max() / jnp.abs(want).max())
    assert rel < 2e-2, rel  # the kernel's fast accumulation and bf16 result
    for g, e in zip(grads, want_grads, strict=True):
        # dW's product follows the forward's result (the loss squares it): float8 noise
        err = float(jnp.abs(g.astype(jnp.float32) - e).max() / jnp.abs(e).max())
        assert err < 5e-2, err


@pytest.mark.skipif(jax.__version_info__ < (0, 11), reason="the float8 kernel needs jax >= 0.11")
def test_parallel_moe_delayed_float8():
    """`nnx.ParallelMoE` on every GPU of the machine under delayed scaling (dY's states too):
    its grouped GEMMs on commgemm's float8 kernel, forward and dX (f8e4m3fn and f8e5m2 operands
    of Mosaic GPU calls in the gradient's program); after two training steps every state has
    advanced, dY's written back from the gradients, and the output is within float8 rounding
    of the same block in bf16."""
    from flax import nnx
    from jax.sharding import NamedSharding

    from commgemm import nnx as cgnnx

    devices = jax.devices()
    size = len(devices)
    mesh = Mesh(np.array(devices), ("tp",))
    start = cg.ScalingState.create(history=4)
    recipe = cg.ScalingRecipe("delayed_tensor_scaling", x_state=start, w_state=start,
                              dy_state=start)  # fmt: skip

    def make(scaling):
        return cgnnx.create_sharded(
            lambda: cgnnx.ParallelMoE(512, 512, 2 * size, mesh=mesh, rngs=nnx.Rngs(0),
                                      config=cg.OverlapConfig(method="none"), scaling=scaling,
                                      dtype=jnp.bfloat16),
            mesh,
        )  # fmt: skip

    moe, bf16 = make(recipe), make(None)
    x = jax.random.normal(jax.random.key(1), (2, 256 * size, 512), jnp.bfloat16)
    x = jax.device_put(x, NamedSharding(mesh, P(None, "tp", None)))
    loss = lambda m, a: jnp.sum(m(a).astype(jnp.float32) ** 2)  # noqa: E731
    graphdef, state = nnx.split(moe)
    text = jax.jit(jax.grad(lambda s, a: loss(nnx.merge(graphdef, s), a)))
    lines = text.lower(state, x).compile().as_text().splitlines()
    calls = [ln for ln in lines if "custom-call" in ln and "mosaic" in ln]
    assert any("f8e5m2[" in ln for ln in calls) and any("f8e4m3fn[" in ln for ln in calls), calls
    diff = nnx.DiffState(0, (nnx.Param, cgnnx.Float8GradState))
    step = nnx.jit(nnx.grad(loss, argnums=diff))
    for _ in range(2):
        params = cgnnx.apply_float8_grads(moe, step(moe, x))
        assert all(bool(jnp.isfinite(p[...]).all()) for _, p in params.flat_state())
    run = nnx.jit(lambda m, a: m(a))
    out, want = run(moe, x).astype(jnp.float32), run(bf16, x).astype(jnp.float32)
    err = float(jnp.abs(out - want).max() / jnp.abs(want).max())
    assert err < 0.1, err  # two GEMMs' e4m3 operands (3.7e-2 each on the grouped ops)
    states, dy = moe.float8.get_value(), moe.float8_dy.get_value()
    for part in ("up", "down"):
        assert all(float(s.amax_history[0]) > 0 for s in states[part].values()), states[part]
        assert float(dy[part].amax_history[0]) > 0 and float(dy[part].amax_history[1]) > 0
