"""The grouped GEMM's weight gradient on Hopper: dW [G, K, N], dW[g] = x_g^T @ dy_g, the rows
of x [M, K] and dy [M, N] sorted by group, on commgemm's ping-pong schedule; 16-bit operands
(`weight_grad`) or float8 ones (`float8_weight_grad`).

Units: one tile_m x tile_n tile of one group's dW (tile_m of x's K columns, tile_n of dy's
columns), G x K / tile_m x N / tile_n of them, group-major (a group's units run side by side,
so its rows stay in L2), dealt to one persistent CTA per SM in turn. 16-bit: a unit's K loop
runs over its group's rows in steps of tile_k rows from the group's first row rounded down to
a multiple of 8 (Mosaic GPU's tiled shared memory loads whole 8s of rows); the rows of a step
outside the group (up to 7 before it and the last step's tail) are zeroed in x's block in
shared memory before its wgmma, which reads the x block [tile_k, tile_m] transposed, and rows
past the groups' sum in dy's block too (whatever they hold, they contribute nothing). dy's
rows of a neighbouring group inside a step meet zeros in x: finite values add nothing, a NaN or
inf there reaches this group's dW too (XLA's ragged dot keeps it in its own group's). An empty
group's units store zero tiles.

Float8: wgmma multiplies float8 operands K-major only, and the tokens are the contraction, so
the kernel reads x and dy transposed (`transposes.padded_rows_transposed`: one Pallas Triton
kernel each, [K, M'] and [N, M'], 1 byte an element read and written), a unit's K loop over
its group's tokens in steps of 128 columns from the group's first token rounded down to a
multiple of 128 (`TOKEN_ALIGN`); the columns of a step outside the group are zeroed in x's
block, those past the groups' sum in dy's too, as the 16-bit kernel zeroes rows (in f16
registers: Mosaic GPU selects on 16 bits or more). The two tensor scales multiply the float32
accumulator in the epilogue; the wgmma accumulates across the K-steps (fast accumulation).

Schedule (as `grouped_pingpong`, CUTLASS's ping-pong): a load warpgroup fills one ring of
`stages` slots step by step across the CTA's units (a unit's steps are counted by a prefix
sum over the CTA's units, computed beside the kernel), and two compute warpgroups take the
units in turn, each owning a whole tile, so one's epilogue (a TMA store of the tile) runs
under the other's K loop. Where dW's units hold few rows each (many small groups) the kernel
is bound by the stores of dW itself, which the ping-pong keeps streaming; jax's transposed
ragged dot (one warpgroup, a pipeline per tile, its store awaited) leaves them exposed."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from commgemm.mosaic_gpu import tiles as mt
from commgemm.mosaic_gpu.configs import FLOAT8_TILE_K, ROW_ALIGN, WGMMA_M, PingPongTiles
from commgemm.mosaic_gpu.grouped_kernel import FLOAT8
from commgemm.mosaic_gpu.grouped_pingpong import SMEM_BYTES, launch, ring_scratch
from commgemm.mosaic_gpu.pingpong import by_warpgroup, k_loop_in_turn
from commgemm.mosaic_gpu.transposes import TILE, padded_rows_transposed

#: Operand dtypes the 16-bit kernel multiplies (`float8_weight_grad` takes FLOAT8's).
DTYPES = (jnp.bfloat16, jnp.float16)
#: The float8 kernel's transposed operands hold whole 128s of tokens a row and its K loops
#: start at whole 128s: Mosaic GPU loads tiled shared memory (128-byte swizzled rows) from
#: whole tiles of the minor dimension.
TOKEN_ALIGN = TILE


def shape_reason(tiles: PingPongTiles, m: int, k: int, n: int, dtype) -> str | None:
    """Why the kernel cannot compute dW [G, k, n] from x [m, k] and dy [m, n] of `dtype` in
    `tiles` (tile_m of K, tile_n of N, tile_k rows a step; FLOAT8_TILE_K for float8), or
    None."""
    dtype = jnp.dtype(dtype)
    if 0 in (m, k, n):
        return f"an empty operand ({m} x {k} x {n}): XLA's ragged dot"
    if dtype not in DTYPES + FLOAT8:
        return f"it multiplies bf16, fp16 or float8 operands, got {dtype.name}"
    tiles = operand_tiles(tiles, dtype)
    if k % tiles.tile_m or n % tiles.tile_n:
        return f"K={k} and N={n} must be whole {tiles.tile_m} x {tiles.tile_n} tiles"
    if (tiles.tile_m * dtype.itemsize) % 128 or (tiles.tile_n * dtype.itemsize) % 128:
        return (
            f"tile_m={tiles.tile_m} and tile_n={tiles.tile_n} must be whole 128-byte rows of "
            f"{dtype.name} (x's and dy's blocks are loaded in rows of them)"
        )
    if tiles.tile_m % WGMMA_M or tiles.tile_k % WGMMA_M:
        return (
            f"tile_m={tiles.tile_m} and tile_k={tiles.tile_k} must be whole {WGMMA_M}s (wgmma "
            "rows; a 16-bit step's x block is masked in the wgmma layout of 64-row blocks)"
        )
    if stages(tiles, dtype, jnp.bfloat16 if dtype in FLOAT8 else dtype) < 2:
        return f"{tiles} leaves shared memory for fewer than 2 stages"
    return None


#: The fewest rows a group holds on average where dW runs on float8 (`float8_reason`): with
#: fewer, most of a unit's K-steps are its group's first or last, masked in registers, and the
#: 16-bit kernel on dequantized operands (which the passes that quantize them write anyway) is
#: the faster.
FLOAT8_MIN_GROUP_ROWS = 256


def float8_reason(m: int, k: int, n: int, groups: int) -> str | None:
    """Why dW [groups, k, n] of float8 x [m, k] and dy [m, n] should not run on the float8
    kernel (`float8_weight_grad`), or None."""
    if m < FLOAT8_MIN_GROUP_ROWS * groups:
        return (f"{m} rows in {groups} groups: fewer than {FLOAT8_MIN_GROUP_ROWS} a group, "
                "where the 16-bit kernel on dequantized operands is the faster")  # fmt: skip
    return shape_reason(PingPongTiles(), m, k, n, jnp.float8_e4m3fn)


def operand_tiles(tiles: PingPongTiles, dtype) -> PingPongTiles:
    """`tiles` as the kernel runs them on `dtype`: float8 steps of FLOAT8_TILE_K tokens."""
    if jnp.dtype(dtype) in FLOAT8:
        return dataclasses.replace(tiles, tile_k=FLOAT8_TILE_K)
    return tiles


def stages(tiles: PingPongTiles, dtype, out_dtype) -> int:
    """The ring's slots: `tiles.stages`, or as many as fit beside the two output tiles."""
    out = 2 * tiles.tile_m * tiles.tile_n * jnp.dtype(out_dtype).itemsize
    slot = (tiles.tile_m + tiles.tile_n) * tiles.tile_k * jnp.dtype(dtype).itemsize
    return min(tiles.stages, (SMEM_BYTES - out) // slot)


def group_steps(
    sizes: jax.Array, m: int, tile_k: int, align: int = ROW_ALIGN
) -> tuple[jax.Array, ...]:
    """Each group's rows [start, end) (sizes' sum cut at m), the first row of its K loop (start
    rounded down to a multiple of `align`) and its steps of tile_k rows (0 for no rows), int32
    [G] each."""
    ends = jnp.minimum(jnp.cumsum(sizes.astype(jnp.int32)), m)
    starts = jnp.concatenate([jnp.zeros(1, jnp.int32), ends[:-1]])
    base = starts // align * align
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


def _check(name: str, x, dy, sizes, tiles: PingPongTiles, dtypes) -> None:
    (m, k), n = x.shape, dy.shape[1]
    if dy.shape[0] != m or x.dtype not in dtypes or dy.dtype not in dtypes:
        raise ValueError(
            f"{name}: x {x.dtype}{list(x.shape)} and dy {dy.dtype}{list(dy.shape)} must be "
            f"[M, K] and [M, N] of {'/'.join(jnp.dtype(d).name for d in dtypes)}"
        )
    if sizes.ndim != 1 or sizes.shape[0] < 1:
        raise ValueError(f"{name}: sizes {list(sizes.shape)} must be [G >= 1]")
    if (reason := shape_reason(tiles, m, k, n, x.dtype)) is not None:
        raise ValueError(f"{name}: {reason}")


def weight_grad(
    x: jax.Array, dy: jax.Array, sizes: jax.Array, tiles: PingPongTiles | None = None
) -> jax.Array:
    """dW [G, K, N] = x_g^T @ dy_g per group g of `sizes` [G] (int32 rows per group, sorted,
    summing to at most M; rows past the sum contribute nothing), x [M, K] and dy [M, N] of one
    16-bit dtype, float32 accumulation, in x's dtype. K and N whole tiles (`shape_reason`)."""
    tiles = tiles or PingPongTiles()
    if dy.dtype != x.dtype:
        raise ValueError(f"grouped dW kernel: x {x.dtype} and dy {dy.dtype} must be one dtype")
    _check("grouped dW kernel", x, dy, sizes, tiles, DTYPES)
    plan = group_steps(sizes, x.shape[0], tiles.tile_k)
    return _kernel(tiles, x.shape[1], dy.shape[1], x.dtype, plan, x, dy, None)


def float8_weight_grad(
    x: jax.Array,
    x_scale_inv: jax.Array,
    dy: jax.Array,
    dy_scale_inv: jax.Array,
    sizes: jax.Array,
    out_dtype=jnp.bfloat16,
    tiles: PingPongTiles | None = None,
) -> jax.Array:
    """dW [G, K, N] = (x_g^T @ dy_g) x x_scale_inv x dy_scale_inv per group g of `sizes` [G]
    (as `weight_grad`), x [M, K] and dy [M, N] float8 (e4m3 and e5m2 in any pairing), their
    tensor scales (the factors that dequantize, scalars), float32 accumulation (fast), in
    `out_dtype`. K and N whole tiles (`shape_reason`); rows past the sum contribute nothing."""
    tiles = operand_tiles(tiles or PingPongTiles(), jnp.float8_e4m3fn)
    _check("float8 grouped dW kernel", x, dy, sizes, tiles, FLOAT8)
    plan = group_steps(sizes, x.shape[0], tiles.tile_k, TOKEN_ALIGN)
    scale = (x_scale_inv * dy_scale_inv).astype(jnp.float32).reshape(1)
    k, n = x.shape[1], dy.shape[1]
    xt, dyt = padded_rows_transposed(x), padded_rows_transposed(dy)
    return _kernel(tiles, k, n, jnp.dtype(out_dtype), plan, xt, dyt, scale)


def _kernel(tiles: PingPongTiles, k: int, n: int, out_dtype, plan, x, dy, scale):
    """The kernel: 16-bit (`scale` None; x [M, K], dy [M, N]) or float8 (x [K, M'] and dy
    [N, M'] transposed, `scale` [1]); plan = `group_steps`'."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu
    from jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu import MatmulDimension

    float8, steps = scale is not None, plan[3]
    layout = plgpu.Layout.WGMMA_8BIT if float8 else plgpu.Layout.WGMMA
    groups = steps.shape[0]
    tm, tn, tk = tiles.tile_m, tiles.tile_n, tiles.tile_k
    ring = stages(tiles, x.dtype, out_dtype)
    m_iters, n_iters, sms = k // tm, n // tn, mt.num_sms()
    per_group = m_iters * n_iters
    units = groups * per_group

    def body(*refs):
        start_ref, end_ref, base_ref, steps_ref, offs_ref, x_ref, dy_ref, *refs = refs
        scale_ref, out_ref = refs if float8 else (None, *refs)
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

            def blocks(tokens, rows, cols):  # a step's blocks of x and dy
                if float8:  # transposed: the tokens are columns
                    return x_ref.at[rows, tokens], dy_ref.at[cols, tokens]
                return x_ref.at[tokens, rows], dy_ref.at[tokens, cols]

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

                        align = TOKEN_ALIGN if float8 else ROW_ALIGN
                        tokens = pl.ds(pl.multiple_of(base + kk * tk, align), tk)
                        for c in (0, 1):
                            issue = functools.partial(load_step, loaded[c].at[slot], slot)
                            pl.when(lax.rem(j, 2) == c)(
                                lambda issue=issue: issue(*blocks(tokens, rows, cols))
                            )

            def zero_rows(block, below, above):  # zero tokens outside [below, above) of a block
                token = plgpu.layout_cast(  # float8 blocks hold tokens in columns
                    lax.broadcasted_iota(jnp.int32, block.shape, 1 if float8 else 0), layout
                )
                keep = (token >= below) & (token < above)
                if float8:  # Mosaic GPU selects on 16 bits or more: float8 is exact in f16
                    value = plgpu.load(block, (), layout=layout).astype(jnp.float16)
                else:
                    value = block[...]
                block[...] = jnp.where(keep, value, jnp.zeros_like(value)).astype(block.dtype)
                plgpu.commit_smem()

            def masked(g, kk, slot):  # zero the step's tokens outside its group
                lo, hi = start_ref[g] - base_ref[g], end_ref[g] - base_ref[g]
                total = end_ref[groups - 1] - base_ref[g]  # and the groups' sum
                below, above = lo - kk * tk, hi - kk * tk  # the step's own rows

                @pl.when((below > 0) | (above < tk))
                def _zero_other_groups_rows():
                    zero_rows(x_smem.at[slot], below, above)

                @pl.when(total - kk * tk < tk)  # rows past the sum: dy's too (any values)
                def _zero_rows_past_the_sum():
                    zero_rows(dy_smem.at[slot], 0, total - kk * tk)

            def gemm_tile(c, j):
                g, first, rows, cols = where(j)
                count = steps_ref[g]

                def k_step(kk, acc):
                    slot = lax.rem(first + kk, ring)
                    plgpu.barrier_wait(loaded[c].at[slot])
                    masked(g, kk, slot)
                    if float8:
                        plgpu.wgmma(acc, x_smem.at[slot], dy_smem.at[slot].T)
                    else:
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
                    out_smem[c] = mt.scaled(acc_ref[...], scale_ref if float8 else None, out_dtype)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(out_smem.at[c], out_ref.at[g, rows, cols])

                pl.run_scoped(tile_scope, plgpu.ACC((tm, tn), jnp.float32))

            def compute(c):
                pl.loop(c, mine, step=2)(functools.partial(gemm_tile, c))
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

            by_warpgroup(load, compute)

        x_block, dy_block = ((tm, tk), (tn, tk)) if float8 else ((tk, tm), (tk, tn))
        operand_smem = [
            plgpu.SMEM((ring, *shape), a.dtype, transforms=mt.smem_transforms(a.dtype, shape[1]))
            for shape, a in ((x_block, x), (dy_block, dy))
        ]
        result_smem = plgpu.SMEM(
            (2, tm, tn), out_dtype, transforms=mt.smem_transforms(out_dtype, tn)
        )
        scratch = ring_scratch(ring, *operand_smem, result_smem)
        pl.run_scoped(scoped, *scratch, collective_axes="wg")

    offsets = unit_offsets(steps, per_group, sms)
    operands = (*plan, offsets, x, dy) + (() if scale is None else (scale,))
    name = "grouped_dw8_pingpong" if float8 else "grouped_dw_pingpong"
    return launch(body, name, (groups, k, n), out_dtype, *operands)
