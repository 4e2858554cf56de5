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
from commgemm.grouped import blocks, scaling
from commgemm.mosaic_gpu import grouped, rows
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
    `live`, whatever x holds there (large values, inf, NaN: unwritten padding)."""
    assert scaling.rows_reason((64, 128), jnp.bfloat16, dtype) is not None
    x = np.random.default_rng().standard_normal((37, 96)) * 50
    x[live:] = 0
    garbage = x.copy()
    garbage[live:] = 1e4
    if live < 37:
        garbage[live, 0], garbage[-1, -1] = np.inf, np.nan
    x = jnp.asarray(x, jnp.bfloat16)
    want = quant.quantize(x, "current_tensor_scaling", dtype=dtype)
    for a in (x, jnp.asarray(garbage, jnp.bfloat16)):
        q, values = scaling.quantized_rows(a, jnp.int32(live), dtype)
        np.testing.assert_array_equal(np.asarray(q.data), np.asarray(want.data))
        assert float(q.scale_inv) == float(want.scale_inv)
        want_values = np.asarray(quant.dequantize(want, x.dtype))
        np.testing.assert_array_equal(np.asarray(values), want_values)
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
    # the padding of this step's buffers is left unwritten there: its GEMMs read none of it
    w = jnp.zeros((2, 256, 256), jnp.bfloat16)
    assert grouped.padding_reason(256, jnp.bfloat16, w) is None


def test_padding_is_written_where_a_reader_takes_every_row(monkeypatch):
    """Where the received buffers' padding must stay zeros: off Hopper (no kernel to skip it),
    where dW would fall back to XLA's ragged dot (K not whole tiles), and where the float8
    block's backward hands dY to an amax over every row (delayed scaling, or no kernel)."""
    w = jnp.zeros((2, 256, 256), jnp.bfloat16)
    assert grouped.padding_reason(256, jnp.bfloat16, w) is not None  # this CPU
    monkeypatch.setattr(mosaic_tiles, "hopper_reason", lambda: None)
    assert grouped.padding_reason(256, jnp.bfloat16, w) is None
    assert grouped.padding_reason(256, jnp.bfloat16, jnp.zeros((2, 200, 256))) is not None
    x = jnp.asarray(np.random.default_rng().standard_normal((256, 256)), jnp.bfloat16)
    assert not blocks.reads_cotangent_padding(x, None, None, None)  # bf16
    start = cg.ScalingState.create(history=4)
    delayed = cg.ScalingRecipe("delayed_tensor_scaling", x_state=start, w_state=start,
                               dy_state=start)  # fmt: skip
    for recipe, reads in (("current_tensor_scaling", False), (delayed, True)):
        values, _, recipe, q, experts = scaling.quantized_operands(x, w, recipe)
        assert blocks.reads_cotangent_padding(values, q, experts, recipe) is reads
        # no float8 rows (the block emulated): XLA's amax over every row of dY
        assert blocks.reads_cotangent_padding(values, None, None, recipe)


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "no-vma"])
def test_unfilled_exchange_off_gpu_fills(check_vma):
    """`ragged_all_to_all(fill=False, fill_grad=False)` off a GPU: the fallback's result and
    gradient, zeros outside the live rows as ever."""
    from commgemm.grouped.exchange import Layout, ragged_all_to_all

    size, rows, k = 4, 16, 8
    rng = np.random.default_rng()
    counts = rng.integers(0, rows // size + 1, size=(size, size)).astype(np.int32)
    bounds = np.tile(np.arange(0, rows + 1, rows // size, dtype=np.int32), (size, 1))

    def fn(**fills):
        def body(x, c, ct):
            send, recv = Layout(bounds[0], c[0, 0]), Layout(bounds[0], c[0, 1])
            move = lambda a: ragged_all_to_all(a, send, recv, "x", rows // size, rows, **fills)  # noqa: E731
            out, pullback = jax.vjp(move, x)
            return out, pullback(ct)[0]

        specs = (P("x"), P("x"), P("x"))
        return shard(body, mesh1d(size), specs, (P("x"), P("x")), check_vma=check_vma)

    c = np.stack([np.stack([counts[d], counts[:, d]]) for d in range(size)])  # [P, 2, P]
    x = jnp.asarray(rng.standard_normal((size * rows, k)), jnp.float32)
    ct = jnp.asarray(rng.standard_normal((size * rows, k)), jnp.float32)
    got = fn(fill=False, fill_grad=False)(x, jnp.asarray(c), ct)
    want = fn()(x, jnp.asarray(c), ct)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    out = np.asarray(want[0]).reshape(size, size, rows // size, k)
    for d in range(size):  # rows outside the live ones: zeros
        for s in range(size):
            assert not out[d, s, counts[s, d] :].any()


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
