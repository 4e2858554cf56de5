"""The grouped GEMM's ping-pong Hopper kernel: x [M, K] (rows sorted by group) times w [G, K, N],
each row multiplied by its group's weight (`lax.ragged_dot`), on tiles aligned to the groups.

Tiles: each group's rows run in tiles of tile_m rows from its first row rounded down to a
multiple of 8 (Mosaic GPU loads tiled shared memory from whole 8s of rows), so a tile holds one
group's rows (a group's first tile also up to 7 rows of the group before it, and its last tile
rows past the group's end: computed, never stored). A tile is one K loop over its group's
weights, whatever the groups: a group costs about half a tile of rows it does not need (its
partial last tile), where tiles aligned to the rows (`grouped_kernel`) run one more K loop per
group boundary inside a tile. A tile's rows are stored by a ladder of TMA stores of powers of
two rows (`ladder`), each taken or not by the bits of the row count (as jax's
`ragged_dot_mgpu`). Rows past the groups' sum come out zero: the compute warpgroups store zero
tiles over them after their GEMM tiles.

Schedule (CUTLASS's ping-pong): one persistent CTA per SM with a warpgroup that issues the TMA
loads and two compute warpgroups, each owning a whole tile_m x tile_n tile (a 128 x 128
float32 accumulator) and taking the CTA's tiles in turn. The load warpgroup fills one ring of
`stages` shared-memory slots in tile order, so one warpgroup's K loop follows the other's and
each tile's epilogue runs under the other warpgroup's K loop, where the dense kernels' two
warpgroups (one tile between them) run their epilogues together and leave the tensor cores
idle; an ordered pair of barriers makes the K loops alternate. A compute warpgroup waits on
the "loaded" barriers of its own tiles only (one array per warpgroup, so each barrier's phases
are awaited in order) and releases each slot on one "consumed" array, which the load warpgroup
awaits before reusing the slot. The load warpgroup reads a tile's place (its first row and
group, from global memory) once per tile, not in each K-step, where those dependent loads
would set the loads' pace. CTAs walk the output tiles in bands `band` row tiles wide. The
groups' partial last tiles often leave a last wave that fills few CTAs; where it fills at most
half of them, its tiles run as two halves of tile_m / 2 rows each, on two CTAs. Its pieces are
the dense ping-pong kernels' (`pingpong.Deal`, traced: the tiles follow the group sizes;
`pingpong.by_warpgroup`, `k_loop_in_turn`) and, with `ring_scratch` and `launch`, `grouped_dw`'s.

It runs the forward and dX (w read [G, N, K]) at any group size (`grouped.pick_tiles`), and
the float8 forward and dX where `grouped.float8_kernel` picks it (fast accumulation). With a
`grouped_return.Returned` plan the epilogue stores each tile's rows into their owners' results
instead, over NVLink (`grouped_return`); with a `grouped_dispatch.Dispatched` one, x's rows
arrive from their owners while the GEMM runs (`grouped_dispatch`)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from commgemm.mosaic_gpu import tiles as mt
from commgemm.mosaic_gpu.configs import FLOAT8_TILE_K, ROW_ALIGN, WGMMA_M, PingPongTiles
from commgemm.mosaic_gpu.grouped_kernel import FLOAT8
from commgemm.mosaic_gpu.pingpong import Deal, by_warpgroup, k_loop_in_turn

#: Shared memory a Hopper CTA may use (227 KiB), less 1 KiB for the barriers.
SMEM_BYTES = 227 * 1024 - 1024
#: The shared-memory swizzle of the operands' tiles, bytes: w's rows [K, N] are whole ones.
SWIZZLE = 128


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowTiles:
    """The kernel's row tiles, int32: tile p holds rows [start, start + tile_m) of x, of which
    `rows` from start + skip are its group's (and stored); groups' tiles first, in group order,
    then the tail's (rows past the groups' sum, zeroed), then unused ones (rows 0).

    start, skip, rows, group [`max_row_tiles`]; counts [2]: the groups' tiles, and theirs with
    the tail's."""

    start: jax.Array
    skip: jax.Array
    rows: jax.Array
    group: jax.Array
    counts: jax.Array

    def arrays(self) -> tuple[jax.Array, ...]:
        return self.start, self.skip, self.rows, self.group, self.counts


