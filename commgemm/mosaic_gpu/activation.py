"""GELU on the first rows of a buffer, on Hopper GPUs: the rows past them are zeroed without
being read (`commgemm.grouped.activation` says why).

Units of TILE_ROWS x cols: a TMA load of y's tile (and g's, backward) into shared memory, the
values in float32 in registers, a TMA store of the result; the tiles past the live rows get
the zero tile, stored without a load. Units are dealt round-robin to CTAS_PER_SM CTAs per SM
(one warpgroup each), the live tiles first. The tile holding row `live` stores its rows up to
it and zeros from it, each a ladder of TMA stores of powers of two rows
(`grouped_pingpong.ladder_store`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from commgemm.mosaic_gpu import tiles as mt
from commgemm.mosaic_gpu.grouped_pingpong import ladder_store

#: Rows of a unit (a TMA box dimension is at most 256 elements).
TILE_ROWS = 64
#: CTAs per SM: loads of one overlap another's math and stores.
CTAS_PER_SM = 4
#: Bytes of a unit's row in shared memory: 16 KiB a tile.
ROW_BYTES = 256


def tile_cols(f: int, dtype) -> int | None:
    """Columns of a unit for rows of f elements: ROW_BYTES worth, down to a power of two that
    divides f (16 bytes at least, a TMA box's least row), or None."""
    itemsize = jnp.dtype(dtype).itemsize
    cols = ROW_BYTES // itemsize
    while cols * itemsize >= 16:
        if f % cols == 0:
            return cols
        cols //= 2
    return None


def gelu_rows(
    y: jax.Array, live: jax.Array, value_and_slope, g: jax.Array | None = None
) -> jax.Array:
    """value_and_slope(x) (float32 -> (GELU(x), GELU'(x))) on y's [R, F] first `live` rows
    (int32 [1]): GELU(y), or with g [R, F] g * GELU'(y); zeros past them; y's dtype. R a
    multiple of TILE_ROWS, F of `tile_cols`."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    (r, f), dtype = y.shape, y.dtype
    tm, tc = TILE_ROWS, tile_cols(f, dtype)
    if tc is None or r % tm:
        raise ValueError(f"GELU rows kernel: {y.shape} {jnp.dtype(dtype).name} is no whole tiles")
    blocks, ctas = f // tc, mt.num_sms() * CTAS_PER_SM
    ins = (y,) if g is None else (y, g)

    def body(live_ref, *refs):
        *srcs, zeros_ref, out_ref = refs
        scratch = [plgpu.SMEM((tm, tc), dtype) for _ in range(len(srcs) + 2)]
        barriers = [plgpu.Barrier(num_arrivals=1) for _ in range(len(srcs) + 1)]
        pl.run_scoped(lambda *s: work(live_ref, srcs, zeros_ref, out_ref, *s), *scratch, *barriers)

    def work(live_ref, srcs, zeros_ref, out_ref, *scratch):
        n = len(srcs)
        bufs, out, zeros = scratch[:n], scratch[n], scratch[n + 1]
        loaded, zero_loaded = scratch[n + 2 : 2 * n + 2], scratch[2 * n + 2]
        cta, live = lax.axis_index("cta"), live_ref[0]
        live_units = (live + tm - 1) // tm * blocks
        plgpu.copy_gmem_to_smem(zeros_ref, zeros, zero_loaded)
        plgpu.barrier_wait(zero_loaded)

        @pl.loop(0, (live_units - cta + ctas - 1) // ctas)
        def _live(i):
            unit = cta + i * ctas
            first, cols = unit // blocks * tm, pl.ds(lax.rem(unit, blocks) * tc, tc)
            for src, buf, barrier in zip(srcs, bufs, loaded, strict=True):
                plgpu.copy_gmem_to_smem(src.at[pl.ds(first, tm), cols], buf, barrier)
            for barrier in loaded:
                plgpu.barrier_wait(barrier)
            value, slope = value_and_slope(bufs[0][...].astype(jnp.float32))
            if n == 2:
                value = slope * bufs[1][...].astype(jnp.float32)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last stores have read `out`
            out[...] = value.astype(dtype)
            plgpu.commit_smem()
            rows = jnp.minimum(tm, live - first)  # the tile holding row `live`: zeros from it
            ladder_store(out, out_ref, first, rows, cols, tm)
            ladder_store(zeros, out_ref, first + rows, tm - rows, cols, tm)

        @pl.loop(0, (r // tm * blocks - live_units - cta + ctas - 1) // ctas)
        def _zero(i):
            unit = live_units + cta + i * ctas
            at = (pl.ds(unit // blocks * tm, tm), pl.ds(lax.rem(unit, blocks) * tc, tc))
            plgpu.copy_smem_to_gmem(zeros, out_ref.at[at])

        plgpu.wait_smem_to_gmem(0, wait_read_only=False)

    with jax.named_scope("gelu_rows"), jax.enable_x64(False):
        return plgpu.kernel(
            body,
            out_type=jax.ShapeDtypeStruct((r, f), dtype),
            grid=(ctas,),
            grid_names=("cta",),
            compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        )(jnp.reshape(live, (1,)).astype(jnp.int32), *ins, jnp.zeros((tm, tc), dtype))
