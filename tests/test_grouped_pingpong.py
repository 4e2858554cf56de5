"""commgemm's ping-pong grouped Hopper kernel, off the GPU: its row tiles (which rows of which
group each tile stores, the tail's zeroed rows), its tiling's and operands' checks, that it
lowers for a CUDA target, and that its K-step loads (and the dW kernel's) read no schedule
array. tests/gpu/test_fused_gpu.py checks its values on Hopper."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from commgemm.mosaic_gpu import grouped_pingpong, pingpong
from commgemm.mosaic_gpu import tiles as mosaic_tiles
from commgemm.mosaic_gpu.grouped_pingpong import ROW_ALIGN, PingPongTiles

pytest.importorskip("jax.experimental.pallas.mosaic_gpu")


@functools.cache
def _row_tiles(m: int, tile_m: int):
    return jax.jit(lambda sizes: grouped_pingpong.row_tiles(sizes, m, tile_m))


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 700), min_size=1, max_size=12),
    m=st.integers(1, 2500),
    tile_m=st.sampled_from([64, 128, 192]),
)
def test_row_tiles_store_every_row_once(sizes, m, tile_m):
    """Every row of the m rows is stored by exactly one tile: a row in group g (its sum cut at
    m) by one of g's tiles, a row past the sum by one of the tail's (counts[0] <= p <
    counts[1]); tiles start at whole 8s of rows, hold their rows within tile_m, and run in
    group order; unused tiles store nothing. Against the rows' groups counted in numpy."""
    plan = _row_tiles(m, tile_m)(jnp.asarray(sizes, jnp.int32))
    start, skip, rows, group, counts = (np.asarray(a) for a in plan.arrays())
    assert start.shape[0] == grouped_pingpong.max_row_tiles(m, len(sizes), tile_m)
    owner = np.repeat(np.arange(len(sizes)), sizes)[:m]
    owner = np.concatenate([owner, np.full(m - owner.shape[0], len(sizes))])  # the tail
    stored = np.full(m, -1)
    used, total = counts
    assert 0 <= used <= total <= start.shape[0]
    for p in range(start.shape[0]):
        if p >= total:
            assert rows[p] == 0
            continue
        assert start[p] % ROW_ALIGN == 0 and 0 <= skip[p] < ROW_ALIGN
        assert 0 < rows[p] and skip[p] + rows[p] <= tile_m
        assert (group[p] < len(sizes)) == (p < used)
        span = np.arange(start[p] + skip[p], start[p] + skip[p] + rows[p])
        assert (stored[span] == -1).all(), f"tile {p} stores rows stored before"
        stored[span] = group[p]
    np.testing.assert_array_equal(stored, owner)
    assert np.all(np.diff(group[:total]) >= 0)


def test_tiles_and_shapes():
    """PingPongTiles takes positive ints, two stages or more, whole 64s of rows and whole 8s of
    columns up to 256; the kernel takes 16-bit operands with N and K whole tiles (any rows),
    and says why not otherwise."""
    bad_fields = (dict(tile_m=0), dict(stages=True), dict(stages=1), dict(band=1.5),
                  dict(tile_m=100), dict(tile_m=72), dict(tile_n=100),
                  dict(tile_n=264))  # fmt: skip
    for bad in bad_fields:
        with pytest.raises(ValueError, match="PingPongTiles"):
            PingPongTiles(**bad)
    tiles, reason = PingPongTiles(), grouped_pingpong.shape_reason
    assert reason(tiles, 1000, 320, 512, jnp.bfloat16) is None
    assert reason(tiles, 7, 64, 128, jnp.float16) is None
    assert "N=192" in reason(tiles, 1024, 320, 192, jnp.bfloat16)
    assert "K=100" in reason(tiles, 1024, 100, 512, jnp.bfloat16)
    assert "float32" in reason(tiles, 1024, 320, 512, jnp.float32)
    assert "empty operand" in reason(tiles, 0, 320, 512, jnp.bfloat16)
    # w [G, K, N] is loaded in whole 128-byte rows; read [G, N, K] any whole 8s of columns
    narrow = PingPongTiles(tile_n=160)
    assert "swizzle" in reason(narrow, 1024, 320, 640, jnp.bfloat16)
    assert reason(narrow, 1024, 320, 640, jnp.bfloat16, w_nk=True) is None
    # the ring's slots beside two output tiles in 227 KiB: 5 with bf16 results, 3 with float32
    assert grouped_pingpong.ring_stages(tiles, jnp.bfloat16, jnp.bfloat16) == 5
    assert grouped_pingpong.ring_stages(tiles, jnp.bfloat16, jnp.float32) == 3
    assert grouped_pingpong.ring_stages(PingPongTiles(tile_k=256), jnp.float16, jnp.float32) == 0


