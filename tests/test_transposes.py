"""The float8 operands' transposes (`mosaic_gpu.transposes`), off the GPU: the Pallas Triton
kernels interpreted against numpy's transpose and `quant.quantize` bit for bit, their checks,
and where the float8 GEMMs' operands lower to them for a CUDA target (the experts' and dense
weights' values, quantized and transposed in one kernel; dW's rows). tests/gpu/ checks the
kernels they feed on Hopper."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import mesh1d, shard
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import commgemm as cg
from commgemm import operand_scaling
from commgemm.mosaic_gpu import tiles as mosaic_tiles
from commgemm.mosaic_gpu import transposes

pytest.importorskip("jax.experimental.pallas.triton")

F8 = jnp.float8_e4m3fn


def _bytes(shape, dtype, rng):
    bits = rng.integers(0, 256, size=shape, dtype=np.uint8)
    return bits, jax.lax.bitcast_convert_type(jnp.asarray(bits), dtype)


def _triton_calls(fn, *args) -> int:
    lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    return sum("xla.gpu.triton" in line for line in lowered.splitlines())


@settings(max_examples=12, deadline=None)
@given(
    lead=st.sampled_from([(), (3,), (2, 2)]),
    m=st.integers(1, 400),
    c=st.sampled_from([128, 384]),
    dtype=st.sampled_from([jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.uint8]),
    extra=st.integers(0, 1),
)
def test_triton_transposed_matches_numpy(lead, m, c, dtype, extra):
    """The kernel (interpreted here) swaps the last two axes of any 1-byte [..., M, C] bit for
    bit, zeros past M up to `cols` (M rounded up to 128, or a tile more)."""
    bits, q = _bytes((*lead, m, c), dtype, np.random.default_rng())
    cols = (-(-m // 128) + extra) * 128
    got = transposes.triton_transposed(q, cols, interpret=True)
    assert got.shape == (*lead, c, cols) and got.dtype == dtype
    want = np.zeros((*lead, c, cols), np.uint8)
    want[..., :m] = np.swapaxes(bits, -1, -2)
    np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(got, jnp.uint8)), want)


def test_triton_transposed_refuses_bad_operands():
    """2-byte values, columns not whole 128s, too few or ragged output columns, a vector:
    ValueError."""
    q = jnp.zeros((200, 256), F8)
    bad = ((q.astype(jnp.bfloat16), 256), (q[:, :200], 256), (q, 128), (q, 300), (q[0], 256))
    for operand, cols in bad:
        with pytest.raises(ValueError, match="must be 1-byte"):
            transposes.triton_transposed(operand, cols)


def test_padded_rows_transposed_pads_to_whole_128s():
    """dW's operands: q [M, C] transposed, zeros past M up to a multiple of 128; exact."""
    rng = np.random.default_rng()
    for m in (128, 37, 1000):
        q = jnp.asarray(rng.normal(size=(m, 5)), F8)
        got = np.asarray(transposes.padded_rows_transposed(q).astype(jnp.float32))
        assert got.shape == (5, -(-m // 128) * 128)
        np.testing.assert_array_equal(got[:, :m], np.asarray(q.astype(jnp.float32)).T)
        assert not got[:, m:].any()


@pytest.mark.parametrize("shape", [(4, 256, 384), (256, 128), (3, 5, 8), (0, 128, 128)])
def test_swapped_is_swapaxes(shape):
    """`swapped` evaluated here (XLA's transpose) equals np.swapaxes of the last two axes."""
    bits, q = _bytes(shape, F8, np.random.default_rng())
    got = jax.jit(transposes.swapped)(q)
    got = np.asarray(jax.lax.bitcast_convert_type(got, jnp.uint8))
    np.testing.assert_array_equal(got, np.swapaxes(bits, -1, -2))


def test_transposes_are_triton_kernels_on_cuda():
    """Lowered for CUDA: one Pallas Triton call (opaque to XLA's fusion) for 1-byte operands
    with whole 128s (M and C for `swapped`, C for the padded rows), XLA's transpose otherwise."""
    sds = jax.ShapeDtypeStruct
    assert _triton_calls(transposes.padded_rows_transposed, sds((1000, 256), F8)) == 1
    assert _triton_calls(transposes.padded_rows_transposed, sds((1000, 200), F8)) == 0
    for shape, calls in (
        ((4, 256, 384), 1),
        ((256, 384), 1),
        ((4, 256, 200), 0),
        ((4, 200, 256), 0),
    ):
        assert _triton_calls(transposes.swapped, sds(shape, F8)) == calls, shape
    assert _triton_calls(transposes.swapped, sds((256, 384), jnp.bfloat16)) == 0


def _specials(shape, rng, dtype=jnp.bfloat16):
    """Normal values over twelve decades (float8's subnormals, saturation after scaling) with
    a few infinities and NaNs."""
    x = rng.standard_normal(shape) * 10.0 ** rng.integers(-8, 4, size=shape)
    flat = x.reshape(-1)
    flat[rng.integers(0, flat.size, size=3)] = [np.inf, -np.inf, np.nan]
    return jnp.asarray(x, dtype)


def _same_float8(a, b):
    """Bit for bit, NaNs (whatever their payload) equal."""
    a32, b32 = np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32))
    np.testing.assert_array_equal(np.isnan(a32), np.isnan(b32))
    np.testing.assert_array_equal(
        np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8))[~np.isnan(a32)],
        np.asarray(jax.lax.bitcast_convert_type(b, jnp.uint8))[~np.isnan(b32)],
    )


