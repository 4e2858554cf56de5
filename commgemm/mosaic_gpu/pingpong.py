"""The ping-pong schedule the dense fused kernels share (`pingpong_rs`,
`pingpong_ag`): CUTLASS's ping-pong (and cuBLASLt's kernel for these shapes).

A persistent CTA's two compute warpgroups take its units of work in turn, each a whole
tile_m x tile_n output tile; one load warpgroup fills ONE ring of `stages` smem slots in unit
order; each compute warpgroup awaits only its own units' slots (one barrier array each) and
their K loops alternate (an ordered barrier pair), so while one runs its epilogue the other
keeps the tensor cores busy. The two epilogues alternate too, so they share one buffer of EPI
rows (a barrier pair hands it over once a warpgroup's stores have read it). The load warpgroup
awaits every slot's release, the last ones' too, so no CTA of a cluster exits while its peer
may still arrive on its barriers (jax's pipelines and CUTLASS's producers do the same). A kernel
plugs its loads, its stores and its communication into `run` through callbacks (`Unit`), and
deals its tiles to the CTAs through a `Deal`: unit i of cluster cid is tile cid + i * ctas,
except that a narrowed tail (`narrow_tail`) runs the tiles of the last, at most half filled
wave as two units of half their rows each, one a cluster, so that wave takes half a tile's time.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from commgemm.mosaic_gpu import tiles as mt
from commgemm.mosaic_gpu.configs import EPI, HOPPER_SMEM


def swizzle_columns(dtype, tile_n: int) -> int:
    """Columns of the TMA tiling of a tile of tile_n columns of `dtype` (its smem swizzle)."""
    return mt.smem_transforms(dtype, tile_n)[0].tiling[1]


def shape_reason(
    tiles,
    rows: int,
    k: int,
    n: int,
    dtype,
    *,
    w_nk: bool,
    out_dtype=None,
    partial_rows: bool = False,
) -> str | None:
    """Why a ping-pong kernel in `tiles` cannot multiply `rows` rows per device (of one block),
    K `k` and `n` columns of `dtype` (w read [n, K] with `w_nk`), or None. With partial_rows
    (the RS kernel on one device) rows need not be whole cluster tiles."""
    itemsize = jnp.dtype(dtype).itemsize
    if rows % tiles.cluster_m and not partial_rows:
        return f"rows per device={rows} must be divisible by the tile {tiles.cluster_m}"
    if k % tiles.tile_k:
        return f"K={k} must be divisible by the tile {tiles.tile_k}"
    if tiles.tile_k * itemsize % 128:
        return f"tile_k={tiles.tile_k} must be whole 128-byte rows of {jnp.dtype(dtype).name}"
    if not w_nk and tiles.tile_n * itemsize % 128:
        return (
            f"tile_n={tiles.tile_n} with w read [K, n] must be whole 128-byte rows of "
            f"{jnp.dtype(dtype).name} (its smem swizzle)"
        )
    out_dtype = jnp.dtype(out_dtype or dtype)
    for what, of in (("the output", out_dtype), *(() if w_nk else (("w [K, n]", dtype),))):
        minor = swizzle_columns(of, tiles.tile_n)
        if n % minor:
            return f"N={n} must be whole {minor}s (the TMA tiling of {what}'s tiles)"
    smem = tiles.smem_bytes(itemsize, jnp.dtype(out_dtype).itemsize)
    if smem > HOPPER_SMEM:
        return f"its {tiles.stages} stages and epilogue buffer take {smem} bytes of shared memory"
    return None


def no_split(family: type) -> str:
    """Why a ping-pong kernel takes no split accumulation."""
    return (
        f"{family.__name__} takes no split accumulation (two accumulators of a whole tile "
        "do not fit in a warpgroup's registers)"
    )


def checked_tiles(tiles, family: type, split_accumulator: bool):
    """`tiles`, a `family` tiling, for a call without split accumulation; else raises."""
    if not isinstance(tiles, family):
        raise ValueError(f"kernel={tiles!r} is not a {family.__name__}")
    if split_accumulator:
        raise ValueError(no_split(family))
    return tiles


def tile_origin(tiles, tile, m_pairs: int, n_iters: int):
    """(first row, first column) of cluster tile `tile` of a block of m_pairs x n_iters cluster
    tiles: tiles walked in bands (`plgpu.planar_snake`)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    from jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu import MatmulDimension

    minor = MatmulDimension.M if tiles.grid_minor_m else MatmulDimension.N
    m_pair, n_idx = plgpu.planar_snake(tile, (m_pairs, n_iters), minor, tiles.grid_tile_width)
    return m_pair * tiles.cluster_m, n_idx * tiles.tile_n


