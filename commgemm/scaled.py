"""The ops' quantized path (`scaling=`): operands quantized inside the op, the quantized payload
on the wire, partial sums reduced in bf16 or float32, and a straight-through VJP.

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
scales as its alpha); with a fused config (PIPELINE + atomic_gemm on Hopper), to the direct
kernels' float8 wgmma (commgemm.mosaic_gpu.fused). Hopper has no tensor cores for block
scales: block modes are emulated, dequantized per block in x's dtype, then multiplied (the
layout, `quant.swizzle_block_scales`, is ready for hardware that has them).

How the operands are quantized (x, w, a weight quantized once for several calls, dY):
commgemm.operand_scaling.

Backward (straight-through, as the reference system's): dY is quantized by current scaling to
`grad_dtype` (float8_e5m2 by default; block modes use their own format), with its amax over the
axis; dX runs the forward's complementary collective with the forward's method, on the
quantized dY and W (block modes quantize W again with blocks along N, dX's contracting
dimension). With fast dgrad (`ScalingRecipe.split_accumulator[1]` False) a fused forward's
dX runs the other collective's fused kernel, as a bf16 op's does
(`autodiff.fused_backward_config`), e5m2 dY times e4m3 W on the float8 tensor cores, and the
AG kernel returns the float8 dY rows it gathered for dW; with promoted dgrad (the default) it
runs RING_EXCHANGE, on XLA's promoted FP8 GEMMs, which the kernels' split form was not faster
than (BENCHMARKS.md "A float8 op's backward"). dW multiplies the quantized X (the gathered
payload, for AG) by the quantized dY.
Block modes' dW is emulated on the row-wise blocks (the hardware would want blocks along the
rows, dW's contracting dimension). Delayed scaling with a `dy_state` scales dY by that state's
scale instead and returns the advanced state as the state's cotangent (`dy_quantized`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from commgemm.config import Collective, OverlapConfig
from commgemm.operand_scaling import (
    check_blocks,
    check_scales,
    dy_quantized,
    quantize_operand,
    tensor_scale,
    weight_operand,
)
from commgemm.operands import dot
from commgemm.quant import (
    E8M0,
    TENSOR_MODES,
    ScaledTensor,
    Scaling,
    ScalingMode,
    ScalingRecipe,
    ScalingState,
    _held,
    amax,
    as_recipe,
    dequantize,
    quantize,
)
from commgemm.vma import all_reduce_transpose, like_primal


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


def _block_values(t: ScaledTensor, dtype) -> jax.Array:
    """A block-scaled tensor's values times its block scales (the global scale left out)."""
    return dequantize(dataclasses.replace(t, global_scale_inv=None), dtype)


def _scaled_dot(lhs, rhs, dims, scale, accumulate_dtype, result_dtype, split: bool):
    """lax.dot_general(lhs, rhs) * scale in `result_dtype`.

    Float8 operands on an NVIDIA GPU: one cuBLASLt FP8 GEMM with the result in `result_dtype`
    and the scale folded into it (XLA's ANY_F8_ANY_F8_ANY algorithm, `split` choosing the
    promoted or the fast accumulation), so no float32 result is written and cast in a second
    pass (BENCHMARKS.md "FP8 GEMMs"). Elsewhere (other backends, the block modes' emulation):
    a float32 accumulation, scaled, then cast."""
    result = jnp.dtype(result_dtype or accumulate_dtype)
    if jnp.dtype(lhs.dtype).itemsize == 1 and jax.default_backend() == "gpu":
        preset = lax.DotAlgorithmPreset
        algorithm = preset.ANY_F8_ANY_F8_ANY if split else preset.ANY_F8_ANY_F8_ANY_FAST_ACCUM
        out = lax.dot_general(lhs, rhs, (dims, ((), ())), precision=algorithm,
                              preferred_element_type=result)  # fmt: skip
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
        transposed copy, else the values transposed (a copy XLA makes in each call)."""
        if w_transposed:
            return self.w.data
        return self.w.data.T if self.transposed is None else self.transposed

    def matmul(
        self, rows: jax.Array, w_transposed: bool, accumulate_dtype: str, result_dtype
    ) -> jax.Array:
        """payload rows [r, K(+scales)] @ W -> [r, n], scaled back, in `result_dtype`."""
        mode = self.w.mode
        scale = self.lhs_scale_inv * tensor_scale(self.w)
        if mode in TENSOR_MODES:  # K-major: no transpose where w's is kept
            lhs, rhs, dims = rows, self.k_major(w_transposed), ((1,), (1,))
        else:
            lhs = _block_values(unpack_rows(rows, mode, self.lhs_k), self.dtype)
            rhs = _block_values(self.w, self.dtype)
            dims = ((1,), (1 if w_transposed else 0,))
        return _scaled_dot(lhs, rhs, dims, scale, accumulate_dtype, result_dtype,
                           self.split_accumulator)  # fmt: skip


def _rows(t_payload: jax.Array, mode: ScalingMode, k: int, dtype) -> jax.Array:
    """A payload's values for dW: float8 as is (tensor modes), else dequantized per block."""
    if mode in TENSOR_MODES:
        return t_payload
    return _block_values(unpack_rows(t_payload, mode, k), dtype)


