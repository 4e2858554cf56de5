"""Current tensor scaling on a buffer's live rows by the `mosaic_gpu.rows` kernels on one
Hopper GPU, against XLA's passes over every row (`quant.quantize`, `quant.dequantize`) and
numpy, on fresh random rows: bit for bit where the rows past `live` are zeros, those rows
never read (garbage there changes nothing), and the FP8 MoE block with them against without."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import moe_block_step

from commgemm import quant
from commgemm.grouped import scaling
from commgemm.mosaic_gpu.rows import amax_rows

SHAPES = [(4096, 1408, 1999), (512, 256, 0), (192, 2048, 192), (8192, 512, 8191), (128, 128, 70)]


def _rows(rows, cols, live, rng, scale=30.0):
    """(x with zeros past `live`, x with garbage there: large values, inf and NaN), bf16."""
    x = rng.standard_normal((rows, cols)) * scale
    x[live:] = 0
    garbage = x.copy()
    garbage[live:] = rng.standard_normal((rows - live, cols)) * 1e4
    if live < rows:
        garbage[live, 0], garbage[rows - 1, -1] = np.inf, np.nan
    return jnp.asarray(x, jnp.bfloat16), jnp.asarray(garbage, jnp.bfloat16)


@pytest.mark.parametrize("rows, cols, live", SHAPES)
def test_amax_rows(rows, cols, live):
    """The largest finite |value| of the live rows (an inf and a NaN inside them ignored),
    nothing past them read."""
    rng = np.random.default_rng()
    x, garbage = _rows(rows, cols, live, rng)
    if live:
        x = x.at[live // 2, 1].set(jnp.inf).at[live - 1, 2].set(jnp.nan)
        garbage = garbage.at[live // 2, 1].set(jnp.inf).at[live - 1, 2].set(jnp.nan)
    values = np.abs(np.asarray(x[:live], np.float32))
    want = float(np.max(np.where(np.isfinite(values), values, 0), initial=0))
    for a in (x, garbage):
        assert float(jax.jit(amax_rows)(a, jnp.int32(live))) == want


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
@pytest.mark.parametrize("rows, cols, live", SHAPES)
def test_quantized_rows_is_quantize(rows, cols, live, dtype):
    """The float8 values, the scale and the bf16 values equal XLA's quantize of the whole
    buffer and its dequantize bit for bit; zeros past `live` whatever x holds there."""
    assert scaling.rows_reason((rows, cols), jnp.bfloat16, dtype) is None
    x, garbage = _rows(rows, cols, live, np.random.default_rng())
    want = jax.jit(lambda a: quant.quantize(a, "current_tensor_scaling", dtype=dtype))(x)
    want_values = np.asarray(jax.jit(quant.dequantize, static_argnums=1)(want, jnp.bfloat16))
    fn = jax.jit(lambda a, n: scaling.quantized_rows(a, n, dtype))
    for a in (x, garbage):
        q, values = fn(a, jnp.int32(live))
        assert float(q.scale_inv) == float(want.scale_inv)
        np.testing.assert_array_equal(np.asarray(q.data).view(np.uint8),
                                      np.asarray(want.data).view(np.uint8))  # fmt: skip
        np.testing.assert_array_equal(np.asarray(values), want_values)


@pytest.mark.parametrize("rows, cols, live", SHAPES)
def test_rows_values_on_live_rows(rows, cols, live):
    """`Rows.values` with `live`: XLA's dequantize of the float8 payload on the live rows, bit
    for bit, zeros past them."""
    x, _ = _rows(rows, cols, live, np.random.default_rng())
    q = quant.quantize(x, "current_tensor_scaling", dtype=jnp.float8_e4m3fn)
    payload = q.data.at[live:].set(jnp.float8_e4m3fn(448.0))  # never read
    mode = quant.ScalingMode.CURRENT_TENSOR_SCALING
    got = jax.jit(lambda p, s, n: scaling.Rows(p, s, mode, cols, "bfloat16", n).values())(
        payload, q.scale_inv, jnp.int32(live)
    )
    want = np.asarray(quant.dequantize(q, jnp.bfloat16))
    np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh"])
def test_fp8_moe_block_live_rows_against_every_row(monkeypatch, activation):
    """The FP8 MoE block's loss and gradients (AUTO, all GPUs) with the live-row quantization
    against the same block quantizing every row (`rows_reason` turned off): the same float8
    values, so equal up to the order XLA adds in (1e-3 in norm)."""
    step, (x, w1, w2) = moe_block_step(activation, "current_tensor_scaling")
    got = step(x, w1, w2)
    monkeypatch.setattr(scaling, "rows_reason", lambda *a: "turned off")
    want = step(x, w1, w2)
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-3)
    for a, b in zip(got[1], want[1], strict=True):
        a, b = (np.asarray(v, np.float64) for v in (a, b))
        assert np.linalg.norm(a - b) <= 1e-3 * np.linalg.norm(b)
