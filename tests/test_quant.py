"""Quantization modes: round trips within each mode's documented error, scale shapes and
dtypes, delayed scaling's state over steps, the cuBLAS block-scale swizzle, bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from commgemm.quant import (
    E8M0,
    FP4,
    ScalingMode,
    ScalingState,
    _max,
    _on_grid,
    dequantize,
    dequantize_fusible,
    quantize,
    quantize_by,
    swizzle_block_scales,
    unswizzle_block_scales,
)

#: Relative round-trip error bounds per element, against the block's (or tensor's) amax:
#: half a unit in the last place of the value format at the top of its range, with the scale
#: exact (tensor, MXFP8's powers of two) or itself rounded to e4m3 (NVFP4's block scales).
BOUNDS = {
    ScalingMode.CURRENT_TENSOR_SCALING: 2.0**-4,  # e4m3: 3 mantissa bits
    ScalingMode.MXFP8_1D_SCALING: 2.0**-3,  # a power-of-two scale leaves up to 2x headroom
    ScalingMode.NVFP4_1D_SCALING: 0.25 + 2.0**-3,  # e2m1 steps of 0.5 at the top of [-6, 6]
}


@pytest.mark.parametrize("mode", list(BOUNDS))
@pytest.mark.parametrize("axis", [-1, 0])
def test_round_trip_within_bound(rng, mode, axis):
    x = rng.standard_normal((64, 96)) * np.exp(rng.standard_normal((64, 1)))  # row scales vary
    t = quantize(jnp.asarray(x, jnp.float32), mode, axis=axis)
    back = np.asarray(dequantize(t), np.float64)
    if mode is ScalingMode.CURRENT_TENSOR_SCALING:
        ref_amax = np.abs(x).max()
        assert np.abs(back - x).max() <= BOUNDS[mode] * ref_amax
        return
    size = {ScalingMode.MXFP8_1D_SCALING: 32, ScalingMode.NVFP4_1D_SCALING: 16}[mode]
    moved = np.moveaxis(x, axis, -1)
    blocks = moved.reshape(*moved.shape[:-1], -1, size)
    amax = np.repeat(np.abs(blocks).max(-1), size, axis=-1)
    err = np.abs(np.moveaxis(back, axis, -1) - moved)
    assert (err <= BOUNDS[mode] * amax + 1e-30).all()


def test_scale_shapes_and_dtypes(rng):
    x = jnp.asarray(rng.standard_normal((8, 64)), jnp.float32)
    mx = quantize(x, "mxfp8_1d_scaling")
    assert mx.data.dtype == jnp.float8_e4m3fn and mx.scale_inv.shape == (8, 2)
    assert mx.scale_inv.dtype == E8M0
    nv = quantize(x, ScalingMode.NVFP4_1D_SCALING)
    assert nv.data.dtype == FP4 and nv.scale_inv.shape == (8, 4)
    assert nv.scale_inv.dtype == jnp.float8_e4m3fn and nv.global_scale_inv.shape == ()
    cur = quantize(x, "current_tensor_scaling", dtype=jnp.float8_e5m2)
    assert cur.data.dtype == jnp.float8_e5m2 and cur.scale_inv.shape == ()
    assert jax.tree.leaves(cur)  # a pytree: jit and vmap see its arrays


def test_zero_tensor_has_unit_scale():
    for mode in ("current_tensor_scaling", "mxfp8_1d_scaling", "nvfp4_1d_scaling"):
        t = quantize(jnp.zeros((4, 32)), mode)
        back = dequantize(t)
        assert np.isfinite(np.asarray(back)).all() and not np.asarray(back).any()


@pytest.mark.parametrize("algorithm", ["max", "most_recent"])
def test_delayed_scaling_state_over_steps(rng, algorithm):
    """Ten steps of growing amax: each step quantizes with the scale the previous steps
    left, the history holds the newest amaxes first, and the next scale follows it."""
    state = ScalingState.create(history=4, algorithm=algorithm)
    step = jax.jit(lambda x, s: quantize(x, "delayed_tensor_scaling", state=s))
    amaxes = []
    for i in range(10):
        x = jnp.asarray(rng.standard_normal((16, 16)) * (i + 1), jnp.float32)
        before = state.scale
        t, state = step(x, state)
        amaxes.append(float(jnp.max(jnp.abs(x))))
        np.testing.assert_allclose(float(t.scale_inv), 1 / float(before), rtol=1e-6)
        np.testing.assert_allclose(
            np.asarray(state.amax_history),
            amaxes[::-1][:4] + [0] * (4 - len(amaxes[-4:])),
            rtol=1e-6,
        )
        want = amaxes[-1] if algorithm == "most_recent" else max(amaxes[-4:])
        np.testing.assert_allclose(float(state.scale), 448.0 / want, rtol=1e-6)


@pytest.mark.parametrize("shape", [(128, 4), (200, 7), (1, 1), (256, 12)])
def test_swizzle_round_trip(rng, shape):
    scales = jnp.asarray(rng.integers(0, 255, size=shape), jnp.int32)
    flat = swizzle_block_scales(scales)
    assert flat.size == (-(-shape[0] // 128) * 128) * (-(-shape[1] // 4) * 4)
    np.testing.assert_array_equal(np.asarray(unswizzle_block_scales(flat, *shape)), scales)
    # the first tile's first 16 entries: rows 0, 32, 64, 96 for columns 0..3, then row 1
    if shape == (128, 4):
        first = np.asarray(flat[:16]).reshape(4, 4)
        np.testing.assert_array_equal(first, np.asarray(scales)[[0, 32, 64, 96]])


def test_bad_input():
    with pytest.raises(ValueError, match="must divide into blocks of 32"):
        quantize(jnp.ones((4, 40)), "mxfp8_1d_scaling")
    with pytest.raises(ValueError, match="needs state="):
        quantize(jnp.ones((4, 4)), "delayed_tensor_scaling")
    with pytest.raises(ValueError, match="is not a valid ScalingMode"):
        quantize(jnp.ones((4, 4)), "fp3")
    with pytest.raises(ValueError, match="history=0"):
        ScalingState.create(history=0)


@settings(max_examples=25, deadline=None)
@given(
    dtype=st.sampled_from(["float8_e4m3fn", "float8_e5m2"]),
    log_scale=st.floats(-30, 30),
    seed=st.integers(0, 2**31 - 1),
)
def test_quantize_by_recovers_the_float8_values(dtype, log_scale, seed):
    """Values quantized by a tensor scale and dequantized to bf16, quantized again by that scale
    (`quantize_by`), give back the very same float8 values (what the collective grouped ops'
    float8 dX relies on), subnormals and the format's largest values included."""
    x = np.random.default_rng(seed).standard_normal(4096) * 2.0**log_scale
    x[:3] = [0.0, 2.0**log_scale * 1e-6, -(2.0**log_scale) * 1e3]  # a zero, tiny and huge values
    q = quantize(jnp.asarray(x, jnp.float32), "current_tensor_scaling", dtype=dtype)
    again = quantize_by(dequantize(q, jnp.bfloat16), q.scale_inv, dtype)
    as_f32 = lambda t: np.asarray(t.data, np.float32)  # noqa: E731
    np.testing.assert_array_equal(as_f32(again), as_f32(q))
    assert again.scale_inv == q.scale_inv


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_float8_grid_in_float32_is_the_cast(dtype):
    """`_on_grid` rounds float32 values as a cast to the float8 format does: every finite
    float8 value, each midpoint between neighbours (ties to even) and its float32 neighbours,
    random values over 40 octaves (subnormals included), zeros and NaN; values clipped to the
    format's range as quantizing clips them."""
    every = np.arange(256, dtype=np.uint8).view(jnp.dtype(dtype)).astype(np.float32)
    grid = np.sort(every[np.isfinite(every)])
    mids = (grid[1:] + grid[:-1]) / 2
    rng = np.random.default_rng()
    spread = rng.standard_normal(50_000) * np.exp2(rng.integers(-24, 16, 50_000))
    v = np.concatenate([grid, mids, np.nextafter(mids, np.inf), np.nextafter(mids, -np.inf),
                        spread, [0.0, -0.0, np.nan]]).astype(np.float32)  # fmt: skip
    top = float(_max(dtype))
    v = np.where(np.isnan(v), v, np.clip(v, -top, top)).astype(np.float32)
    want = jnp.asarray(v).astype(dtype).astype(jnp.float32)
    np.testing.assert_array_equal(jax.jit(lambda a: _on_grid(a, dtype))(jnp.asarray(v)), want)


@pytest.mark.parametrize("mode", ["current_tensor_scaling", "mxfp8_1d_scaling"])
@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_dequantize_fusible_is_dequantize(rng, mode, dtype):
    """`dequantize_fusible` (no optimization barrier) gives `dequantize`'s values bit for bit,
    inside one jitted program with the quantizing pass, in bf16 and float32."""
    x = jnp.asarray(rng.standard_normal((64, 256)) * np.exp2(rng.integers(-12, 12, (64, 1))),
                    jnp.bfloat16)  # fmt: skip
    for out in (jnp.bfloat16, jnp.float32):

        def both(a, out=out):
            q = quantize(a, mode, dtype=dtype, axis=-1)
            return dequantize(q, out), dequantize_fusible(q, out)

        held, fused = jax.jit(both)(x)
        assert fused.dtype == out
        np.testing.assert_array_equal(np.asarray(fused, np.float32), np.asarray(held, np.float32))
