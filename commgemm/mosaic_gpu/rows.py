"""Elementwise maps and the amax over the first rows of a buffer, on Hopper GPUs: the rows past
them are zeroed without being read, or not written at all where no one reads them
(`commgemm.grouped.activation` and `commgemm.grouped.scaling` say where such buffers come
from).

Units of TILE_ROWS x cols (the same columns for every operand: ROW_BYTES of the widest dtype):
a TMA load of each input's tile into shared memory, the values in float32 in registers, the
map's results stored by TMA in their own dtypes; the units past the live rows get zero tiles,
stored without a load. Units are dealt round-robin to CTAS_PER_SM CTAs per SM (one warpgroup
each), the live ones first. The tile holding row `live` stores its rows up to it and zeros
from it, each a ladder of TMA stores of powers of two rows (`grouped_pingpong.ladder_store`).
The amax takes each whole live tile's largest finite |value| in the kernel (one float32 a
unit) and the partial tile's rows in XLA (64 rows)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from commgemm.mosaic_gpu import tiles as mt
from commgemm.mosaic_gpu.grouped_pingpong import ladder_store

#: Rows of a unit (a TMA box dimension is at most 256 elements).
TILE_ROWS = 64
#: CTAs per SM: loads of one overlap another's math and stores.
CTAS_PER_SM = 4
#: Bytes of a unit's row of the widest operand in shared memory: 16 KiB a tile.
ROW_BYTES = 256

#: fn(tiles, scalars) -> results: float32 [TILE_ROWS, cols] tiles of the inputs and float32
#: scalars in, float32 tiles out (one per result dtype).
RowMap = Callable[[Sequence[jax.Array], Sequence[jax.Array]], Sequence[jax.Array]]


def tile_cols(f: int, *dtypes) -> int | None:
    """Columns of a unit for rows of f elements of `dtypes`: ROW_BYTES of the widest, down to a
    power of two that divides f (16 bytes of the narrowest at least, a TMA box's least row), or
    None."""
    sizes = [jnp.dtype(d).itemsize for d in dtypes]
    cols = ROW_BYTES // max(sizes)
    while cols * min(sizes) >= 16:
        if f % cols == 0:
            return cols
        cols //= 2
    return None


def kernel_reason(shape: tuple[int, ...], *dtypes) -> str | None:
    """Why these kernels cannot take [R, F] buffers of `dtypes` here, or None."""
    if (reason := mt.hopper_reason()) is not None:
        return reason
    if len(shape) != 2 or not shape[0] or shape[0] % TILE_ROWS:
        return f"{shape} is no whole row tiles of {TILE_ROWS}"
    if tile_cols(shape[1], *dtypes) is None:
        return f"rows of {shape[1]} are no whole tiles of 2^i >= 16 bytes"
    return None


def map_rows(
    fn: RowMap,
    ins: Sequence[jax.Array],
    live: jax.Array,
    out_dtypes: Sequence,
    scalars: Sequence[jax.Array] = (),
    *,
    fill: bool = True,
) -> tuple[jax.Array, ...]:
    """fn on the first `live` rows (int32 scalar) of `ins` ([R, F] each): its results [R, F]
    in `out_dtypes`, zeros past `live` (those rows of `ins` are not read; `live` is taken
    between 0 and R); with `fill=False` the results' rows past `live` are not written (their
    values unspecified: for readers of the first `live` rows only). `scalars`: float32 scalars
    fn takes beside the tiles. R a multiple of TILE_ROWS, F of `tile_cols`."""
    return _launch(fn, tuple(ins), live, tuple(out_dtypes), tuple(scalars), amax=False, fill=fill)


def amax_rows(x: jax.Array, live: jax.Array) -> jax.Array:
    """The largest finite |value| of x's [R, F] first `live` rows (float32; 0 where none):
    whole tiles in the kernel, the partial tile's rows in XLA."""
    r, f = x.shape
    live = _rows_of(live, r)
    (per_unit,) = _launch(None, (x,), live, (), (), amax=True)
    blocks = f // tile_cols(f, x.dtype)
    whole = live // TILE_ROWS * TILE_ROWS
    taken = jnp.arange(per_unit.shape[0]) < whole // TILE_ROWS * blocks
    edge = lax.dynamic_slice_in_dim(x, jnp.minimum(whole, r - TILE_ROWS), TILE_ROWS)
    edge_rows = jnp.minimum(whole, r - TILE_ROWS) + jnp.arange(TILE_ROWS)[:, None]
    magnitude = jnp.abs(edge.astype(jnp.float32))
    inside = (edge_rows >= whole) & (edge_rows < live) & (magnitude < jnp.inf)
    return jnp.maximum(
        jnp.max(jnp.where(taken, per_unit, 0.0)), jnp.max(jnp.where(inside, magnitude, 0.0))
    )


def _rows_of(live, rows: int) -> jax.Array:
    """`live` as the kernels read it: an int32 count between 0 and `rows`."""
    return jnp.clip(jnp.asarray(live, jnp.int32), 0, rows)


