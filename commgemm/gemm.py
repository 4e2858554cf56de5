"""The global entry `gemm`: reads the operands' shardings and the requested output sharding,
infers the collective, and runs the matching per-shard op under `jax.shard_map`."""

from __future__ import annotations

import functools

import jax
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from commgemm.config import Collective, OverlapConfig
from commgemm.distributed import check_launched_initialized
from commgemm.epilogue import Activation, apply_epilogue, check_epilogue
from commgemm.layout import Layout, classify_on, implied_specs, spec_entries
from commgemm.operands import check_dtypes, check_matmul_shapes, dot
from commgemm.ops import (
    all_gather_matmul,
    matmul_2d,
    matmul_all_reduce,
    matmul_reduce_scatter,
)
from commgemm.partitioned import partitioned_gemm
from commgemm.plan import with_dtypes
from commgemm.quant import QuantizedWeight, Scaling, as_recipe
from commgemm.registry import resolve
from commgemm.scaled import matmul as quantized_matmul


def _mesh_of(x: jax.Array, out_sharding: NamedSharding | PartitionSpec):
    if isinstance(out_sharding, NamedSharding):
        return out_sharding.mesh
    if isinstance(getattr(x, "sharding", None), NamedSharding):
        return x.sharding.mesh
    mesh = jax.typeof(x).sharding.mesh
    if mesh.axis_names:
        return mesh
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.axis_names:
        return mesh
    raise ValueError(
        "gemm cannot find the mesh: pass out_sharding as a NamedSharding, or call with arrays "
        "placed by jax.device_put(..., NamedSharding(mesh, spec)), or inside jax.set_mesh(mesh)"
    )


def _spec_of(a: jax.Array, given: PartitionSpec | None, mesh) -> PartitionSpec | None:
    """The operand's spec: given, read off a placed array, or off an Explicit-axes tracer."""
    if given is not None:
        return given
    sharding = getattr(a, "sharding", None)
    if isinstance(sharding, NamedSharding):
        return sharding.spec
    typed = jax.typeof(a).sharding
    if mesh.axis_names and all(t == AxisType.Explicit for t in mesh.axis_types):
        return typed.spec
    return None


