"""`gemm` under `jax.jit` where the operands' shardings are known only when XLA partitions the
program (mesh axes of type Auto): a `custom_partitioning` op whose partition callback reads the
shardings that propagation chose, picks the collective they imply (`layout.classify_on`) and runs
the per-shard op; layouts it cannot overlap become a local GEMM on operands XLA reshards first
(correct, without overlap). A Shardy sharding rule (and the GSPMD callbacks) let sharding
propagation flow through it both ways.

Differentiable by a custom VJP whose backward is a second custom-partitioned op: (x, w, dY) ->
(dX, dW) sharded like x and w, partitioned by the same layout as the forward and computed by the
per-shard op's own VJP, so dX and dW come from one op that gathers each tensor once (the AG
forward's backward is GEMM + RS, the RS forward's is AG + GEMM sharing the gathered dY with dW)
and a quantized forward gets the quantized backward (dY in the recipe's grad_dtype, dW on
float8 operands) that the shard_map ops have.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from commgemm.config import Collective, OverlapConfig, uses_tpu_kernels
from commgemm.layout import classify_on, spec_entries
from commgemm.operands import dot
from commgemm.registry import resolve
from commgemm.vma import whole_cotangents


@dataclasses.dataclass(frozen=True)
class _Call:
    """What one partitioned GEMM needs besides its operands (hashable: one op per value)."""

    ndim: int  # x's
    out_spec: tuple  # the result's spec
    config: OverlapConfig | int | None
    scaling: object
    out_dtype: str
    in_dtype: str  # x's and w's


def _plain(x: jax.Array, w: jax.Array, call: _Call) -> jax.Array:
    """The op's meaning: x @ w, float32 accumulation; under call.scaling the quantized GEMM (as
    the fall-back's local GEMM: each row shard of x then takes its own scale, the operands being
    whole only along K)."""
    x2d = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])  # explicit sizes: M may be 0
    out_shape = (*x.shape[:-1], w.shape[1])
    if call.scaling is not None:
        from commgemm.scaled import matmul as quantized_matmul

        out = quantized_matmul(x2d, w, call.scaling)
        return out.astype(call.out_dtype).reshape(out_shape)
    wide = jnp.promote_types(x.dtype, jnp.float32).name
    out = dot(x2d, w, ((1,), (0,)), accumulate_dtype=wide, result_dtype=call.out_dtype)
    return out.reshape(out_shape)


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
    return lambda a, b: op(a, b, layout.axis, axis=layout.row_dim, **kwargs)


def _layout(call: _Call, mesh, arg_shapes):
    """(per-shard body, x spec, w spec, out spec, the axes the body all-reduces its result over)
    of the layout the operands' shardings imply; a layout gemm cannot overlap becomes a local
    GEMM on x's row shards and a whole w, which XLA reshards the operands to."""
    names = tuple(mesh.axis_names)
    x_spec = spec_entries(arg_shapes[0].sharding.spec, call.ndim, "x", names)
    w_spec = spec_entries(arg_shapes[1].sharding.spec, 2, "w", names)
    x_shape, w_shape = arg_shapes[0].shape, arg_shapes[1].shape
    uneven = not (
        _even(mesh, x_spec, x_shape)
        and _even(mesh, w_spec, w_shape)
        and _even(mesh, call.out_spec, (*x_shape[:-1], w_shape[1]))
    )
    layout = None if uneven else classify_on(mesh, x_spec, w_spec, call.out_spec)
    if layout is not None and layout.collective is not None:
        if _unrunnable(layout, call, mesh, tuple(x_shape), tuple(w_shape)) is not None:
            layout = None
    if layout is None or layout.collective is None:
        # XLA pads uneven shards with values that are not zeros: a dimension the GEMM
        # contracts, gathers or scatters must be whole, so uneven dimensions go unsharded
        rows = tuple(
            a if _divides(mesh, a, d) else None
            for a, d in zip(x_spec[:-1], x_shape[:-1], strict=True)
        )
        body = functools.partial(_plain, call=call)
        return body, rows + (None,), (None, None), rows + (None,), ()
    reduced = ()
    if layout.collective is Collective.ALL_REDUCE:
        reduced = (layout.axis,)
    elif layout.collective is Collective.NONE and not uses_tpu_kernels(resolve(call.config)[0]):
        reduced = (layout.axis[1],)  # matmul_2d all-reduces over its k axis
    return _body(layout, call), x_spec, w_spec, call.out_spec, reduced