def _launch(fn, ins, live, out_dtypes, scalars, amax: bool, fill: bool = True):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    (r, f), out_dtypes = ins[0].shape, tuple(jnp.dtype(d) for d in out_dtypes)
    tm, tc = TILE_ROWS, tile_cols(f, *(x.dtype for x in ins), *out_dtypes)
    if tc is None or r % tm or not r or any(x.shape != (r, f) for x in ins):
        shapes = [(x.shape, x.dtype.name) for x in ins]
        raise ValueError(f"rows kernel: {shapes} -> {out_dtypes} are no whole tiles")
    blocks, ctas, n_in, n_out = f // tc, mt.num_sms() * CTAS_PER_SM, len(ins), len(out_dtypes)
    units = r // tm * blocks

    def body(live_ref, scalar_ref, *refs):
        tiles = [plgpu.SMEM((tm, tc), x.dtype) for x in ins]
        tiles += [plgpu.SMEM((tm, tc), d) for d in out_dtypes + out_dtypes]  # results, zeros
        barriers = [plgpu.Barrier(num_arrivals=1) for _ in range(n_in + n_out)]
        pl.run_scoped(lambda *s: work(live_ref, scalar_ref, refs, s), *tiles, *barriers)

    def work(live_ref, scalar_ref, refs, scratch):
        srcs, zero_srcs = refs[:n_in], refs[n_in : n_in + n_out]
        outs, amax_ref = refs[n_in + n_out : n_in + 2 * n_out], refs[-1] if amax else None
        bufs, results = scratch[:n_in], scratch[n_in : n_in + n_out]
        zeros, at = scratch[n_in + n_out : n_in + 2 * n_out], n_in + 2 * n_out
        loaded, zero_loaded = scratch[at : at + n_in], scratch[at + n_in :]
        cta, live = lax.axis_index("cta"), live_ref[0]
        values_of = tuple(scalar_ref[i] for i in range(len(scalars)))
        # the amax reads whole tiles only; the maps every tile with a live row
        live_units = (live // tm if amax else (live + tm - 1) // tm) * blocks
        for src, tile, barrier in zip(zero_srcs, zeros, zero_loaded, strict=True):
            plgpu.copy_gmem_to_smem(src, tile, barrier)
        for barrier in zero_loaded:
            plgpu.barrier_wait(barrier)

        @pl.loop(0, (live_units - cta + ctas - 1) // ctas)
        def _live(i):
            unit = cta + i * ctas
            first, cols = unit // blocks * tm, pl.ds(lax.rem(unit, blocks) * tc, tc)
            for src, buf, barrier in zip(srcs, bufs, loaded, strict=True):
                plgpu.copy_gmem_to_smem(src.at[pl.ds(first, tm), cols], buf, barrier)
            for barrier in loaded:
                plgpu.barrier_wait(barrier)
            tiles = [buf[...].astype(jnp.float32) for buf in bufs]
            if amax_ref is not None:  # |x| < inf: neither inf nor NaN
                magnitude = jnp.abs(tiles[0])
                amax_ref[unit] = jnp.max(jnp.where(magnitude < jnp.inf, magnitude, 0.0))
            if not n_out:
                return
            values = fn(tiles, values_of)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last stores have read them
            for result, value in zip(results, values, strict=True):
                result[...] = value.astype(result.dtype)
            plgpu.commit_smem()
            rows = jnp.minimum(tm, live - first)  # the tile holding row `live`: zeros from it
            for result, zero, out in zip(results, zeros, outs, strict=True):
                ladder_store(result, out, first, rows, cols, tm)
                if fill:
                    ladder_store(zero, out, first + rows, tm - rows, cols, tm)

        if n_out and fill:

            @pl.loop(0, (units - live_units - cta + ctas - 1) // ctas)
            def _zero(i):
                unit = live_units + cta + i * ctas
                at = (pl.ds(unit // blocks * tm, tm), pl.ds(lax.rem(unit, blocks) * tc, tc))
                for zero, out in zip(zeros, outs, strict=True):
                    plgpu.copy_smem_to_gmem(zero, out.at[at])

        plgpu.wait_smem_to_gmem(0, wait_read_only=False)

    out_type = [jax.ShapeDtypeStruct((r, f), d) for d in out_dtypes]
    if amax:
        out_type.append(jax.ShapeDtypeStruct((units,), jnp.float32))
    with jax.named_scope("amax_rows" if amax else "map_rows"), jax.enable_x64(False):
        return tuple(
            plgpu.kernel(
                body,
                out_type=tuple(out_type),
                grid=(ctas,),
                grid_names=("cta",),
                compiler_params=plgpu.CompilerParams(
                    lowering_semantics=plgpu.LoweringSemantics.Lane
                ),
            )(
                jnp.reshape(_rows_of(live, r), (1,)),
                jnp.stack([jnp.asarray(s, jnp.float32) for s in scalars] or [jnp.float32(0)]),
                *ins,
                *(jnp.zeros((tm, tc), d) for d in out_dtypes),
            )
        )
