"""The collective grouped ops' float8 forward (`commgemm.grouped.blocks.block_matmul`): on a
Hopper GPU with tensor scaling each block of rows is multiplied as it travelled (its float8
payload) by the experts' float8 values [G, N, K] in commgemm's grouped kernel. Here the kernel
is replaced by a float32 product of the same float8 operands (the GPU tests run the kernel
itself), so the CPU checks the wiring: which payload, scales and group sizes each block's GEMM
gets, for every op and method, against the float64 product of the quantized operands; that the
gradients are the emulated path's; and that block modes and float32 results stay emulated."""

import dataclasses

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import P, dequantized, mesh1d, shard
from test_grouped import random_sizes, reference

import commgemm as cg
from commgemm.grouped import scaling
from commgemm.mosaic_gpu import grouped_kernel, grouped_pingpong

# the kernel's bf16 result against the float64 product: bf16 rounding (2^-8) of values summed
# over K = 128 products of float8 operands
TOL = 2e-2


class Calls(list):
    """The fake kernel's calls, (x shape, w shape, result dtype, x dtype) each, and the scales
    its calls on float8_e5m2 (dX's) were given, as each device saw them."""

    def __init__(self):
        super().__init__()
        self.dx_scales = []


@pytest.fixture
def kernel_calls(monkeypatch):
    """Hopper's float8 path on the CPU: the experts as the kernels read them (no Hopper check),
    and either grouped kernel a float32 ragged dot of its float8 operands; returns its
    `Calls`."""
    calls = Calls()

    def experts(recipe, qw, nk=None):
        if recipe.mode not in scaling.TENSOR_MODES:
            return None
        return scaling.Float8Experts.of(recipe, qw, nk)

    def kernel(x, w, sizes, tiles=None, *, w_nk, scale, out_dtype, split_accumulator=False):
        # the forward's x (e4m3) or dX's dY (e5m2) by the experts' e4m3 values
        assert w_nk and w.dtype == jnp.float8_e4m3fn and sizes.dtype == jnp.int32
        assert x.dtype in (jnp.float8_e4m3fn, jnp.float8_e5m2), x.dtype
        calls.append((x.shape, w.shape, jnp.dtype(out_dtype).name, x.dtype.name))
        if x.dtype == jnp.float8_e5m2:
            jax.debug.callback(lambda s: calls.dx_scales.append(float(s[0])), scale)
        wide = jnp.float32
        out = jax.lax.ragged_dot(x.astype(wide), jnp.swapaxes(w, 1, 2).astype(wide), sizes)
        return (out * scale[0]).astype(out_dtype)

    monkeypatch.setattr(scaling, "float8_experts", experts)
    monkeypatch.setattr(grouped_kernel, "grouped_matmul", kernel)  # both grouped kernels
    monkeypatch.setattr(grouped_pingpong, "grouped_matmul", kernel)
    return calls


def _dq(a, axis):
    return dequantized(a, "current_tensor_scaling", axis)


def _bf16(rng, shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)


def _config(method: str) -> cg.OverlapConfig:
    return cg.OverlapConfig(method=method, num_splits=2 if method == "pipeline" else 1)


def _grads(op, args, dy=None):
    """(the gradients of <op('current_tensor_scaling')(*args), dY>, dY) for a fixed random dY
    (op may also be `_emulated`'s)."""
    fn = op if getattr(op, "emulated", False) else op("current_tensor_scaling")
    out, vjp = jax.vjp(fn, *args)
    dy = jax.random.normal(jax.random.key(0), out.shape, out.dtype) if dy is None else dy
    grads = vjp(dy)
    jax.effects_barrier()
    return grads, dy


# dX from float8 dY and w on the kernel against dX from their bf16 dequantized values (the
# emulated backward): the same float8 values, each of the emulation's operands within 2^-9 of
# its exact value, both results rounded to bf16 (2^-8): a few bf16 steps of the largest value.
# A wrong scale for dY shows in the scales checked beside it.
DX_TOL = 2e-2


