"""The grouped GEMM's weight gradient on Hopper: dW [G, K, N], dW[g] = x_g^T @ dy_g, the rows
of x [M, K] and dy [M, N] sorted by group, on commgemm's ping-pong schedule.

Units: one tile_m x tile_n tile of one group's dW (tile_m of x's K columns, tile_n of dy's
columns), G x K / tile_m x N / tile_n of them, group-major (a group's units run side by side,
so its rows stay in L2), dealt to one persistent CTA per SM in turn. A unit's K loop runs
over its group's rows in steps of tile_k rows from the group's first row rounded down to a
multiple of 8 (Mosaic GPU's tiled shared memory loads whole 8s of rows); the rows of a step
outside the group (up to 7 before it and the last step's tail) are zeroed in x's block in
shared memory before its wgmma, which reads the x block [tile_k, tile_m] transposed, and rows
past the groups' sum in dy's block too (whatever they hold, they contribute nothing). dy's
rows of a neighbouring group inside a step meet zeros in x: finite values add nothing, a NaN or
inf there reaches this group's dW too (XLA's ragged dot keeps it in its own group's). An empty
group's units store zero tiles.

Schedule (as `grouped_pingpong`, CUTLASS's ping-pong): a load warpgroup fills one ring of
`stages` slots step by step across the CTA's units (a unit's steps are counted by a prefix
sum over the CTA's units, computed beside the kernel), and two compute warpgroups take the
units in turn, each owning a whole tile, so one's epilogue (a TMA store of the tile) runs
under the other's K loop. Where dW's units hold few rows each (many small groups) the kernel
is bound by the stores of dW itself, which the ping-pong keeps streaming; jax's transposed
ragged dot (one warpgroup, a pipeline per tile, its store awaited) leaves them exposed."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from commgemm.mosaic_gpu import tiles as mt
from commgemm.mosaic_gpu.configs import ROW_ALIGN, WGMMA_M, PingPongTiles
from commgemm.mosaic_gpu.grouped_pingpong import SMEM_BYTES, launch, ring_scratch
from commgemm.mosaic_gpu.pingpong import by_warpgroup, k_loop_in_turn

#: Operand dtypes the kernel multiplies (float8 dW runs on dequantized 16-bit operands).
DTYPES = (jnp.bfloat16, jnp.float16)


def shape_reason(tiles: PingPongTiles, m: int, k: int, n: int, dtype) -> str | None:
    """Why the kernel cannot compute dW [G, k, n] from x [m, k] and dy [m, n] of `dtype` in
    `tiles` (tile_m of K, tile_n of N, tile_k rows a step), or None."""
    dtype = jnp.dtype(dtype)
    if 0 in (m, k, n):
        return f"an empty operand ({m} x {k} x {n}): XLA's ragged dot"
    if dtype not in DTYPES:
        return f"it multiplies bf16 or fp16 operands, got {dtype.name}"
    if k % tiles.tile_m or n % tiles.tile_n:
        return f"K={k} and N={n} must be whole {tiles.tile_m} x {tiles.tile_n} tiles"
    if (tiles.tile_m * dtype.itemsize) % 128 or (tiles.tile_n * dtype.itemsize) % 128:
        return (
            f"tile_m={tiles.tile_m} and tile_n={tiles.tile_n} must be whole 128-byte rows of "
            f"{dtype.name} (x's and dy's blocks are loaded in rows of them)"
        )
    if tiles.tile_k % WGMMA_M:
        return (
            f"tile_k={tiles.tile_k} rows a step must be whole {WGMMA_M}s (a step's x block is "
            "masked in registers, in the wgmma layout of whole 64-row blocks)"
        )
    if stages(tiles, dtype) < 2:
        return f"{tiles} leaves shared memory for fewer than 2 stages"
    return None


def stages(tiles: PingPongTiles, dtype) -> int:
    """The ring's slots: `tiles.stages`, or as many as fit beside the two output tiles."""
    itemsize = jnp.dtype(dtype).itemsize
    out = 2 * tiles.tile_m * tiles.tile_n * itemsize
    slot = (tiles.tile_m + tiles.tile_n) * tiles.tile_k * itemsize
    return min(tiles.stages, (SMEM_BYTES - out) // slot)


def group_steps(sizes: jax.Array, m: int, tile_k: int) -> tuple[jax.Array, ...]:
    """Each group's rows [start, end) (sizes' sum cut at m), the first row of its K loop (start
    rounded down to a multiple of ROW_ALIGN) and its steps of tile_k rows (0 for no rows), int32
    [G] each."""
    ends = jnp.minimum(jnp.cumsum(sizes.astype(jnp.int32)), m)
    starts = jnp.concatenate([jnp.zeros(1, jnp.int32), ends[:-1]])
    base = starts // ROW_ALIGN * ROW_ALIGN
    steps = jnp.where(ends > starts, (ends - base + tile_k - 1) // tile_k, 0)
    return starts, ends, base, steps.astype(jnp.int32)


def unit_offsets(steps: jax.Array, per_group: int, ctas: int) -> jax.Array:
    """[units] int32: unit u's first step among its CTA's (CTA u % ctas runs units u, u +
    ctas, ...: an exclusive prefix sum of their steps, `per_group` units a group)."""
    units = steps.shape[0] * per_group
    waves = -(-units // ctas)
    counts = jnp.broadcast_to(steps[:, None], (steps.shape[0], per_group)).reshape(units)
    counts = jnp.pad(counts, (0, waves * ctas - units)).reshape(waves, ctas)
    return (jnp.cumsum(counts, axis=0) - counts).reshape(-1)[:units].astype(jnp.int32)


def weight_grad(
    x: jax.Array, dy: jax.Array, sizes: jax.Array, tiles: PingPongTiles | None = None
) -> jax.Array:
    """dW [G, K, N] = x_g^T @ dy_g per group g of `sizes` [G] (int32 rows per group, sorted,
    summing to at most M; rows past the sum contribute nothing), x [M, K] and dy [M, N] of one
    16-bit dtype, float32 accumulation, in x's dtype. K and N whole tiles (`shape_reason`)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu
    from jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu import MatmulDimension

    tiles = tiles or PingPongTiles()
    (m, k), n, groups = x.shape, dy.shape[1], sizes.shape[0]
    if dy.shape[0] != m or dy.dtype != x.dtype or sizes.ndim != 1 or groups < 1:
        raise ValueError(
            f"grouped dW kernel: x {x.dtype}{list(x.shape)}, dy {dy.dtype}{list(dy.shape)} "
            f"and sizes {list(sizes.shape)} must be [M, K], [M, N] of one dtype and [G >= 1]"
        )
    if (reason := shape_reason(tiles, m, k, n, x.dtype)) is not None:
        raise ValueError(f"grouped dW kernel: {reason}")
    tm, tn, tk = tiles.tile_m, tiles.tile_n, tiles.tile_k
    ring = stages(tiles, x.dtype)
    m_iters, n_iters, sms = k // tm, n // tn, mt.num_sms()
    per_group = m_iters * n_iters
    units = groups * per_group

    def body(start_ref, end_ref, base_ref, steps_ref, offs_ref, x_ref, dy_ref, out_ref):
        cta = lax.axis_index("sm")
        mine = (units - cta + sms - 1) // sms  # units cta, cta + sms, ...

        def where(j):  # the CTA's j-th unit: (group, its first step, dW's rows and columns)
            u = cta + j * sms
            g = u // per_group
            m_idx, n_idx = plgpu.planar_snake(
                lax.rem(u, per_group), (m_iters, n_iters), MatmulDimension.M, tiles.band
            )
            return g, offs_ref[u], pl.ds(m_idx * tm, tm), pl.ds(n_idx * tn, tn)

        def scoped(x_smem, dy_smem, loaded0, loaded1, consumed, out_smem, turn0, turn1):
            loaded, turn = (loaded0, loaded1), (turn0, turn1)

            def load_step(done, slot, x_block, dy_block):  # a step's two loads into `slot`
                plgpu.copy_gmem_to_smem(x_block, x_smem.at[slot], done)
                plgpu.copy_gmem_to_smem(dy_block, dy_smem.at[slot], done)

            def load():

                @pl.loop(0, mine)
                def _unit(j):
                    g, first, rows, cols = where(j)
                    base = base_ref[g]

                    @pl.loop(0, steps_ref[g])
                    def _step(kk):
                        s = first + kk
                        slot = lax.rem(s, ring)

                        @pl.when(s >= ring)
                        def _reuse():
                            plgpu.barrier_wait(consumed.at[slot])

                        tokens = pl.ds(pl.multiple_of(base + kk * tk, ROW_ALIGN), tk)
                        for c in (0, 1):
                            issue = functools.partial(load_step, loaded[c].at[slot], slot)
                            pl.when(lax.rem(j, 2) == c)(
                                lambda issue=issue: issue(
                                    x_ref.at[tokens, rows], dy_ref.at[tokens, cols]
                                )
                            )

            def zero_rows(block, below, above):  # zero rows outside [below, above) of a block
                row = plgpu.layout_cast(
                    lax.broadcasted_iota(jnp.int32, block.shape, 0), plgpu.Layout.WGMMA
                )
                keep = (row >= below) & (row < above)
                block[...] = jnp.where(keep, block[...], jnp.zeros_like(block[...]))
                plgpu.commit_smem()

            def gemm_tile(c, j):
                g, first, rows, cols = where(j)
                count, lo = steps_ref[g], start_ref[g] - base_ref[g]
                hi = end_ref[g] - base_ref[g]  # the group's rows: [lo, hi) from its base row
                total = end_ref[groups - 1] - base_ref[g]  # and the groups' sum

                def k_step(kk, acc):
                    slot = lax.rem(first + kk, ring)
                    plgpu.barrier_wait(loaded[c].at[slot])
                    below, above = lo - kk * tk, hi - kk * tk  # the step's own rows

                    @pl.when((below > 0) | (above < tk))
                    def _zero_other_groups_rows():
                        zero_rows(x_smem.at[slot], below, above)

                    @pl.when(total - kk * tk < tk)  # rows past the sum: dy's too (any values)
                    def _zero_rows_past_the_sum():
                        zero_rows(dy_smem.at[slot], 0, total - kk * tk)

                    plgpu.wgmma(acc, x_smem.at[slot].T, dy_smem.at[slot])
                    plgpu.wgmma_wait(1)  # the step before is done: release its slot

                    @pl.when(kk > 0)
                    def _release():
                        plgpu.barrier_arrive(consumed.at[lax.rem(first + kk - 1, ring)])

                    return acc

                def tile_scope(acc_ref):
                    k_loop_in_turn(turn, c, j, count, k_step, acc_ref)

                    @pl.when(count > 0)
                    def _release_last():
                        plgpu.barrier_arrive(consumed.at[lax.rem(first + count - 1, ring)])

                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    out_smem[c] = acc_ref[...].astype(out_smem.dtype)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(out_smem.at[c], out_ref.at[g, rows, cols])

                pl.run_scoped(tile_scope, plgpu.ACC((tm, tn), jnp.float32))

            def compute(c):
                pl.loop(c, mine, step=2)(functools.partial(gemm_tile, c))
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

            by_warpgroup(load, compute)

        pl.run_scoped(
            scoped,
            *ring_scratch(
                ring,
                plgpu.SMEM((ring, tk, tm), x.dtype, transforms=mt.smem_transforms(x.dtype, tm)),
                plgpu.SMEM((ring, tk, tn), x.dtype, transforms=mt.smem_transforms(x.dtype, tn)),
                plgpu.SMEM((2, tm, tn), x.dtype, transforms=mt.smem_transforms(x.dtype, tn)),
            ),
            collective_axes="wg",
        )

    starts, ends, base, steps = group_steps(sizes, m, tk)
    offsets = unit_offsets(steps, per_group, sms)
    operands = (starts, ends, base, steps, offsets, x, dy)
    return launch(body, "grouped_dw_pingpong", (groups, k, n), x.dtype, *operands)
