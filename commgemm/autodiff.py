"""Custom VJPs that keep the backward pass overlapped, in the same method family as the forward.

  AG + GEMM   forward: Y = all_gather(X) @ W
              backward: dX = reduce_scatter(dY @ W^T)       (GEMM + RS, same method)
                        dW = all_gather(X)^T @ dY            (X saved from the forward, or
                                                              re-gathered beside the dX GEMM: BULK)
  GEMM + RS   forward: Y = reduce_scatter(X @ W)
              backward: dX = all_gather(dY) @ W^T            (AG + GEMM, same method; the ring
                        dW = X^T @ all_gather(dY)             also returns the gathered dY)
  A fused Hopper forward (atomic_gemm, one kernel) runs dX on the other collective's fused
  kernel of its method family where that kernel takes dY's shape, else RING_EXCHANGE
  (`fused_backward_config`); the fused AG kernel returns the rows it gathered.
  GEMM + AR   forward: Y = all_reduce(X @ W)
              backward: dP = the transpose of the all-reduce applied to dY; dX = dP @ W^T,
                        dW = X^T @ dP (both local)

All functions act on the 2-D views [rows, K]; the epilogue (bias, GELU) stays outside, where JAX
differentiates it and XLA fuses the bias gradient and GELU derivative into one pass. dX and dW
are typed as x and w (under check_vma: summed over a mesh axis only the cotangent varies over,
e.g. a data axis the weights are replicated over; vma.like_primal).

Reverse mode only, as for any `jax.custom_vjp`: grad, vjp and grad of grad work; jvp, jacfwd
and hessian (forward mode) raise JAX's TypeError.
"""

from __future__ import annotations

import functools

import jax
from jax import lax

from commgemm.config import Collective, Method, OverlapConfig, uses_tpu_kernels
from commgemm.operands import dot
from commgemm.vma import all_reduce_transpose, like_primal
from commgemm.xla import module_for


def _weight_grad(a: jax.Array, d: jax.Array, w: jax.Array, w_transposed: bool, cfg) -> jax.Array:
    """dW for out = a @ W: a^T @ d as [K, n], or d^T @ a as [n, K] when W is stored transposed."""
    lhs, rhs = (d, a) if w_transposed else (a, d)
    return dot(lhs, rhs, ((0,), (0,)), accumulate_dtype=cfg.accumulate_dtype, result_dtype=w.dtype)


def backward_config(cfg: OverlapConfig, x: jax.Array) -> OverlapConfig:
    """The forward's method for the backward collectives (a fused Hopper forward's backward
    runs the ring, RING_EXCHANGE; the TPU kernels' backward runs the same kernels, AG <-> RS);
    gradients come out in x's dtype."""
    if uses_tpu_kernels(cfg):
        return cfg.replace(collective=None, out_dtype=x.dtype.name, reduce_dtype=None)
    return cfg.replace(
        method=Method.RING_EXCHANGE if cfg.atomic_gemm else cfg.method,
        atomic_gemm=False,
        kernel=None,
        aggregate=False,
        bidirectional=cfg.bidirectional or cfg.aggregate,
        collective=None,
        out_dtype=x.dtype.name,
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3, 4, 5))
def collective_matmul(
    collective: Collective,
    x: jax.Array,
    w: jax.Array,
    axis_name: str,
    cfg: OverlapConfig,
    w_transposed: bool,
) -> jax.Array:
    """The validated 2-D collective GEMM `collective` with method cfg.method (see ops)."""
    return _forward(collective, x, w, axis_name, cfg, w_transposed)[0]


FN_NAMES = {
    Collective.ALL_GATHER: "all_gather_matmul",
    Collective.REDUCE_SCATTER: "matmul_reduce_scatter",
    Collective.ALL_REDUCE: "matmul_all_reduce",
}


def _forward(collective, x, w, axis_name, cfg, w_transposed):
    module = module_for(cfg)
    if collective is Collective.ALL_GATHER and cfg.save_gathered_input:
        out, gathered = module.all_gather_matmul(
            x, w, axis_name, cfg, w_transposed=w_transposed, return_gathered=True
        )
        return out, (x, w, gathered)
    out = getattr(module, FN_NAMES[collective])(x, w, axis_name, cfg, w_transposed=w_transposed)
    return out, (x, w, None)


def fused_backward_config(
    collective: Collective, cfg: OverlapConfig, x: jax.Array, dy: jax.Array, w: jax.Array,
    axis_name: str, w_transposed: bool,
) -> OverlapConfig:  # fmt: skip
    """The backward config of a forward of `cfg`: for a fused Hopper forward of `collective`
    (AG or RS), the other collective's fused kernel of the same method family where it runs
    dY's shape (`mosaic_gpu.fused.backward_config`), else `backward_config`'s. w_transposed:
    the forward's."""
    back = backward_config(cfg, x)
    fused_forward = cfg.atomic_gemm and not uses_tpu_kernels(cfg)
    if not fused_forward or collective is Collective.ALL_REDUCE or dy.dtype != x.dtype:
        return back
    from commgemm.mosaic_gpu import fused

    other = {Collective.ALL_GATHER: Collective.REDUCE_SCATTER,
             Collective.REDUCE_SCATTER: Collective.ALL_GATHER}[collective]  # fmt: skip
    size = lax.axis_size(axis_name)
    kernel = fused.backward_config(other, cfg, dy, w, size, w_transposed=not w_transposed)
    return back if kernel is None else kernel


def _backward(collective, axis_name, cfg, w_transposed, residuals, dy):
    x, w, gathered = residuals
    back = fused_backward_config(collective, cfg, x, dy, w, axis_name, w_transposed)
    module = module_for(back)
    if collective is Collective.ALL_GATHER:
        if gathered is None:  # BULK: independent of the dX GEMM below, so XLA overlaps them
            gathered = lax.all_gather(x, axis_name, axis=0, tiled=True)
        dx = module.matmul_reduce_scatter(dy, w, axis_name, back, w_transposed=not w_transposed)
        return _typed(dx, x, _weight_grad(gathered, dy, w, w_transposed, cfg), w)
    if collective is Collective.REDUCE_SCATTER:
        dx, dy_gathered = module.all_gather_matmul(
            dy, w, axis_name, back, w_transposed=not w_transposed, return_gathered=True
        )
        return _typed(dx, x, _weight_grad(x, dy_gathered, w, w_transposed, cfg), w)
    dp = all_reduce_transpose(dy, axis_name)
    dx = dot(dp, w, ((1,), (0 if w_transposed else 1,)), accumulate_dtype=cfg.accumulate_dtype,
             result_dtype=x.dtype)  # fmt: skip
    return _typed(dx, x, _weight_grad(x, dp, w, w_transposed, cfg), w)


def _typed(dx, x, dw, w):
    """(dx, dw) typed as x and w (summed over the mesh axes only they vary over: vma)."""
    return like_primal(dx, x), like_primal(dw, w)


collective_matmul.defvjp(_forward, _backward)