@settings(max_examples=6, deadline=None)
@given(
    lead=st.sampled_from([(), (3,), (2, 2)]),
    m=st.sampled_from([128, 256]),
    c=st.sampled_from([128, 384]),
    dtype=st.sampled_from([jnp.float8_e4m3fn, jnp.float8_e5m2]),
    wide=st.sampled_from([jnp.bfloat16, jnp.float16]),
    scale=st.floats(1e-3, 1e3),
)
def test_triton_quantized_swapped_is_quantize(lead, m, c, dtype, wide, scale):
    """The kernel (interpreted here) writes `quant.quantize`'s float8 values of a 16-bit x by
    a given tensor scale, bit for bit (subnormals, saturation, infinities and NaNs included),
    and the same values with the last two axes swapped."""
    x = _specials((*lead, m, c), np.random.default_rng(), wide)
    scale = jnp.float32(scale)
    q, t = transposes.triton_quantized_swapped(x, scale, dtype, interpret=True)
    want = cg.quantize(x, "delayed_tensor_scaling", dtype=dtype, state=_state(scale))[0].data
    assert q.shape == x.shape and t.shape == (*lead, c, m) and q.dtype == t.dtype == dtype
    _same_float8(q, want)
    _same_float8(t, jnp.swapaxes(want, -1, -2))


def _state(scale):
    """A delayed-scaling state whose scale is `scale`."""
    state = cg.ScalingState.create()
    return dataclasses.replace(state, scale=jnp.asarray(scale, jnp.float32))


def test_triton_quantized_swapped_refuses_bad_operands():
    """float32 or float8 x, sides not whole 128s, a vector, a scale of several numbers, a
    16-bit target: ValueError."""
    x, one = jnp.zeros((256, 128), jnp.bfloat16), jnp.float32(1)
    bad = (
        (x.astype(jnp.float32), one, F8),
        (x.astype(F8), one, F8),
        (x[:200], one, F8),
        (x[:, :64], one, F8),
        (x[0], one, F8),
        (x, jnp.ones(2, jnp.float32), F8),
        (x, one, jnp.bfloat16),
    )
    for operand, scale, dtype in bad:
        with pytest.raises(ValueError, match="must be 16-bit"):
            transposes.triton_quantized_swapped(operand, scale, dtype)


