"""The float8 operands' transposes (`mosaic_gpu.transposes`), off the GPU: the Pallas Triton
kernel interpreted against numpy's transpose bit for bit, its checks, and where the float8
GEMMs' operands lower to it for a CUDA target (the experts' and dense weights' values, dW's
rows). tests/gpu/ checks the kernels they feed on Hopper."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import mesh1d, shard
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import commgemm as cg
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


def test_kept_transposed_weight_is_the_kernels():
    """`cg.quantize_weight(..., keep_transposed=True)`: its [N, K] copy by the kernel on CUDA,
    here the float8 values transposed exactly."""
    w = jnp.asarray(np.random.default_rng().normal(size=(256, 384)), jnp.bfloat16)
    qw = cg.quantize_weight(w, "current_tensor_scaling", keep_transposed=True)
    np.testing.assert_array_equal(
        np.asarray(qw.transposed.astype(jnp.float32)), np.asarray(qw.quantized.data.T, np.float32)
    )

    def keep(w):
        return cg.quantize_weight(w, "current_tensor_scaling", keep_transposed=True).transposed

    assert _triton_calls(keep, jax.ShapeDtypeStruct(w.shape, w.dtype)) == 1


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "no-vma"])
def test_grouped_float8_forward_reads_the_kernels_weights(check_vma, monkeypatch):
    """The grouped op's float8 forward on Hopper, inside shard_map under check_vma on and off:
    the experts' [G, N, K] float8 values come from the kernel (a Triton call taking the
    quantized [G, K, N] values), and the program lowers."""
    monkeypatch.setattr(mosaic_tiles, "hopper_reason", lambda: None)
    monkeypatch.setattr(mosaic_tiles, "num_sms", lambda: 132)

    def body(x, w, sizes):
        return cg.grouped_matmul(x, w, sizes, scaling="current_tensor_scaling")

    f = shard(body, mesh1d(2), (P("x"), P(), P()), P("x"), check_vma=check_vma)
    sds = jax.ShapeDtypeStruct
    args = (sds((1024, 256), jnp.bfloat16), sds((4, 256, 384), jnp.bfloat16), sds((4,), jnp.int32))
    text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    triton = [ln for ln in text.splitlines() if "xla.gpu.triton" in ln]
    assert [ln for ln in triton if "tensor<4x256x384xui8>" in ln], triton