def gemm(
    x: jax.Array,
    w: jax.Array,
    *,
    out_sharding: NamedSharding | PartitionSpec,
    config: OverlapConfig | int | None = None,
    x_spec: PartitionSpec | None = None,
    w_spec: PartitionSpec | None = None,
    bias: jax.Array | None = None,
    activation: Activation = None,
    return_pre_activation: bool = False,
    scaling: Scaling = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """x @ w on sharded arrays, with the collective the shardings imply overlapped by `config`.

    Args:
      x: [..., K] global, sharded on a mesh. w: [K, N] global.
      out_sharding: the result's NamedSharding, or a PartitionSpec on x's mesh.
      config: OverlapConfig / buffer id / None (serial). Its collective, if set, must match the
        one the shardings imply (and lets `gemm` work out x_spec / w_spec when it cannot read them).
      bias, activation, return_pre_activation: the epilogue (see `all_gather_matmul`); bias [N]
        is sharded like the output's last dimension.
      scaling: quantized operands (see `all_gather_matmul`); the XLA fall-back runs the
        quantized GEMM on the global arrays (commgemm.scaled.matmul).
      x_spec, w_spec: the operands' PartitionSpecs; read off the arrays (placed arrays, or
        tracers on Explicit mesh axes) when not given. Under jit on Auto mesh axes, where a
        tracer carries no sharding, the layout is decided when XLA partitions the program
        (commgemm.partitioned), from the shardings its propagation chose.
    Layouts (a, r, c mesh axes):
      x P(a, None), w P(None, a) -> out P(None, a): all-gather + GEMM (any row dim of N-D x).
      x P(None, a), w P(a, None) -> out P(a, None): GEMM + reduce-scatter.
      x P(None, a), w P(a, None) -> out P(None, None): GEMM + all-reduce.
      x P(r, c),    w P(r, None) -> out P(r, None): the 2-D case (`matmul_2d`).
      Other mesh axes on row dims pass through unchanged. Any other layout is computed by plain
      XLA (dot + resharding), correct and without overlap.
    Returns:
      [..., N] with `out_sharding`.
    """
    check_launched_initialized()  # whatever the layout: a local GEMM would hide it too
    if isinstance(w, QuantizedWeight):
        raise TypeError(
            "gemm takes w itself with scaling=, not a QuantizedWeight: within one jitted program "
            "XLA computes a shared weight's quantization once; the per-shard ops take "
            "QuantizedWeights (quantized inside shard_map)"
        )
    cfg, _ = resolve(config)
    recipe = as_recipe(scaling)
    check_dtypes(x, w)
    check_matmul_shapes(x, w)
    check_epilogue(bias, activation, w.shape[1], x.dtype)
    mesh = _mesh_of(x, out_sharding)
    names = tuple(mesh.axis_names)
    if isinstance(out_sharding, NamedSharding):
        if tuple(out_sharding.mesh.axis_names) != names:
            raise ValueError(f"out_sharding's mesh {out_sharding.mesh} differs from x's mesh")
        out_spec_raw = out_sharding.spec
    elif isinstance(out_sharding, PartitionSpec):
        out_spec_raw = out_sharding
    else:
        raise TypeError(
            f"out_sharding must be a NamedSharding or PartitionSpec, got {type(out_sharding)}"
        )
    out = spec_entries(out_spec_raw, x.ndim, "out_sharding", names)
    xs, ws = _spec_of(x, x_spec, mesh), _spec_of(w, w_spec, mesh)
    if xs is None or ws is None:
        if cfg.collective is None:  # decided when XLA partitions the program
            if recipe is not None and (recipe.x_state is not None):
                raise ValueError(
                    "gemm under jit on Auto mesh axes takes stateless scaling (a ScalingMode): "
                    "for delayed scaling pass x_spec= and w_spec="
                )
            out_dtype = cfg.out_dtype or x.dtype.name
            z = partitioned_gemm(
                x, w, mesh=mesh, out_spec=out, config=config, scaling=recipe, out_dtype=out_dtype
            )
            return apply_epilogue(z, bias, activation, return_pre_activation)
        implied_x, implied_w = implied_specs(cfg.collective, out, x.ndim)
        xs = xs if xs is not None else PartitionSpec(*implied_x)
        ws = ws if ws is not None else PartitionSpec(*implied_w)
    layout = classify_on(
        mesh, spec_entries(xs, x.ndim, "x", names), spec_entries(ws, 2, "w", names), out
    )
    if layout.collective is None:
        if cfg.collective not in (None, Collective.NONE):
            raise ValueError(
                f"config.collective={cfg.collective.name} contradicts the shardings x {xs}, "
                f"w {ws} -> out {PartitionSpec(*out)}, which need no such collective"
            )
        z = _xla_gemm(x, w, mesh, PartitionSpec(*out), cfg, recipe)
        return apply_epilogue(z, bias, activation, return_pre_activation)
    if cfg.collective is not None and cfg.collective not in (layout.collective, Collective.NONE):
        raise ValueError(
            f"config.collective={cfg.collective.name} contradicts the shardings x {xs}, w {ws} "
            f"-> out {PartitionSpec(*out)}, which imply {layout.collective.name}"
        )
    has = (bias is not None, recipe is not None)
    mapped = _sharded_call(mesh, layout, config, activation, return_pre_activation, *has)
    extra = (() if recipe is None else (recipe,)) + (() if bias is None else (bias,))
    return mapped(x, w, *extra)


@functools.lru_cache(maxsize=256)
def _sharded_call(
    mesh,
    layout: Layout,
    config: OverlapConfig | int | None,
    activation: Activation,
    return_pre_activation: bool,
    has_bias: bool,
    has_recipe: bool,
):
    """The jitted shard_map of one layout and config, built once (so eager calls with the same
    shapes reuse the compiled program, as jax.jit's cache does). Its arguments: x, w, then the
    scaling recipe (replicated) and the bias where there are."""
    epilogue = dict(activation=activation, return_pre_activation=return_pre_activation)
    if layout.collective is Collective.NONE:
        row_axis, k_axis = layout.axis
        body = functools.partial(
            matmul_2d, row_axis=row_axis, k_axis=k_axis, config=config, **epilogue
        )
    else:
        op = {
            Collective.ALL_GATHER: all_gather_matmul,
            Collective.REDUCE_SCATTER: matmul_reduce_scatter,
            Collective.ALL_REDUCE: matmul_all_reduce,
        }[layout.collective]
        body = functools.partial(
            op, axis_name=layout.axis, config=config, axis=layout.row_dim, **epilogue
        )
    out_spec = PartitionSpec(*layout.out_spec)
    specs = (PartitionSpec(*layout.x_spec), PartitionSpec(*layout.w_spec))
    if has_recipe:
        specs += (PartitionSpec(),)
    if has_bias:
        specs += (PartitionSpec(layout.out_spec[-1]),)

    def call(a, b, *rest):
        recipe = rest[0] if has_recipe else None
        return body(a, b, bias=rest[-1] if has_bias else None, scaling=recipe)

    mapped = jax.shard_map(
        call,
        mesh=mesh,
        in_specs=specs,
        out_specs=(out_spec, out_spec) if return_pre_activation else out_spec,
    )
    return jax.jit(mapped)


def _xla_gemm(
    x: jax.Array, w: jax.Array, mesh, out_spec: PartitionSpec, cfg: OverlapConfig, recipe
):
    """Plain XLA: one dot, float32 accumulation (or the quantized GEMM), then the requested
    sharding. On Explicit mesh axes the GEMM runs with the axes made Auto (`auto_axes`), so that
    XLA's propagation shards it and its gradient as under jit on Auto axes: layouts the dot's
    sharding rule calls ambiguous (a sharded contraction) or illegal (an axis on both M and N)
    are then resharded, as `jnp.dot(..., out_sharding=)` does."""

    def product(x, w):
        if recipe is not None:
            return quantized_matmul(x, w, recipe).astype(cfg.out_dtype or x.dtype)
        wide = with_dtypes(cfg, x.dtype)
        return dot(
            x,
            w,
            ((x.ndim - 1,), (0,)),
            accumulate_dtype=wide.accumulate_dtype,
            result_dtype=wide.out_dtype,
        )

    if all(t == AxisType.Explicit for t in mesh.axis_types):
        return jax.sharding.auto_axes(product, out_sharding=NamedSharding(mesh, out_spec))(x, w)
    return lax.with_sharding_constraint(product(x, w), NamedSharding(mesh, out_spec))
