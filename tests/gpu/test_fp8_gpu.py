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
from commgemm import scaled


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
    """The direct kernel of `op` with no mesh axis: its GEMM core on this GPU, nothing to send."""
    from commgemm.mosaic_gpu import fused, push_gather_gemm, scatter_add_gemm

    cfg = cg.OverlapConfig(method="pipeline", atomic_gemm=True, kernel=tiles)
    if float8:  # the ops' path: a QuantizedRhs, w stored [n, K]
        if op == "ag":
            return jax.jit(lambda a, r: fused.all_gather_matmul(a, r, None, cfg, w_transposed=True))
        return jax.jit(lambda a, r: fused.matmul_reduce_scatter(a, r, None, cfg, w_transposed=True))
    # bf16 w laid out [n, K]: the transposed right operand
    if op == "ag":
        return jax.jit(lambda a, b: push_gather_gemm.all_gather_matmul(a, b, None, cfg, w_nk=True))
    return jax.jit(lambda a, b: scatter_add_gemm.matmul_reduce_scatter(a, b, None, cfg, w_nk=True))


@pytest.mark.skipif(jax.__version_info__ < (0, 11), reason="the fused kernels need jax >= 0.11")
@pytest.mark.parametrize("k", [1024, 1088])  # 1088: not whole 128-element K-steps, 64 stay
@pytest.mark.parametrize("op", ["ag", "rs"])
def test_direct_kernels_float8_core(op, k):
    """The direct kernels' float8 wgmma (w [n, K], scales in the epilogue) and their bf16
    transposed-w path agree with the float32 product of the same operands."""
    from commgemm.mosaic_gpu.configs import DirectAGConfig, DirectRSConfig

    x, w = _operands(m=512, k=k, n=1024)
    tiles = (DirectAGConfig if op == "ag" else DirectRSConfig)()
    qx = cg.quantize(x, "current_tensor_scaling")
    qw = cg.quantize(w, "current_tensor_scaling", axis=0)
    rhs = scaled.QuantizedRhs(cg.ScaledTensor(qw.data.T, qw.scale_inv), qx.scale_inv, k,
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
