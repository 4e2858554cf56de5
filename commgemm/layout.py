"""Which collective a sharding triple implies: the specs as one entry per dimension
(`spec_entries`) and the `Layout` that `gemm` and the partitioned path run (`classify_on`)."""

from __future__ import annotations

import dataclasses
import functools

from jax.sharding import PartitionSpec

from commgemm.config import Collective

Spec = tuple[str | None, ...]


@dataclasses.dataclass(frozen=True)
class Layout:
    """What `gemm` decided: the collective (NONE for the XLA fall-back), the mesh axis (or the
    (row, k) axes of the 2-D case), x's split dimension and the three specs it runs with."""

    collective: Collective | None
    axis: str | tuple[str, str] | None
    row_dim: int
    x_spec: Spec
    w_spec: Spec
    out_spec: Spec


def spec_entries(
    spec: PartitionSpec | None, ndim: int, what: str, mesh_axes: tuple[str, ...]
) -> Spec:
    """A PartitionSpec as one entry per dimension: None or a single mesh-axis name."""
    entries = tuple(spec) if spec is not None else ()
    if len(entries) > ndim:
        raise ValueError(f"{what} spec {spec} has {len(entries)} entries for {ndim} dimensions")
    out: list[str | None] = []
    for e in entries + (None,) * (ndim - len(entries)):
        if isinstance(e, tuple | list):
            e = tuple(e)
            if len(e) == 0:
                e = None
            elif len(e) == 1:
                e = e[0]
        if e is not None and not isinstance(e, tuple) and e not in mesh_axes:
            raise ValueError(f"{what} spec {spec} names axis {e!r}, not in the mesh {mesh_axes}")
        out.append(e)
    named = [a for a in out if a is not None]
    if len(set(map(str, named))) != len(named):
        raise ValueError(f"{what} spec {spec} uses a mesh axis twice")
    return tuple(out)


def implied_specs(collective: Collective, out: Spec, ndim: int) -> tuple[Spec, Spec]:
    """x and w specs implied by a collective and the requested output spec (rank-2 layouts)."""
    rows, n = out[:-1], out[-1]
    if collective is Collective.ALL_GATHER and n is not None:
        return (n,) + (None,) * (ndim - 1), (None, n)
    sharded = [a for a in rows if a is not None]
    if collective is Collective.REDUCE_SCATTER and len(sharded) == 1 and n is None:
        a = sharded[0]
        return tuple(None if r == a else r for r in rows) + (a,), (a, None)
    raise ValueError(
        f"cannot work out the operand shardings for collective={collective.name} and output spec "
        f"{out}: pass x_spec= and w_spec="
    )


def classify(x_spec: Spec, w_spec: Spec, out_spec: Spec) -> Layout:
    """The collective a sharding triple asks for; collective None means "let XLA do it"."""
    x_rows, x_k = x_spec[:-1], x_spec[-1]
    w_k, w_n = w_spec
    out_rows, out_n = out_spec[:-1], out_spec[-1]
    sharded = [i for i, a in enumerate(x_rows) if a is not None]

    def same_rows_except(dim: int, x_val, out_val) -> bool:
        return all(
            (xr == orow) if i != dim else (xr == x_val and orow == out_val)
            for i, (xr, orow) in enumerate(zip(x_rows, out_rows, strict=True))
        )

    layout = functools.partial(Layout, x_spec=x_spec, w_spec=w_spec, out_spec=out_spec)
    if x_k is None and w_k is None and w_n is not None and out_n == w_n:
        for dim in sharded:
            a = x_rows[dim]
            if a == w_n and same_rows_except(dim, a, None):
                return layout(Collective.ALL_GATHER, a, dim)
    if x_k is not None and w_k == x_k and w_n is None and out_n is None:
        a = x_k
        if x_rows == out_rows and a not in x_rows:
            return layout(Collective.ALL_REDUCE, a, 0)
        for dim, orow in enumerate(out_rows):
            if orow == a and same_rows_except(dim, None, a):
                return layout(Collective.REDUCE_SCATTER, a, dim)
    if (
        len(x_spec) == 2
        and None not in x_spec
        and x_spec[0] != x_spec[1]
        and w_spec == (x_spec[0], None)
        and out_spec == (x_spec[0], None)
    ):
        return layout(Collective.NONE, (x_spec[0], x_spec[1]), 0)
    return layout(None, None, 0)


def classify_on(mesh, x_spec: Spec, w_spec: Spec, out_spec: Spec) -> Layout:
    """`classify`, and where that finds no collective, again with the mesh's axes of size 1
    left out: they shard nothing, and XLA's propagation drops them where a caller's spec may
    keep them (x P(None, "tp", None) meeting out P("data", None, "tp") with "data" of size 1).
    The layout keeps the specs as given (Explicit axes of size 1 are in the types too)."""
    layout = classify(x_spec, w_spec, out_spec)
    unit = {n for n, size in zip(mesh.axis_names, mesh.axis_sizes, strict=True) if size == 1}
    if layout.collective is not None or not unit:
        return layout

    def without(spec: Spec) -> Spec:
        entries = []
        for e in spec:
            axes = tuple(a for a in (e if isinstance(e, tuple) else (e,)) if a not in (None, *unit))
            entries.append(axes[0] if len(axes) == 1 else axes or None)
        return tuple(entries)

    found = classify(without(x_spec), without(w_spec), without(out_spec))
    if found.collective is None:
        return layout
    return dataclasses.replace(found, x_spec=x_spec, w_spec=w_spec, out_spec=out_spec)
