"""commgemm's grouped Hopper kernel, off the GPU: its schedule (which groups each row tile
multiplies, which rows of the tile each one owns, the tiles' order over the CTAs), its tiling's
checks and which kernel the Hopper path picks. tests/test_kernels_lower.py lowers it for CUDA;
tests/gpu/test_fused_gpu.py checks its values on Hopper."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from commgemm.mosaic_gpu import grouped, grouped_kernel
from commgemm.mosaic_gpu import tiles as mosaic_tiles
from commgemm.mosaic_gpu.configs import GroupedConfig
from commgemm.mosaic_gpu.grouped_pingpong import PingPongTiles


def _walk_rows(tiles: GroupedConfig, tiles_m: int, tiles_n: int) -> np.ndarray:
    """The row tile of each output tile, in the kernel's walk order (`planar_snake`)."""
    walk = jnp.arange(tiles_m * tiles_n, dtype=jnp.int32)
    return np.asarray(jax.vmap(lambda t: mosaic_tiles.cluster_tile(tiles, t, tiles_m, tiles_n))(
        walk)[0])  # fmt: skip


@functools.cache
def _schedule(tiles: GroupedConfig, m: int, n: int, ctas: int, pairwise: bool = True):
    del pairwise  # a cache key: the rank's form, as PAIRWISE_RANK_TILES picks it when traced
    return jax.jit(lambda sizes: grouped_kernel.schedule(sizes, tiles, m, n, ctas))


@pytest.mark.parametrize(
    "groups,tiles_m,tiles_n,tile_m,ctas",
    [(1, 1, 1, 64, 1), (5, 4, 3, 128, 4), (12, 6, 2, 64, 9), (8, 3, 4, 128, 132)],
)
@pytest.mark.parametrize("pairwise", [True, False], ids=["pairs", "sort"])
@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_schedule_covers_every_row_once(groups, tiles_m, tiles_n, tile_m, ctas, pairwise, data):
    """Each row tile's pairs are the non-empty groups with rows in it, in group order, their
    [lo, hi) ranges giving every row of the tile its group (rows past the groups' sum none,
    a sum beyond M cut at M); the tiles' order is a permutation, costliest first (by their
    warpgroups' K loops) within the kernel's rounds as `balanced_slots` deals them, a last
    wave narrowed or not; the tiles ranked over their pairs or by a sort alike."""
    tiles = GroupedConfig(tile_m=tile_m, narrow_tail=data.draw(st.booleans()))
    m, n = tiles_m * tiles.cta_m, tiles_n * tiles.cta_n
    sizes = np.array(data.draw(st.lists(st.integers(0, m), min_size=groups, max_size=groups)))
    if sizes.sum() > m and data.draw(st.booleans()):
        sizes = np.diff(np.concatenate([[0], np.minimum(np.cumsum(sizes), m)]))
    with pytest.MonkeyPatch.context() as patch:  # traced here, at the first call
        patch.setattr(grouped_kernel, "PAIRWISE_RANK_TILES", 10**9 if pairwise else 0)
        plan = _schedule(tiles, m, n, ctas, pairwise)(jnp.asarray(sizes, jnp.int32))
    ends = np.minimum(np.cumsum(sizes), m)
    starts = np.concatenate([[0], ends[:-1]])
    owner = np.full(m, -1)
    for g in range(groups):
        owner[starts[g] : ends[g]] = g
    cm = tiles.cta_m
    for t in range(tiles_m):
        first, count = int(plan.first[t]), int(plan.count[t])
        rows = owner[t * cm : (t + 1) * cm]
        assert [int(plan.group[p]) for p in range(first, first + count)] == sorted(
            {int(g) for g in rows if g >= 0}
        )
        got = np.full(cm, -1)
        for p in range(first, first + count):
            assert 0 <= int(plan.lo[p]) < int(plan.hi[p]) <= cm
            got[int(plan.lo[p]) : int(plan.hi[p])] = int(plan.group[p])
        np.testing.assert_array_equal(got, rows)
    order = np.asarray(plan.order)
    assert sorted(order.tolist()) == list(range(tiles_m * tiles_n))
    # a tile's cost: the K loops of its warpgroups, each over the groups with rows in its block
    owned = [{int(g) for g in owner[b : b + tiles.tile_m] if g >= 0}
             for b in range(0, m, tiles.tile_m)]  # fmt: skip
    blocks = np.array([len(owned[2 * t]) + len(owned[2 * t + 1]) for t in range(tiles_m)])
    cost = blocks[_walk_rows(tiles, tiles_m, tiles_n)]
    tail = mosaic_tiles.narrow_tail_units(tiles, order.size, ctas)
    slots = grouped_kernel.balanced_slots(order.size, ctas, tail)
    ranked = order[slots]  # the tiles from the costliest, ties in walk order
    np.testing.assert_array_equal(ranked, np.argsort(-cost, kind="stable"))


