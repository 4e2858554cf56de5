"""The one custom VJP of the collective GEMMs, which keeps the backward pass overlapped in the
forward's method family, for plain and quantized operands alike.

  AG + GEMM   forward: Y = all_gather(X) @ W
              backward: dX = reduce_scatter(dY @ W^T)       (GEMM + RS, same method)
                        dW = all_gather(X)^T @ dY            (X saved from the forward, or
                                                              re-gathered beside the dX GEMM: BULK)
  GEMM + RS   forward: Y = reduce_scatter(X @ W)
              backward: dX = all_gather(dY) @ W^T            (AG + GEMM, same method; the ring
                        dW = X^T @ all_gather(dY)             also returns the gathered dY)
  GEMM + AR   forward: Y = all_reduce(X @ W)
              backward: dP = the transpose of the all-reduce applied to dY; dX = dP @ W^T,
                        dW = X^T @ dP (both local)
  A fused Hopper forward (atomic_gemm, one kernel) runs dX on the other collective's fused
  kernel of its method family where that kernel takes dY's shape, else RING_EXCHANGE
  (`fused_backward_config`); the fused AG kernel returns the rows it gathered.

A `Quantizer` says how the operands and dY enter the GEMMs. `NO_QUANTIZER` (plain operands)
passes them as they are, as Transformer Engine's no-op quantizer set. A recipe's quantizer
(straight-through, as the reference system's): x and w are quantized before the op (their
payload moves; commgemm.quantized_gemm), dY by current scaling to `grad_dtype` (float8_e5m2 by
default; block modes use their own format) with its amax over the axis, or by the caller's
`dy_state` (delayed scaling, its advanced state returned as the state's cotangent); dX runs the
complementary collective on the quantized dY and W (block modes quantize W again with blocks
along N, dX's contracting dimension); with fast dgrad (`ScalingRecipe.split_accumulator[1]`
False) a fused forward's dX runs the other collective's fused kernel as a plain op's does, else
RING_EXCHANGE on XLA's promoted FP8 GEMMs. dW multiplies the quantized X (the gathered payload,
for AG) by the quantized dY; block modes' dW is emulated on the row-wise blocks.

All functions act on the 2-D views [rows, K]; the epilogue (bias, GELU) stays outside, where JAX
differentiates it and XLA fuses the bias gradient and GELU derivative into one pass. dX and dW
are typed as x and w (under check_vma: summed over a mesh axis only the cotangent varies over,
e.g. a data axis the weights are replicated over; vma.like_primal).

Reverse mode only, as for any `jax.custom_vjp`: grad, vjp and grad of grad work; jvp, jacfwd
and hessian (forward mode) raise JAX's TypeError.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax import lax

from commgemm.backend import FN_NAMES, backend_for
from commgemm.config import Collective, OverlapConfig, uses_tpu_kernels
from commgemm.operand_scaling import (
    check_blocks,
    dy_quantized,
    tensor_scale,
    weight_operand,
    x_operand,
)
from commgemm.operands import dot
from commgemm.quant import TENSOR_MODES, ScaledTensor, ScalingMode, ScalingRecipe, amax, quantize
from commgemm.quantized_gemm import QuantizedRhs, block_values, payload, scaled_dot, unpack_rows
from commgemm.vma import all_reduce_transpose, like_primal


@dataclasses.dataclass(frozen=True)
class Quantizer:
    """How a call's operands and dY enter its GEMMs: `mode` None passes them as they are (the
    no-op quantizer); else `mode`'s scaling, dY in `grad_dtype`, and the recipe's
    split_accumulator flags (forward, dgrad, wgrad)."""

    mode: ScalingMode | None = None
    grad_dtype: str = "float8_e5m2"
    split: tuple[bool, bool, bool] = (True, True, True)

    @classmethod
    def of(cls, recipe: ScalingRecipe) -> Quantizer:
        return cls(recipe.mode, recipe.grad_dtype, recipe.split_accumulator)

    @property
    def active(self) -> bool:
        return self.mode is not None

    def lhs(self, x: jax.Array, qx: ScaledTensor | None) -> tuple[jax.Array, jax.Array | None]:
        """The left operand's rows as they travel, and its tensor scale (None: plain)."""
        return (x, None) if qx is None else (payload(qx), tensor_scale(qx))

    def rhs(self, w, qw, lhs_scale, k: int, dtype: str, split: bool, kept=None):
        """W as the methods' local GEMM takes it: w itself, or a `QuantizedRhs`."""
        if not self.active:
            return w
        return QuantizedRhs(qw, lhs_scale, k, dtype, split, kept)

    def local(self, rows, rhs, w_transposed: bool, accumulate_dtype: str, out_dtype) -> jax.Array:
        """rows @ W on one device: [r, n] in out_dtype."""
        if self.active:
            return rhs.matmul(rows, w_transposed, accumulate_dtype, out_dtype)
        dims = ((1,), (1 if w_transposed else 0,))
        return dot(rows, rhs, dims, accumulate_dtype=accumulate_dtype, result_dtype=out_dtype)

    def weight_grad(
        self,
        a,
        a_scale,
        d,
        d_scale,
        k_a: int,
        k_d: int,
        w_transposed: bool,
        accumulate_dtype: str,
        w_dtype,
    ) -> jax.Array:
        """dW for out = a @ W from the rows of a and dY: a^T @ d as [K, n], or d^T @ a as
        [n, K] when W is stored transposed."""
        if self.active and self.mode not in TENSOR_MODES:  # dequantized per block
            a = block_values(unpack_rows(a, self.mode, k_a), w_dtype)
            d = block_values(unpack_rows(d, self.mode, k_d), w_dtype)
        lhs, rhs = (d, a) if w_transposed else (a, d)
        if not self.active:
            return dot(
                lhs, rhs, ((0,), (0,)), accumulate_dtype=accumulate_dtype, result_dtype=w_dtype
            )
        dims, scale = ((0,), (0,)), a_scale * d_scale
        return scaled_dot(lhs, rhs, dims, scale, accumulate_dtype, w_dtype, self.split[2])