def _divides(mesh, entry, dim: int) -> bool:
    """Whether the mesh axes of one spec entry split a dimension of `dim` evenly."""
    axes = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
    return dim % math.prod(mesh.shape[a] for a in axes) == 0


def _even(mesh, spec, shape) -> bool:
    return all(_divides(mesh, e, d) for e, d in zip(spec, shape, strict=True))


@functools.lru_cache(maxsize=256)
def _unrunnable(layout, call: _Call, mesh, x_shape, w_shape) -> str | None:
    """Why the per-shard op of `layout` refuses this call (its plan-time error), or None: found
    by tracing it on the shards' shapes, so that a refusal becomes a warning (once per call:
    the forward and backward partitions both ask) and the local GEMM rather than an error from
    inside XLA's partitioner."""
    from jax.sharding import Mesh

    def spec(s):
        return PartitionSpec(*s)

    concrete = mesh if isinstance(mesh, Mesh) else None
    if concrete is None:
        return None
    mapped = jax.shard_map(
        _body(layout, call),
        mesh=concrete,
        in_specs=(spec(layout.x_spec), spec(layout.w_spec)),
        out_specs=spec(layout.out_spec),
        check_vma=False,
    )
    x = jax.ShapeDtypeStruct(x_shape, call.in_dtype)
    w = jax.ShapeDtypeStruct(w_shape, call.in_dtype)
    try:
        jax.eval_shape(mapped, x, w)
    except (ValueError, TypeError) as err:
        warnings.warn(
            f"commgemm.gemm: the shardings XLA chose (x {layout.x_spec}, w {layout.w_spec} -> "
            f"out {layout.out_spec}) imply {layout.collective.name} over {layout.axis!r}, which "
            f"config {call.config} cannot run: {err}. Computing this GEMM without overlap; "
            "pass x_spec= and w_spec= to get this error at trace time",
            stacklevel=2,
        )
        return str(err)
    return None


def _shard(mesh, spec) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec(*spec))


def _partition(call: _Call, mesh, arg_shapes, result_shape):
    body, x_spec, w_spec, out_spec, _ = _layout(call, mesh, arg_shapes)
    args = (_shard(mesh, x_spec), _shard(mesh, w_spec))
    return mesh, body, _shard(mesh, out_spec), args


def _unmentioned(mesh, spec) -> tuple[str, ...]:
    """The mesh axes (of more than one device) that `spec` does not shard over."""
    named = set()
    for entry in spec:
        named.update(entry if isinstance(entry, tuple) else (entry,))
    return tuple(a for a in mesh.axis_names if mesh.shape[a] > 1 and a not in named)


def _grad_partition(call: _Call, mesh, arg_shapes, result_shape):
    """The backward op's partition: the per-shard VJP of the forward's body. A custom partition
    tracks no varying axes, so the body is transposed as unchecked shard_map transposes it
    (dY divided by the size of the axes the result is replicated over, dX and dW summed over
    the axes x and w are replicated over), except over the axes the body all-reduces over:
    there every device holds the whole dY, and the all-reduce's transpose is the identity
    (`vma.whole_cotangents`), as under check_vma=True, with no collective."""
    body, x_spec, w_spec, out_spec, reduced = _layout(call, mesh, arg_shapes)
    replicas = math.prod(mesh.shape[a] for a in _unmentioned(mesh, out_spec) if a not in reduced)
    x_sum, w_sum = _unmentioned(mesh, x_spec), _unmentioned(mesh, w_spec)

    def lower(x, w, dy):
        if replicas > 1:
            dy = dy / jnp.asarray(replicas, dy.dtype)
        with whole_cotangents():
            dx, dw = jax.vjp(body, x, w)[1](dy)
        return (lax.psum(dx, x_sum) if x_sum else dx), (lax.psum(dw, w_sum) if w_sum else dw)

    x_sharding, w_sharding = _shard(mesh, x_spec), _shard(mesh, w_spec)
    args = (x_sharding, w_sharding, _shard(mesh, out_spec))
    return mesh, lower, (x_sharding, w_sharding), args


