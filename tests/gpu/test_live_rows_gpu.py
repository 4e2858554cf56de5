"""Current tensor scaling on a buffer's live rows by the `mosaic_gpu.rows` kernels on one
Hopper GPU, against XLA's passes over every row (`quant.quantize`, `quant.dequantize`) and
numpy, on fresh random rows: bit for bit where the rows past `live` are zeros, those rows
never read (garbage there changes nothing), and the FP8 MoE block with them against without;
the results' rows past `live` left unwritten (`fill=False`), and the MoE block so."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import garbage_freed, moe_block_step

import commgemm as cg
from commgemm import quant
from commgemm.grouped import scaling
from commgemm.grouped.activation import activation_rows
from commgemm.mosaic_gpu import grouped
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
    for fill in (True, False):  # unfilled: the rows past `live` unspecified
        fn = jax.jit(lambda a, n, fill=fill: scaling.quantized_rows(a, n, dtype, fill=fill))
        rows_ = slice(None) if fill else slice(live)
        for a in (x, garbage):
            garbage_freed(8 * rows * cols)
            q, values = fn(a, jnp.int32(live))
            assert float(q.scale_inv) == float(want.scale_inv)
            np.testing.assert_array_equal(np.asarray(q.data)[rows_].view(np.uint8),
                                          np.asarray(want.data)[rows_].view(np.uint8))  # fmt: skip
            np.testing.assert_array_equal(np.asarray(values)[rows_], want_values[rows_])


@pytest.mark.parametrize("rows, cols, live", SHAPES)
def test_rows_values_on_live_rows(rows, cols, live):
    """`Rows.values` with `live`: XLA's dequantize of the float8 payload on the live rows, bit
    for bit, zeros past them (with `fill=False` not written there)."""
    x, _ = _rows(rows, cols, live, np.random.default_rng())
    q = quant.quantize(x, "current_tensor_scaling", dtype=jnp.float8_e4m3fn)
    payload = q.data.at[live:].set(jnp.float8_e4m3fn(448.0))  # never read
    mode = quant.ScalingMode.CURRENT_TENSOR_SCALING
    want = np.asarray(quant.dequantize(q, jnp.bfloat16))
    for fill in (True, False):
        rows_ = scaling.Rows(payload, q.scale_inv, mode, cols, "bfloat16", jnp.int32(live), fill)
        garbage_freed(8 * rows * cols)
        got = np.asarray(jax.jit(lambda r: r.values())(rows_))
        np.testing.assert_array_equal(got if fill else got[:live], want if fill else want[:live])


@pytest.mark.parametrize("rows, cols, live", SHAPES)
def test_gelu_gradient_unfilled(rows, cols, live):
    """`activation_rows(fill_grad=False)`: the gradient's live rows bit for bit those of the
    filled one (zeros past `live`), whatever lies in the freed memory it is written to."""
    x, _ = _rows(rows, cols, live, np.random.default_rng(), scale=2.0)
    g = jnp.asarray(np.random.default_rng().standard_normal((rows, cols)), jnp.bfloat16)
    grads = []
    for fill in (True, False):
        fn = lambda a, fill=fill: activation_rows(a, jnp.int32(live), "gelu", fill_grad=fill)  # noqa: E731
        garbage_freed(8 * rows * cols)
        grads.append(np.asarray(jax.jit(lambda a, fn=fn: jax.vjp(fn, a)[1](g)[0])(x)))
    np.testing.assert_array_equal(grads[1][:live], grads[0][:live])
    assert not grads[0][live:].any()


def _delayed() -> cg.ScalingRecipe:
    start = cg.ScalingState.create(history=4)
    return cg.ScalingRecipe("delayed_tensor_scaling", x_state=start, w_state=start,
                            dy_state=start)  # fmt: skip


@pytest.mark.parametrize("scaling_", [None, "current_tensor_scaling", "delayed"])
def test_moe_block_with_unwritten_padding(monkeypatch, scaling_):
    """The MoE block (AUTO, all GPUs) leaving its received buffers' padding unwritten (freed
    NaNs beneath) against the same block writing zeros there (`padding_reason` turned off):
    finite, and equal losses and gradients (1e-5 in norm)."""
    step, (x, w1, w2) = moe_block_step("gelu", _delayed() if scaling_ == "delayed" else scaling_)
    assert grouped.padding_reason(2048, jnp.bfloat16, w1[:4]) is None
    garbage_freed(1 << 30)
    got = step(x, w1, w2)
    monkeypatch.setattr(grouped, "padding_reason", lambda *a: "turned off")
    want = step(x, w1, w2)
    _assert_steps_close(got, want, 1e-5, finite=True)


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh"])
def test_fp8_moe_block_live_rows_against_every_row(monkeypatch, activation):
    """The FP8 MoE block's loss and gradients (AUTO, all GPUs) with the live-row quantization
    against the same block quantizing every row (`rows_reason` turned off): the same float8
    values, so equal up to the order XLA adds in (1e-3 in norm)."""
    step, (x, w1, w2) = moe_block_step(activation, "current_tensor_scaling")
    got = step(x, w1, w2)
    monkeypatch.setattr(scaling, "rows_reason", lambda *a: "turned off")
    want = step(x, w1, w2)
    _assert_steps_close(got, want, 1e-3)


def _assert_steps_close(got, want, tol: float, finite: bool = False) -> None:
    """(loss, gradients) of two steps: the loss within `tol` relative, each gradient within
    `tol` in norm (and finite where asked)."""
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=tol)
    for a, b in zip(got[1], want[1], strict=True):
        a, b = (np.asarray(v, np.float64) for v in (a, b))
        assert not finite or np.isfinite(a).all()
        assert np.linalg.norm(a - b) <= tol * np.linalg.norm(b)