@pytest.mark.parametrize("shape", [(4, 256, 384), (256, 128), (3, 5, 8), (1, 200, 256)])
def test_quantized_swapped_off_the_gpu(shape):
    """`quantized_swapped` evaluated here (XLA): quantize's values and their swapaxes, for any
    shape (the kernel's or not)."""
    x, scale = _specials(shape, np.random.default_rng()), jnp.float32(0.37)
    q, t = jax.jit(transposes.quantized_swapped, static_argnums=2)(x, scale, F8)
    want = cg.quantize(x, "delayed_tensor_scaling", dtype=F8, state=_state(scale))[0].data
    _same_float8(q, want)
    _same_float8(t, jnp.swapaxes(want, -1, -2))


@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_kept_transposed_weight_is_the_kernels(recipe):
    """`cg.quantize_weight(..., keep_transposed=True)`: its values and [N, K] copy by one
    kernel on CUDA (reading the 16-bit weight), here quantize's values (the same as without
    the copy, current and delayed scaling) and those transposed exactly."""
    w = jnp.asarray(np.random.default_rng().normal(size=(256, 384)), jnp.bfloat16)
    state = cg.ScalingState.create().update(jnp.float32(3.0), jnp.float8_e4m3fn)
    scaling = (
        cg.ScalingRecipe(mode="delayed_tensor_scaling", x_state=state, w_state=state)
        if recipe == "delayed"
        else "current_tensor_scaling"
    )
    qw = cg.quantize_weight(w, scaling, keep_transposed=True)
    plain = cg.quantize_weight(w, scaling)
    _same_float8(qw.quantized.data, plain.quantized.data)
    np.testing.assert_array_equal(qw.quantized.scale_inv, plain.quantized.scale_inv)
    _same_float8(qw.transposed, qw.quantized.data.T)

    def keep(w):
        return cg.quantize_weight(w, scaling, keep_transposed=True).transposed

    text = jax.jit(keep).trace(w).lower(lowering_platforms=("cuda",)).as_text()
    calls = [ln for ln in text.splitlines() if "xla.gpu.triton" in ln]
    assert len(calls) == 1 and "x256x384xbf16>) ->" in calls[0], calls


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "no-vma"])
def test_grouped_float8_forward_reads_the_kernels_weights(check_vma, monkeypatch):
    """The grouped op's float8 forward on Hopper, inside shard_map under check_vma on and off:
    the experts' float8 values in both layouts come from one kernel (a Triton call taking the
    16-bit [G, K, N] weights, writing [G, K, N] and [G, N, K] bytes), and the program lowers."""
    monkeypatch.setattr(mosaic_tiles, "hopper_reason", lambda: None)
    monkeypatch.setattr(mosaic_tiles, "num_sms", lambda: 132)

    def body(x, w, sizes):
        return cg.grouped_matmul(x, w, sizes, scaling="current_tensor_scaling")

    f = shard(body, mesh1d(2), (P("x"), P(), P()), P("x"), check_vma=check_vma)
    sds = jax.ShapeDtypeStruct
    args = (sds((1024, 256), jnp.bfloat16), sds((4, 256, 384), jnp.bfloat16), sds((4,), jnp.int32))
    text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    triton = [ln for ln in text.splitlines() if "xla.gpu.triton" in ln]
    types = (
        "(tensor<1xf32>, tensor<4x256x384xbf16>) -> (tensor<4x256x384xui8>, tensor<4x384x256xui8>)"
    )
    assert [ln for ln in triton if types in ln], triton


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "no-vma"])
@pytest.mark.parametrize("w_transposed", [False, True])
def test_dense_float8_weight_quantized_in_one_kernel(w_transposed, check_vma):
    """A dense op's float8 forward lowered for CUDA inside shard_map: w [K, n] quantized and
    transposed to [n, K] (what the forward reads) in one Triton call reading the 16-bit
    weight; w [n, K] (w_transposed) is read as quantized, no Triton call."""

    def body(x, w):
        return cg.all_gather_matmul(
            x, w, "x", scaling="current_tensor_scaling", w_transposed=w_transposed
        )

    f = shard(body, mesh1d(2), (P("x"), P()), P("x"), check_vma=check_vma)
    sds = jax.ShapeDtypeStruct
    w = sds((384, 256) if w_transposed else (256, 384), jnp.bfloat16)
    text = f.trace(sds((512, 256), jnp.bfloat16), w).lower(lowering_platforms=("cuda",)).as_text()
    calls = [ln for ln in text.splitlines() if "xla.gpu.triton" in ln]
    if w_transposed:
        assert not calls, calls
    else:
        assert len(calls) == 1 and "x256x384xbf16>) ->" in calls[0], calls


