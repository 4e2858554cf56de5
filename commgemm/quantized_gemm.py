"""The local GEMM on quantized operands, shared by every backend: the rows that travel
(`payload`, `unpack_rows`) and W as a method's local GEMM sees it (`QuantizedRhs`).

How a shard's scales relate to the tensor's:
  tensor scaling (CURRENT, DELAYED): one scale per tensor, the same on every shard. CURRENT
    takes the amax over the op's mesh axis (`amax`, a lax.pmax); DELAYED takes it from the
    caller's `ScalingState`, which the caller advances with that same amax. So the gathered
    payload of AG + GEMM is float8 alone (the scale is the receiver's already), and the partial
    sums of GEMM + RS / AR, scaled back in each GEMM's epilogue, add in one scale.
  block scaling (MXFP8, NVFP4): blocks of 32 / 16 along the contracting dimension, which never
    straddle shards (K per shard must be a multiple of the block); a row's block scales travel
    with the row: the payload that moves is [rows, K + K/block] bytes (values, then scales).
    NVFP4's float32 global scale is shared over the axis like a tensor scale; its values
    travel as float8_e4m3fn bytes, which hold every float4_e2m1fn value exactly.

The GEMM: tensor-scaled float8 operands go to XLA's dot as float8 with a float32 result, the
two scales applied to it (XLA's GPU compiler gives that to cuBLASLt's FP8 GEMM on Hopper,
scales as its alpha); with a fused config, to the fused kernels' float8 wgmma
(commgemm.mosaic_gpu.fused). Hopper has no tensor cores for block scales: block modes are
emulated, dequantized per block in x's dtype, then multiplied (the layout,
`quant.swizzle_block_scales`, is ready for hardware that has them).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from commgemm.mosaic_gpu.transposes import swapped
from commgemm.operand_scaling import tensor_scale
from commgemm.quant import E8M0, TENSOR_MODES, ScaledTensor, ScalingMode, _held, dequantize


def payload(t: ScaledTensor) -> jax.Array:
    """The rows that travel for a row-wise operand [..., K] (blocks along its last dimension):
    float8 values (tensor modes), or values and block scales as bytes [..., K + K/block]
    (block modes)."""
    if t.mode in TENSOR_MODES:
        return t.data
    values = _held(t.data).astype(jnp.float8_e4m3fn)  # exact for float4_e2m1fn
    parts = (values, t.scale_inv)
    return jnp.concatenate([lax.bitcast_convert_type(p, jnp.uint8) for p in parts], axis=-1)


def unpack_rows(rows: jax.Array, mode: ScalingMode, k: int) -> ScaledTensor:
    """The inverse of `payload` for block modes, without NVFP4's global scale."""
    values = lax.bitcast_convert_type(rows[..., :k], jnp.float8_e4m3fn)
    scale_dtype = jnp.float8_e4m3fn if mode is ScalingMode.NVFP4_1D_SCALING else E8M0
    scales = lax.bitcast_convert_type(rows[..., k:], scale_dtype)
    return ScaledTensor(values, scales, mode=mode, axis=-1)


def block_values(t: ScaledTensor, dtype) -> jax.Array:
    """A block-scaled tensor's values times its block scales (the global scale left out)."""
    return dequantize(dataclasses.replace(t, global_scale_inv=None), dtype)


def scaled_dot(lhs, rhs, dims, scale, accumulate_dtype, result_dtype, split: bool):
    """lax.dot_general(lhs, rhs) * scale in `result_dtype`.

    Float8 operands on an NVIDIA GPU: one cuBLASLt FP8 GEMM with the result in `result_dtype`
    and the scale folded into it (XLA's ANY_F8_ANY_F8_ANY algorithm, `split` choosing the
    promoted or the fast accumulation), so no float32 result is written and cast in a second
    pass. Elsewhere (other backends, the block modes' emulation):
    a float32 accumulation, scaled, then cast."""
    result = jnp.dtype(result_dtype or accumulate_dtype)
    if jnp.dtype(lhs.dtype).itemsize == 1 and jax.default_backend() == "gpu":
        preset = lax.DotAlgorithmPreset
        algorithm = preset.ANY_F8_ANY_F8_ANY if split else preset.ANY_F8_ANY_F8_ANY_FAST_ACCUM
        out = lax.dot_general(
            lhs, rhs, (dims, ((), ())), precision=algorithm, preferred_element_type=result
        )
        return out * scale.astype(result)
    out = lax.dot_general(
        lhs, rhs, (dims, ((), ())), preferred_element_type=jnp.dtype(accumulate_dtype)
    )
    return (out * scale).astype(result)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedRhs:
    """W as the XLA methods' local GEMM sees it under `scaling`: quantized, with the scale of
    the left operand's tensor and how to read the left operand's payload rows. The methods
    pass it where they pass w (commgemm.xla.common.matmul calls `matmul` on it).
    `transposed`: w's float8 values with the two dimensions swapped, where the caller kept
    them (`QuantizedWeight.transposed`), else None."""

    w: ScaledTensor
    lhs_scale_inv: jax.Array
    lhs_k: int = dataclasses.field(metadata=dict(static=True))
    dtype: str = dataclasses.field(metadata=dict(static=True))
    split_accumulator: bool = dataclasses.field(default=True, metadata=dict(static=True))
    transposed: jax.Array | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.w.data.shape

    def k_major(self, w_transposed: bool) -> jax.Array:
        """W's float8 values [n, K] (tensor modes), K-major as Hopper's float8 GEMMs read both
        operands: the values themselves where w is [n, K] (`w_transposed`), else the kept
        transposed copy, else the values transposed (a copy made in each call,
        `mosaic_gpu.transposes.swapped`)."""
        if w_transposed:
            return self.w.data
        return swapped(self.w.data) if self.transposed is None else self.transposed

    def matmul(
        self, rows: jax.Array, w_transposed: bool, accumulate_dtype: str, result_dtype
    ) -> jax.Array:
        """payload rows [r, K(+scales)] @ W -> [r, n], scaled back, in `result_dtype`."""
        mode = self.w.mode
        scale = self.lhs_scale_inv * tensor_scale(self.w)
        if mode in TENSOR_MODES:  # K-major: no transpose where w's is kept
            lhs, rhs, dims = rows, self.k_major(w_transposed), ((1,), (1,))
        else:
            lhs = block_values(unpack_rows(rows, mode, self.lhs_k), self.dtype)
            rhs = block_values(self.w, self.dtype)
            dims = ((1,), (1 if w_transposed else 0,))
        split = self.split_accumulator
        return scaled_dot(lhs, rhs, dims, scale, accumulate_dtype, result_dtype, split)
