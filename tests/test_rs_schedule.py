"""The direct RS kernel's schedule (`rs_schedule`), checked as plain arithmetic: every tile
and owner gets each K-step exactly once, from the main loop, a split tail or a streamed one, and
each wave's zeroing comes before its first adds."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from commgemm import mosaic_gpu
from commgemm.mosaic_gpu import rs_schedule


def _add_tail(steps, per_block: int, tail: int, splits: int, ctas: int, k_iters: int) -> None:
    """Add 1 to steps[tile, owner, k] for each K-step the tail runs, as the kernel deals it:
    split (`tail_unit`: every part of every tail tile once) or streamed (`stream_pieces`: at
    most `stream_share` steps a CTA, in at most two pieces, the traced pieces equal to the
    static ones). The tail's tiles are this device's own (owner 0)."""
    if splits != rs_schedule.STREAMED:
        unit = jnp.arange(tail * splits, dtype=jnp.int32)
        tile, part = (np.asarray(v) for v in rs_schedule.tail_unit(unit, per_block, tail, splits))
        assert sorted(zip(tile.tolist(), part.tolist(), strict=True)) == [
            (t, p) for t in range(per_block - tail, per_block) for p in range(splits)
        ]
        width = k_iters // splits
        for t, p in zip(tile.tolist(), part.tolist(), strict=True):
            steps[t, 0, p * width : (p + 1) * width] += 1
        return
    share = rs_schedule.stream_share(tail, k_iters, ctas)
    assert share <= k_iters and share * ctas >= tail * k_iters
    traced = jax.jit(jax.vmap(lambda c: rs_schedule.stream_pieces(
        c, share, per_block, tail, k_iters)))(jnp.arange(ctas, dtype=jnp.int32))  # fmt: skip
    for c in range(ctas):
        pieces = rs_schedule.stream_pieces(c, share, per_block, tail, k_iters)
        assert sum(count for _, _, count in pieces) <= share
        for i, (t, first_k, count) in enumerate(pieces):
            assert [int(np.asarray(v)[c]) for v in traced[i]] == [t, first_k, count]
            if count:
                assert per_block - tail <= t < per_block and first_k + count <= k_iters
                steps[t, 0, first_k : first_k + count] += 1


@settings(max_examples=40, deadline=None)
@given(
    size=st.integers(1, 8),  # 1: the kernel's GEMM core
    per_block=st.integers(1, 300),
    ctas=st.sampled_from([66, 132, 7, 1]),
    k_iters=st.sampled_from([1, 2, 4, 8, 32, 40, 64, 96]),
    split=st.sampled_from([0, 1, 2, 4, 5]),
    stream=st.booleans(),
)
def test_tail_covers_every_step_once(size, per_block, ctas, k_iters, split, stream):
    """ATOMIC_GEMM_RS with split_tail (0: automatic, split or streamed) or stream_tail: the main
    loop runs whole waves of CTAs, then the tail; together every (tile, owner) gets each K-step
    exactly once, the own copy of each other tile first."""
    if stream and split > 1:
        with pytest.raises(ValueError, match="asks for a split as well"):
            mosaic_gpu.DirectRSConfig(split_tail=split, stream_tail=True)
        return
    tiles = mosaic_gpu.DirectRSConfig(split_tail=split, stream_tail=stream)
    num_tiles = size * per_block
    try:
        tail, splits = rs_schedule.tail_plan(num_tiles, per_block, ctas, k_iters, tiles)
    except ValueError as err:
        assert split > 1 or stream  # an explicit tail that does not fit
        assert "split_tail" in str(err) or "stream_tail needs the tail" in str(err)
        return
    if (split == 1 and not stream) or num_tiles % ctas == 0:
        assert (tail, splits) == (0, 1)
    if tail:
        assert tail == num_tiles % ctas and (num_tiles - tail) % ctas == 0
        if stream:
            assert splits == rs_schedule.STREAMED
        elif splits != rs_schedule.STREAMED:
            assert splits > 1 and k_iters % splits == 0 and k_iters // splits >= tiles.stages
    steps = np.zeros((per_block, size, k_iters), int)
    lin = jnp.arange(num_tiles - tail, dtype=jnp.int32)
    tile, offset = (np.asarray(v) for v in rs_schedule.main_unit(lin, size, per_block, tail))
    np.add.at(steps, (tile, offset), 1)
    own = offset == 0
    assert (np.diff(tile[own]) == 1).all() and (np.diff(tile[~own] * size + offset[~own]) > 0).all()
    if size > 1:
        peer_tiles_before = np.cumsum(~own) // (size - 1)  # whole tiles of peers' copies so far
        assert (peer_tiles_before[own] == tile[own]).all()
    if tail:
        _add_tail(steps, per_block, tail, splits, ctas, k_iters)
    assert (steps == 1).all()


@settings(max_examples=15, deadline=None)
@given(
    size=st.integers(2, 8),
    per_block=st.integers(1, 300),
    ctas=st.sampled_from([66, 132, 7, 1]),
    k_iters=st.sampled_from([8, 32, 40]),
    split=st.sampled_from([0, 1, 2]),
)
def test_wave_tiles_are_each_waves_first_adds(size, per_block, ctas, k_iters, split):
    """DirectRSConfig.zero_ahead zeroes wave w's tile range before wave w: the ranges follow one
    another from 0 to per_block, each tile's first add (any owner) comes in the wave whose
    range holds it, and the traced ranges (the kernel's) equal the static ones."""
    num_tiles = size * per_block
    tiles = mosaic_gpu.DirectRSConfig(split_tail=split)
    try:
        tail, _ = rs_schedule.tail_plan(num_tiles, per_block, ctas, k_iters, tiles)
    except ValueError:  # an explicit split that does not fit (the test above)
        return
    main_units = num_tiles - tail
    waves = -(-main_units // ctas)
    args = (ctas, main_units, size, per_block, tail)
    ranges = [list(rs_schedule.wave_tiles(w, *args)) for w in range(waves)]
    assert ranges[0][0] == 0 and ranges[-1][1] == per_block
    assert all(lo <= hi for lo, hi in ranges)
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    traced = jax.jit(jax.vmap(lambda w: rs_schedule.wave_tiles(w, *args)))
    assert np.asarray(traced(jnp.arange(waves, dtype=jnp.int32))).T.tolist() == ranges
    lin = np.arange(main_units)
    tile = np.asarray(rs_schedule.main_unit(jnp.asarray(lin, jnp.int32), size, per_block, tail)[0])
    first_wave = np.full(per_block, -1)
    for t, w in zip(tile[::-1], (lin // ctas)[::-1], strict=True):
        first_wave[t] = w
    range_of = np.concatenate([np.full(hi - lo, w) for w, (lo, hi) in enumerate(ranges)])
    assert (first_wave == range_of).all()
    # the zeroing plan the RS kernels share: the first `ahead` waves' tiles by the compute
    # warpgroups, each later wave's bands spread over the SMs, late_iters bands each at most
    bands, sms = 8, ctas * 2
    for zero_ahead in (0, 1, 2):
        plan = rs_schedule.zero_plan(zero_ahead, *args, bands, sms)
        assert plan.waves == waves
        assert plan.ahead == (min(zero_ahead, waves) if zero_ahead else waves)
        assert plan.first_tiles == ranges[plan.ahead - 1][1]
        assert plan.late_zero == (plan.ahead < waves)  # size >= 2 here
        later = [(hi - lo) * bands for lo, hi in ranges[plan.ahead :]]
        assert plan.late_iters * sms >= max(later, default=0)
        assert plan.late_iters == max([-(-b // sms) for b in later], default=0)


@pytest.mark.parametrize(
    ("num_tiles", "k_iters", "expected"),
    [
        (1792, 32, (10, 4)),  # llama8b_mlp RS in 2-CTA clusters: 27 waves and 10 tiles
        (1024, 64, (34, rs_schedule.STREAMED)),  # comm_heavy: 33 steps a cluster, not 5 x 8
        (1728, 40, (12, 5)),  # llama13b_mlp
        (1716, 40, (0, 1)),  # whole waves: nothing to split
    ],
)
def test_automatic_split_tail(num_tiles, k_iters, expected):
    tiles = mosaic_gpu.DirectRSConfig(split_tail=0)
    plan = rs_schedule.tail_plan(num_tiles, num_tiles // 2, 66, k_iters, tiles)
    assert plan == expected


def test_stream_tail_deals_comm_heavy():
    """comm_heavy's RS core in 256 x 256 cluster tiles (M 16384, N 4096, K 4096: 1024 tiles,
    64 K-steps each, on 66 clusters): a tail of 34 tiles, 33 K-steps a cluster where the best
    split (8 ranges) runs five rounds of 8; at 16 K-steps a tile (K 1024) the automatic tail
    runs whole, as it measured faster there."""
    tiles = mosaic_gpu.DirectRSConfig(stream_tail=True)
    assert rs_schedule.tail_plan(1024, 1024, 66, 64, tiles) == (34, rs_schedule.STREAMED)
    assert rs_schedule.stream_share(34, 64, 66) == 33
    assert rs_schedule.stream_pieces(1, 33, 1024, 34, 64) == ((990, 33, 31), (991, 0, 2))
    split = mosaic_gpu.DirectRSConfig(split_tail=8)
    assert rs_schedule.tail_plan(1024, 1024, 66, 64, split) == (34, 8)
    auto = mosaic_gpu.DirectRSConfig(split_tail=0)
    assert rs_schedule.tail_plan(1024, 1024, 66, 16, auto) == (0, 1)
    assert rs_schedule.tail_plan(1024, 1024, 66, 16, tiles) == (34, rs_schedule.STREAMED)