def _float8_backward(op, args, calls, blocks, dx_scale=None):
    """The float8 path's gradients against the emulated path's for one random dY: the backward
    multiplies dY (e5m2) on the kernel once for each of the forward's `blocks` GEMMs; dX (of
    args[0]) agrees within DX_TOL of its largest value, dW (the rest) equals the emulation's.
    dx_scale(dY): the scale each dX call must get (dY's tensor scale times the experts')."""
    calls.clear()
    calls.dx_scales.clear()
    (dx, *dws), dy = _grads(op, args)
    assert [c[3] for c in calls].count("float8_e5m2") == blocks, calls
    (ex, *ews), _ = _grads(_emulated(op), args, dy)
    scale = float(np.abs(np.float32(ex)).max())
    np.testing.assert_allclose(np.float32(dx), np.float32(ex), atol=DX_TOL * scale)
    _same_gradients(dws, ews)
    if dx_scale is not None:
        np.testing.assert_allclose(calls.dx_scales, float(dx_scale(dy)), rtol=1e-6)


def _current_scales(w):
    """dx_scale for current scaling: dY's global amax (e5m2) times the experts' w (e4m3)."""
    w_scale = cg.quantize(w, "current_tensor_scaling", axis=1).scale_inv
    return lambda dy: w_scale * cg.quantize(dy, "current_tensor_scaling",
                                            dtype=jnp.float8_e5m2).scale_inv  # fmt: skip


