"""`gemm` under `jax.jit` where the operands' shardings are known only when XLA partitions the
program (mesh axes of type Auto): a `custom_partitioning` op whose partition callback reads the
shardings that propagation chose, picks the collective they imply (`gemm.classify`) and runs
the per-shard op; layouts it cannot overlap become a local GEMM on operands XLA reshards first
(correct, without overlap). A Shardy sharding rule (and the GSPMD callbacks) let sharding
propagation flow through it both ways.

Differentiable by a custom VJP: dX is partitioned the same way, with dX's sharding taken from
x's (the same op with w transposed, so the AG forward gets an RS backward and the reverse);
dW = X^T dY is left to XLA's partitioner.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from commgemm.config import Collective, OverlapConfig
from commgemm.operands import dot


@dataclasses.dataclass(frozen=True)
class _Call:
    """What one partitioned GEMM needs besides its operands (hashable: one op per value)."""

    ndim: int  # x's
    w_transposed: bool
    out_spec: tuple | None  # the result's spec, or None: like the third operand's
    config: OverlapConfig | int | None
    scaling: object
    out_dtype: str


def _plain(x: jax.Array, w: jax.Array, call: _Call) -> jax.Array:
    """The op's meaning: x @ w (w [N, K] when transposed), float32 accumulation; under
    call.scaling the quantized GEMM (as the fall-back's local GEMM: each row shard of x then
    takes its own scale, the operands being whole only along K)."""
    x2d = x.reshape(-1, x.shape[-1])
    if call.scaling is not None:
        from commgemm.scaled import matmul as quantized_matmul

        out = quantized_matmul(x2d, w, call.scaling, w_transposed=call.w_transposed)
        return out.astype(call.out_dtype).reshape(*x.shape[:-1], -1)
    wide = jnp.promote_types(x.dtype, jnp.float32).name
    dims = ((1,), (1 if call.w_transposed else 0,))
    out = dot(x2d, w, dims, accumulate_dtype=wide, result_dtype=call.out_dtype)
    return out.reshape(*x.shape[:-1], -1)


def _body(layout, call: _Call):
    """The per-shard function of a recognized layout."""
    from commgemm.ops import (
        all_gather_matmul,
        matmul_2d,
        matmul_all_reduce,
        matmul_reduce_scatter,
    )

    kwargs = dict(config=call.config, scaling=call.scaling)
    if layout.collective is Collective.NONE:
        row_axis, k_axis = layout.axis
        return lambda a, b: matmul_2d(a, b, row_axis=row_axis, k_axis=k_axis, **kwargs)
    op = {
        Collective.ALL_GATHER: all_gather_matmul,
        Collective.REDUCE_SCATTER: matmul_reduce_scatter,
        Collective.ALL_REDUCE: matmul_all_reduce,
    }[layout.collective]
    return lambda a, b: op(
        a, b, layout.axis, axis=layout.row_dim, w_transposed=call.w_transposed, **kwargs
    )


def _specs(mesh, arg_shapes, call: _Call):
    from commgemm.gemm import spec_entries

    names = tuple(mesh.axis_names)
    x_spec = spec_entries(arg_shapes[0].sharding.spec, call.ndim, "x", names)
    w_spec = spec_entries(arg_shapes[1].sharding.spec, 2, "w", names)
    if call.w_transposed:
        w_spec = w_spec[::-1]  # as [K, N]
    if call.out_spec is not None:
        out_spec = call.out_spec
    else:
        out_spec = spec_entries(arg_shapes[2].sharding.spec, call.ndim, "like", names)
    return x_spec, w_spec, out_spec


def _partition(call: _Call, mesh, arg_shapes, result_shape):
    from commgemm.gemm import classify_on

    x_spec, w_spec, out_spec = _specs(mesh, arg_shapes, call)
    layout = classify_on(mesh, x_spec, w_spec, out_spec)
    shard = lambda spec: NamedSharding(mesh, PartitionSpec(*spec))  # noqa: E731
    w_as_stored = (lambda s: s[::-1]) if call.w_transposed else (lambda s: s)
    if layout.collective is None:  # XLA reshards the operands; the GEMM is local
        rows = x_spec[:-1]
        x_spec, w_spec, out_spec = rows + (None,), (None, None), rows + (None,)
        body = functools.partial(_plain, call=call)
    else:
        body = _body(layout, call)
    args = (shard(x_spec), shard(w_as_stored(w_spec)))
    if call.out_spec is None:
        args += (arg_shapes[2].sharding,)
    lower = (lambda a, b, _like: body(a, b)) if call.out_spec is None else body
    return mesh, lower, shard(out_spec), args


def _infer(call: _Call, mesh, arg_shapes, result_shape):
    if call.out_spec is None:
        return arg_shapes[2].sharding
    return NamedSharding(mesh, PartitionSpec(*call.out_spec))


def _rule(call: _Call) -> str:
    rows = " ".join(f"r{i}" for i in range(call.ndim - 1))
    w = "n k" if call.w_transposed else "k n"
    rule = f"{rows} k, {w}"
    if call.out_spec is None:
        rule += f", {rows} n"
    return f"{rule} -> {rows} n"


@functools.lru_cache(maxsize=256)
def _op(call: _Call):
    """The custom-partitioned GEMM of `call` (one per distinct call, as jit caches by it)."""
    if call.out_spec is None:
        fn = custom_partitioning(lambda x, w, like: _plain(x, w, call))
    else:
        fn = custom_partitioning(lambda x, w: _plain(x, w, call))
    fn.def_partition(
        partition=functools.partial(_partition, call),
        infer_sharding_from_operands=functools.partial(_infer, call),
        sharding_rule=_rule(call),
        reduction_factors=("k",),
    )
    return fn


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _gemm(x: jax.Array, w: jax.Array, call: _Call) -> jax.Array:
    return _op(call)(x, w)


def _gemm_fwd(x, w, call):
    return _op(call)(x, w), (x, w)


def _gemm_bwd(call, residuals, dy):
    x, w = residuals
    back = dataclasses.replace(
        call, w_transposed=not call.w_transposed, out_spec=None, out_dtype=x.dtype.name
    )
    dx = _op(back)(dy, w, x)  # dY @ W^T, sharded like x
    rows = tuple(range(x.ndim - 1))
    lhs, rhs = (dy, x) if call.w_transposed else (x, dy)
    wide = jnp.promote_types(w.dtype, jnp.float32).name
    typed = jax.typeof(w).sharding  # on a mixed mesh: w's Explicit axes (the rows' are summed)
    explicit = typed.mesh.axis_names and any(t == AxisType.Explicit for t in typed.mesh.axis_types)
    dw = dot(lhs, rhs, (rows, rows), accumulate_dtype=wide, result_dtype=w.dtype,
             out_sharding=typed if explicit else None)  # fmt: skip
    return dx, dw


_gemm.defvjp(_gemm_fwd, _gemm_bwd)


def partitioned_gemm(
    x: jax.Array,
    w: jax.Array,
    *,
    mesh,
    out_spec: tuple,
    config: OverlapConfig | int | None,
    scaling,
    out_dtype: str,
) -> jax.Array:
    """x [..., K] @ w [K, N] -> [..., N] with sharding `out_spec` on `mesh`, overlapped where
    the shardings XLA's propagation chose imply a collective `gemm` knows."""
    call = _Call(x.ndim, False, tuple(out_spec), config, scaling, out_dtype)
    out = _gemm(x, w, call)
    explicit = {n for n, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
                if t == AxisType.Explicit}  # fmt: skip
    if explicit:  # a mixed mesh: the types carry the Explicit axes, the constraint the Auto ones
        auto_spec = [None if e in explicit else e for e in out_spec]
        typed = PartitionSpec(*[e if e in explicit else None for e in out_spec])
        out = jax.sharding.reshard(out, NamedSharding(mesh, typed))
        return lax.with_sharding_constraint(out, NamedSharding(mesh, PartitionSpec(*auto_spec)))
    return lax.with_sharding_constraint(out, NamedSharding(mesh, PartitionSpec(*out_spec)))