def _rows_rule(call: _Call) -> str:
    return " ".join(f"r{i}" for i in range(call.ndim - 1))


@functools.lru_cache(maxsize=256)
def _op(call: _Call):
    """The custom-partitioned GEMM of `call` (one per distinct call, as jit caches by it)."""
    fn = custom_partitioning(lambda x, w: _plain(x, w, call))
    fn.def_partition(
        partition=functools.partial(_partition, call),
        infer_sharding_from_operands=lambda mesh, arg_shapes, result_shape: _shard(
            mesh, call.out_spec
        ),
        sharding_rule=f"{_rows_rule(call)} k, k n -> {_rows_rule(call)} n",
        reduction_factors=("k",),
    )
    return fn


def _plain_grad(x, w, dy, call: _Call):
    """The backward op's meaning: the VJP of `_plain`."""
    return jax.vjp(lambda a, b: _plain(a, b, call), x, w)[1](dy)


@functools.lru_cache(maxsize=256)
def _grad_op(call: _Call):
    """The custom-partitioned backward of `_op(call)`: (x, w, dY) -> (dX, dW)."""
    fn = custom_partitioning(lambda x, w, dy: _plain_grad(x, w, dy, call))
    rows = _rows_rule(call)
    fn.def_partition(
        partition=functools.partial(_grad_partition, call),
        infer_sharding_from_operands=lambda mesh, arg_shapes, result_shape: (
            arg_shapes[0].sharding,
            arg_shapes[1].sharding,
        ),
        sharding_rule=f"{rows} k, k n, {rows} n -> {rows} k, k n",
    )
    return fn


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _gemm(x: jax.Array, w: jax.Array, call: _Call) -> jax.Array:
    return _op(call)(x, w)


def _gemm_fwd(x, w, call):
    return _op(call)(x, w), (x, w)


def _gemm_bwd(call, residuals, dy):
    x, w = residuals
    return _grad_op(call)(x, w, dy)


_gemm.defvjp(_gemm_fwd, _gemm_bwd)


def _batched(a: jax.Array) -> bool:
    from jax._src.interpreters.batching import BatchTracer  # no public name for it

    return isinstance(a, BatchTracer)


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
    if _batched(x) or _batched(w):
        raise NotImplementedError(
            "commgemm.gemm under jit on Auto mesh axes has no vmap rule (XLA's custom "
            "partitioning has none): fold the batch into x's leading dimensions instead "
            "(x [B, ..., K] with a leading None in out_sharding), or pass x_spec= and w_spec= "
            "(the shard_map path, which vmap batches)"
        )
    if 0 in (*x.shape, w.shape[1]):  # nothing to partition: the empty product, or zeros
        out = _plain(x, w, _Call(x.ndim, tuple(out_spec), config, scaling, out_dtype, x.dtype.name))
        return lax.with_sharding_constraint(out, NamedSharding(mesh, PartitionSpec(*out_spec)))
    call = _Call(x.ndim, tuple(out_spec), config, scaling, out_dtype, x.dtype.name)
    out = _gemm(x, w, call)
    explicit = {
        n for n, t in zip(mesh.axis_names, mesh.axis_types, strict=True) if t == AxisType.Explicit
    }
    if explicit:  # a mixed mesh: the types carry the Explicit axes, the constraint the Auto ones
        auto_spec = [None if e in explicit else e for e in out_spec]
        typed = PartitionSpec(*[e if e in explicit else None for e in out_spec])
        out = jax.sharding.reshard(out, NamedSharding(mesh, typed))
        return lax.with_sharding_constraint(out, NamedSharding(mesh, PartitionSpec(*auto_spec)))
    return lax.with_sharding_constraint(out, NamedSharding(mesh, PartitionSpec(*out_spec)))
