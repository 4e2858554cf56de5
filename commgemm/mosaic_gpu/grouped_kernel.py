"""The grouped GEMM's Hopper kernel: x [M, K] (rows sorted by group) times w [G, K, N], each
row multiplied by its group's weight (`lax.ragged_dot`), on the dense kernels' tiles
(`mosaic_gpu.tiles`: one persistent CTA per SM, two compute warpgroups and one that issues the
TMA loads, 128 x 256 CTA tiles, 4 stages).

Output tiles are aligned to the rows, not to the groups, so every store is whole. A CTA's tile
of rows [r, r + 128) runs one warp-specialized pipeline over (group, K-step) for every group
with rows in it: a tile inside one group is a plain GEMM tile; a tile that straddles group
boundaries runs one K loop per group into the same accumulator. Each compute warpgroup owns 64
rows of the tile: it runs a group's K-steps only where the group has rows in its block (the
other warpgroup's wgmmas then have the tensor cores to themselves), zeroing in shared memory
the rows of its x block that are not the group's before each wgmma where the block straddles a
boundary. Rows past the groups' sum are in no group and come out zero. The work per column is
M / 64 warpgroup blocks plus one per group boundary inside a block (jax's `ragged_dot_mgpu`
runs a whole tile per boundary, its stores following the groups in a ladder of partial TMA
stores).

The (row tile, group) pairs are listed before the kernel, in XLA (`Schedule`), with the
output tiles' order over the CTAs, costliest first. Where the last, partly filled wave of
tiles fills at most half the CTAs (`GroupedConfig.narrow_tail`), its tiles, the cheapest, run
as two of half the columns each (`tiles.narrowed`), in a shared-memory scope of their own, so
that wave takes about half a tile's time; by default where a model of the schedule says that
shortens the busiest CTA (`narrowing_pays`: tiles that straddle group boundaries may already
fill the last wave's idle CTAs).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from commgemm.mosaic_gpu import tiles as mt
from commgemm.mosaic_gpu.configs import GroupedConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Schedule:
    """The kernel's work, int32: its (row tile, group) pairs for cta_m-row tiles of M rows,
    and the order of its output tiles.

    group, lo, hi [M / cta_m + G - 1]: pair p multiplies rows [lo, hi) of its row tile
      (offsets within the tile) by w[group]; pairs are in row-tile order, then group order.
    first, count [M / cta_m]: row tile r's pairs are first[r], ..., first[r] + count[r] - 1
      (count 0: the tile lies past the groups' sum).
    order [tiles]: the output tile (its index in the tiles' `planar_snake` walk) of the
      kernel's unit u; CTA c runs units c, c + ctas, ... (`balanced_slots`)."""

    group: jax.Array
    lo: jax.Array
    hi: jax.Array
    first: jax.Array
    count: jax.Array
    order: jax.Array

    def arrays(self) -> tuple[jax.Array, ...]:
        return self.group, self.lo, self.hi, self.first, self.count, self.order


def balanced_slots(units: int, ctas: int, tail: int = 0) -> np.ndarray:
    """Where the i-th costliest of `units` tiles runs (its unit index, as CTA c runs units
    c, c + ctas, ...): each round deals one tile to every CTA in a snake, the CTAs with one
    tile fewer first, so that the costliest tiles go to different CTAs and a CTA dealt a
    costly tile in one round is dealt a cheap one in the next. The `tail` cheapest go last,
    in order (a narrowed last wave: `tiles.narrow_tail_units`)."""
    if tail:
        return np.concatenate([balanced_slots(units - tail, ctas), np.arange(units - tail, units)])
    rounds = -(-units // ctas)
    full = units - (rounds - 1) * ctas  # CTAs that run `rounds` tiles
    slots = []
    for r in range(rounds):
        dealt = [*range(full, ctas), *range(full)] if r < rounds - 1 else list(range(full))
        slots += [c + r * ctas for c in (dealt[::-1] if r % 2 else dealt)]
    return np.asarray(slots, np.int32)


def schedule(sizes: jax.Array, tiles: GroupedConfig, m: int, n: int, ctas: int) -> Schedule:
    """The pairs of row tiles and groups for group `sizes` [G] (summing to at most m; a sum
    beyond m is cut at m) over m rows (whole tiles), and the output tiles' order over `ctas`
    CTAs, balanced by their warpgroups' K loops (`balanced_slots`), the cheapest last where
    the last wave runs narrowed (`GroupedConfig.narrow_tail`). The pairs are counted by
    comparisons and prefix sums over the groups, not searched: a few fused elementwise ops on
    a GPU, where a search is a loop of small kernels; the tiles are ranked by `cost_rank`."""
    cta_m = tiles.cta_m
    num_groups, tiles_m, tiles_n = sizes.shape[0], m // cta_m, n // tiles.cta_n
    ends = jnp.minimum(jnp.cumsum(sizes.astype(jnp.int32)), m)
    starts = jnp.concatenate([jnp.zeros(1, jnp.int32), ends[:-1]])
    first_tile, last_tile = starts // cta_m, (ends - 1) // cta_m
    tiles_of = jnp.where(ends > starts, last_tile - first_tile + 1, 0)  # per group
    total = jnp.cumsum(tiles_of)
    pair = jnp.arange(tiles_m + num_groups - 1, dtype=jnp.int32)
    group = jnp.minimum(jnp.sum(total[None, :] <= pair[:, None], axis=1), num_groups - 1)
    group = group.astype(jnp.int32)
    row_tile = first_tile[group] + pair - (total - tiles_of)[group]
    row_tile = jnp.where(pair < total[-1], row_tile, tiles_m)  # unused pairs sort last
    row0 = row_tile * cta_m
    lo = jnp.clip(starts[group] - row0, 0, cta_m)
    hi = jnp.clip(ends[group] - row0, 0, cta_m)
    tile = jnp.arange(tiles_m, dtype=jnp.int32)
    in_tile = row_tile[None, :] == tile[:, None]
    first = jnp.sum(row_tile[None, :] < tile[:, None], axis=1, dtype=jnp.int32)
    count = jnp.sum(in_tile, axis=1, dtype=jnp.int32)
    # a tile's cost: its warpgroups' K loops (a warpgroup runs a group's loop only where the
    # group has rows in its tile_m-row block)
    block = jnp.arange(0, cta_m, tiles.tile_m, dtype=jnp.int32)
    blocks = jnp.sum((lo[:, None] < block + tiles.tile_m) & (hi[:, None] > block), axis=1)
    walk = jnp.arange(tiles_m * tiles_n, dtype=jnp.int32)
    m_idx, _ = jax.vmap(lambda t: mt.cluster_tile(tiles, t, tiles_m, tiles_n))(walk)
    # each tile's rank by cost, costliest first, ties in walk order
    cost = jnp.sum(jnp.where(in_tile, blocks[None, :], 0), axis=1, dtype=jnp.int32)[m_idx]
    rank = cost_rank(cost, walk)
    tail = mt.narrow_tail_units(tiles, walk.shape[0], ctas)
    slots = jnp.asarray(balanced_slots(walk.shape[0], ctas, tail))
    order = jnp.zeros_like(walk).at[slots[rank]].set(walk, unique_indices=True)
    return Schedule(group=group, lo=lo, hi=hi, first=first, count=count, order=order)


#: Tiles up to which `cost_rank` compares all pairs (one fused reduction, cheaper than a prefix
#: sum or a sort for a few thousand tiles); past it the tiles**2 comparisons outgrow a sort.
PAIRWISE_RANK_TILES = 8192


def cost_rank(cost: jax.Array, walk: jax.Array) -> jax.Array:
    """[T] int32: each tile's place by `cost` [T], costliest first, ties in `walk` order
    (arange(T)): over all pairs up to PAIRWISE_RANK_TILES tiles, else by a stable sort."""
    if cost.shape[0] <= PAIRWISE_RANK_TILES:
        tie = (cost[None, :] == cost[:, None]) & (walk[None, :] < walk[:, None])
        return jnp.sum((cost[None, :] > cost[:, None]) | tie, axis=1, dtype=jnp.int32)
    by_cost = jnp.argsort(-cost, stable=True).astype(jnp.int32)
    return jnp.zeros_like(walk).at[by_cost].set(walk, unique_indices=True)


@functools.cache
def narrowing_pays(tiles: GroupedConfig, m: int, n: int, groups: int, ctas: int) -> bool:
    """Whether running the last, partly filled wave narrowed (`GroupedConfig.narrow_tail`)
    shortens the kernel's busiest CTA, in a model of its schedule for m x n outputs of `groups`
    groups on `ctas` CTAs: a row tile runs one K loop per group with rows in it, each taking a
    whole tile's time whatever its rows (w[g]'s blocks are loaded either way), a half tile half
    that; the G - 1 group boundaries fall inside row tiles spread evenly; tiles are dealt as
    `balanced_slots` deals them, costliest first. A tie keeps the tiles whole (a half tile does
    less per cycle). Where the weights' reads bound the kernel (many groups) the two forms run
    alike (docs/performance.md: "the last wave narrowed in the grouped kernel")."""
    if tiles.cta_m % 128 or tiles.cta_n % 128:  # no half tiles of whole epilogue blocks
        return False
    tiles_m, tiles_n = m // tiles.cta_m, n // tiles.cta_n
    units = tiles_m * tiles_n
    tail = mt.narrow_tail_units(dataclasses.replace(tiles, narrow_tail=True), units, ctas)
    if not tail:
        return False
    boundaries = np.arange(1, groups) * tiles_m // groups  # the row tile of each boundary
    loops = 1 + np.bincount(boundaries, minlength=tiles_m)[:tiles_m]
    cost = np.sort(np.repeat(loops, tiles_n))[::-1].astype(float)  # by rank, costliest first

    def busiest(tail: int) -> float:
        slots, load = balanced_slots(units, ctas, tail), np.zeros(ctas)
        whole = slots < units - tail
        np.add.at(load, slots[whole] % ctas, cost[whole])
        for part in (0, 1):  # a tail unit's two halves run on consecutive CTAs
            np.add.at(load, (2 * (slots[~whole] - units + tail) + part) % ctas, cost[~whole] / 2)
        return float(load.max())

    return busiest(tail) < busiest(0)


#: The float8 formats the kernel multiplies, either on either side (jax >= 0.11's wgmma takes
#: the e4m3 x e5m2 pair: dX's e5m2 cotangent times e4m3 weights), with w laid out [G, N, K]
#: (K-major, as float8 wgmma needs), in `fused.float8_tiling` (K-steps of 128 where K allows;
#: split accumulation `fused.split_tiling`: 64 x 128 warpgroup tiles, K-steps of 256 if K allows).
FLOAT8 = (jnp.float8_e4m3fn, jnp.float8_e5m2)


def _float8_tiling(tiles: GroupedConfig, k: int, split: bool = False) -> GroupedConfig:
    from commgemm.mosaic_gpu import fused

    return fused.split_tiling(tiles, k) if split else fused.float8_tiling(tiles, k)


def _load(ref, layout) -> jax.Array:
    """The whole of smem `ref` in registers, in `layout`: jax 0.10's `plgpu.load` wants an
    index beside the ref, which jax 0.11 deprecates (index the ref with `.at` instead)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    idx = inspect.signature(plgpu.load).parameters.get("idx")
    if idx is not None and idx.default is inspect.Parameter.empty:
        return plgpu.load(ref, (), layout=layout)
    return plgpu.load(ref, layout=layout)


def shape_reason(
    tiles: GroupedConfig,
    m: int,
    k: int,
    n: int,
    dtype,
    *,
    w_nk: bool = False,
    split: bool = False,
) -> str | None:
    """Why the kernel cannot multiply x [m, K] by w [G, K, n] ([G, n, K] with w_nk) of `dtype`
    (with `split` accumulation: float8 only), or None."""
    if 0 in (m, k, n):
        return f"an empty operand ({m} x {k} x {n}): XLA's ragged dot"
    dtype = jnp.dtype(dtype)
    if dtype in FLOAT8:
        if not w_nk:
            return f"{dtype.name} operands need w laid out [G, N, K] (K-major)"
        tiles = _float8_tiling(tiles, k, split)
    elif dtype not in (jnp.bfloat16, jnp.float16):
        return f"it multiplies bf16, fp16 or float8 operands, got {dtype.name}"
    elif split:
        return "split accumulation is for float8 operands (16-bit ones accumulate in float32)"
    return mt.shape_reason(tiles, m, k, n)


def grouped_matmul(
    x: jax.Array,
    w: jax.Array,
    sizes: jax.Array,
    tiles: GroupedConfig | None = None,
    *,
    w_nk: bool = False,
    scale: jax.Array | None = None,
    out_dtype=None,
    split_accumulator: bool = False,
) -> jax.Array:
    """x [M, K] (rows sorted by group) times w [G, K, N] ([G, N, K] with w_nk, as dX's
    transposed weight) per group, `sizes` [G] int32 rows per group summing to at most M ->
    [M, N] in `out_dtype` (default x's), float32 accumulation, times `scale` [1] float32 if
    given; rows past the sum are zero. M, K and N whole tiles (`shape_reason`). Float8 x and w
    (w_nk; e4m3 and e5m2 in any pairing) multiply on the float8 tensor cores: in
    `fused.float8_tiling` the wgmma accumulating across K-steps (the dense kernels' fast
    accumulation), or with `split_accumulator` in `fused.split_tiling`, each K-step's product
    added into a float32 total (`tiles.accumulate`)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    tiles = tiles or GroupedConfig()
    dtype = x.dtype
    out_dtype = jnp.dtype(out_dtype or dtype)
    float8 = jnp.dtype(dtype) in FLOAT8
    wide = jnp.float16 if float8 else dtype  # the masking's dtype
    if float8:
        tiles = _float8_tiling(tiles, x.shape[1], split_accumulator)
    m, k = x.shape
    n = w.shape[1 if w_nk else 2]
    same = w.dtype == dtype or (float8 and w.dtype in FLOAT8)
    if w.ndim != 3 or w.shape[2 if w_nk else 1] != k or not same:
        layout = "[G, N, K]" if w_nk else "[G, K, N]"
        kind = "a float8 dtype" if float8 else f"dtype {dtype}"
        raise ValueError(
            f"grouped kernel: w {w.dtype}{list(w.shape)} must be {layout} with x's K={k} and {kind}"
        )
    if sizes.shape != (w.shape[0],) or w.shape[0] < 1:
        raise ValueError(
            f"grouped kernel: sizes {sizes.shape} must hold one count per group of w "
            f"{list(w.shape)}, at least one"
        )
    if (
        reason := shape_reason(tiles, m, k, n, dtype, w_nk=w_nk, split=split_accumulator)
    ) is not None:
        raise ValueError(f"grouped kernel: {reason}")
    m_iters, n_iters, k_iters = m // tiles.cta_m, n // tiles.cta_n, k // tiles.tile_k
    transforms = mt.smem_transforms(dtype, tiles.tile_k)

    sms = mt.num_sms()
    if tiles.narrow_tail is None:
        narrow = narrowing_pays(tiles, m, n, w.shape[0], sms)
        tiles = dataclasses.replace(tiles, narrow_tail=narrow)
    units = m_iters * n_iters
    tail = mt.narrow_tail_units(tiles, units, sms)

    def body(x_ref, w_ref, group_ref, lo_ref, hi_ref, first_ref, count_ref, order_ref, *refs):
        scale_ref, out_ref = refs if scale is not None else (None, *refs)
        wg = lax.axis_index("wg")

        def pipeline(tiling, m_idx, n_idx, mma_body, compute_context):
            """The warp-specialized loop over (group, K-step) of row tile m_idx, column n_idx of
            `tiling`."""
            first = first_ref[m_idx]

            def w_index(j, kk):
                group = group_ref[first + j]
                return (group, n_idx, kk) if w_nk else (group, kk, n_idx)

            w_block = (tiling.cta_n, tiling.tile_k) if w_nk else (tiling.tile_k, tiling.cta_n)
            return plgpu.emit_pipeline_warp_specialized(
                mma_body,
                grid=(count_ref[m_idx], k_iters),
                memory_registers=40,
                in_specs=[
                    plgpu.BlockSpec(
                        (tiling.cta_m, tiling.tile_k),
                        lambda j, kk: (m_idx, kk),
                        transforms=transforms,
                        delay_release=1,  # the K-step's wgmma may still read it
                    ),
                    plgpu.BlockSpec(
                        (None, *w_block), w_index, transforms=transforms, delay_release=1
                    ),
                ],
                wg_axis="wg",
                num_compute_wgs=2,
                max_concurrent_steps=tiling.stages,
                compute_context=compute_context,
            )

        def walk(tiling, units: int, unit_of):
            """Run `units` units in `tiling`, in a shared-memory scope of their own: unit_of(i)
            is (lin, part), the lin-th output tile in the schedule's order whole (part None)
            or its part-th half (`tiles.narrowed`)."""
            ignore = lambda *_, **__: None  # noqa: E731
            allocations = pipeline(tiling, 0, 0, ignore, ignore).get_allocations(x_ref, w_ref)

            @functools.partial(
                pl.run_scoped,
                pipeline_allocs=allocations,
                out_smem=mt.out_smem(tiling, out_dtype),
                collective_axes="wg",
            )
            def _scope(pipeline_allocs, out_smem):
                @plgpu.nd_loop((units,), collective_axes="cluster_grid")
                def _tiles(info):
                    (i,) = info.index
                    lin, part = unit_of(i)
                    at = mt.tile_slices(tiles, order_ref[lin], m_iters, n_iters)
                    if part is not None:
                        at = mt.narrowed_slices(tiles, at, part)
                    run_tile(tiling, at, pipeline_allocs, out_smem)

                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        def run_tile(tiling, at, pipeline_allocs, out_smem):
            num_slots = mt.epilogue_slots(tiling)
            first, count = first_ref[at.m_idx], count_ref[at.m_idx]
            wg_row0 = wg * tiling.tile_m  # this warpgroup's rows within the row tile

            def finish(read):
                acc = mt.scaled(read(), scale_ref, out_dtype)
                dest = out_ref.at[at.cta_m, at.cta_n].at[at.wg_m, at.wg_n]
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                for epi_m, epi_n, slot in mt.epilogue_blocks(tiling, num_slots):
                    plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                    out_smem[wg, slot] = acc[epi_m, epi_n]
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(out_smem.at[wg, slot], dest.at[epi_m, epi_n])

            def compute_context(eval_pipeline):
                mt.accumulated(tiling, eval_pipeline, finish, split=False)

            def mma_body(idxs, a_smem, b_smem, acc):
                j, _ = idxs
                rows = a_smem.at[at.wg_m]
                lo, hi = lo_ref[first + j], hi_ref[first + j]
                # does the group have rows in this warpgroup's block, all of them?
                mine = (lo < wg_row0 + tiling.tile_m) & (hi > wg_row0)
                whole = (lo <= wg_row0) & (hi >= wg_row0 + tiling.tile_m)

                @pl.when(mine & ~whole)
                def _other_groups_rows():  # zero them: the block straddles a boundary
                    shape, layout = (tiling.tile_m, tiling.tile_k), plgpu.Layout.WGMMA
                    row = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=layout)
                    row = row + wg_row0
                    # float8 is selected in fp16, which holds every float8 value exactly
                    # (Mosaic GPU computes on no 8-bit type)
                    block = _load(rows, layout).astype(wide)
                    keep = (row >= lo) & (row < hi)
                    rows[...] = jnp.where(keep, block, jnp.zeros(shape, wide)).astype(dtype)
                    plgpu.commit_smem()

                @pl.when(mine)  # else the warpgroup leaves the K loop to the other
                def _multiply():
                    rhs = mt.rhs_operand(b_smem, at.wg_n, w_nk=w_nk)
                    if split_accumulator:  # the K-step's product promoted into the total
                        acc[...] = mt.accumulate(tiling, acc[...], rows, rhs, split=True)
                    else:
                        plgpu.wgmma(acc, rows, rhs)
                    plgpu.wgmma_wait(1)

                @pl.when(~mine)  # an earlier step's wgmma may read the slot released after this
                def _idle():
                    plgpu.wgmma_wait(0)

                mt.await_last_step((j == count - 1) & (idxs[1] == k_iters - 1))
                return acc

            @pl.when(count > 0)
            def _groups():
                pipeline(tiling, at.m_idx, at.n_idx, mma_body, compute_context)(
                    x_ref, w_ref, allocations=pipeline_allocs
                )

            @pl.when((count == 0) & (wg < 2))
            def _past_the_sum():  # rows in no group
                zeros = jnp.zeros((tiling.tile_m, tiling.tile_n), jnp.float32)
                finish(lambda: plgpu.layout_cast(zeros, plgpu.Layout.WGMMA))

        if units > tail:
            walk(tiles, units - tail, lambda i: (i, None))
        if tail:  # a new scope: every warpgroup has left the main loop's shared memory
            walk(
                mt.narrowed(tiles),
                2 * tail,
                lambda i: (units - tail + i // 2, lax.rem(i, jnp.int32(2))),
            )

    plan = schedule(sizes, tiles, m, n, sms)
    # traced in 32-bit mode: under jax_enable_x64 the pipeline's loop over a grid known only at
    # run time mixes int32 steps with int64 constants
    with jax.named_scope("grouped_gemm"), jax.enable_x64(False):
        return plgpu.kernel(
            body,
            out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
            **mt.kernel_params(sms, 1),
        )(x, w, *plan.arrays(), *([] if scale is None else [scale]))
