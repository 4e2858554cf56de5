"""The local grouped GEMM (mixture-of-experts): rows sorted by group, one weight per group, with
the semantics of `jax.lax.ragged_dot` (rows past the groups' sum are zero)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from commgemm.config import floating_dtype_name
from commgemm.mosaic_gpu.transposes import swapped
from commgemm.quant import as_recipe, check_weight_scaling


def check_grouped(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> None:
    """x [M, K], w [G, K, N], group_sizes [G] integers; one floating dtype for x and w."""
    if x.ndim != 2:
        raise ValueError(f"x must be [rows, K], got shape {x.shape}")
    if w.ndim != 3:
        raise ValueError(f"w must be [groups, K, N], got shape {w.shape}")
    if x.shape[1] != w.shape[1]:
        raise ValueError(
            f"contracting dimensions differ: x {x.shape} has K={x.shape[1]}, "
            f"w {w.shape} has K={w.shape[1]}"
        )
    if group_sizes.shape != (w.shape[0],):
        raise ValueError(
            f"group_sizes must have shape ({w.shape[0]},) (one count per group of w), got "
            f"{group_sizes.shape}"
        )
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise TypeError(f"group_sizes must be integers, got {group_sizes.dtype}")
    if not isinstance(group_sizes, jax.core.Tracer):  # concrete counts: checked here
        counts = np.asarray(group_sizes)
        if (counts < 0).any():
            raise ValueError(f"group_sizes must be >= 0, got {counts.tolist()}")
        if counts.sum() > x.shape[0]:
            raise ValueError(
                f"group_sizes sum to {int(counts.sum())}, more than x's {x.shape[0]} rows"
            )
    for name, a in (("x", x), ("w", w)):
        if not jnp.issubdtype(a.dtype, jnp.floating):
            raise TypeError(f"{name} has dtype {a.dtype}; grouped GEMMs need floating operands")
    if x.dtype != w.dtype:
        raise TypeError(f"x has dtype {x.dtype} but w has dtype {w.dtype}: cast one so both match")


def prequantized_matmul(x, w, group_sizes: jax.Array, out_dtype=None) -> jax.Array:
    """`grouped_matmul` on `ScaledTensor`s the caller quantized (e.g. the experts' weights once
    for serving): x [M, K] quantized along K (axis -1), w [G, K, N] along axis 1 or [G, N, K]
    along axis 2 (the layout the float8 kernel reads; [G, K, N] is transposed each call).
    Forward only; the result in `out_dtype` (default bfloat16). On a Hopper GPU with tensor
    scales (e4m3 or e5m2, either pairing), commgemm's grouped kernel on the tensor cores
    (`mosaic_gpu.grouped.prequantized_reason`); elsewhere XLA's ragged dot of the dequantized
    values in float32."""
    from commgemm.mosaic_gpu import grouped as hopper
    from commgemm.quant import ScaledTensor, dequantize

    if not (isinstance(x, ScaledTensor) and isinstance(w, ScaledTensor)):
        raise TypeError("grouped_matmul: quantize both x and w (cg.quantize), or pass scaling=")
    if x.data.ndim != 2 or x.axis % 2 != 1:
        raise ValueError(
            f"x must be [rows, K] quantized along K (axis -1), got "
            f"{x.data.shape} along axis {x.axis}"
        )
    if w.data.ndim != 3 or w.axis % 3 not in (1, 2):
        raise ValueError(
            f"w must be [G, K, N] quantized along axis 1 or [G, N, K] along axis 2, "
            f"got {w.data.shape} along axis {w.axis}"
        )
    w_nk = w.axis % 3 == 2
    g, *kn = w.data.shape
    as_kn = jax.ShapeDtypeStruct((g, *(kn[::-1] if w_nk else kn)), jnp.float32)
    check_grouped(jax.ShapeDtypeStruct(x.data.shape, jnp.float32), as_kn, group_sizes)
    out_dtype = floating_dtype_name(out_dtype or "bfloat16", "out_dtype")
    sizes = group_sizes.astype(jnp.int32)
    if hopper.prequantized_reason(x, w, w_nk, out_dtype) is None:
        data = w.data if w_nk else swapped(w.data)
        return hopper.float8_matmul(x.data, x.scale_inv, data, w.scale_inv, sizes, out_dtype)
    xs, ws = dequantize(x, jnp.float32), dequantize(w, jnp.float32)
    ws = jnp.swapaxes(ws, 1, 2) if w_nk else ws
    return lax.ragged_dot(xs, ws, sizes, preferred_element_type=jnp.float32).astype(out_dtype)


def sizes_in_rows(group_sizes: jax.Array, lo, hi) -> jax.Array:
    """The group sizes of rows [lo, hi) of a group-sorted operand (lo, hi may be traced):
    each group's count clipped to the range."""
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    starts = ends - group_sizes.astype(jnp.int32)
    lo, hi = jnp.int32(lo), jnp.int32(hi)
    return jnp.clip(ends, lo, hi) - jnp.clip(starts, lo, hi)


def group_of_rows(group_sizes: jax.Array, rows: int) -> jax.Array:
    """The group of each of `rows` rows, int32 [rows]; -1 past the groups' sum."""
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    index = jnp.arange(rows, dtype=jnp.int32)
    group = jnp.searchsorted(ends, index, side="right").astype(jnp.int32)
    return jnp.where(index < ends[-1] if ends.size else False, group, -1)