def _delayed(grad_dtype="float8_e5m2"):
    """A delayed recipe with every state (dY's too)."""
    start = cg.ScalingState.create(history=4)
    return cg.ScalingRecipe(
        "delayed_tensor_scaling", grad_dtype=grad_dtype, x_state=start, w_state=start,
        dy_state=start,
    )  # fmt: skip


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "no-vma"])
def test_gradient_through_a_delayed_recipe(check_vma, monkeypatch):
    """jax.grad of a loss with respect to a delayed recipe (every state) and w: the dense op
    (w [K, n], quantized in one pass with its transposed values) runs here and gives the
    gradients of the same program quantizing w alone (values equal); the grouped op lowers
    for a Hopper GPU (its experts by the kernel, which has no derivative rule: no gradient
    may reach it)."""
    rng = np.random.default_rng()
    x = jnp.asarray(rng.standard_normal((256, 256)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((256, 384)) / 16, jnp.bfloat16)

    def dense(recipe, x, w):
        out = cg.all_gather_matmul(x, w, "x", scaling=recipe)
        return jax.lax.psum(jnp.sum(out.astype(jnp.float32) ** 2), "x")

    f = jax.shard_map(dense, mesh=mesh1d(2), in_specs=(P(), P("x"), P()), out_specs=P(),
                      check_vma=check_vma)  # fmt: skip
    got = jax.jit(jax.grad(f, argnums=(0, 2)))(_delayed(), x, w)

    def one_layout(a, scale, dtype):
        return cg.quantize(a, "delayed_tensor_scaling", dtype=dtype, state=_state(scale))[
            0
        ].data, None

    monkeypatch.setattr(operand_scaling, "quantized_swapped", one_layout)
    want = jax.jit(jax.grad(f, argnums=(0, 2)))(_delayed(), x, w)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    monkeypatch.undo()

    monkeypatch.setattr(mosaic_tiles, "hopper_reason", lambda: None)
    monkeypatch.setattr(mosaic_tiles, "num_sms", lambda: 132)

    def grouped(recipe, x, w, sizes):
        out = cg.grouped_matmul(x, w, sizes, scaling=recipe)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    sds = jax.ShapeDtypeStruct
    args = (sds((1024, 256), jnp.bfloat16), sds((4, 256, 384), jnp.bfloat16), sds((4,), jnp.int32))
    text = (
        jax.jit(jax.grad(grouped, argnums=(0, 2)))
        .trace(_delayed("float8_e4m3fn"), *args)  # jax 0.10 lowers no e5m2 x e4m3 wgmma
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )
    assert "tensor<4x256x384xbf16>) -> (tensor<4x256x384xui8>" in text


@pytest.mark.parametrize(
    "platform, capability, kernel",
    [("gpu", "8.0", False), ("gpu", "8.6", False), ("gpu", "8.9", True), ("gpu", "9.0", True),
     ("gpu", "10.0", True), ("cpu", None, True)],
)  # fmt: skip
def test_quantized_swapped_only_where_kernels_cast_float8(
    monkeypatch, platform, capability, kernel
):
    """The one-pass kernel is traced only where the devices' kernels convert to float8
    (compute capability 8.9 and up; no GPU here: lowered for CUDA from this machine), XLA's
    passes on older GPUs (an A100's Triton refuses the cast)."""

    class Device:
        pass

    device = Device()
    device.platform, device.compute_capability = platform, capability
    monkeypatch.setattr(jax, "devices", lambda *_: [device])
    assert transposes.kernels_cast_float8() is kernel
    x = jax.ShapeDtypeStruct((256, 384), jnp.bfloat16)
    jaxpr = jax.make_jaxpr(lambda x: transposes.quantized_swapped(x, 2.0, F8))(x)
    assert ("pallas_call" in str(jaxpr)) is kernel