@pytest.mark.parametrize("tile_m", [64, 128, 192, 256, 320])
def test_store_ladder_covers_every_row_count(tile_m):
    """A tile's rows are stored by the ladder's steps whose bits the row count has, each at the
    rows the steps before took: for every count 0 to tile_m (a whole tile of 192 rows too, not
    a power of two), the steps taken cover rows [0, count) once, within the tile's rows."""
    steps = grouped_pingpong.ladder(tile_m)
    assert steps[-1] == 1 and all(a == 2 * b for a, b in zip(steps, steps[1:], strict=False))
    for count in range(tile_m + 1):
        at, covered = 0, []
        for size in steps:
            if count & size:
                covered += range(at, at + size)
                at += size
        assert covered == list(range(count)), count
        assert at <= tile_m


def test_bad_operands_raise(monkeypatch):
    """Operands that do not match: clear errors before any kernel is built."""
    monkeypatch.setattr(mosaic_tiles, "num_sms", lambda: 132)
    x = jnp.zeros((256, 128), jnp.bfloat16)
    sizes = jnp.asarray([100, 156], jnp.int32)
    matmul = grouped_pingpong.grouped_matmul
    with pytest.raises(ValueError, match=r"\[G, K, N\] with x's K=128"):
        matmul(x, jnp.zeros((2, 64, 128), jnp.bfloat16), sizes)
    with pytest.raises(ValueError, match=r"\[G, N, K\]"):
        matmul(x, jnp.zeros((2, 128, 256), jnp.bfloat16), sizes, w_nk=True)
    with pytest.raises(ValueError, match="dtype bfloat16"):
        matmul(x, jnp.zeros((2, 128, 128), jnp.float16), sizes)
    with pytest.raises(ValueError, match="one count per group"):
        matmul(x, jnp.zeros((3, 128, 128), jnp.bfloat16), sizes)
    with pytest.raises(ValueError, match="at least one"):
        matmul(x, jnp.zeros((0, 128, 128), jnp.bfloat16), sizes[:0])
    with pytest.raises(ValueError, match="N=96"):
        matmul(x, jnp.zeros((2, 128, 96), jnp.bfloat16), sizes)
    with pytest.raises(ValueError, match="0 stages, needs 2"):
        w = jnp.zeros((2, 256, 128), jnp.bfloat16)
        matmul(jnp.zeros((256, 256), jnp.bfloat16), w, sizes, PingPongTiles(tile_k=256),
               out_dtype=jnp.float32)  # fmt: skip


@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "scaled"])
@pytest.mark.parametrize("w_nk", [False, True], ids=["forward", "dX"])
def test_pingpong_kernel_lowers(w_nk, scaled, monkeypatch):
    """The kernel (the forward, dX's form with w read [G, N, K], with a scale and a float32
    result) lowers for a CUDA target under jax_enable_x64, rows not whole tiles: one Mosaic GPU
    call taking the row tiles' five int32 arrays, x and w."""
    monkeypatch.setattr(mosaic_tiles, "num_sms", lambda: 132)
    sds = jax.ShapeDtypeStruct
    x = sds((1000, 256), jnp.bfloat16)
    w = sds((8, 512, 256) if w_nk else (8, 256, 512), jnp.bfloat16)
    extra = dict(scale=jnp.ones((1,), jnp.float32), out_dtype=jnp.float32) if scaled else {}
    fn = functools.partial(grouped_pingpong.grouped_matmul, w_nk=w_nk, **extra)
    with jax.enable_x64(True):
        text = jax.jit(fn).trace(x, w, sds((8,), jnp.int32)).lower(lowering_platforms=("cuda",))
    calls = [line for line in text.as_text().splitlines()
             if "custom_call" in line and "mosaic_gpu" in line]  # fmt: skip
    assert len(calls) == 1, calls
    out = "f32" if scaled else "bf16"
    assert f"-> tensor<1000x512x{out}>" in calls[0], calls[0]