def _weight_grad(a, a_scale, d, d_scale, fmt, k_a, k_d, w_transposed, cfg, w_dtype):
    """dW = A^T @ dY as [K, n] (or dY^T @ A as [n, K]), from their payloads."""
    mode, _, split = fmt
    a_rows, d_rows = _rows(a, mode, k_a, w_dtype), _rows(d, mode, k_d, w_dtype)
    lhs, rhs = (d_rows, a_rows) if w_transposed else (a_rows, d_rows)
    scale = a_scale * d_scale
    return _scaled_dot(lhs, rhs, ((0,), (0,)), scale, cfg.accumulate_dtype, w_dtype, split[2])


def collective_matmul(
    collective: Collective,
    x: jax.Array,
    w: jax.Array,
    axis_name: str,
    cfg: OverlapConfig,
    w_transposed: bool,
    recipe: ScalingRecipe,
) -> jax.Array:
    """The validated 2-D collective GEMM of commgemm.ops under `recipe`: x [rows, K] quantized
    with blocks along K, w along its K dimension, scales shared over `axis_name`. Collective
    NONE (axis_name None) is the local GEMM, out in cfg.out_dtype."""
    check_blocks(recipe, x.shape[1], w.shape[0] if w_transposed else w.shape[1])
    qx = quantize_operand(lax.stop_gradient(x), recipe, -1, axis_name, recipe.x_state)
    k_dim = 1 if w_transposed else 0
    w, qw, kept = weight_operand(w, recipe, k_dim, () if axis_name is None else axis_name)
    fmt = (recipe.mode, recipe.grad_dtype, recipe.split_accumulator)
    return _scaled(collective, axis_name, cfg, w_transposed, fmt, x, w, qx, qw, recipe.dy_state,
                   kept)  # fmt: skip


def prequantized_matmul(
    collective: Collective,
    qx: ScaledTensor,
    qw: ScaledTensor,
    axis_name: str,
    cfg: OverlapConfig,
    w_transposed: bool,
) -> jax.Array:
    """The 2-D collective GEMM on operands the caller quantized: qx [rows, K] (blocks along K),
    qw [K, n] (or [n, K] with w_transposed; blocks along K). Forward only; the result in
    cfg.out_dtype."""
    if qx.mode is not qw.mode:
        raise ValueError(f"x is {qx.mode.name} but w is {qw.mode.name}: quantize both alike")
    for name, t in (("x", qx), ("w", qw)):
        check_scales(name, t)
    k_dim = 1 if w_transposed else 0
    if qx.mode not in TENSOR_MODES and (qw.axis % 2 != k_dim):
        raise ValueError(
            f"w's blocks run along its dimension {qw.axis % 2}, but its K dimension is {k_dim}: "
            f"quantize w with axis={k_dim}"
        )
    fmt = (qx.mode, "float8_e5m2", ScalingRecipe().split_accumulator)
    like_x = qx.data[:0].astype(cfg.out_dtype)  # the dtype, K and varying axes _forward reads
    out, _ = _forward(collective, axis_name, cfg, w_transposed, fmt, like_x, None, qx, qw)
    return out


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _scaled(
    collective: Collective,
    axis_name: str,
    cfg: OverlapConfig,
    w_transposed: bool,
    fmt: tuple[ScalingMode, str, tuple[bool, bool, bool]],
    x: jax.Array,
    w: jax.Array,
    qx: ScaledTensor,
    qw: ScaledTensor,
    dy_state: ScalingState | None,
    kept: jax.Array | None = None,
) -> jax.Array:
    """The 2-D collective GEMM on quantized operands qx (x's rows, blocks along K) and qw (w,
    blocks along K; `kept`: its values transposed, or None); x and w are what gradients flow
    to (straight-through); dy_state's cotangent is its advanced state (`dy_quantized`)."""
    return _forward(collective, axis_name, cfg, w_transposed, fmt, x, w, qx, qw, dy_state,
                    kept)[0]  # fmt: skip


