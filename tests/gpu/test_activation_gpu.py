"""The experts' activation kernel (`mosaic_gpu.rows`) on one Hopper GPU: GELU and its
gradient on the live rows against jax.nn.gelu in float64, zeros past them, within bf16/f16
rounding, on fresh random rows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import moe_block_step

from commgemm.grouped import activation as act


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("approximate", [False, True], ids=["exact", "tanh"])
@pytest.mark.parametrize("rows, cols, live", [(4096, 1408, 1999), (512, 256, 0), (192, 48, 192),
                                              (8192, 512, 8191)])  # fmt: skip
def test_kernel_against_float64(dtype, approximate, rows, cols, live):
    assert act.kernel_reason((rows, cols), dtype) is None
    rng = np.random.default_rng()
    y = rng.standard_normal((rows, cols)) * 3
    y[live:] = 0
    g = rng.standard_normal((rows, cols))
    y16, g16 = jnp.asarray(y, dtype), jnp.asarray(g, dtype)
    name = "gelu_tanh" if approximate else "gelu"
    out, pullback = jax.vjp(lambda a: act.activation_rows(a, jnp.int32(live), name), y16)
    (dy,) = pullback(g16)
    y64, g64 = np.asarray(y16, np.float64), np.asarray(g16, np.float64)
    with jax.enable_x64(True):  # the reference in float64 (on the GPU)
        ref, pull = jax.vjp(lambda a: jax.nn.gelu(a, approximate=approximate), jnp.asarray(y64))
        dref = np.array(pull(jnp.asarray(g64))[0])
    dref[live:] = 0
    ulp = float(jnp.finfo(dtype).eps)
    np.testing.assert_allclose(np.asarray(out, np.float64), ref, rtol=ulp, atol=ulp)
    np.testing.assert_allclose(np.asarray(dy, np.float64), dref, rtol=2 * ulp, atol=2 * ulp)
    assert not np.asarray(out[live:], np.float64).any() and not np.asarray(dy[live:]).any()


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh"])
@pytest.mark.parametrize("scaling", [None, "current_tensor_scaling"], ids=["bf16", "fp8"])
def test_moe_block_with_the_kernel(monkeypatch, activation, scaling):
    """The MoE block's loss and gradients (AUTO, all GPUs; its activation on the live rows by
    the kernel) against the same block with the activation over every row. bf16: within 2% in
    norm (the kernel's float32 math is its own, rounded once). FP8: a value a hair apart may
    round to the neighbouring float8 value, so each is held to the bf16 block's results in
    float32 (no kernel): the kernel's distance at most 1.25x the fallback's, plus 0.5%."""
    step, (x, w1, w2) = moe_block_step(activation, scaling)
    got = step(x, w1, w2)
    monkeypatch.setattr(act, "kernel_reason", lambda shape, dtype: "turned off")
    want = step(x, w1, w2)
    wide = [a.astype(jnp.float32) for a in (x, w1, w2)]
    ref = step(*wide, scaling=None) if scaling else want
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-2)
    for a, b, r in zip(got[1], want[1], ref[1], strict=True):
        a, b, r = (np.asarray(v, np.float64) for v in (a, b, r))
        if scaling is None:
            assert np.linalg.norm(a - b) <= 2e-2 * np.linalg.norm(b)
        else:
            assert np.linalg.norm(a - r) <= 1.25 * np.linalg.norm(b - r) + 5e-3 * np.linalg.norm(r)
