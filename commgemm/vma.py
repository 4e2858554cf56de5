"""Varying manual axes: what `jax.shard_map(..., check_vma=True)` tracks, read and produced the
same way on every supported jax.

Under check_vma=True (shard_map's default) every value inside carries the set of mesh axes it
varies over; `lax.psum` returns a value invariant over its axis, and the transpose of a psum is
the identity on an invariant cotangent. Under check_vma=False nothing is tracked and the
transpose of a psum is another psum. The ops here follow `lax` in both settings.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
from jax import lax

_WHOLE_COTANGENTS = contextvars.ContextVar("commgemm_whole_cotangents", default=False)


def varying_axes(x: jax.Array) -> frozenset[str]:
    """The mesh axes `x` is typed as varying over (empty outside shard_map or unchecked)."""
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)
    if vma is None:
        vma = getattr(getattr(aval, "manual_axis_type", None), "varying", frozenset())
    return frozenset(vma)


def checks_vma(axis_name: str) -> bool:
    """Whether the enclosing shard_map tracks varying axes: only then is an axis index typed as
    varying over its own axis."""
    return axis_name in varying_axes(lax.axis_index(axis_name))


@contextlib.contextmanager
def whole_cotangents():
    """Within it, the cotangent of an all-reduced result holds the whole cotangent on every
    device (as under check_vma=True), though nothing is tracked: a custom partition's backward
    (commgemm.partitioned), where each device is handed the replicated result's cotangent as
    is, where unchecked shard_map hands it 1/P of it."""
    token = _WHOLE_COTANGENTS.set(True)
    try:
        yield
    finally:
        _WHOLE_COTANGENTS.reset(token)


def all_reduce_transpose(dy: jax.Array, axis_name: str) -> jax.Array:
    """The transpose of a `lax.psum` over `axis_name` applied to its result's cotangent: the
    identity where dy is the whole cotangent on every device (check_vma=True, where dy is
    typed invariant, or `whole_cotangents`), else another psum (unchecked shard_map)."""
    if checks_vma(axis_name) or _WHOLE_COTANGENTS.get():
        return dy
    return lax.psum(dy, axis_name)


def all_gather_invariant(x: jax.Array, axis_name: str, *, axis: int = 0) -> jax.Array:
    """`lax.all_gather(x, axis_name, axis=axis, tiled=True)` typed as invariant over
    `axis_name` (every device holds the same result), as an all-reduce's result is."""
    if not checks_vma(axis_name):  # nothing tracked (check_vma=False, custom_partitioning)
        return lax.all_gather(x, axis_name, axis=axis, tiled=True)
    gather = getattr(lax, "all_gather_invariant", None)
    if gather is None:  # jax 0.10 keeps it private
        from jax._src.lax.parallel import all_gather_invariant as gather
    return gather(x, axis_name, axis=axis, tiled=True)


def out_struct(
    shape: tuple[int, ...], dtype, inputs: tuple, *, invariant_over: tuple[str, ...] = ()
) -> jax.ShapeDtypeStruct:
    """The ShapeDtypeStruct of a kernel's output inside shard_map: varying over the axes its
    inputs vary over, less `invariant_over` (axes over which every device computes the same
    value, as an all-reduce does). Outside shard_map or unchecked: a plain struct."""
    axes = frozenset().union(*(varying_axes(a) for a in inputs)) - frozenset(invariant_over)
    mat = getattr(jax.typeof(inputs[0]), "manual_axis_type", None)
    if mat is None:
        return jax.ShapeDtypeStruct(shape, dtype)
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat.update(varying=axes))


def like_primal(ct: jax.Array, primal: jax.Array) -> jax.Array:
    """A custom VJP's cotangent `ct` typed as its primal input's: summed over the mesh axes only
    `ct` varies over (the transpose of the broadcast that let an input invariant over an axis,
    say weights over a data axis, meet operands varying over it), and marked varying over the
    axes only `primal` varies over. Unchecked (check_vma=False) nothing is tracked: shard_map's
    own transpose sums over the unmentioned axes, and `ct` is returned as is."""
    extra = tuple(sorted(varying_axes(ct) - varying_axes(primal)))
    if extra:
        ct = lax.psum(ct, extra)
    return _mark_varying(ct, varying_axes(primal))


def varying_like(a: jax.Array, *inputs: jax.Array) -> jax.Array:
    """`a` (a kernel's result) typed as varying over every mesh axis one of `inputs` varies
    over, as the values it was computed from do; a no-op where it already is or unchecked."""
    return _mark_varying(a, frozenset().union(*(varying_axes(i) for i in inputs)))


def _mark_varying(a: jax.Array, axes: frozenset[str]) -> jax.Array:
    """`a` marked varying over those of `axes` it is not typed as varying over yet."""
    missing = tuple(sorted(axes - varying_axes(a)))
    if not missing:
        return a
    pcast = getattr(lax, "pcast", None)  # jax 0.10 has no lax.pvary
    return pcast(a, missing, to="varying") if pcast else lax.pvary(a, missing)