NO_QUANTIZER = Quantizer()
#: The collective of dX's GEMM for a forward of each.
OTHER_COLLECTIVE = {
    Collective.ALL_GATHER: Collective.REDUCE_SCATTER,
    Collective.REDUCE_SCATTER: Collective.ALL_GATHER,
}


def backward_config(cfg: OverlapConfig, x: jax.Array) -> OverlapConfig:
    """The forward's method for the backward collectives (the TPU kernels' backward runs the
    same kernels, AG <-> RS; a fused Hopper forward's backward is `unfused_backward`'s where
    no fused kernel takes it); gradients come out in x's dtype."""
    if uses_tpu_kernels(cfg):
        return cfg.replace(collective=None, out_dtype=x.dtype.name, reduce_dtype=None)
    return cfg.replace(
        atomic_gemm=False,
        kernel=None,
        aggregate=False,
        bidirectional=cfg.bidirectional or cfg.aggregate,
        collective=None,
        out_dtype=x.dtype.name,
    )


def unfused_backward(
    collective: Collective,
    cfg: OverlapConfig,
    x: jax.Array,
    dy: jax.Array,
    w: jax.Array,
    axis_name: str,
    w_transposed: bool,
    *,
    quantized: bool = False,
) -> OverlapConfig:
    """`backward_config`, and for a fused Hopper forward of `collective` (AG or RS) dX's
    collective (RS for an AG forward, AG for RS) by the XLA method the cost model picks for
    dX's own shape (`autotune.auto.unfused_plan`): on GPUs serial unless a split plan beats
    it by `AUTO_MARGINS` (the split rings ran slower than serial on 2 and 4 GPUs).
    w_transposed: the forward's."""
    back = backward_config(cfg, x)
    fused_forward = cfg.atomic_gemm and not uses_tpu_kernels(cfg)
    if not fused_forward or collective not in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER):
        return back
    from commgemm.autotune.auto import unfused_plan

    other = OTHER_COLLECTIVE[collective]
    size = lax.axis_size(axis_name)
    plan = unfused_plan(other, dy, w, size, w_transposed=not w_transposed, quantized=quantized)
    return back.replace(
        method=plan.method, num_splits=plan.num_splits, bidirectional=plan.bidirectional
    )