def grouped_matmul(
    x: jax.Array,
    w: jax.Array,
    group_sizes: jax.Array,
    *,
    bias: jax.Array | None = None,
    out_dtype=None,
    scaling=None,
    hopper_tiles=None,
) -> jax.Array:
    """Rows of x sorted by group times their group's weight: `lax.ragged_dot` semantics.

    Args:
      x: [M, K], rows sorted by group.
      w: [G, K, N], one weight per group.
      group_sizes: [G] int, rows per group, summing to at most M (rows past the sum give 0).
        Concrete counts are checked (>= 0, sum <= M); traced ones cannot be: a sum past M
        cuts the groups at row M, as `lax.ragged_dot` does, and negative counts are undefined.
      bias: optional [G, N], added to each row of its group (not to rows past the sum).
      out_dtype: the result's dtype (default x's); accumulation is float32 (float64 for
        float64 operands).
      scaling: quantized operands (a `ScalingMode` or `ScalingRecipe`; delayed scaling's
        dy_state gets the advanced state as its gradient, as for the other ops). On a Hopper
        GPU, tensor scaling multiplies float8 operands on the tensor cores in the forward and dX
        (`mosaic_gpu.grouped.float8_ragged_dot`, where commgemm's kernel takes the shape),
        accumulating as the recipe's `split_accumulator` asks, and in dW where it lets dW
        accumulate fast (`split_accumulator[2]` False) and the groups are large enough
        (`mosaic_gpu.grouped_dw.float8_reason`); otherwise emulated: see
        commgemm.grouped.scaling.
      x, w may instead be `ScaledTensor`s quantized by the caller: forward only, see
        `prequantized_matmul`. With `scaling`, w may be a `QuantizedWeight` (quantized once
        for several calls by `cg.quantize_weight(w, scaling, axis=1)`; with
        `keep_transposed=True` Hopper's float8 forward reads its values as kept, [G, N, K],
        instead of transposing them in each call): differentiable.
      hopper_tiles: the Hopper forward's kernel: a `PingPongTiles` (commgemm's ping-pong
        kernel, which None picks where its tiles fit: `mosaic_gpu.grouped.pick_tiles`), a
        `GroupedConfig` (its row-aligned kernel) or a `GroupedTiles` (jax's ragged dot). On a
        Hopper GPU with 16-bit operands whose shape divides into the tiles, the forward and dX
        run a Mosaic GPU kernel and dW commgemm's ping-pong dW kernel; elsewhere XLA's ragged
        dot (on a Hopper GPU far below the tensor cores' rate: docs/performance.md).
    Returns:
      [M, N]. Differentiable in x, w and bias. Not batchable with `jax.vmap` where x, w and
      group_sizes are not all batched along axis 0: `lax.ragged_dot` raises
      NotImplementedError there (jax 0.10, 0.11); `lax.map` over the batch works.
    """
    from commgemm.quant import ScaledTensor

    if isinstance(x, ScaledTensor) or isinstance(w, ScaledTensor):
        if bias is not None or scaling is not None or hopper_tiles is not None:
            raise ValueError(
                "grouped_matmul on ScaledTensor operands takes no bias, scaling or "
                "hopper_tiles (apply a bias to the result)"
            )
        return prequantized_matmul(x, w, group_sizes, out_dtype)
    check_grouped(x, w, group_sizes)
    check_weight_scaling("grouped_matmul", w, scaling)
    from commgemm.mosaic_gpu import grouped as hopper

    recipe = as_recipe(scaling)
    float8 = (
        recipe is not None
        and isinstance(hopper_tiles, hopper.GroupedConfig | None)
        and hopper.float8_reason(x, w, recipe, hopper_tiles) is None
    )
    if recipe is not None and not float8:
        from commgemm.grouped.scaling import quantized_operands, with_quantized_cotangent

        x, w, recipe, _, _ = quantized_operands(x, w, scaling)
        out = grouped_matmul(
            x, w, group_sizes, bias=bias, out_dtype=out_dtype, hopper_tiles=hopper_tiles
        )
        return with_quantized_cotangent(out, recipe)
    out_dtype = floating_dtype_name(out_dtype or x.dtype.name, "out_dtype")
    acc = jnp.promote_types(x.dtype, jnp.float32)  # float32, or float64 for float64 operands
    sizes = group_sizes.astype(jnp.int32)

    if float8:  # Hopper's float8 tensor cores (`mosaic_gpu.grouped.float8_ragged_dot`)
        from commgemm.operand_scaling import weight_operand

        w, qw, nk = weight_operand(w, recipe, 1, (), swap=True)  # both layouts read
        plan = hopper.Float8Plan.of(recipe, hopper_tiles)
        states = (recipe.x_state, recipe.dy_state)
        out = hopper.float8_ragged_dot(x, w, sizes, qw, nk, states, plan)  # quantizes dY itself
    elif hopper.unsupported_reason(x, w, hopper_tiles) is None:
        out = hopper.ragged_dot(x, w, sizes, hopper_tiles)
    elif jnp.dtype(out_dtype).itemsize == 2 and acc == jnp.float32:
        # a 16-bit result asked of XLA directly: float32 accumulation inside, no extra pass
        out = lax.ragged_dot(x, w, sizes, preferred_element_type=out_dtype)
    else:
        out = lax.ragged_dot(x, w, sizes, preferred_element_type=acc)
    if bias is not None:
        bias = jnp.asarray(bias)
        if bias.shape != (w.shape[0], w.shape[2]):
            raise ValueError(
                f"bias must be [groups, N] = {(w.shape[0], w.shape[2])}, got {bias.shape}"
            )
        group = group_of_rows(group_sizes, x.shape[0])
        rows = jnp.where((group >= 0)[:, None], bias[jnp.maximum(group, 0)].astype(acc), 0)
        out = out.astype(acc) + rows
    return out.astype(out_dtype)