def max_row_tiles(m: int, groups: int, tile_m: int) -> int:
    """A bound on the row tiles of m rows in `groups` groups and the tail: each of the G + 1
    spans takes at most one tile more than its rows (and the 7 rows below its aligned start)."""
    return -(-(m + ROW_ALIGN * (groups + 1)) // tile_m) + groups + 1


def row_tiles(sizes: jax.Array, m: int, tile_m: int) -> RowTiles:
    """The row tiles of groups `sizes` [G] (their sum cut at m) over m rows and of the tail
    [sum, m), counted by comparisons and prefix sums (a few fused elementwise ops)."""
    ends = jnp.minimum(jnp.cumsum(sizes.astype(jnp.int32)), m)
    ends = jnp.concatenate([ends, jnp.full((1,), m, jnp.int32)])  # the tail: one more span
    offs = jnp.concatenate([jnp.zeros(1, jnp.int32), ends[:-1]])
    base = offs // ROW_ALIGN * ROW_ALIGN
    count = jnp.where(ends > offs, (ends - base + tile_m - 1) // tile_m, 0)
    cum = jnp.cumsum(count)
    p = jnp.arange(max_row_tiles(m, sizes.shape[0], tile_m), dtype=jnp.int32)
    span = jnp.minimum(jnp.sum(cum[None, :] <= p[:, None], axis=1), ends.shape[0] - 1)
    start = base[span] + (p - (cum - count)[span]) * tile_m
    first = jnp.maximum(offs[span], start)
    rows = jnp.where(p < cum[-1], jnp.minimum(start + tile_m, ends[span]) - first, 0)
    i32 = functools.partial(jnp.asarray, dtype=jnp.int32)
    counts = jnp.stack([cum[-2], cum[-1]])
    return RowTiles(i32(start), i32(first - start), i32(rows), i32(span), i32(counts))


def ladder(tile_m: int) -> tuple[int, ...]:
    """The row counts of the store ladder of a tile_m-row tile: the powers of two from the
    largest not above tile_m down to 1. A tile storing `count` rows (0 to tile_m) takes the
    steps whose bits `count` has, each at the rows the steps before it took; every count up to
    tile_m is a sum of distinct such steps, tile_m itself included where it is not a power of
    two (192 = 128 + 64)."""
    top = 1 << (tile_m.bit_length() - 1)
    return tuple(top >> i for i in range(top.bit_length()))


def ladder_store(source, dest, first, count, cols, tile_m: int, at=0) -> None:
    """In a Mosaic GPU kernel: source's rows [at, at + count) (of a tile_m-row shared-memory
    tile, unswizzled where `at` is not 0; 0 <= count <= tile_m - at) into dest's rows [first,
    first + count) at columns `cols`, by the `ladder`'s TMA stores (to be waited on by the
    caller)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    done = 0
    for step in ladder(tile_m):

        @pl.when(count & step != 0)
        def _part(done=done, step=step):
            plgpu.copy_smem_to_gmem(
                source.at[pl.ds(at + done, step)], dest.at[pl.ds(first + done, step), cols]
            )

        done = done + (count & step)


def ring_stages(tiles: PingPongTiles, dtype, out_dtype) -> int:
    """The ring's slots: `tiles.stages`, or as many as fit in shared memory beside the two
    output tiles (fewer for a 32-bit result)."""
    out = 2 * tiles.tile_m * tiles.tile_n * jnp.dtype(out_dtype).itemsize
    slot = (tiles.tile_m + tiles.tile_n) * tiles.tile_k * jnp.dtype(dtype).itemsize
    return min(tiles.stages, (SMEM_BYTES - out) // slot)


def operand_tiles(tiles: PingPongTiles, k: int, dtype) -> PingPongTiles:
    """`tiles` for operands of `dtype`: float8 K-steps of FLOAT8_TILE_K where K is whole steps
    of it (the same bytes a step as 16-bit operands' 64)."""
    if jnp.dtype(dtype) in FLOAT8 and k % FLOAT8_TILE_K == 0:
        return dataclasses.replace(tiles, tile_k=max(tiles.tile_k, FLOAT8_TILE_K))
    return tiles


def ring_scratch(stages: int, x_smem, w_smem, out_smem) -> tuple:
    """The ping-pong's shared memory, in the order its kernels' scopes take it: the ring's
    operand slots (`x_smem`, `w_smem`: plgpu.SMEM of `stages` blocks), one "loaded" barrier
    array per compute warpgroup (two loads a slot), the "consumed" array, the two output tiles
    (`out_smem`) and the ordered pair of turn barriers (`k_loop_in_turn`)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    loads = [plgpu.Barrier(num_arrivals=2, num_barriers=stages) for _ in range(2)]
    consumed = plgpu.Barrier(num_arrivals=1, num_barriers=stages)
    turns = [plgpu.Barrier(num_arrivals=1) for _ in range(2)]
    return (x_smem, w_smem, *loads, consumed, out_smem, *turns)


def launch(body, name: str, out_shape: tuple[int, ...], out_dtype, *operands, also=None):
    """A ping-pong grouped kernel `body` on `operands`: one persistent CTA per SM ("sm"), two
    compute warpgroups and one that loads ("wg"), traced in 32-bit mode (its loops are bounded
    at run time) under the named scope `name`; its result [out_shape] of `out_dtype` (and a
    second, `also`: a jax.ShapeDtypeStruct)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    out_type = jax.ShapeDtypeStruct(out_shape, out_dtype)
    with jax.named_scope(name), jax.enable_x64(False):
        return plgpu.kernel(
            body,
            out_type=out_type if also is None else (out_type, also),
            grid=(mt.num_sms(),),
            grid_names=("sm",),
            num_threads=3,
            thread_name="wg",
            compiler_params=plgpu.CompilerParams(
                lowering_semantics=plgpu.LoweringSemantics.Warpgroup
            ),
        )(*operands)


def shape_reason(
    tiles: PingPongTiles, m: int, k: int, n: int, dtype, *, w_nk: bool = False
) -> str | None:
    """Why the kernel cannot multiply x [m, K] by w [G, K, n] ([G, n, K] with w_nk) of `dtype`
    in `tiles`, or None: 16-bit operands, or float8 ones with w_nk (K-major, as float8 wgmma
    needs); N and K whole tiles (any number of rows)."""
    dtype = jnp.dtype(dtype)
    if 0 in (m, k, n):
        return f"an empty operand ({m} x {k} x {n}): XLA's ragged dot"
    if dtype in FLOAT8 and not w_nk:
        return f"{dtype.name} operands need w laid out [G, N, K] (K-major)"
    if dtype not in (jnp.bfloat16, jnp.float16, *FLOAT8):
        return f"it multiplies bf16, fp16 or float8 operands, got {dtype.name}"
    if n % tiles.tile_n or k % tiles.tile_k:
        return f"N={n} and K={k} must be whole {tiles.tile_n} x {tiles.tile_k} tiles"
    if not w_nk and (tiles.tile_n * dtype.itemsize) % SWIZZLE:
        return (
            f"w [G, K, N] is loaded in rows of tile_n={tiles.tile_n} elements, which must "
            f"be whole {SWIZZLE}-byte swizzles"
        )
    return None


def grouped_matmul(
    x: jax.Array,
    w: jax.Array,
    sizes: jax.Array,
    tiles: PingPongTiles | None = None,
    *,
    w_nk: bool = False,
    scale: jax.Array | None = None,
    out_dtype=None,
    returned=None,
    dispatched=None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """x [M, K] (rows sorted by group) times w [G, K, N] ([G, N, K] with w_nk, as dX's
    transposed weight) per group, `sizes` [G] int32 rows per group summing to at most M ->
    [M, N] in `out_dtype` (default x's; bf16 for float8 x), float32 accumulation, times `scale`
    [1] float32 if given; rows past the sum are zero. N and K whole tiles (`shape_reason`).
    Float8 x and w (w_nk; e4m3 and e5m2 in any pairing) multiply on the float8 tensor cores,
    the wgmma accumulating across K-steps (the dense kernels' fast accumulation), in K-steps of
    `operand_tiles`. `returned` (a `grouped_return.Returned`, inside shard_map over its axis):
    the rows go to their owners instead -> [returned.out_rows, N], this device's result.
    `dispatched` (a `grouped_dispatch.Dispatched`, inside shard_map over its axis; 16 bits): x
    (a jax.ShapeDtypeStruct) arrives from its owners while the GEMM runs -> (result, x)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu
    from jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu import MatmulDimension

    (m, k), n = x.shape, w.shape[1 if w_nk else 2]
    tiles = operand_tiles(tiles or PingPongTiles(), k, x.dtype)
    float8 = jnp.dtype(x.dtype) in FLOAT8
    layout = "[G, N, K]" if w_nk else "[G, K, N]"
    same = w.dtype == x.dtype or (float8 and w.dtype in FLOAT8)
    if w.ndim != 3 or w.shape[2 if w_nk else 1] != k or not same:
        kind = "a float8 dtype" if float8 else f"dtype {x.dtype}"
        raise ValueError(
            f"ping-pong grouped kernel: w {w.dtype}{list(w.shape)} must be "
            f"{layout} with x's K={k} and {kind}"
        )
    if sizes.shape != (w.shape[0],) or w.shape[0] < 1:
        raise ValueError(
            f"ping-pong grouped kernel: sizes {sizes.shape} must hold one count "
            f"per group of w {list(w.shape)}, at least one"
        )
    if (reason := shape_reason(tiles, m, k, n, x.dtype, w_nk=w_nk)) is not None:
        raise ValueError(f"ping-pong grouped kernel: {reason}")
    out_dtype = jnp.dtype(out_dtype or (jnp.bfloat16 if float8 else x.dtype))
    tm, tn, tk = tiles.tile_m, tiles.tile_n, tiles.tile_k
    stages = ring_stages(tiles, x.dtype, out_dtype)
    if stages < 2:
        raise ValueError(
            f"ping-pong grouped kernel: {tiles} with a {out_dtype.name} result "
            f"leaves shared memory for {stages} stages, needs 2"
        )
    n_iters, k_iters, sms = n // tn, k // tk, mt.num_sms()
    transforms = mt.smem_transforms(x.dtype, tk)  # w's dtype is as wide (float8: 1 byte)
    w_block = (tn, tk) if w_nk else (tk, tn)
    halves = tm % (2 * WGMMA_M) == 0  # a last wave's halves: whole wgmma rows
    axis = getattr(returned or dispatched, "axis_name", None)  # the mesh axis of the peers
    peers, senders = lax.axis_size(axis) if axis else 0, getattr(dispatched, "senders", 0)
    n_plan = 2 if returned is not None else 3 if dispatched is not None else 0
    if dispatched is not None and (returned is not None or float8 or out_dtype != x.dtype):
        raise ValueError("ping-pong grouped kernel: rows dispatched into it take 16-bit operands,"
                         " a result of x's dtype and no `returned` plan")  # fmt: skip

    def body(start_ref, skip_ref, rows_ref, group_ref, counts_ref, *refs):
        plan, refs = refs[:n_plan], refs[n_plan:]
        x_ref, w_ref, *refs = refs if dispatched is None else (refs[-1], *refs[:-1])  # x: a result
        scale_ref, out_ref = refs if scale is not None else (None, *refs)
        cta, used = lax.axis_index("sm"), counts_ref[0]
        me, ctas = cta - senders, sms - senders  # this GEMM CTA, of `ctas`
        if returned is not None:  # the rows go to their owners (`grouped_return`)
            epilogue = returned.epilogue(peers, *plan, out_ref, sms)
        arrivals = None if dispatched is None else dispatched.arrivals(peers, *plan, x_ref, sms)
        deal = Deal.traced(used * n_iters, ctas, halving=halves)
        tail = ((counts_ref[1] - used) * n_iters - me + ctas - 1) // ctas  # the tail's units

        def where(i):  # the CTA's i-th GEMM unit: its rows' tile, columns and half (0 or 1)
            tile, half = deal.tile(me, i)
            p, n_idx = plgpu.planar_snake(tile, (used, n_iters), MatmulDimension.M, tiles.band)
            return p, pl.ds(n_idx * tn, tn), half

        def whole_or_half(i, fn):  # fn(rows): unit i's rows, tile_m or tile_m / 2
            if not halves:
                return fn(tm)
            half = deal.half(i)
            pl.when(~half)(lambda: fn(tm))
            pl.when(half)(lambda: fn(tm // 2))

        def scoped(x_smem, w_smem, loaded0, loaded1, consumed, out_smem, turn0, turn1, blocks=None):
            loaded, turn = (loaded0, loaded1), (turn0, turn1)

            def x_slot(slot, rows):  # the first `rows` rows of a slot's x block
                return x_smem.at[slot] if rows == tm else x_smem.at[slot, pl.ds(0, rows)]

            def issue(c, s, kk, x_rows, group, cols, rows):  # step s (K-step kk) of warpgroup c
                slot, ks = s % stages, pl.ds(kk * tk, tk)
                plgpu.copy_gmem_to_smem(x_rows.at[:, ks], x_slot(slot, rows), loaded[c].at[slot])
                block = group.at[cols, ks] if w_nk else group.at[ks, cols]
                plgpu.copy_gmem_to_smem(block, w_smem.at[slot], loaded[c].at[slot])

            def load():

                @pl.loop(0, deal.count(me))
                def _tile(i):  # the tile's schedule read once, not in each of its K-steps
                    p, cols, half = where(i)
                    group = w_ref.at[group_ref[p]]
                    if dispatched is not None:  # until its rows have arrived
                        arrivals.wait(start_ref[p] + skip_ref[p], rows_ref[p])

                    def steps(rows):
                        first = pl.multiple_of(start_ref[p] + half * rows, ROW_ALIGN)
                        x_rows = x_ref.at[pl.ds(first, rows)]

                        @pl.loop(0, k_iters)
                        def _step(kk):
                            s = i * k_iters + kk

                            @pl.when(s >= stages)
                            def _reuse():
                                plgpu.barrier_wait(consumed.at[s % stages])

                            for c in (0, 1):
                                step = functools.partial(issue, c, s, kk, x_rows, group, cols, rows)
                                pl.when(i % 2 == c)(step)

                    whole_or_half(i, steps)

                if dispatched is not None:
                    arrivals.finish(me)

            def store(c, value, p, cols, half=0, rows=tm):
                """The unit's own rows (its tile's rows [skip, skip + rows_ref[p]) inside the
                unit's [half * rows, half * rows + rows)): a ladder of TMA stores."""
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                out_smem.at[c, pl.ds(0, rows)][...] = value
                plgpu.commit_smem()
                first, skip = half * rows, skip_ref[p]
                lo = jnp.maximum(skip, first)
                count = jnp.maximum(jnp.minimum(skip + rows_ref[p], first + rows) - lo, 0)
                row0, at = start_ref[p] + first, lo - first
                if returned is None:
                    ladder_store(out_smem.at[c], out_ref, row0 + at, count, cols, rows, at=at)
                else:
                    epilogue.store(out_smem.at[c], group_ref[p], row0 + at, at, count, cols, rows)

            def gemm_tile(c, i):
                p, cols, half = where(i)
                whole_or_half(i, lambda rows: tile_rows(c, i, p, cols, half, rows))

            def tile_rows(c, i, p, cols, half, rows):  # unit i, of `rows` rows
                def k_step(kk, acc):
                    s = i * k_iters + kk
                    plgpu.barrier_wait(loaded[c].at[s % stages])
                    rhs = w_smem.at[s % stages]
                    plgpu.wgmma(acc, x_slot(s % stages, rows), rhs.T if w_nk else rhs)
                    plgpu.wgmma_wait(1)  # the K-step before is done: release its slot

                    @pl.when(kk > 0)
                    def _release():
                        plgpu.barrier_arrive(consumed.at[(s - 1) % stages])

                    return acc

                def tile_scope(acc_ref):
                    k_loop_in_turn(turn, c, i, k_iters, k_step, acc_ref)
                    plgpu.barrier_arrive(consumed.at[(i * k_iters + k_iters - 1) % stages])
                    value = mt.scaled(acc_ref[...], scale_ref, out_dtype)
                    store(c, value, p, cols, half, rows)

                pl.run_scoped(tile_scope, plgpu.ACC((rows, tn), jnp.float32))

            def zeros():
                return plgpu.layout_cast(jnp.zeros((tm, tn), out_dtype), plgpu.Layout.WGMMA)

            def zero_tile(c, j):  # rows past the groups' sum
                z = me + j * ctas
                store(c, zeros(), used + z // n_iters, pl.ds((z % n_iters) * tn, tn))

            def compute(c):
                if returned is not None:
                    epilogue.enter(cta, c)
                pl.loop(c, deal.count(me), step=2)(functools.partial(gemm_tile, c))
                if returned is None:
                    pl.loop(c, tail, step=2)(functools.partial(zero_tile, c))
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    return
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the tile's last stores read
                out_smem.at[c][...] = zeros()
                plgpu.commit_smem()
                epilogue.zero(cta, c, out_smem.at[c], tn, n_iters)
                epilogue.leave(cta, c)

            if dispatched is None:
                return by_warpgroup(load, compute)
            arrivals.roles(cta, lambda: by_warpgroup(load, compute), blocks, loaded0)

        scratch = ring_scratch(
            stages,
            plgpu.SMEM((stages, tm, tk), x.dtype, transforms=transforms),
            plgpu.SMEM((stages, *w_block), w.dtype, transforms=transforms),
            plgpu.SMEM((2, tm, tn), out_dtype),  # plain rows: the ladder starts at any row
        )
        if dispatched is None:
            return pl.run_scoped(scoped, *scratch, collective_axes="wg")
        dispatched.run_scoped(scoped, scratch, stages * (tm + tn) * tk * x.dtype.itemsize)

    plan, inputs, name = (), (x, w) + (() if scale is None else (scale,)), "grouped_gemm_pingpong"
    if returned is not None:
        plan, name = returned.operands(tm, n_iters), "grouped_gemm_returned"
    if dispatched is not None:  # x is the second result
        plan, inputs, name = dispatched.operands(), inputs[1:], "grouped_gemm_dispatched"
    operands = (*row_tiles(sizes, m, tm).arrays(), *plan, *inputs)
    also = None if dispatched is None else jax.ShapeDtypeStruct((m, k), x.dtype)
    rows = m if returned is None else returned.out_rows
    return launch(body, name, (rows, n), out_dtype, *operands, also=also)