def test_schedule_ranks_tiles_by_warpgroup_loops():
    """Two tiles of two groups each: the one whose boundary splits a warpgroup's 64-row block
    (three warpgroup K loops) ranks before the one whose boundary lies between the blocks (two
    loops, the same as a tile of one group), though it comes later in the walk."""
    tiles = GroupedConfig()
    sizes = jnp.asarray([64, 96, 224], jnp.int32)  # boundaries at rows 64 and 160
    plan = _schedule(tiles, 3 * tiles.cta_m, tiles.cta_n, 3)(sizes)
    np.testing.assert_array_equal(np.asarray(plan.count), [2, 2, 1])
    np.testing.assert_array_equal(np.asarray(plan.order)[grouped_kernel.balanced_slots(3, 3)],
                                  [1, 0, 2])  # fmt: skip


@pytest.mark.parametrize("units,ctas", [(448, 132), (896, 132), (7, 3), (12, 4), (5, 8)])
def test_balanced_slots_keeps_costly_tiles_apart(units, ctas):
    """Every unit gets one tile; the costliest go to different CTAs, those running one tile
    fewer first, so tiles of cost 2 (a straddling tile's two K loops), as many as those CTAs,
    leave no CTA more work than the rounds of a dense GEMM (the 8-group case: BENCHMARKS.md)."""
    slots = grouped_kernel.balanced_slots(units, ctas)
    assert sorted(slots.tolist()) == list(range(units))
    rounds = -(-units // ctas)
    short = rounds * ctas - units if rounds > 1 else 0  # CTAs that run one tile fewer
    first_round = slots[: min(units, ctas)] % ctas
    assert len(set(first_round.tolist())) == first_round.size
    for costly in range(short + 1):
        cost = np.ones(units)
        cost[slots[:costly]] = 2  # the costliest tiles, where the dealing puts them
        load = np.bincount(np.arange(units) % ctas, weights=cost, minlength=ctas)
        assert load.max() <= rounds


@pytest.mark.parametrize(
    "units,ctas,tail", [(448, 132, 52), (462, 132, 66), (463, 132, 0), (16, 132, 16), (396, 132, 0)]
)
def test_narrowed_last_wave(units, ctas, tail):
    """The last wave runs narrowed where it fills at most half the CTAs (its halves then fit in
    one wave; 52 of 132 in the 8-group benchmark's 448 tiles): the cheapest tiles, in rank
    order, in its units; the rounds before it are dealt as without it."""
    assert mosaic_tiles.narrow_tail_units(GroupedConfig(narrow_tail=True), units, ctas) == tail
    for undecided_or_off in (None, False):
        config = GroupedConfig(narrow_tail=undecided_or_off)
        assert mosaic_tiles.narrow_tail_units(config, units, ctas) == 0
    slots = grouped_kernel.balanced_slots(units, ctas, tail)
    assert sorted(slots.tolist()) == list(range(units))
    np.testing.assert_array_equal(slots[units - tail :], np.arange(units - tail, units))
    np.testing.assert_array_equal(
        slots[: units - tail], grouped_kernel.balanced_slots(units - tail, ctas)
    )
    with pytest.raises(ValueError, match="narrow_tail"):
        GroupedConfig(narrow_tail=1)
    with pytest.raises(ValueError, match="multiples of 128"):
        GroupedConfig(tile_n=320, narrow_tail=True)


@pytest.mark.parametrize(
    "groups,n,pays",
    [(1, 1792, True), (8, 1792, False), (16, 1792, True), (8, 4096, False), (16, 4096, False)],
)
def test_narrowing_pays_where_the_model_says(groups, n, pays):
    """The automatic choice (narrow_tail None) on M 8192 (64 row tiles) and 132 CTAs: one group
    is a dense GEMM, 448 tiles in 3.4 waves, narrowed; with 8 groups the 49 tiles that straddle
    a boundary (two K loops) fill the last wave's idle CTAs, whole (the model: 4 tile-times
    against 4.5; measured on H100: whole 7 to 15% faster); with 16, 105 of them, narrowed (5
    against 4.5; measured 5 to 10% faster); N = 4096 leaves a last wave more than half full."""
    tiles = GroupedConfig()
    assert grouped_kernel.narrowing_pays(tiles, 8192, n, groups, 132) is pays
    assert not grouped_kernel.narrowing_pays(GroupedConfig(tile_m=64, tile_n=192), 8192, 1728,
                                             1, 132)  # no half tiles of whole 64s  # fmt: skip


def test_grouped_config_and_shapes():
    """Only warpgroups stacked along M (each masks its own rows); whole tiles of 16-bit
    operands, else a reason."""
    with pytest.raises(ValueError, match="wg_along_m"):
        GroupedConfig(wg_along_m=False)
    tiles = GroupedConfig()
    assert (tiles.cta_m, tiles.cta_n) == (128, 256)
    assert grouped_kernel.shape_reason(tiles, 1024, 512, 768, jnp.bfloat16) is None
    assert "rows=1000" in grouped_kernel.shape_reason(tiles, 1000, 512, 768, jnp.bfloat16)
    assert "N=640" in grouped_kernel.shape_reason(tiles, 1024, 512, 640, jnp.bfloat16)
    assert "float32" in grouped_kernel.shape_reason(tiles, 1024, 512, 768, jnp.float32)
    x, sizes = jnp.zeros((128, 64), jnp.bfloat16), jnp.array([64, 64], jnp.int32)
    for w, w_nk in ((jnp.zeros((2, 128, 256), jnp.bfloat16), False),
                    (jnp.zeros((2, 64, 256), jnp.bfloat16), True),
                    (jnp.zeros((2, 64, 256), jnp.float16), False)):  # fmt: skip
        with pytest.raises(ValueError, match="must be \\[G"):
            grouped_kernel.grouped_matmul(x, w, sizes, w_nk=w_nk)
    with pytest.raises(ValueError, match="one count per group"):
        grouped_kernel.grouped_matmul(x, jnp.zeros((3, 64, 256), jnp.bfloat16), sizes)
    with pytest.raises(ValueError, match="at least one"):
        grouped_kernel.grouped_matmul(
            x, jnp.zeros((0, 64, 256), jnp.bfloat16), jnp.zeros((0,), jnp.int32)
        )
    with pytest.raises(ValueError, match="K=100"):
        grouped_kernel.grouped_matmul(
            jnp.zeros((128, 100), jnp.bfloat16), jnp.zeros((2, 100, 256), jnp.bfloat16),
            jnp.array([64, 64], jnp.int32),
        )  # fmt: skip
    two = jnp.array([64, 64], jnp.int32)
    with pytest.raises(ValueError, match="a float8 dtype"):  # float8 x takes float8 w only
        grouped_kernel.grouped_matmul(
            jnp.zeros((128, 256), jnp.float8_e5m2), jnp.zeros((2, 256, 256), jnp.bfloat16), two,
            w_nk=True,
        )  # fmt: skip
    with pytest.raises(ValueError, match="split accumulation is for float8"):
        grouped_kernel.grouped_matmul(jnp.zeros((128, 256), jnp.bfloat16),
                                      jnp.zeros((2, 256, 256), jnp.bfloat16), two,
                                      split_accumulator=True)  # fmt: skip


def test_float8_shapes_and_path_reasons(monkeypatch):
    """Float8 operands need w laid out [G, N, K] and take K-steps of 128 where K allows (split
    accumulation: 64 x 128 warpgroup tiles, and float8 only); the grouped op's float8 kernel
    takes tensor scaling, current or delayed (the block modes emulate), on the kernel's
    shapes."""
    import commgemm as cg

    tiles = GroupedConfig()
    for dtype in grouped_kernel.FLOAT8:
        assert grouped_kernel.shape_reason(tiles, 1024, 512, 768, dtype, w_nk=True) is None
        assert "[G, N, K]" in grouped_kernel.shape_reason(tiles, 1024, 512, 768, dtype)
    from commgemm.mosaic_gpu.fused import float8_tiling  # the tiling the kernel takes

    assert float8_tiling(tiles, 512).tile_k == 128
    assert float8_tiling(tiles, 576).tile_k == 64  # 4.5 steps of 128
    monkeypatch.setattr(mosaic_tiles, "hopper_reason", lambda: None)  # as on a Hopper GPU
    x, w = jnp.zeros((1024, 512), jnp.bfloat16), jnp.zeros((8, 512, 768), jnp.bfloat16)
    current = cg.ScalingRecipe("current_tensor_scaling")
    assert grouped.float8_reason(x, w, current) is None
    state = cg.ScalingState.create()
    delayed = cg.ScalingRecipe("delayed_tensor_scaling", x_state=state, w_state=state)
    assert grouped.float8_reason(x, w, delayed) is None
    assert "MXFP8" in grouped.float8_reason(x, w, cg.ScalingRecipe("mxfp8_1d_scaling"))
    split = cg.ScalingRecipe("current_tensor_scaling", split_accumulator=(True, True, True))
    assert grouped.float8_reason(x, w, split) is None
    # N not whole 256s: the ping-pong kernel's 128-column tiles (fast accumulation), or the
    # row-aligned kernel's 64 x 128 warpgroup tiles (split)
    assert grouped.float8_reason(x, w[:, :, :640], current) is None
    assert grouped.float8_reason(x, w[:, :, :640], split) is None
    assert "N=704" in grouped.float8_reason(x, w[:, :, :704], split)
    assert "N=704" in grouped.float8_reason(x, w[:, :, :704], current)
    assert "N=640" in grouped.float8_reason(x, w[:, :, :640], current, GroupedConfig())
    assert "float8" in grouped_kernel.shape_reason(tiles, 1024, 512, 768, jnp.bfloat16,
                                                   split=True)  # fmt: skip
    # no rows, K or N: no kernel, XLA's ragged dot (which takes empty operands)
    assert "empty operand" in grouped.float8_reason(x[:0], w, current)
    assert "float32" in grouped.float8_reason(x.astype(jnp.float32), w, current)
    for a, b in ((x[:0], w), (x[:, :0], w[:, :0]), (x, w[:, :, :0])):
        assert "empty operand" in grouped.unsupported_reason(a, b)


@pytest.mark.parametrize(
    "m,k,n,groups,want",
    [
        (8192, 4096, 1792, 8, PingPongTiles),  # 1024 rows a group
        (32768, 4096, 14336, 8, PingPongTiles),  # 4096 rows a group
        (8192, 4096, 1792, 16, PingPongTiles),  # 512
        (8192, 4096, 4096, 64, PingPongTiles),  # 128
        (8192, 4096, 1664, 8, PingPongTiles),  # N not whole 256-column tiles
        (8000, 4096, 1792, 8, PingPongTiles),  # M not whole 128-row tiles
        (8192, 4096, 1600, 8, type(None)),  # N not whole 128-column tiles: XLA's ragged dot
        (8192, 100, 1792, 8, type(None)),  # K not whole 64s
        (8192, 4096, 1792, 0, type(None)),  # no groups: XLA's ragged dot (zeros)
    ],
)
def test_pick_tiles(m, k, n, groups, want):
    """The forward's and dX's kernel by shape: the ping-pong kernel wherever its tiles fit,
    whatever the rows a group; else XLA's ragged dot (None)."""
    assert isinstance(grouped.pick_tiles(m, k, n, groups, jnp.bfloat16), want)
    assert isinstance(grouped.pick_tiles(m, k, n, groups, jnp.float16), want)


@pytest.mark.parametrize(
    "m,k,n,groups,split,want",
    [
        (8192, 4096, 1792, 8, False, PingPongTiles),  # 1024 rows a group
        (32768, 14336, 4096, 8, False, PingPongTiles),  # 4096 rows a group
        (8192, 4096, 1792, 16, False, PingPongTiles),  # 512 rows a group
        (8192, 4096, 1792, 16, True, GroupedConfig),  # split: the row-aligned kernel only
        (98304, 2048, 1408, 64, False, PingPongTiles),  # N 11 x 128: 256-column tiles misfit
        (98304, 2048, 1408, 64, True, GroupedConfig),  # split: 64 x 128 warpgroup tiles
        (8000, 4096, 1792, 8, False, PingPongTiles),  # M not whole 128-row tiles
        (8000, 4096, 1792, 8, True, str),  # ... and split: no kernel
        (8192, 4096, 1600, 8, False, str),  # N not whole 128s
        (8192, 4096, 1792, 8, None, GroupedConfig),  # tiles given: the row-aligned kernel
    ],
)
def test_float8_kernel(m, k, n, groups, split, want):
    """The float8 forward's kernel (and dX's, split or not) by shape: the ping-pong kernel
    wherever accumulation is fast and its tiles fit, whatever the rows a group; the row-aligned
    kernel for split accumulation or where its tiling is given; a str (why) where neither
    kernel takes it."""
    tiles = GroupedConfig() if split is None else None
    got = grouped.float8_kernel(m, k, n, groups, jnp.float8_e4m3fn, split=bool(split),
                                tiles=tiles)  # fmt: skip
    assert isinstance(got, want), got
    reason = grouped.float8_shape_reason(m, k, n, groups, jnp.float8_e4m3fn, split=bool(split),
                                         tiles=tiles)  # fmt: skip
    assert reason == (got if want is str else None)
    if want is str:
        assert f"N={n}" in got or f"rows={m}" in got, got
        # float8_matmul refuses the shape with that reason, before any kernel is built
        a = jax.ShapeDtypeStruct((m, k), jnp.float8_e4m3fn)
        b = jax.ShapeDtypeStruct((groups, n, k), jnp.float8_e4m3fn)
        one, sizes = (
            jax.ShapeDtypeStruct((), jnp.float32),
            jax.ShapeDtypeStruct((groups,), jnp.int32),
        )
        matmul = functools.partial(grouped.float8_matmul, out_dtype=jnp.bfloat16, split=bool(split))
        with pytest.raises(ValueError, match="float8 grouped GEMM"):
            jax.eval_shape(matmul, a, one, b, one, sizes)