def _forward(collective, axis_name, cfg, w_transposed, fmt, x, w, qx, qw, dy_state=None,
             kept=None):  # fmt: skip
    from commgemm.autodiff import FN_NAMES
    from commgemm.xla import module_for

    k = x.shape[1]
    rhs = QuantizedRhs(qw, tensor_scale(qx), k, x.dtype.name, fmt[2][0], kept)
    if collective is Collective.NONE:  # a local GEMM
        out = rhs.matmul(payload(qx), w_transposed, cfg.accumulate_dtype, cfg.out_dtype)
        return out, (payload(qx), tensor_scale(qx), w, qw, x[:0], dy_state, kept)
    fn = getattr(module_for(cfg), FN_NAMES[collective])
    if collective is Collective.ALL_GATHER:
        out, rows = fn(payload(qx), rhs, axis_name, cfg, w_transposed=w_transposed,
                       return_gathered=True)  # fmt: skip
    else:
        out, rows = fn(payload(qx), rhs, axis_name, cfg, w_transposed=w_transposed), payload(qx)
    like_x = x[:0]  # x's dtype, K and varying axes, as an array residual
    return out, (rows, tensor_scale(qx), w, qw, like_x, dy_state, kept)


def _backward_config(collective, cfg, like_x, dy, w, axis_name, w_transposed, mode, split):
    """The config of dX's collective GEMM: for a tensor mode's AG or RS with fast dgrad (`split`
    False), as the bf16 op's (`autodiff.fused_backward_config`: a fused forward's dX on the
    other collective's fused kernel, float8 wgmma on the quantized dY and W); else
    `autodiff.backward_config` (a fused forward's dX on RING_EXCHANGE, whose XLA GEMMs promote
    faster than the kernels' split form: BENCHMARKS.md "A float8 op's backward")."""
    from commgemm.autodiff import backward_config, fused_backward_config

    fused_kernels = collective in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER)
    if mode in TENSOR_MODES and fused_kernels and not split:
        return fused_backward_config(collective, cfg, like_x, dy, w, axis_name, w_transposed)
    return backward_config(cfg, like_x)


def _backward(collective, axis_name, cfg, w_transposed, fmt, residuals, dy):
    from commgemm.xla import module_for

    rows, x_scale, w, qw, like_x, dy_state, kept = residuals
    x_dtype, k = like_x.dtype, like_x.shape[1]
    mode, grad_dtype, split = fmt
    back = _backward_config(collective, cfg, like_x, dy, w, axis_name, w_transposed, mode,
                            split[1])  # fmt: skip
    if collective is Collective.ALL_REDUCE:
        dy = all_reduce_transpose(dy, axis_name)
    n = dy.shape[1]
    names = () if axis_name is None else axis_name
    qdy, new_state = dy_quantized(dy, mode, grad_dtype, names, dy_state)
    if mode not in TENSOR_MODES:  # blocks along N, dX's contracting dimension
        n_dim = 0 if w_transposed else 1
        qw, kept = quantize(w, mode, axis=n_dim, amax=amax(w, names)), None
    rhs = QuantizedRhs(qw, tensor_scale(qdy), n, x_dtype.name, split[1], kept)
    if collective is Collective.ALL_GATHER:
        dx = module_for(back).matmul_reduce_scatter(
            payload(qdy), rhs, axis_name, back, w_transposed=not w_transposed
        )
        d_rows = payload(qdy)
    elif collective is Collective.REDUCE_SCATTER:
        dx, d_rows = module_for(back).all_gather_matmul(
            payload(qdy), rhs, axis_name, back, w_transposed=not w_transposed,
            return_gathered=True,
        )  # fmt: skip
    else:  # a local GEMM, or the GEMM of an all-reduce (whose transpose is done above)
        d_rows = payload(qdy)
        dx = rhs.matmul(d_rows, not w_transposed, cfg.accumulate_dtype, x_dtype)
    dw = _weight_grad(
        rows, x_scale, d_rows, tensor_scale(qdy), fmt, k, n, w_transposed, cfg, w.dtype
    )
    return like_primal(dx.astype(x_dtype), like_x), like_primal(dw, w), None, None, new_state, None


_scaled.defvjp(_forward, _backward)


def matmul(
    x: jax.Array, w: jax.Array, scaling: Scaling, *, w_transposed: bool = False
) -> jax.Array:
    """x [..., K] @ w [K, N] (or [N, K] with w_transposed) under `scaling`, as one GEMM: on one
    device, or on global arrays that XLA partitions (with the whole tensor's amax). Returns
    [..., N] in x's dtype; differentiable as the ops are. No scaling: a plain dot."""
    recipe = as_recipe(scaling)
    x2d = x.reshape(-1, x.shape[-1])
    if recipe is None:
        wide = jnp.promote_types(x.dtype, jnp.float32).name
        dims = ((1,), (1 if w_transposed else 0,))
        out = dot(x2d, w, dims, accumulate_dtype=wide, result_dtype=x.dtype)
        return out.reshape(*x.shape[:-1], -1)
    cfg = OverlapConfig(out_dtype=x.dtype.name)
    out = collective_matmul(Collective.NONE, x2d, w, None, cfg, w_transposed, recipe)
    return out.reshape(*x.shape[:-1], -1)
