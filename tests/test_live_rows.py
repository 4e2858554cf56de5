"""Current tensor scaling on a buffer's live rows (`grouped.scaling.quantized_rows`,
`Rows.values` with `live`): off a GPU equal to `quant.quantize` over every row; the FP8
expert step with the live-row kernels (`mosaic_gpu.rows`) lowering for CUDA under check_vma on
and off. The kernels' results against XLA's: tests/gpu/test_live_rows_gpu.py."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import P, mesh1d, shard
from test_kernels_lower import JaxOnAnH100

import commgemm as cg
from commgemm import quant
from commgemm.grouped import scaling
from commgemm.mosaic_gpu import rows
from commgemm.mosaic_gpu import tiles as mosaic_tiles


@pytest.mark.parametrize(
    "f, dtypes, want",
    [(1408, (jnp.bfloat16, jnp.float8_e4m3fn), 128), (2048, (jnp.float8_e5m2,), 256),
     (24, (jnp.bfloat16, jnp.float8_e4m3fn), None), (48, (jnp.bfloat16,), 16),
     (4096, (jnp.float32, jnp.bfloat16), 64)],
)  # fmt: skip
def test_tile_cols_of_mixed_dtypes(f, dtypes, want):
    """One unit's columns for every operand: 256 bytes of the widest dtype, halved until they
    divide the row, 16 bytes of the narrowest at least."""
    assert rows.tile_cols(f, *dtypes) == want


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
@pytest.mark.parametrize("live", [0, 5, 37])
def test_quantized_rows_off_gpu_is_quantize(dtype, live):
    """Off a GPU: `quantize` by the whole buffer's amax and its values, bit for bit; zeros past
    `live` stay zeros."""
    assert scaling.rows_reason((64, 128), jnp.bfloat16, dtype) is not None
    x = np.random.default_rng().standard_normal((37, 96)) * 50
    x[live:] = 0
    x = jnp.asarray(x, jnp.bfloat16)
    q, values = scaling.quantized_rows(x, jnp.int32(live), dtype)
    want = quant.quantize(x, "current_tensor_scaling", dtype=dtype)
    np.testing.assert_array_equal(np.asarray(q.data), np.asarray(want.data))
    assert float(q.scale_inv) == float(want.scale_inv)
    np.testing.assert_array_equal(np.asarray(values), np.asarray(quant.dequantize(want, x.dtype)))
    assert not np.asarray(values[live:], np.float32).any()


def _fp8_step_text(check_vma: bool, size: int) -> str:
    """The FP8 `expert_mlp` step (NONE, `size` shards, named GELU) lowered for CUDA as on a
    Hopper GPU."""
    from commgemm.grouped.expert_parallel import expert_mlp

    m, k, f, n, e = 256 // size, 256, 256, 256, 2
    grad = "float8_e5m2" if jax.__version_info__ >= (0, 11) else "float8_e4m3fn"
    recipe = cg.ScalingRecipe("current_tensor_scaling", grad_dtype=grad)
    cfg = cg.OverlapConfig(method="none")

    def body(x, w1, w2, g):
        return expert_mlp(x, w1, w2, g[0], "x", activation="gelu", config=cfg,
                          scaling=recipe)[0]  # fmt: skip

    fn = shard(body, mesh1d(size), (P("x"),) * 4, P("x"), check_vma=check_vma)
    loss = lambda *a: jnp.sum(fn(*a).astype(jnp.float32) ** 2)  # noqa: E731
    sds = jax.ShapeDtypeStruct
    args = (sds((size * m, k), jnp.bfloat16), sds((size * e, k, f), jnp.bfloat16),
            sds((size * e, f, n), jnp.bfloat16), sds((size, size * e), jnp.int32))  # fmt: skip
    step = jax.jit(jax.grad(loss, (0, 1, 2))).trace(*args)
    return step.lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("size", [1, 2])
@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "no-vma"])
def test_fp8_step_quantizes_live_rows_on_kernels(check_vma, size, monkeypatch):
    """The FP8 expert step as on a Hopper GPU, 2 shards: the tokens' values on arrival
    dequantized by one live-row kernel (float8 [P*C, K] in, bf16 out), and h, dZ and dY1 each
    quantized by two (the amax: one float32 a unit; the float8 values and their bf16 copy), no
    XLA pass over the received rows for them. One shard (no padding): XLA's passes, none of
    those kernels."""
    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu as transposed

    monkeypatch.setattr(mosaic_tiles, "hopper_reason", lambda: None)
    monkeypatch.setattr(mosaic_tiles, "num_sms", lambda: 132)
    monkeypatch.setattr(transposed, "jax", JaxOnAnH100())
    calls = [ln.rsplit(" : (", 1)[1] for ln in _fp8_step_text(check_vma, size).splitlines()
             if "custom_call @mosaic_gpu" in ln]  # fmt: skip
    head = r"^tensor<1xi32>, tensor<\d+xf32>, "
    amax = [c for c in calls if re.match(head + r"tensor<256x256xbf16>\) -> tensor<8xf32>", c)]
    quantize = [c for c in calls if re.match(head + r".*-> \(tensor<256x256xf8E\w+>, "
                                             r"tensor<256x256xbf16>\)", c)]  # fmt: skip
    dequantize = [c for c in calls if re.match(head + r"tensor<256x256xf8E4M3FN>, "
                                               r"tensor<64x128xbf16>\) -> tensor<256x256xbf16>",
                                               c)]  # fmt: skip
    gelu = r"tensor<256x256xbf16>, (tensor<256x256xbf16>, )?tensor<64x128xbf16>\) -> tensor<256"
    gelu = [c for c in calls if re.match(head + gelu, c)]
    want = (3, 3, 1) if size > 1 else (0, 0, 0)
    assert (len(amax), len(quantize), len(dequantize), len(gelu)) == (*want, 2), calls


@pytest.mark.parametrize(
    "shapes, dtype",
    [([(100, 128)], jnp.bfloat16), ([(0, 128)], jnp.bfloat16), ([(128, 12)], jnp.bfloat16),
     ([(128, 128), (64, 128)], jnp.bfloat16)],
    ids=["rows", "empty", "cols", "mismatch"],
)  # fmt: skip
def test_map_rows_refuses_buffers_that_do_not_tile(shapes, dtype):
    """Buffers that are no whole [TILE_ROWS, tile_cols] tiles, or of different shapes, are
    refused before any kernel is built (here on the CPU)."""
    ins = [jnp.zeros(s, dtype) for s in shapes]
    with pytest.raises(ValueError, match="no whole tiles"):
        rows.map_rows(lambda t, s: (t[0],), ins, jnp.int32(1), (dtype,))