def fused_backward_config(
    collective: Collective,
    cfg: OverlapConfig,
    x: jax.Array,
    dy: jax.Array,
    w: jax.Array,
    axis_name: str,
    w_transposed: bool,
) -> OverlapConfig:
    """The backward config of a forward of `cfg`: for a fused Hopper forward of `collective`
    (AG or RS), the other collective's fused kernel of the same method family where it runs
    dY's shape (`mosaic_gpu.fused.backward_config`), else `unfused_backward`'s. w_transposed:
    the forward's."""
    fused_forward = cfg.atomic_gemm and not uses_tpu_kernels(cfg)
    if fused_forward and collective is not Collective.ALL_REDUCE and dy.dtype == x.dtype:
        from commgemm.mosaic_gpu import fused

        other = OTHER_COLLECTIVE[collective]
        size = lax.axis_size(axis_name)
        kernel = fused.backward_config(other, cfg, dy, w, size, w_transposed=not w_transposed)
        if kernel is not None:
            return kernel
    return unfused_backward(collective, cfg, x, dy, w, axis_name, w_transposed)


def _dgrad_config(collective, cfg, quantizer, like_x, dy, w, axis_name, w_transposed):
    """dX's config: `fused_backward_config` where dY enters the fused kernels (plain, or a
    tensor mode with fast dgrad), else `unfused_backward` (a fused forward's dX on the XLA
    method the cost model picks, with promoted XLA GEMMs the kernels' split form did not
    beat)."""
    fused_dgrad = not quantizer.active or (
        quantizer.mode in TENSOR_MODES
        and collective in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER)
        and not quantizer.split[1]
    )
    if fused_dgrad:
        return fused_backward_config(collective, cfg, like_x, dy, w, axis_name, w_transposed)
    return unfused_backward(
        collective, cfg, like_x, dy, w, axis_name, w_transposed, quantized=quantizer.active
    )