def k_loop_in_turn(turn, c: int, unit, steps, k_step, acc_ref) -> None:
    """Compute warpgroup c's K loop of `steps` steps (`k_step(kk, acc_ref)`) over its CTA's
    unit `unit` (0, 1, ...: the warpgroups take them in turn), after the other warpgroup's K
    loop of the unit before (the ordered barrier pair `turn`); then it hands the turn over and
    awaits its wgmmas, so its epilogue runs under the other's next K loop."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    @pl.when(unit > 0)
    def _wait_turn():
        plgpu.barrier_wait(turn[c])

    lax.fori_loop(0, steps, k_step, acc_ref)
    plgpu.barrier_arrive(turn[1 - c])
    plgpu.wgmma_wait(0)


def by_warpgroup(load, compute) -> None:
    """The warpgroups of a ping-pong kernel: warpgroup 2 runs load() on 40 registers a thread,
    compute warpgroups 0 and 1 each compute(c) on 232."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def loads():
        plgpu.set_max_registers(40, action="decrease")
        load()

    def computes(c: int):
        plgpu.set_max_registers(232, action="increase")
        compute(c)

    wg = lax.axis_index("wg")
    pl.when(wg == 2)(loads)
    for c in (0, 1):
        pl.when(wg == c)(functools.partial(computes, c))