def _same_gradients(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.float32(g), np.float32(w), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("size", "method", "check_vma"),
    [(2, "none", True), (4, "pipeline", True), (4, "ring_exchange", True),
     (2, "ring_exchange", False)],
)  # fmt: skip
def test_all_gather_blocks(rng, kernel_calls, size, method, check_vma):
    m, groups = 256, 3
    x, w = _bf16(rng, (size * m, 128)), _bf16(rng, (groups, 128, 256 * size))
    sizes = jnp.asarray(np.stack([random_sizes(rng, groups, m) for _ in range(size)]))
    specs = (P("x"), P(None, None, "x"), P("x"))

    def op(mode):
        body = lambda a, b, s: cg.all_gather_grouped_matmul(  # noqa: E731
            a, b, s[0], "x", config=_config(method), scaling=mode)  # fmt: skip
        f = shard(body, mesh1d(size), specs, P(None, "x"), check_vma=check_vma)
        return lambda a, b: f(a, b, sizes)

    out = op("current_tensor_scaling")(x, w)
    # the ring multiplies each block as it arrives; the others every gathered block (of each
    # chunk) in one GEMM, regrouped (`grouped.blocks.merged_matmul`)
    calls = {"ring_exchange": size, "none": 1, "pipeline": 2}[method]
    assert len(kernel_calls) == calls, kernel_calls
    assert all(c[0][0] == m * size // calls for c in kernel_calls), kernel_calls
    qx, qw = _dq(np.float32(x), -1), _dq(np.float32(w), 1)
    want = np.concatenate([reference(qx[s * m : (s + 1) * m], qw, sizes[s]) for s in range(size)])
    np.testing.assert_allclose(np.float32(out), want, rtol=TOL, atol=TOL * np.abs(want).max())
    kernel_calls.clear()
    # block scaling has no Hopper tensor-core path: emulated, the kernel never called
    op("mxfp8_1d_scaling")(x, w)
    assert not kernel_calls
    _float8_backward(op, (x, w), kernel_calls, calls, _current_scales(w))
    if method == "ring_exchange":  # under remat: the same gradients, dX still on the kernel
        kernel_calls.clear()
        remat = _grads(lambda mode: jax.checkpoint(op(mode)), (x, w))[0]
        assert [c[3] for c in kernel_calls].count("float8_e5m2") == calls, kernel_calls
        _same_gradients(remat, _grads(op, (x, w))[0])


def _emulated(op):
    """op('current_tensor_scaling') with the block GEMMs emulated (no float8 experts)."""

    def run(*args):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(scaling, "float8_experts", lambda *_: None)
            return op("current_tensor_scaling")(*args)

    run.emulated = True
    return run


@pytest.mark.parametrize(("method", "check_vma"), [("ring_exchange", True), ("none", False)])
def test_fast_wgrad_blocks_take_the_float8_dw(rng, kernel_calls, monkeypatch, method, check_vma):
    """With a fast wgrad every block that multiplied on the float8 kernel takes its dW on the
    float8 dW kernel too (here a float32 product of its operands): the payload's e4m3 values
    and dY's e5m2 ones with their two scales; dW within DX_TOL of the emulated path's (the same
    float8 values, dequantized to bf16), dX as before."""
    from commgemm.mosaic_gpu import grouped_dw

    dw_calls = []

    def fake_dw(x, x_scale_inv, dy, dy_scale_inv, sizes, out_dtype=jnp.bfloat16, tiles=None):
        dw_calls.append((x.dtype.name, dy.dtype.name))
        ends = jnp.cumsum(sizes)
        rows = jnp.arange(x.shape[0])
        member = (rows >= (ends - sizes)[:, None]) & (rows < ends[:, None])  # [G, M]
        f32 = jnp.float32
        dw = jnp.einsum("gm,mk,mn->gkn", member.astype(f32), x.astype(f32), dy.astype(f32))
        return (dw * x_scale_inv * dy_scale_inv).astype(out_dtype)

    monkeypatch.setattr(grouped_dw, "float8_weight_grad", fake_dw)
    monkeypatch.setattr(grouped_dw, "FLOAT8_MIN_GROUP_ROWS", 1)
    size, m, groups = 2, 256, 3
    x, w = _bf16(rng, (size * m, 128)), _bf16(rng, (groups, 128, 256 * size))
    sizes = jnp.asarray(np.stack([random_sizes(rng, groups, m) for _ in range(size)]))
    fast = cg.ScalingRecipe(split_accumulator=(False, False, False))

    def op(mode):
        body = lambda a, b, s: cg.all_gather_grouped_matmul(  # noqa: E731
            a, b, s[0], "x", config=_config(method), scaling=mode)  # fmt: skip
        f = shard(body, mesh1d(size), (P("x"), P(None, None, "x"), P("x")), P(None, "x"),
                  check_vma=check_vma)  # fmt: skip
        return lambda a, b: f(a, b, sizes)

    (dx, dw), dy = _grads(lambda _: op(fast), (x, w))
    blocks = {"ring_exchange": size, "none": 1}[method]
    assert dw_calls == [("float8_e4m3fn", "float8_e5m2")] * blocks, dw_calls
    (ex, ew), _ = _grads(_emulated(op), (x, w), dy)
    for got, want in ((dx, ex), (dw, ew)):
        scale = float(np.abs(np.float32(want)).max())
        np.testing.assert_allclose(np.float32(got), np.float32(want), atol=DX_TOL * scale)


@pytest.mark.parametrize(
    ("method", "reduce_dtype"),
    [("none", None), ("pipeline", None), ("ring_exchange", "float32")],
)
def test_reduce_scatter_blocks(rng, kernel_calls, method, reduce_dtype):
    size, rows, groups = 2, 1024, 4
    x, w = _bf16(rng, (rows, 128 * size)), _bf16(rng, (groups, 128 * size, 256))
    sizes = jnp.asarray(random_sizes(rng, groups, rows))
    cfg = _config(method).replace(reduce_dtype=reduce_dtype)

    def op(mode):
        body = lambda a, b: cg.grouped_matmul_reduce_scatter(  # noqa: E731
            a, b, sizes, "x", config=cfg, scaling=mode)  # fmt: skip
        return shard(body, mesh1d(size), (P(None, "x"), P(None, "x", None)), P("x"))

    out = op("current_tensor_scaling")(x, w)
    # the ring's partial sums of 512-row blocks, one GEMM over x (none) or over each chunk's
    # rows, regrouped (pipeline); a float32 reduce asks the kernel for float32: emulated
    calls = {"ring_exchange": size, "none": 1, "pipeline": 2}[method]
    assert len(kernel_calls) == (0 if reduce_dtype else calls), kernel_calls
    want = reference(_dq(np.float32(x), -1), _dq(np.float32(w), 1), sizes)
    np.testing.assert_allclose(np.float32(out), want, rtol=TOL, atol=TOL * np.abs(want).max())
    if reduce_dtype is None:
        _float8_backward(op, (x, w), kernel_calls, calls, _current_scales(w))
    else:  # emulated both ways
        kernel_calls.clear()
        _same_gradients(_grads(op, (x, w))[0], _grads(_emulated(op), (x, w))[0])
        assert not kernel_calls


@pytest.mark.parametrize(("method", "mlp", "ffn"), [
    ("none", False, 256), ("ring_exchange", False, 256), ("none", True, 256),
    ("ring_exchange", True, 256), ("none", True, 384), ("ring_exchange", False, 384)])  # fmt: skip
def test_expert_parallel_blocks(rng, kernel_calls, method, mlp, ffn):
    """Dispatch, experts, return: both ways' GEMMs on the kernel, as two ops or as
    `expert_mlp` (NONE: the tokens regrouped once, from the first GEMM to the second); also
    with ffn = 384, three 128-column tiles (the ping-pong kernel's, where the row-aligned
    kernel's 256-column tiles do not fit)."""
    from commgemm.grouped.expert_parallel import expert_mlp

    size, m, per_shard = 2, 256, 2
    experts = size * per_shard
    x = _bf16(rng, (size * m, 128))
    w1, w2 = _bf16(rng, (experts, 128, ffn)), _bf16(rng, (experts, ffn, 128 * 2))
    tokens = [rng.integers(0, experts, size=m) for _ in range(size)]
    sizes = np.stack([np.bincount(t, minlength=experts) for t in tokens]).astype(np.int32)
    cfg = _config(method)

    def op(mode):
        def body(a, b, c, g):
            if mlp:
                return expert_mlp(a, b, c, g[0], "x", activation=lambda v: v, config=cfg,
                                  scaling=mode)[0]  # fmt: skip
            y, got = cg.all_to_all_grouped_matmul(a, b, g[0], "x", config=cfg, scaling=mode)
            return cg.grouped_matmul_all_to_all(y, c, got, g[0], "x", config=cfg, scaling=mode)

        f = shard(body, mesh1d(size), (P("x"), P("x"), P("x"), P("x")), P("x"))
        return lambda a, b, c: f(a, b, c, sizes)

    out = op("current_tensor_scaling")(x, w1, w2)
    # the ring: each block's GEMMs; none: one GEMM over every block, each way
    assert len(kernel_calls) == 2 * (size if method == "ring_exchange" else 1), kernel_calls
    qx, q1, q2 = _dq(np.float32(x), -1), _dq(np.float32(w1), 1), _dq(np.float32(w2), 1)
    hidden = np.concatenate([reference(qx[s * m : (s + 1) * m], q1, sizes[s]) for s in range(size)])
    # the second op quantizes the bf16 hidden activation, all shards sharing a scale
    qh = _dq(np.float32(jnp.asarray(hidden, jnp.bfloat16)), -1)
    want = np.concatenate([reference(qh[s * m : (s + 1) * m], q2, sizes[s]) for s in range(size)])
    np.testing.assert_allclose(np.float32(out), want, rtol=TOL, atol=TOL * np.abs(want).max())
    kernel_calls.clear()
    kernel_calls.dx_scales.clear()
    (dx, dw1, dw2), dy = _grads(op, (x, w1, w2))
    # each way's dX on the kernel too, one call a forward GEMM; the return's (half of them) by
    # the test's dY's scale
    blocks = 2 * (size if method == "ring_exchange" else 1)
    assert [c[3] for c in kernel_calls].count("float8_e5m2") == blocks, kernel_calls
    returned = np.isclose(kernel_calls.dx_scales, float(_current_scales(w2)(dy)), rtol=1e-6)
    assert 2 * returned.sum() == len(kernel_calls.dx_scales) > 0, kernel_calls.dx_scales
    (ex, ew1, ew2), _ = _grads(_emulated(op), (x, w1, w2), dy)
    # the dispatch's dY is the return's dX, quantized again: where the float8 and the emulated
    # dX differ in their last bits, its float8 rounding flips a step (e5m2: 12.5%) now and
    # then, and so through dX and dW1; dW2 multiplies the hidden activation quantized again,
    # whose rounding follows the first GEMM's last bits alike
    for got, want in ((dx, ex), (dw1, ew1), (dw2, ew2)):
        scale = np.abs(np.float32(want)).max()
        np.testing.assert_allclose(np.float32(got), np.float32(want), atol=0.1 * scale)


def test_delayed_scaling_blocks(rng, kernel_calls):
    """Delayed tensor scaling (the scales from the recipe's states) takes the float8 blocks
    too: the all-gather ring's result and gradients against its emulated blocks, the same
    quantized values."""
    size, m, groups = 2, 256, 3
    x, w = _bf16(rng, (size * m, 128)), _bf16(rng, (groups, 128, 256 * size))
    sizes = jnp.asarray(np.stack([random_sizes(rng, groups, m) for _ in range(size)]))
    state = cg.ScalingState.create()
    state = jax.tree.map(lambda a: a + 4.0 if a.dtype == jnp.float32 else a, state)  # amax 4
    recipe = cg.ScalingRecipe(
        "delayed_tensor_scaling", x_state=state, w_state=state, dy_state=state
    )

    def op(mode):
        body = lambda a, b, s: cg.all_gather_grouped_matmul(  # noqa: E731
            a, b, s[0], "x", config=_config("ring_exchange"), scaling=recipe)  # fmt: skip
        f = shard(body, mesh1d(size), (P("x"), P(None, None, "x"), P("x")), P(None, "x"))
        return lambda a, b: f(a, b, sizes)

    out = op(None)(x, w)
    assert len(kernel_calls) == size, kernel_calls
    want = _emulated(op)(x, w)
    scale = float(jnp.abs(want.astype(jnp.float32)).max())
    np.testing.assert_allclose(np.float32(out), np.float32(want), atol=TOL * scale)
    # the backward: dY quantized by dy_state's scale (5), w by w_state's (5)
    _float8_backward(op, (x, w), kernel_calls, size, lambda dy: 1 / 25)


@pytest.mark.parametrize(
    ("op", "method", "check_vma"),
    [("ag", "ring_exchange", True), ("ag", "none", True), ("rs", "none", True),
     ("dispatch", "ring_exchange", True), ("ag", "ring_exchange", False)],
)  # fmt: skip
def test_kept_transposed_experts(rng, kernel_calls, op, method, check_vma):
    """A `QuantizedWeight` whose float8 values are kept transposed (`keep_transposed=True`):
    the forward's kernel reads that copy (marked here by negating it, which negates the result
    exactly, while dX, which reads the values as quantized, is unchanged); unmarked, results
    and gradients equal the op quantizing w itself."""
    size, m, groups, mode = 2, 256, 4, "current_tensor_scaling"
    cfg = _config(method)
    if op == "rs":
        x, w = _bf16(rng, (m, 128 * size)), _bf16(rng, (groups, 128 * size, 256))
        sizes = np.tile(random_sizes(rng, groups, m), (size, 1))
        specs, out_spec = (P(None, "x"), P(None, "x", None), P("x")), P("x")
    else:
        x, w = _bf16(rng, (size * m, 128)), _bf16(rng, (groups, 128, 256 * size))
        if op == "dispatch":  # 2 of the 4 experts on each device
            tokens = [rng.integers(0, groups, size=m) for _ in range(size)]
            sizes = np.stack([np.bincount(t, minlength=groups) for t in tokens])
            specs, out_spec = (P("x"), P("x"), P("x")), P("x")
        else:
            sizes = np.stack([random_sizes(rng, groups, m) for _ in range(size)])
            specs, out_spec = (P("x"), P(None, None, "x"), P("x")), P(None, "x")
    call = {"ag": cg.all_gather_grouped_matmul, "rs": cg.grouped_matmul_reduce_scatter,
            "dispatch": lambda *a, **kw: cg.all_to_all_grouped_matmul(*a, **kw)[0]}[op]  # fmt: skip

    def run(how):
        def body(a, b, s):
            if how != "per call":
                b = cg.quantize_weight(b, mode, axis=1, axis_name="x", keep_transposed=True)
                if how == "marked":
                    b = dataclasses.replace(b, transposed=-b.transposed)
            return call(a, b, s[0], "x", config=cfg, scaling=mode)

        f = shard(body, mesh1d(size), specs, out_spec, check_vma=check_vma)
        return lambda a, b: f(a, b, jnp.asarray(sizes, jnp.int32))

    kernel_calls.clear()
    out = run("kept")(x, w)
    assert kernel_calls, "the blocks ran emulated"
    np.testing.assert_array_equal(np.float32(out), np.float32(run("per call")(x, w)))
    np.testing.assert_array_equal(np.float32(run("marked")(x, w)), -np.float32(out))
    kept, dy = _grads(lambda _: run("kept"), (x, w))
    _same_gradients(kept, _grads(lambda _: run("per call"), (x, w), dy)[0])
    marked = _grads(lambda _: run("marked"), (x, w), dy)[0]
    _same_gradients(marked[0], kept[0])  # dX reads the experts as quantized


def test_auto_runs_none_on_the_float8_kernel(rng, kernel_calls):
    """AUTO's all-gather on two devices runs the ring on 16-bit blocks but NONE, one regrouped
    GEMM, where the blocks multiply on the float8 kernel (faster there:
    `plan.GROUPED_AUTO_RING_SIZES`)."""
    size, m, groups = 2, 256, 3
    x, w = _bf16(rng, (size * m, 128)), _bf16(rng, (groups, 128, 256 * size))
    sizes = jnp.asarray(np.stack([random_sizes(rng, groups, m) for _ in range(size)]))
    auto = cg.OverlapConfig(method="auto")
    body = lambda a, b, s: cg.all_gather_grouped_matmul(  # noqa: E731
        a, b, s[0], "x", config=auto, scaling="current_tensor_scaling")  # fmt: skip
    out = shard(body, mesh1d(size), (P("x"), P(None, None, "x"), P("x")), P(None, "x"))(x, w, sizes)
    assert len(kernel_calls) == 1 and kernel_calls[0][0][0] == size * m, kernel_calls
    qx, qw = _dq(np.float32(x), -1), _dq(np.float32(w), 1)
    want = np.concatenate([reference(qx[s * m : (s + 1) * m], qw, sizes[s]) for s in range(size)])
    np.testing.assert_allclose(np.float32(out), want, rtol=TOL, atol=TOL * np.abs(want).max())


@pytest.mark.parametrize("method", ["ring_exchange", "none"])
def test_moe_block_with_experts_quantized_once(rng, kernel_calls, method):
    """The MoE block's function (`commgemm.nnx.moe_per_shard`) on experts quantized before the
    call and kept transposed (`cg.quantize_weight(..., keep_transposed=True)`, as for serving):
    both grouped GEMMs on the kernel, the same result as the block quantizing them itself."""
    pytest.importorskip("flax")
    from commgemm.nnx import moe_per_shard

    size, m, hidden, ffn, experts, mode = 2, 128, 256, 256, 4, "current_tensor_scaling"
    x = _bf16(rng, (size * m, hidden))
    router = _bf16(rng, (hidden, experts))
    w1, w2 = _bf16(rng, (experts, hidden, ffn)), _bf16(rng, (experts, ffn, hidden))
    cfg = _config(method)

    def run(before: bool):
        def body(a, r, b, c):
            if before:
                b, c = (cg.quantize_weight(v, mode, axis=1, axis_name="x", keep_transposed=True)
                        for v in (b, c))  # fmt: skip
            return moe_per_shard(a, r, b, c, k=2, axis_name="x", config=cfg, scaling=mode)

        f = shard(body, mesh1d(size), (P("x"), P(), P("x"), P("x")), P("x"))
        return np.float32(f(x, router, w1, w2))

    kernel_calls.clear()
    once = run(True)
    # each way's blocks on the kernel (ring), or one merged GEMM each way (none)
    assert len(kernel_calls) == 2 * (size if method == "ring_exchange" else 1), kernel_calls
    np.testing.assert_array_equal(once, run(False))


def test_moe_block_capacity_on_the_kernel(rng, kernel_calls):
    """The capped MoE block in FP8 (capacity factor 0.5: 128 tokens a shard, top 2 of 4
    experts, 32 copies an expert, 64 rows a shard pair): both grouped GEMMs on the float8
    kernel over the P*64 capped rows, not P*256, and the result equals the block's with the
    GEMMs emulated (within e4m3's rounding)."""
    from commgemm.grouped.moe import moe_per_shard

    size, m, hidden, ffn, experts = 2, 128, 256, 256, 4
    x = _bf16(rng, (size * m, hidden))
    router = _bf16(rng, (hidden, experts))
    w1, w2 = _bf16(rng, (experts, hidden, ffn)), _bf16(rng, (experts, ffn, hidden))

    def op(mode):
        body = lambda a, r, b, c: moe_per_shard(a, r, b, c, k=2, axis_name="x",  # noqa: E731
                                                config=_config("none"), scaling=mode,
                                                capacity_factor=0.5)  # fmt: skip
        return shard(body, mesh1d(size), (P("x"), P(), P("x"), P("x")), P("x"))

    out = np.float32(op("current_tensor_scaling")(x, router, w1, w2))
    assert [c[0][0] for c in kernel_calls] == [size * 64, size * 64], kernel_calls
    want = np.float32(_emulated(op)(x, router, w1, w2))
    # the hidden activation's e4m3 rounding follows the up GEMM's last bits: a few elements
    # a step apart (up to 4% of the largest output)
    np.testing.assert_allclose(out, want, rtol=TOL, atol=0.05 * np.abs(want).max())


@pytest.mark.parametrize("check_vma", [True, False])
def test_whole_block_quantizes_dy_once(rng, kernel_calls, check_vma):
    """A block that is the op's whole result (`whole_block_matmul`, the MoE block's NONE path)
    quantizes dY in its own backward, by dY's amax over the mesh axis: the result and the
    gradients equal those of the op-wide form (`with_quantized_cotangent` handing dY's scale to
    the block, which quantizes the dequantized dY again), with one float8 cast of dY in the
    backward where the op-wide form has two."""
    from commgemm.grouped.blocks import block_matmul, whole_block_matmul

    size, m, per_shard = 2, 256, 3
    x = _bf16(rng, (size * m, 128))
    w = _bf16(rng, (size * per_shard, 128, 384))
    sizes = jnp.asarray(np.stack([random_sizes(rng, per_shard, m) for _ in range(size)]))
    recipe = cg.ScalingRecipe("current_tensor_scaling")

    def op(whole):
        def body(a, b, s):
            a, b, r, rows, experts = scaling.quantized_operands(a, b, recipe, "x")
            if whole:
                return whole_block_matmul(a, b, s[0], rows, experts, r, "x")
            out = block_matmul(a, b, s[0], rows, experts)
            return scaling.with_quantized_cotangent(out, r, "x", experts)

        f = shard(body, mesh1d(size), (P("x"), P("x"), P("x")), P("x"), check_vma=check_vma)
        return lambda a, b: f(a, b, sizes)

    dy = jax.random.normal(jax.random.key(1), (size * m, 384), jnp.bfloat16)
    got, want = (jax.vjp(op(whole), x, w) for whole in (True, False))
    np.testing.assert_array_equal(np.float32(got[0]), np.float32(want[0]))
    kernel_calls.dx_scales.clear()
    _same_gradients(got[1](dy), want[1](dy))
    jax.effects_barrier()
    # dX's scale: dY's amax over both shards (each shard's call), the same in both forms
    np.testing.assert_allclose(kernel_calls.dx_scales, float(_current_scales(w)(dy)), rtol=1e-6)

    def casts(whole):
        grad = jax.grad(lambda a, b: jnp.sum(op(whole)(a, b).astype(jnp.float32) * dy), (0, 1))
        return str(jax.make_jaxpr(grad)(x, w)).count("new_dtype=float8_e5m2")

    assert casts(True) == 1 and casts(False) == 2, (casts(True), casts(False))


@pytest.mark.parametrize(
    ("mode", "method", "on_kernel", "check_vma"),
    [("current_tensor_scaling", "none", True, True),
     ("current_tensor_scaling", "none", False, False),
     ("current_tensor_scaling", "ring_exchange", True, True),
     ("delayed_tensor_scaling", "none", True, True)],
)  # fmt: skip
def test_moe_block_quantizes_each_token_once(rng, request, mode, method, on_kernel, check_vma):
    """The MoE block quantizes its m tokens [m, H] once, not their m*k copies
    (`grouped.scaling.copied_rows`): its result and every gradient equal the block's that
    quantizes the copies (the copies' amax is the tokens'; each copy's float8 values are its
    token's), on the float8 kernel and emulated, and the only float8 cast of an [m*k, H]
    operand left is none: the forward's one cast of x is of [m, H]."""
    from commgemm.grouped import moe

    if on_kernel:
        request.getfixturevalue("kernel_calls")
    size, m, hidden, ffn, experts, k = 2, 64, 128, 256, 4, 2
    x = _bf16(rng, (size * m, hidden))
    router = _bf16(rng, (hidden, experts))
    w1, w2 = _bf16(rng, (experts, hidden, ffn)), _bf16(rng, (experts, ffn, hidden))
    recipe = mode
    if mode == "delayed_tensor_scaling":  # amax 4 in the history
        state = cg.ScalingState.create()
        state = jax.tree.map(lambda a: a + 4.0 if a.dtype == jnp.float32 else a, state)
        recipe = cg.ScalingRecipe(mode, x_state=state, w_state=state)

    def run():  # fresh functions: jax caches traces by function
        def op(a, r, b, c):
            body = lambda *v: moe.moe_per_shard(*v, k=k, axis_name="x",  # noqa: E731
                                                config=_config(method), scaling=recipe)  # fmt: skip
            specs = (P("x"), P(), P("x"), P("x"))
            return shard(body, mesh1d(size), specs, P("x"), check_vma=check_vma)(a, r, b, c)

        def loss(*v):
            return jnp.sum(jnp.square(op(*v).astype(jnp.float32)))

        args = (x, router, w1, w2)
        return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(*args), _e4m3_cast_rows(op, args)

    got, casts = run()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(moe, "copied_rows", lambda *a, **kw: None)  # the copies quantized
        want, copies_casts = run()
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.float32(g), np.float32(w))
    # per shard: m tokens, m*k copies, the activations' P*m*k rows
    assert m * k in copies_casts and m not in copies_casts, copies_casts
    assert casts == [m if r == m * k else r for r in copies_casts], (casts, copies_casts)


def _e4m3_cast_rows(fn, args) -> list[int]:
    """The leading sizes of the operands fn's jaxpr (nested ones included) casts to e4m3."""
    found = []

    def walk(jaxpr):
        for e in jaxpr.eqns:
            if (
                e.primitive.name == "convert_element_type"
                and e.params["new_dtype"] == jnp.float8_e4m3fn
                and e.invars[0].aval.ndim == 2
            ):
                found.append(e.invars[0].aval.shape[0])
            for sub in jax.extend.core.jaxprs_in_params(e.params):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found
