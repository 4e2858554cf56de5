"""Per-shard collective GEMMs, called inside `jax.shard_map` like the lax collectives.

P is the size of mesh axis `axis_name`. Every op takes `config`: an `OverlapConfig`, a buffer id
from `create_overlap_buffer`, or None (Method.NONE, the serial baseline).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from commgemm.autodiff import collective_matmul
from commgemm.config import Collective, Method, OverlapConfig, uses_tpu_kernels
from commgemm.epilogue import Activation, apply_epilogue, check_epilogue
from commgemm.operand_scaling import rescaled_by_source, scales_may_differ, tensor_scale
from commgemm.operands import (
    axis_size,
    check_divisible,
    check_dtypes,
    collapse_rows,
    normalize_axis,
)
from commgemm.plan import make_plan, with_dtypes
from commgemm.quant import (
    ScaledTensor,
    Scaling,
    ScalingRecipe,
    as_recipe,
    check_weight_scaling,
)
from commgemm.registry import resolve
from commgemm.scaled import prequantized_matmul
from commgemm.vma import all_gather_invariant

ConfigLike = OverlapConfig | int | None


def _as_rows(x: jax.Array, axis: int, x_transposed: bool) -> tuple[jax.Array, object]:
    if x.ndim < 2:
        raise ValueError(
            f"x must be [rows, K] (or [..., rows, K]), got shape {x.shape}: for one vector "
            "of K values pass x[None]"
        )
    if x_transposed:
        if x.ndim != 2:
            raise ValueError(f"x_transposed=True needs a 2-D x [K, m], got shape {x.shape}")
        x = x.T
    return collapse_rows(x, normalize_axis(axis, x.ndim))


def _run(
    collective: Collective,
    fn_name: str,
    x: jax.Array,
    w: jax.Array,
    axis_name: str,
    config: ConfigLike,
    axis: int,
    w_transposed: bool,
    x_transposed: bool,
    bias: jax.Array | None,
    activation: Activation,
    return_pre_activation: bool,
    scaling: Scaling,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    if isinstance(x, ScaledTensor) or isinstance(w, ScaledTensor):
        if x_transposed or bias is not None or activation is not None or scaling is not None:
            raise ValueError(
                f"{fn_name} on ScaledTensor operands takes no x_transposed, bias, activation or "
                "scaling (apply the epilogue to the result)"
            )
        return _run_prequantized(collective, fn_name, x, w, axis_name, config, axis, w_transposed)
    recipe = as_recipe(scaling)
    check_weight_scaling(fn_name, w, recipe)
    x2d, restore = _as_rows(x, axis, x_transposed)
    plan = make_plan(
        x2d,
        w,
        axis_name,
        config,
        collective,
        rows=x2d.shape[0],
        w_transposed=w_transposed,
        op=fn_name,
        recipe=recipe,
    )
    n = w.shape[0] if w_transposed else w.shape[1]
    check_epilogue(bias, activation, n, x.dtype)
    if 0 in (x2d.shape + (n,)):
        z = _empty_result(collective, x2d, n, plan)
    else:
        z = collective_matmul(collective, x2d, w, axis_name, plan.config, w_transposed, recipe)
    return apply_epilogue(restore(z), bias, activation, return_pre_activation)


def _run_prequantized(collective, fn_name, x, w, axis_name, config, axis, w_transposed):
    """The op on operands the caller quantized (commgemm.scaled.prequantized_matmul)."""
    if not (isinstance(x, ScaledTensor) and isinstance(w, ScaledTensor)):
        raise TypeError(f"{fn_name}: quantize both x and w (cg.quantize), or pass scaling=")
    data2d, restore = _as_rows(x.data, axis, False)
    scales2d = x.scale_inv if x.scale_inv.ndim == 0 else _as_rows(x.scale_inv, axis, False)[0]
    x2d = dataclasses.replace(x, data=data2d, scale_inv=scales2d, axis=-1)
    out_dtype = resolve(config)[0].out_dtype or "float32"
    stand_in = jax.ShapeDtypeStruct(data2d.shape, out_dtype)  # what the plan checks shapes by
    w_stand_in = jax.ShapeDtypeStruct(w.data.shape, out_dtype)
    recipe = ScalingRecipe(x.mode)  # the defaults, which scaled.prequantized_matmul runs
    plan = make_plan(
        stand_in,
        w_stand_in,
        axis_name,
        config,
        collective,
        rows=data2d.shape[0],
        w_transposed=w_transposed,
        op=fn_name,
        recipe=recipe,
    )
    out = prequantized_matmul(collective, x2d, w, axis_name, plan.config, w_transposed)
    if collective is Collective.ALL_GATHER and scales_may_differ(x, axis_name):
        out = rescaled_by_source(out, tensor_scale(x), axis_name)
    return restore(out)


def _empty_result(collective: Collective, x2d: jax.Array, n: int, plan) -> jax.Array:
    """The result of a call with a zero-size M, K or N, as jnp.dot gives it (zeros where K = 0,
    empty otherwise), without a collective: there is nothing to move."""
    rows = x2d.shape[0]
    rows = {
        Collective.ALL_GATHER: rows * plan.axis_size,
        Collective.REDUCE_SCATTER: rows // plan.axis_size,
    }.get(collective, rows)
    return jnp.zeros((rows, n), plan.config.out_dtype)


_EPILOGUE_DOC = """
    Quantized (all ops): `scaling` (a `ScalingMode`, its name, or a `ScalingRecipe`) quantizes
    x and w inside the op: the AG moves the quantized payload, RS and AR reduce in the output
    (or reduce) dtype, and the backward quantizes dY; see commgemm.scaled. None or NO_SCALING:
    the operands as they are. x and w may also be `ScaledTensor`s quantized by the caller (x
    with blocks along K, w along its K dimension; tensor scales shared over the axis, e.g.
    `cg.quantize(x, mode, amax=cg.amax(x, axis_name))`): forward only, not differentiable,
    the result in config.out_dtype (default float32), no epilogue. For training, w may be a
    `QuantizedWeight` (`cg.quantize_weight(w, scaling, axis_name=...)`, once for several
    calls) with `scaling=`: differentiable, the gradient flowing to the weight.

    Epilogue (all ops): `bias` [n] (the output's last dimension, sharded like it) is added once,
    after any reduction; `activation` in {None, "gelu", "gelu_tanh"} follows; with
    `return_pre_activation=True` the op returns (y, pre_activation). Differentiable in reverse
    mode (grad, vjp; not jvp): the backward pass is overlapped with the forward's method (see
    commgemm.autodiff)."""


def all_gather_matmul(
    x: jax.Array,
    w: jax.Array,
    axis_name: str,
    *,
    config: ConfigLike = None,
    axis: int = 0,
    w_transposed: bool = False,
    x_transposed: bool = False,
    bias: jax.Array | None = None,
    activation: Activation = None,
    return_pre_activation: bool = False,
    scaling: Scaling = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """all_gather(x) @ w with the gather overlapped with the GEMM.

    Args:
      x: [m, K], the local row block of X [P*m, K] (sharded on `axis_name` along rows). N-D x
        [..., K] is gathered along `axis` (default 0), e.g. [B, S, H] with axis=1 for sequence
        parallelism. With x_transposed, x is [K, m].
      w: [K, n] local (or [n, K] with w_transposed).
      bias: [n], sharded like w's columns.
    Returns:
      [P*m, n] (N-D: x's shape with dimension `axis` multiplied by P and K replaced by n),
      replicated over `axis_name`; dtype config.out_dtype or x's.
    Raises:
      ValueError / TypeError on bad shapes, dtypes, axis names or configs (at trace time).
    """
    return _run(
        Collective.ALL_GATHER,
        "all_gather_matmul",
        x,
        w,
        axis_name,
        config,
        axis,
        w_transposed,
        x_transposed,
        bias,
        activation,
        return_pre_activation,
        scaling,
    )


def matmul_reduce_scatter(
    x: jax.Array,
    w: jax.Array,
    axis_name: str,
    *,
    config: ConfigLike = None,
    axis: int = 0,
    w_transposed: bool = False,
    x_transposed: bool = False,
    bias: jax.Array | None = None,
    activation: Activation = None,
    return_pre_activation: bool = False,
    scaling: Scaling = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """reduce_scatter(x @ w): the GEMM of a K-sharded pair, its sum scattered over rows.

    Args:
      x: [M, k], this device's K-slice (k = K/P) of X [M, K]; N-D x [..., k] is scattered along
        `axis` (default 0).
      w: [k, N], this device's K-slice of W [K, N] (or [N, k] with w_transposed).
      bias: [N], replicated; added once, after the reduction.
    Returns:
      [M/P, N]: this device's row block of X @ W (sharded on `axis_name` along rows).
    """
    return _run(
        Collective.REDUCE_SCATTER,
        "matmul_reduce_scatter",
        x,
        w,
        axis_name,
        config,
        axis,
        w_transposed,
        x_transposed,
        bias,
        activation,
        return_pre_activation,
        scaling,
    )


def matmul_all_reduce(
    x: jax.Array,
    w: jax.Array,
    axis_name: str,
    *,
    config: ConfigLike = None,
    axis: int = 0,
    w_transposed: bool = False,
    x_transposed: bool = False,
    bias: jax.Array | None = None,
    activation: Activation = None,
    return_pre_activation: bool = False,
    scaling: Scaling = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """all_reduce(x @ w) for a K-sharded pair.

    Args:
      x: [M, k], this device's K-slice of X [M, K]; `axis` is the dimension RING_EXCHANGE and
        PIPELINE split (default 0).
      w: [k, N], this device's K-slice of W (or [N, k] with w_transposed).
      bias: [N], replicated; added once, after the reduction.
    Returns:
      [M, N] = X @ W, replicated over `axis_name`.
    """
    return _run(
        Collective.ALL_REDUCE,
        "matmul_all_reduce",
        x,
        w,
        axis_name,
        config,
        axis,
        w_transposed,
        x_transposed,
        bias,
        activation,
        return_pre_activation,
        scaling,
    )


def matmul_2d(
    x: jax.Array,
    w: jax.Array,
    *,
    row_axis: str,
    k_axis: str,
    config: ConfigLike = None,
    bias: jax.Array | None = None,
    activation: Activation = None,
    return_pre_activation: bool = False,
    scaling: Scaling = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """The 2-D mesh case: x P(row_axis, k_axis), w P(row_axis, None) -> out P(row_axis, None).

    The contracting dimension is sharded on both axes: x's columns on `k_axis`, w's rows on
    `row_axis`. W's rows are all-gathered over `row_axis`, this device's K block is multiplied,
    and the partial sums are all-reduced over `k_axis`.

    Args:
      x: [m, K/Y] local (Y = size of k_axis).
      w: [K/X, N] local (X = size of row_axis).
    Returns:
      [m, N], this device's row block of X @ W, replicated over `k_axis`.
    Methods: NONE (gather, GEMM, all-reduce); PIPELINE (N in num_splits column chunks, each
    chunk's gather and all-reduce overlapping its neighbours' GEMMs); RING_EXCHANGE (gather, then
    the ring reduce-scatter + all-gather over k_axis); atomic_gemm with the TPU kernels (the
    fused GEMM + reduce-scatter kernel along k_axis, its ring or direct form by the method,
    then the all-gather; the gather of W over row_axis stays outside the kernel).
    `scaling` quantizes x and W (one tensor scale each, or blocks along K) and W's rows travel
    quantized (commgemm.scaled_2d); with the TPU kernels (tensor modes) the float8 K blocks go
    to the fused GEMM + reduce-scatter.
    """
    cfg, _ = resolve(config)
    check_dtypes(x, w)
    check_weight_scaling("matmul_2d", w, scaling)
    if x.ndim != 2 or w.ndim != 2:
        raise ValueError(f"matmul_2d needs 2-D x and w, got {x.shape} and {w.shape}")
    if row_axis == k_axis:
        raise ValueError(f"row_axis and k_axis must differ, both are {row_axis!r}")
    n_rows, n_k = axis_size(row_axis), axis_size(k_axis)
    k_total = w.shape[0] * n_rows
    if x.shape[1] * n_k != k_total:
        raise ValueError(
            f"contracting dimensions differ: x {x.shape} x {k_axis}={n_k} gives K="
            f"{x.shape[1] * n_k}, w {w.shape} x {row_axis}={n_rows} gives K={k_total}"
        )
    if cfg.method in (Method.BULK, Method.AUTO) or (cfg.atomic_gemm and not uses_tpu_kernels(cfg)):
        raise ValueError(
            f"matmul_2d supports methods NONE, PIPELINE and RING_EXCHANGE (and the TPU kernels, "
            f"atomic_gemm on a TPU or with interpret=True), got "
            f"{cfg.method.name}{' with atomic_gemm' if cfg.atomic_gemm else ''}"
        )
    check_epilogue(bias, activation, w.shape[1], x.dtype)
    cfg = with_dtypes(cfg, x.dtype).replace(collective=None)
    if 0 in (x.shape + w.shape):  # nothing to move: jnp.dot's zeros or empty result
        z = jnp.zeros((x.shape[0], w.shape[1]), cfg.out_dtype)
        return apply_epilogue(z, bias, activation, return_pre_activation)
    k_index = lax.axis_index(k_axis)

    def local_k_block(w_cols: jax.Array) -> jax.Array:
        gathered = lax.all_gather(w_cols, row_axis, axis=0, tiled=True)  # [K, n]
        return lax.dynamic_slice_in_dim(gathered, k_index * x.shape[1], x.shape[1], axis=0)

    recipe = as_recipe(scaling)
    if cfg.atomic_gemm and recipe is None:  # the TPU kernels: GEMM + RS along k_axis, gather
        part = matmul_reduce_scatter(x, local_k_block(w), k_axis, config=cfg)
        z = all_gather_invariant(part, k_axis)
        return apply_epilogue(z, bias, activation, return_pre_activation)
    splits = cfg.num_splits if cfg.method is Method.PIPELINE else 1
    check_divisible(w.shape[1], splits, "matmul_2d: N", "num_splits")
    width = w.shape[1] // splits
    base = cfg.replace(method=Method.NONE, num_splits=1, bidirectional=False)
    if recipe is not None:  # W's rows travel quantized
        from commgemm import scaled_2d

        chunk = cfg if cfg.method is Method.RING_EXCHANGE or cfg.atomic_gemm else base
        block = jax.ShapeDtypeStruct((x.shape[1], width), x.dtype)  # a chunk's K block of W
        # the TPU kernels reduce over k_axis by their GEMM + RS, then gather: planned as RS
        reduce = Collective.REDUCE_SCATTER if cfg.atomic_gemm else Collective.ALL_REDUCE
        plan = make_plan(
            x,
            block,
            k_axis,
            chunk,
            reduce,
            rows=x.shape[0],
            w_transposed=False,
            op="matmul_2d",
            recipe=recipe,
        )
        z = scaled_2d.matmul_2d(x, w, row_axis, k_axis, plan.config, splits, recipe)
        return apply_epilogue(z, bias, activation, return_pre_activation)
    if cfg.method is Method.RING_EXCHANGE:
        z = matmul_all_reduce(x, local_k_block(w), k_axis, config=cfg)
        return apply_epilogue(z, bias, activation, return_pre_activation)
    outs = [
        matmul_all_reduce(x, local_k_block(w[:, c * width : (c + 1) * width]), k_axis, config=base)
        for c in range(splits)
    ]
    z = jnp.concatenate(outs, axis=1)
    return apply_epilogue(z, bias, activation, return_pre_activation)


for _op in (all_gather_matmul, matmul_reduce_scatter, matmul_all_reduce):
    _op.__doc__ += _EPILOGUE_DOC