@dataclasses.dataclass(frozen=True)
class Deal:
    """How `units` cluster tiles are dealt to `ctas` clusters: cluster cid's unit i is tile
    cid + i * ctas; with `tail` > 0, the last `tail` tiles (a last wave at most half full) run
    as two halves of tile_m / 2 rows each, half h of tile `waves * ctas + h // 2` on cluster h
    (the last unit of clusters 0 .. 2 * tail - 1). `units` and `tail` are Python ints where the
    shapes fix them (the dense kernels), or traced int32 (`Deal.traced`: the grouped kernel,
    whose tiles follow the group sizes)."""

    units: int | jax.Array
    ctas: int
    tail: int | jax.Array = 0

    @classmethod
    def traced(cls, units: jax.Array, ctas: int, *, halving: bool) -> Deal:
        """The deal of `units` tiles known at run time only: where `halving` (a half tile is
        whole wgmma rows), the last wave's tiles halved where a whole wave precedes it and it
        fills at most half the clusters."""
        if not halving:
            return cls(units, ctas)
        last = units % ctas
        narrow = (units > ctas) & (last > 0) & (last <= ctas // 2)
        return cls(units, ctas, jnp.where(narrow, last, 0))

    @property
    def fixed(self) -> bool:
        """Whether the tail is known at trace time (a Python int)."""
        return isinstance(self.tail, int)

    @property
    def waves(self):
        """Whole waves before a halved tail."""
        return (self.units - self.tail) // self.ctas

    def count(self, cid):
        """Cluster cid's units (traced)."""

        def in_turn():  # no halved tail: units cid, cid + ctas, ...
            return (self.units - cid + self.ctas - 1) // self.ctas

        if self.fixed and not self.tail:
            return in_turn()
        halved = self.waves + (cid < 2 * self.tail).astype(jnp.int32)
        return halved if self.fixed else jnp.where(self.tail > 0, halved, in_turn())

    def half(self, i):
        """Whether unit i (of any cluster) is a half tile (traced), or None without a tail."""
        if self.fixed:
            return None if not self.tail else i >= self.waves
        return (self.tail > 0) & (i >= self.waves)

    def tile(self, cid, i):
        """(tile, which half: 0 or 1, 0 for a whole tile) of cluster cid's unit i (traced)."""
        if self.fixed and not self.tail:
            return cid + i * self.ctas, 0
        half = self.half(i)
        tile = jnp.where(half, self.waves * self.ctas + cid // 2, cid + i * self.ctas)
        return tile, jnp.where(half, lax.rem(cid, jnp.int32(2)), 0)


def deal(tiles, units: int, ctas: int) -> Deal:
    """The deal of `units` cluster tiles to `ctas` clusters: with tiles.narrow_tail, the last
    wave's tiles halved where a full wave precedes it, it fills at most half the clusters and a
    half tile is whole wgmma rows (tile_m whole 128s); else one after the other."""
    tail = units % ctas
    narrow = tiles.narrow_tail and units > ctas and 0 < tail <= ctas // 2
    return Deal(units, ctas, tail if narrow and tiles.tile_m % 128 == 0 else 0)


@dataclasses.dataclass(frozen=True)
class Unit:
    """What a kernel does at each point of the schedule; i is the CTA's unit (0, 1, ...), c the
    compute warpgroup (0 or 1), all hooks optional but the loads and stores. A compute
    warpgroup's hooks see a unit as `state`: begin(c, i) (computed once, before the unit's K
    loop: what its K-steps would otherwise recompute), or i without `begin`.

    load_x(i, kk, dest, barrier): copy K-step kk of unit i's x rows into smem `dest` (rows:
        dest.shape[0], tile_m / 2 for a half tile).
    column(i): unit i's first output column (w's columns).
    store(state, r, out_smem): store row block r (EPI rows) of the unit's tile (its half, for a
        half tile) from out_smem, as TMA stores committed in one group.
    load_start(extra): the load warpgroup, before its loop (extra: the kernel's own smem).
    before_unit(i): the load warpgroup, before unit i's first loads.
    load_end(): the load warpgroup, after its loop.
    compute_start(c, out_smem): a compute warpgroup, before its first unit.
    begin(c, i): a compute warpgroup, before unit i's K loop: the unit's `state`.
    release(c, state, kk, x_slot, arrive): a compute warpgroup, once K-step kk's wgmma is done
        (x_slot: its x block); it must call arrive(j) once for every K-step j of the unit, j
        = kk now or later (a slot held while its block is being sent); without it, arrive(kk).
    before_stores(c, state): a compute warpgroup, between its K loop and its first store.
    compute_end(c): a compute warpgroup, after its last unit's stores were issued.
    """

    load_x: Callable
    column: Callable
    store: Callable
    load_start: Callable | None = None
    before_unit: Callable | None = None
    load_end: Callable | None = None
    compute_start: Callable | None = None
    begin: Callable | None = None
    release: Callable | None = None
    before_stores: Callable | None = None
    compute_end: Callable | None = None


def run(
    tiles,
    unit: Unit,
    *,
    tiles_dealt: Deal,
    k_iters: int,
    w_ref,
    dtype,
    w_dtype,
    out_dtype,
    w_nk: bool,
    scale_ref=None,
    extra_smem: Sequence = (),
) -> None:
    """The schedule of this CTA's units (`tiles_dealt`) of k_iters K-steps each, inside a
    `plgpu.kernel` of 3 warpgroups ("wg": 0 and 1 compute, 2 loads) and, with cluster "m",
    clusters of 2 along "cluster" (grid "cluster_grid"); w_ref [K, n] ([n, K] with w_nk) is read
    at `unit.column`'s columns, the accumulator scaled by scale_ref [1] (if given) into
    `out_dtype`."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    tile_m, tile_n, tile_k, stages = tiles.tile_m, tiles.tile_n, tiles.tile_k, tiles.stages
    pair = tiles.cluster_size
    transforms = mt.smem_transforms(dtype, tile_k)
    w_block = (tile_n, tile_k) if w_nk else (tile_k, tile_n)
    w_transforms = transforms if w_nk else mt.smem_transforms(w_dtype, tile_n)
    out_transforms = mt.smem_transforms(out_dtype, tile_n)
    units = tiles_dealt.count(lax.axis_index("cluster_grid"))

    def whole_or_half(i, fn):
        """fn(rows) for unit i's rows: tile_m, or tile_m / 2 for a half tile."""
        half = tiles_dealt.half(i)
        if half is None:
            return fn(tile_m)
        pl.when(~half)(lambda: fn(tile_m))
        pl.when(half)(lambda: fn(tile_m // 2))

    def scoped(x_smem, w_smem, full0, full1, empty, out_smem, *rest):
        full, order, free, extra = (full0, full1), rest[0:2], rest[2:4], rest[4:]

        def issue(c, s):  # step s's loads, into the slots of compute warpgroup c
            i, kk, slot = s // k_iters, lax.rem(s, jnp.int32(k_iters)), s % stages
            whole_or_half(i, lambda rows: unit.load_x(i, kk, x_rows(slot, rows), full[c].at[slot]))
            cols, ks = pl.ds(unit.column(i), tile_n), pl.ds(kk * tile_k, tile_k)
            src = w_ref.at[cols, ks] if w_nk else w_ref.at[ks, cols]
            shared = dict(collective_axes="cluster") if pair > 1 else {}
            plgpu.copy_gmem_to_smem(src, w_smem.at[slot], full[c].at[slot], **shared)

        def x_rows(slot, rows):  # the first `rows` rows of slot `slot`'s x block
            return x_smem.at[slot] if rows == tile_m else x_smem.at[slot].at[pl.ds(0, rows)]

        def load():
            if unit.load_start:
                unit.load_start(extra)

            @pl.loop(0, units * k_iters)
            def _step(s):
                if unit.before_unit:
                    pl.when(lax.rem(s, jnp.int32(k_iters)) == 0)(
                        lambda: unit.before_unit(s // k_iters)
                    )

                @pl.when(s >= stages)
                def _():
                    plgpu.barrier_wait(empty.at[s % stages])

                for c in (0, 1):
                    pl.when((s // k_iters) % 2 == c)(functools.partial(issue, c, s))

            if unit.load_end:
                unit.load_end()

            # the last slots' releases, awaited as the loop awaits the others': the cluster's
            # peer CTA arrives on this CTA's barriers, which must not happen after it exited
            @pl.loop(jnp.maximum(units * k_iters, stages), units * k_iters + stages)
            def _quiesce(s):
                plgpu.barrier_wait(empty.at[s % stages])

        def release(c, i, state, kk):
            """K-step kk of unit i has been multiplied: its slot goes back to the loads."""

            def arrive(j):
                plgpu.barrier_arrive(empty.at[(i * k_iters + j) % stages])

            if unit.release:
                unit.release(c, state, kk, x_smem.at[(i * k_iters + kk) % stages], arrive)
            else:
                arrive(kk)

        def epilogue(c, i, state, acc_ref, rows):
            @pl.when(i > 0)
            def _():  # the other warpgroup's stores have read the shared buffer
                plgpu.barrier_wait(free[c])

            if unit.before_stores:
                unit.before_stores(c, state)
            for r in range(rows // EPI):
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                out_smem[...] = mt.scaled(acc_ref[r * EPI : (r + 1) * EPI], scale_ref, out_dtype)
                plgpu.commit_smem()
                unit.store(state, r, out_smem)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            plgpu.barrier_arrive(free[1 - c])

        def tile(c, i):
            state = unit.begin(c, i) if unit.begin else i
            whole_or_half(i, lambda rows: tile_rows(c, i, state, rows))

        def tile_rows(c, i, state, rows):  # unit i, of `rows` rows
            def kstep(kk, acc):
                slot = (i * k_iters + kk) % stages
                plgpu.barrier_wait(full[c].at[slot])
                rhs = w_smem.at[slot]
                plgpu.wgmma(acc, x_rows(slot, rows), rhs.T if w_nk else rhs)
                plgpu.wgmma_wait(1)
                pl.when(kk > 0)(lambda: release(c, i, state, kk - 1))  # its wgmma is done
                return acc

            def acc_scope(acc_ref):
                k_loop_in_turn(order, c, i, k_iters, kstep, acc_ref)  # the K loops alternate
                release(c, i, state, k_iters - 1)
                with jax.named_scope("epilogue"):
                    epilogue(c, i, state, acc_ref, rows)

            pl.run_scoped(acc_scope, plgpu.ACC((rows, tile_n), jnp.float32))

        def compute(c):
            if unit.compute_start:
                unit.compute_start(c, out_smem)
            pl.loop(c, units, step=2)(functools.partial(tile, c))
            if unit.compute_end:
                unit.compute_end(c)

        by_warpgroup(load, compute)

    pl.run_scoped(
        scoped,
        plgpu.SMEM((stages, tile_m, tile_k), dtype, transforms=transforms),
        plgpu.SMEM((stages, *w_block), w_dtype, transforms=w_transforms),
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        plgpu.ClusterBarrier(collective_axes=("cluster",), num_barriers=stages)
        if pair > 1
        else plgpu.Barrier(num_arrivals=1, num_barriers=stages),
        plgpu.SMEM((EPI, tile_n), out_dtype, transforms=out_transforms),
        *[plgpu.Barrier(num_arrivals=1) for _ in range(4)],
        *extra_smem,
        collective_axes="wg",
    )