def collective_matmul(
    collective: Collective,
    x: jax.Array,
    w,
    axis_name: str | None,
    cfg: OverlapConfig,
    w_transposed: bool,
    recipe: ScalingRecipe | None = None,
) -> jax.Array:
    """The validated 2-D collective GEMM `collective` with method cfg.method (see ops): x
    [rows, K], w [K, n] (or [n, K] with w_transposed). With `recipe`, x is quantized with blocks
    along K and w along its K dimension (w may be a `QuantizedWeight`), scales shared over
    `axis_name`; Collective.NONE (axis_name None) is then the local GEMM. Out in
    cfg.out_dtype."""
    if recipe is None:
        return _vjp(collective, axis_name, cfg, w_transposed, NO_QUANTIZER, x, w, None, None)
    check_blocks(recipe, x.shape[1], w.shape[0] if w_transposed else w.shape[1])
    qx = x_operand(x, recipe, axis_name)
    k_dim = 1 if w_transposed else 0
    names = () if axis_name is None else axis_name
    # w [K, n]: the forward reads its values [n, K] (K-major), dX as they are
    w, qw, kept = weight_operand(w, recipe, k_dim, names, swap=not w_transposed)
    quantizer = Quantizer.of(recipe)
    return _vjp(
        collective, axis_name, cfg, w_transposed, quantizer, x, w, qx, qw, recipe.dy_state, kept
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _vjp(
    collective, axis_name, cfg, w_transposed, quantizer, x, w, qx, qw, dy_state=None, kept=None
):
    """x and w are what gradients flow to; qx, qw their quantized forms (None: plain; `kept`:
    qw's values transposed, or None); dy_state's cotangent is its advanced state."""
    return forward(
        collective, axis_name, cfg, w_transposed, quantizer, x, w, qx, qw, dy_state, kept
    )[0]


def forward(
    collective, axis_name, cfg, w_transposed, quantizer, x, w, qx, qw, dy_state=None, kept=None
):
    """The forward and its residuals: the rows dW reads (the gathered ones for AG, where kept),
    x's scale, w, qw, x (plain) or a zero-row slice of it (its dtype, K and varying axes)."""
    lhs, x_scale = quantizer.lhs(x, qx)
    rhs = quantizer.rhs(w, qw, x_scale, x.shape[1], x.dtype.name, quantizer.split[0], kept)
    like_x = x[:0] if quantizer.active else x
    if collective is Collective.NONE:  # a local GEMM
        out = quantizer.local(lhs, rhs, w_transposed, cfg.accumulate_dtype, cfg.out_dtype)
        return out, (lhs, x_scale, w, qw, like_x, dy_state, kept)
    fn = getattr(backend_for(cfg), FN_NAMES[collective])
    if collective is not Collective.ALL_GATHER:
        out, rows = fn(lhs, rhs, axis_name, cfg, w_transposed=w_transposed), lhs
    elif quantizer.active or cfg.save_gathered_input:
        out, rows = fn(lhs, rhs, axis_name, cfg, w_transposed=w_transposed, return_gathered=True)
    else:  # BULK: the backward gathers x again beside its dX GEMM
        out, rows = fn(lhs, rhs, axis_name, cfg, w_transposed=w_transposed), None
    return out, (rows, x_scale, w, qw, like_x, dy_state, kept)


def _backward(collective, axis_name, cfg, w_transposed, quantizer, residuals, dy):
    rows, x_scale, w, qw, like_x, dy_state, kept = residuals
    back = _dgrad_config(collective, cfg, quantizer, like_x, dy, w, axis_name, w_transposed)
    if collective is Collective.ALL_REDUCE:
        dy = all_reduce_transpose(dy, axis_name)
    n, x_dtype = dy.shape[1], like_x.dtype
    if quantizer.active:
        names = () if axis_name is None else axis_name
        qdy, new_state = dy_quantized(dy, quantizer.mode, quantizer.grad_dtype, names, dy_state)
        if quantizer.mode not in TENSOR_MODES:  # blocks along N, dX's contracting dimension
            n_dim = 0 if w_transposed else 1
            qw, kept = quantize(w, quantizer.mode, axis=n_dim, amax=amax(w, names)), None
        d, d_scale = payload(qdy), tensor_scale(qdy)
    else:
        (d, d_scale), new_state = (dy, None), None
    rhs = quantizer.rhs(w, qw, d_scale, n, x_dtype.name, quantizer.split[1], kept)
    backend = backend_for(back)
    if collective is Collective.ALL_GATHER:
        if rows is None:  # BULK: independent of the dX GEMM below, so XLA overlaps them
            rows = lax.all_gather(like_x, axis_name, axis=0, tiled=True)
        dx = backend.matmul_reduce_scatter(d, rhs, axis_name, back, w_transposed=not w_transposed)
        d_rows = d
    elif collective is Collective.REDUCE_SCATTER:
        dx, d_rows = backend.all_gather_matmul(
            d, rhs, axis_name, back, w_transposed=not w_transposed, return_gathered=True
        )
    else:  # a local GEMM, or the GEMM of an all-reduce (whose transpose is done above)
        d_rows = d
        dx = quantizer.local(d, rhs, not w_transposed, cfg.accumulate_dtype, x_dtype)
    k = like_x.shape[1]
    dw = quantizer.weight_grad(
        rows, x_scale, d_rows, d_scale, k, n, w_transposed, cfg.accumulate_dtype, w.dtype
    )
    dx, dw = like_primal(dx.astype(x_dtype), like_x), like_primal(dw, w)
    return dx, dw, None, None, new_state, None


_vjp.defvjp(forward, _backward)
