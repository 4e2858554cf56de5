"""The fused TPU kernels behind the ops: ATOMIC_GEMM_AG_P2P / _RS_P2P (the rings, method
RING_EXCHANGE) and ATOMIC_GEMM_AG / _RS (direct, method PIPELINE), on a TPU backend or, with
`OverlapConfig(interpret=True)`, in Pallas' TPU interpret mode on any backend.

Quantized operands (an op's `scaling=`): x arrives as its payload rows and w as a
`commgemm.quantized_gemm.QuantizedRhs`. Tensor modes: the kernels move the float8 rows (AG gathers
them, half of bf16's bytes), widen each tile to bf16 in VMEM, multiply by the two tensor scales
and store x's dtype (`gemm`). Block modes (MXFP8, NVFP4): the rows move as values and
block scales together (`quantized_gemm.payload`), and each tile of x and w is dequantized per
block in VMEM (`gemm.Blocks`); NVFP4's global scales are the tensor scales. RS partial sums
travel in x's dtype. The quantized paths run in interpret mode in the tests and lower for a TPU
target; they have not run on TPU hardware.

Interpret mode on the CPU runs each device's kernel on one of the CPU client's threads (one per
device) and needs one more: use a mesh of fewer devices than `jax.devices()` has there (the
tests and the demo do).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from commgemm.config import Collective, Method, OverlapConfig, fused_fields_reason
from commgemm.pallas_tpu import gemm
from commgemm.pallas_tpu.common import VMEM_BUDGET
from commgemm.vma import all_gather_invariant


def generation() -> str:
    """The TPU generation whose VMEM budget applies ("interpret" off a TPU)."""
    kind = jax.devices()[0].device_kind.lower()
    if jax.default_backend() != "tpu":
        return "interpret"
    for name, marks in (("v5e", ("v5 lite", "v5e")), ("v5p", ("v5p", "v5")), ("v6e", ("v6",))):
        if any(mark in kind for mark in marks):
            return name
    return "v5e"  # the smallest budget where the kind is unknown


def _shapes(collective, x, w, size, w_transposed):
    """(rows, K, n) of the kernel's GEMM; K from w (x's rows may carry block scales too)."""
    rows = x.shape[0]
    n, k = w.shape if w_transposed else w.shape[::-1]
    return (rows if collective is Collective.ALL_GATHER else rows // size), k, n


def tiles_for(
    collective: Collective, x, w, size: int, w_transposed: bool, dtype=None
) -> gemm.Tiles | None:
    """The kernel's VMEM tiles for operands of `dtype` (default x's; a quantized call passes
    the unquantized dtype, as the plan checked it, which leaves room for the widened tiles)."""
    m, k, n = _shapes(collective, x, w, size, w_transposed)
    itemsize = jnp.dtype(dtype or x.dtype).itemsize
    return gemm.Tiles.fit(m, k, n, itemsize, VMEM_BUDGET[generation()])


def unsupported_reason(
    collective: Collective,
    x: jax.Array,
    w: jax.Array,
    size: int,
    config: OverlapConfig,
    *,
    w_transposed: bool,
) -> str | None:
    """Why the TPU kernel cannot run this per-shard call, or None when it can."""
    if collective not in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER):
        return f"there is no fused TPU kernel for {collective.name}"
    if x.dtype not in (jnp.float32, jnp.bfloat16):
        return f"it takes float32 or bfloat16 operands, got {x.dtype}"
    if (reason := fused_fields_reason(config, x.dtype)) is not None:
        return reason
    if config.kernel is not None:
        return f"kernel={type(config.kernel).__name__}(...) configures the Hopper kernels"
    if jax.default_backend() != "tpu" and not config.interpret:
        return "it runs on TPUs (or anywhere with interpret=True)"
    if tiles_for(collective, x, w, size, w_transposed) is None:
        m, k, n = _shapes(collective, x, w, size, w_transposed)
        return (
            f"no GEMM tile of rows {m}, K={k}, N={n} fits the "
            f"{VMEM_BUDGET[generation()] >> 20} MiB VMEM budget ({generation()})"
        )
    return None


def _kernel_args(collective: Collective, x, w, axis_name: str, config, w_transposed: bool):
    """(w [K, n], keyword arguments) for the `gemm` kernel of `collective`: w's values (a
    QuantizedRhs's float8 data, with the two tensor scales and the result's dtype; block
    modes also the block format and w's float32 block scales [K / block, n]), its tiles and
    its form."""
    from commgemm.operand_scaling import tensor_scale
    from commgemm.quant import BLOCK, TENSOR_MODES, ScalingMode
    from commgemm.quantized_gemm import QuantizedRhs

    quantized = {}
    if isinstance(w, QuantizedRhs):
        scale = w.lhs_scale_inv * tensor_scale(w.w)
        quantized = dict(scale=scale, out_dtype=w.dtype)
        mode, data = w.w.mode, w.w.data
        if mode not in TENSOR_MODES:  # blocks along K: float8 values and float32 block scales
            nvfp4 = mode is ScalingMode.NVFP4_1D_SCALING
            scale_dtype = "float8_e4m3fn" if nvfp4 else "float8_e8m0fnu"
            scales = w.w.scale_inv.astype(jnp.float32).T  # [n, K / block] as quantized
            quantized.update(blocks=gemm.Blocks(BLOCK[mode], scale_dtype), w_scales=scales)
            data = data.astype(jnp.float8_e4m3fn)  # exact for float4_e2m1fn
        w = data
    size = jax.lax.axis_size(axis_name)
    dtype = quantized.get("out_dtype")
    tiles = tiles_for(collective, x, w, size, w_transposed, dtype)
    kwargs = dict(direct=config.method is Method.PIPELINE, interpret=config.interpret)
    return (w.T if w_transposed else w), dict(tiles=tiles, **kwargs, **quantized)


def scaling_reason(config: OverlapConfig, recipe) -> str | None:
    """Why the kernels cannot take operands quantized by `recipe`: never (tensor and block
    modes alike)."""
    return None


def all_gather_matmul(x, w, axis_name, config, *, w_transposed, return_gathered=False):
    """x [m, K], w [K, n] -> all_gather(x) @ w [P*m, n] (and the gathered x [P*m, K])."""
    w, kwargs = _kernel_args(Collective.ALL_GATHER, x, w, axis_name, config, w_transposed)
    out, gathered = gemm.all_gather_matmul(x, w, axis_name, **kwargs)
    return (out, gathered) if return_gathered else out


def matmul_reduce_scatter(x, w, axis_name, config, *, w_transposed):
    """x [M, k], w [k, n] (K sharded) -> this device's rows [M/P, n] of the sum."""
    w, kwargs = _kernel_args(Collective.REDUCE_SCATTER, x, w, axis_name, config, w_transposed)
    return gemm.matmul_reduce_scatter(x, w, axis_name, **kwargs)


def matmul_all_reduce(x, w, axis_name, config, *, w_transposed):
    """x [M, k], w [k, n] (K sharded) -> the sum [M, n] on every device: the GEMM +
    reduce-scatter kernel, then an all-gather of its rows. There is no fused all-reduce
    kernel (the plan refuses the op `matmul_all_reduce` on the TPU kernels); the quantized
    `matmul_2d` reduces its K blocks this way."""
    part = matmul_reduce_scatter(x, w, axis_name, config, w_transposed=w_transposed)
    return all_gather_invariant(part, axis_name)