@pytest.mark.parametrize("w_dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_pingpong_kernel_lowers_on_float8(w_dtype, monkeypatch):
    """On float8 x and w [G, N, K] (e4m3 with either format) with the scale as an operand: one
    Mosaic GPU call whose two matrix operands are f8, a bf16 result; w must be K-major. e5m2
    against e4m3 needs jax >= 0.11's wgmma (what the GPUs run)."""
    if w_dtype == "float8_e5m2" and jax.__version_info__ < (0, 11):
        pytest.skip("e5m2 x e4m3 wgmma needs jax >= 0.11")
    monkeypatch.setattr(mosaic_tiles, "num_sms", lambda: 132)
    sds = jax.ShapeDtypeStruct
    x, w = sds((1000, 256), jnp.float8_e4m3fn), sds((8, 512, 256), w_dtype)
    fn = functools.partial(grouped_pingpong.grouped_matmul, w_nk=True)
    args = (x, w, sds((8,), jnp.int32), sds((1,), jnp.float32))
    lowered = jax.jit(lambda a, b, s, c: fn(a, b, s, scale=c)).trace(*args)
    text = lowered.lower(lowering_platforms=("cuda",)).as_text()
    calls = [line for line in text.splitlines() if "custom_call" in line and "mosaic_gpu" in line]
    assert len(calls) == 1, calls
    operands, result = calls[0].rsplit(" : (", 1)[1].split(") -> ", 1)
    assert operands.count("f8E") == 2 and "tensor<1xf32>" in operands, operands
    assert result.startswith("tensor<1000x512xbf16>"), result
    with pytest.raises(ValueError, match=r"need w laid out \[G, N, K\]"):
        grouped_pingpong.grouped_matmul(jnp.zeros((256, 256), jnp.float8_e4m3fn),
                                        jnp.zeros((2, 256, 512), jnp.float8_e4m3fn),
                                        jnp.asarray([100, 156], jnp.int32))  # fmt: skip


def _loops_that_load(jaxpr) -> list[set[str]]:
    """The primitives of each loop body (nested jaxprs included, nested loops not) that issues
    TMA loads (`copy_gmem_to_smem`), over a jaxpr and every jaxpr inside it."""
    from jax.extend import core as jcore

    def inner(eqn):
        for value in eqn.params.values():
            for item in value if isinstance(value, tuple | list) else (value,):
                if isinstance(item, jcore.ClosedJaxpr):
                    yield item.jaxpr
                elif isinstance(item, jcore.Jaxpr):
                    yield item

    def names(body, found):
        for eqn in body.eqns:
            found.add(eqn.primitive.name)
            if eqn.primitive.name not in ("while", "scan"):
                for sub in inner(eqn):
                    names(sub, found)
        return found

    loops = []
    for eqn in jaxpr.eqns:
        for sub in inner(eqn):
            if eqn.primitive.name in ("while", "scan"):
                body = names(sub, set())
                if "copy_gmem_to_smem" in body:
                    loops.append(body)
            loops.extend(_loops_that_load(sub))
    return loops


@pytest.mark.parametrize("form", ["forward", "dX", "float8-dX", "dW"])
def test_k_step_loads_read_no_schedule(form, monkeypatch):
    """The load warpgroup's K-step loop of the grouped ping-pong kernels (forward, dX's form,
    float8, dW) issues its TMA loads from values it was handed: no read of the schedule's arrays
    in global memory (a tile's first row and group, a unit's steps), whose dependent loads in
    every K-step would set the pace of the loads. The kernel's jaxpr, traced on the CPU."""
    from commgemm.mosaic_gpu import grouped_dw

    monkeypatch.setattr(mosaic_tiles, "num_sms", lambda: 132)
    sds, groups = jax.ShapeDtypeStruct, 8
    dtype = jnp.float8_e4m3fn if form == "float8-dX" else jnp.bfloat16
    x, sizes = sds((1024, 256), dtype), sds((groups,), jnp.int32)
    if form == "dW":
        fn, other = grouped_dw.weight_grad, sds((1024, 512), dtype)
    else:
        fn = functools.partial(grouped_pingpong.grouped_matmul, w_nk=form != "forward")
        other = sds((groups, 256, 512) if form == "forward" else (groups, 512, 256), dtype)
    loops = _loops_that_load(jax.make_jaxpr(fn)(x, other, sizes).jaxpr)
    assert loops, "no loop issues the kernel's loads"
    for body in loops:
        assert "get" not in body, sorted(body)


@settings(max_examples=60, deadline=None)
@given(units=st.integers(0, 700), ctas=st.integers(1, 40), halving=st.booleans())
@example(units=35, ctas=10, halving=True)  # a last wave of exactly half the CTAs
def test_traced_deal_runs_every_tile_once(units, ctas, halving):
    """`pingpong.Deal.traced` (the grouped kernel's: units known at run time only): every tile
    runs once, whole on one CTA, or (a last wave at most half full after a whole one, with
    `halving`) as its two halves on two CTAs, the last unit of each; CTAs run within one unit
    of each other; and the traced deal is the dense kernels' static one (`pingpong.Deal` with
    that tail). Counted in Python from the deal of every CTA's every unit."""
    last = units % ctas
    halved = halving and units > ctas and 0 < last <= ctas // 2
    cid = jnp.arange(ctas, dtype=jnp.int32)
    i = jnp.arange(units // ctas + 2, dtype=jnp.int32)[:, None]

    def dealt(deal):
        tile, half = deal.tile(cid, i)
        halves = deal.half(i)
        halves = False if halves is None else halves
        return deal.count(cid), *(
            jnp.broadcast_to(a, (i.shape[0], ctas)) for a in (tile, half, halves)
        )

    with jax.enable_x64(False):
        traced = jax.jit(lambda u: dealt(pingpong.Deal.traced(u, ctas, halving=halving)))
        found = [np.asarray(a) for a in traced(jnp.int32(units))]
        static = jax.jit(lambda: dealt(pingpong.Deal(units, ctas, last if halved else 0)))()
        static = [np.asarray(a) for a in static]
    count, tile, half, is_half = found
    for got, want in zip(found, static, strict=True):
        np.testing.assert_array_equal(got, want)
    runs = {}
    for c in range(ctas):
        for i in range(int(count[c])):
            assert bool(is_half[i, c]) == (halved and i == units // ctas)
            runs.setdefault(int(tile[i, c]), []).append(int(half[i, c]) if is_half[i, c] else None)
    assert sorted(runs) == list(range(units))
    for t, parts in runs.items():
        assert sorted(parts, key=str) == ([0, 1] if halved and t >= units - last else [None]), t
    assert count.max() - count.min() <= 1
