"""The ping-pong kernels (`pingpong`): RS (`PingPongRSConfig`, `pingpong_rs`) and AG
(`PingPongAGConfig`, `pingpong_ag`): their configs' checks, what they refuse, their
specs, the AG kernel's order of a band's visits, and that they lower for a CUDA target on the
CPU on one device (the GEMM core) and on meshes of 2 and 4, bf16 and float8, with partial last
tile columns. Their outputs are checked on Hopper GPUs (tests/gpu)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import P, mesh1d
from hypothesis import example, given, settings
from hypothesis import strategies as st

import commgemm as cg
from commgemm.cli.specs import fused_spec, parse_fused
from commgemm.config import Collective
from commgemm.mosaic_gpu import (
    PingPongAGConfig,
    PingPongRSConfig,
    fused,
    heuristics,
    pingpong,
    pingpong_ag,
    pingpong_rs,
)
from commgemm.mosaic_gpu import tiles as mosaic_tiles
from commgemm.mosaic_gpu.configs import HOPPER_SMEM

pytest.importorskip("jax.experimental.pallas.mosaic_gpu")


@pytest.fixture(autouse=True)
def _h100_sms(monkeypatch):
    monkeypatch.setattr(mosaic_tiles, "num_sms", lambda: 132)  # CPU devices have no SM count


def _config(family=PingPongRSConfig, **fields) -> cg.OverlapConfig:
    return cg.OverlapConfig(method="pipeline", atomic_gemm=True, kernel=family(**fields))


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        (dict(tile_n=200), "more than 192 registers"),
        (dict(tile_m=64, tile_n=264), "up to 256"),
        (dict(tile_n=100), "whole 8s"),
        (dict(tile_m=96), "whole 64s"),
        (dict(stages=1), ">= 2"),
        (dict(cluster="n"), "cluster"),
        (dict(grid_minor_m=1), "bool"),
        (dict(narrow_tail="yes"), "narrow_tail='yes' must be a bool"),
        (dict(tile_k=0), "positive int"),
    ],
)
@pytest.mark.parametrize("family", [PingPongRSConfig, PingPongAGConfig])
def test_config_refuses_bad_fields(family, fields, match):
    with pytest.raises(ValueError, match=match):
        family(**fields)


@pytest.mark.parametrize(("fields", "match"), [(dict(zero_ahead=-1), ">= 0"),
                                               (dict(zero_ahead=True), "int")])  # fmt: skip
def test_rs_config_refuses_bad_zero_ahead(fields, match):
    with pytest.raises(ValueError, match=match):
        PingPongRSConfig(**fields)
    with pytest.raises(TypeError):  # the AG kernel zeroes nothing
        PingPongAGConfig(**fields)


@pytest.mark.parametrize("family", [PingPongRSConfig, PingPongAGConfig])
def test_config_is_for_pipeline_only(family):
    with pytest.raises(ValueError, match="PIPELINE"):
        cg.OverlapConfig(method="ring_exchange", atomic_gemm=True, kernel=family())


@pytest.mark.parametrize(
    "spec",
    [
        "fused-direct-pp",
        "fused-direct-pp-gm-cm",
        "fused-direct-pp-gm-cm-nt",
        "fused-direct-pp-cm-n160-s6-k128",
    ],
)
@pytest.mark.parametrize(("op", "family"), [("rs", PingPongRSConfig), ("ag", PingPongAGConfig)])
def test_spec_round_trip(spec, op, family):
    config = parse_fused(spec, op)
    assert type(config.kernel) is family
    assert parse_fused(fused_spec(config), op) == config


def test_spec_pp_is_direct_only():
    for op in ("ag", "rs"):
        with pytest.raises(ValueError, match="pp"):
            parse_fused("fused-pp", op)
    with pytest.raises(ValueError, match="zero_ahead"):
        parse_fused("fused-direct-pp-a2", "ag")


@settings(max_examples=25, deadline=None)  # eager jax ops per shape: about 0.2 s each
@given(
    m_pairs=st.integers(1, 20),
    n_iters=st.integers(1, 30),
    width=st.integers(1, 9),
    minor_m=st.booleans(),
)
def test_visit_rank_counts_a_bands_visits_in_order(m_pairs, n_iters, width, minor_m):
    """Walking the tiles of a block in the kernel's order (`pingpong.tile_origin`), the visits
    of each band of rows have ranks 0, 1, 2, ... in that order (the AG kernel's senders are a
    band's first visits, each rank once)."""
    tiles = PingPongAGConfig(grid_tile_width=width, grid_minor_m=minor_m, cluster=None)
    count = m_pairs * n_iters

    def walk(lin):  # one jitted program, not an eager compile per op
        rows, cols = pingpong.tile_origin(tiles, lin, m_pairs, n_iters)
        m_pair, n_idx = rows // tiles.cluster_m, cols // tiles.tile_n
        return m_pair, n_idx, pingpong_ag.visit_rank(tiles, m_pair, n_idx, n_iters)

    m_pair, n_idx, ranks = map(np.asarray, jax.jit(walk)(jnp.arange(count, dtype=jnp.int32)))
    assert sorted(zip(m_pair.tolist(), np.asarray(n_idx).tolist(), strict=True)) == [
        (a, b) for a in range(m_pairs) for b in range(n_iters)
    ]  # every tile once
    for band in range(m_pairs):
        assert ranks[m_pair == band].tolist() == list(range(n_iters))


@settings(max_examples=12, deadline=None)
@given(units=st.integers(1, 700), ctas=st.integers(1, 66), narrow=st.booleans())
@example(units=288, ctas=66, narrow=True)  # llama13b's AG core at P = 8: a tail of 24
@example(units=1408, ctas=66, narrow=True)  # comm_heavy's RS cores: 22
@example(units=320, ctas=66, narrow=True)  # llama8b's AG core at P = 8: 56, not narrowed
def test_deal_runs_every_tile_once_and_balances_the_last_wave(units, ctas, narrow):
    """`pingpong.deal`: every tile runs once, whole or as both its halves (each half once);
    halves only with narrow_tail, only in the last wave, where it fills at most half the
    clusters after a full wave; a cluster's work (halves count half) is at most
    ceil(units / ctas), and half a tile less where the tail was narrowed."""
    tiles = PingPongAGConfig(narrow_tail=narrow)
    dealt = pingpong.deal(tiles, units, ctas)
    cid = jnp.arange(ctas, dtype=jnp.int32)[:, None]
    count = np.asarray(jax.jit(dealt.count)(cid))[:, 0]
    i = jnp.arange(int(count.max()), dtype=jnp.int32)[None, :]
    found = jax.jit(lambda c, j: (*dealt.tile(c, j), dealt.half(j) if dealt.tail else False))
    tile, part, half = np.broadcast_arrays(*(np.asarray(a) for a in found(cid, i)))
    ran = i < count[:, None]
    whole = sorted(tile[ran & ~half].tolist())
    halves = sorted(zip(tile[ran & half].tolist(), part[ran & half].tolist(), strict=True))
    assert sorted(whole + [t for t, p in halves if p == 0]) == list(range(units))
    assert [t for t, p in halves if p == 1] == [t for t, p in halves if p == 0]
    tail = units % ctas
    assert bool(halves) == (narrow and units > ctas and 0 < tail <= ctas // 2)
    assert all(t >= units - tail for t, _ in halves)
    work = count - 0.5 * (ran & half).sum(axis=1)
    assert work.max() == (-(-units // ctas) - 0.5 if halves else -(-units // ctas))


@pytest.mark.parametrize(
    ("shape", "dtype", "w_nk", "tiles", "match"),
    [
        ((8192, 1000, 4096), jnp.bfloat16, False, PingPongRSConfig(), "K=1000"),
        ((8064, 1024, 4096), jnp.bfloat16, False, PingPongAGConfig(), "rows per device"),
        ((8192, 1024, 4096), jnp.bfloat16, False, PingPongRSConfig(tile_n=160), "128-byte"),
        ((8192, 1024, 4096), jnp.float8_e4m3fn, True, PingPongRSConfig(), "tile_k=64"),
        ((8192, 1024, 4096), jnp.bfloat16, True, PingPongRSConfig(stages=6), "shared memory"),
        ((8192, 1024, 4000), jnp.bfloat16, False, PingPongRSConfig(), "whole 64s"),
        ((8192, 1024, 4000), jnp.bfloat16, True, PingPongRSConfig(tile_n=128), "whole 64s"),
    ],
)
def test_shape_reason(shape, dtype, w_nk, tiles, match):
    rows, k, n = shape
    reason = pingpong_rs.shape_reason(tiles, rows, k, n, dtype, w_nk=w_nk)
    assert reason is not None and match in reason


@pytest.mark.parametrize("zero_ahead", [0, 2])
@pytest.mark.parametrize("tile_n", [128, 160, 192])
@pytest.mark.parametrize("stages", [4, 5])
def test_smem_bytes_is_what_the_kernel_allocates(tile_n, stages, zero_ahead):
    """The config's shared memory: the x and w rings, one buffer of 64 output rows and with
    zero_ahead a zero block of 16 rows, in bytes; what fits is what shape_reason lets
    through."""
    tiles = PingPongRSConfig(tile_n=tile_n, stages=stages, zero_ahead=zero_ahead)
    zero = 16 * (32 if tile_n == 160 else 64) if zero_ahead else 0
    expected = stages * (128 * 64 + tile_n * 64) * 2 + (64 * tile_n + zero) * 2
    assert tiles.smem_bytes(2, 2) == expected
    fits = pingpong_rs.shape_reason(tiles, 1024, 1024, 4096, jnp.bfloat16, w_nk=True)
    assert (fits is None) == (expected <= HOPPER_SMEM)


def test_unsupported_reason_takes_partial_columns():
    """N need not be whole tiles (the last column of tiles is partial); the rows per device
    of the fused ops must be (only the RS kernel's core on one device takes a partial last row
    of tiles, `test_rs_core_takes_partial_rows`)."""
    x = jax.ShapeDtypeStruct((2 * 1024, 512), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((512, 4160), jnp.bfloat16)  # 4160 = 21 x 192 + 128
    reason = fused.unsupported_reason(Collective.REDUCE_SCATTER, x, w, 2, _config(),
                                      w_transposed=False)  # fmt: skip
    assert reason is None or "N=" not in reason  # on the CPU: the GPU check, not the shape
    rows = jax.ShapeDtypeStruct((2 * 1000, 512), jnp.bfloat16)
    reason = fused.unsupported_reason(Collective.REDUCE_SCATTER, rows, w, 2, _config(),
                                      w_transposed=False)  # fmt: skip
    assert "rows per device=1000" in reason
    ag_rows = jax.ShapeDtypeStruct((1000, 512), jnp.bfloat16)
    reason = fused.unsupported_reason(Collective.ALL_GATHER, ag_rows, w, 2,
                                      _config(PingPongAGConfig), w_transposed=False)  # fmt: skip
    assert "rows per device=1000" in reason
    # K whole 64s but not 128s: bf16 would run, a quantized call's float8 K-steps would not
    short = jax.ShapeDtypeStruct((2 * 1024, 576), jnp.bfloat16)
    w_short = jax.ShapeDtypeStruct((576, 4160), jnp.bfloat16)
    reason = fused.unsupported_reason(Collective.REDUCE_SCATTER, short, w_short, 2, _config(),
                                      w_transposed=False)  # fmt: skip
    assert "K=576 must be whole 128s" in reason
    assert heuristics.pingpong_tiles(1024, 576, 14336) is None
    assert heuristics.pingpong_tiles(1024, 512, 14336) == PingPongRSConfig()  # 0.45% padded
    assert heuristics.pingpong_tiles(1024, 512, 4160) is None  # 1.5% padded
    # a partial last row of tiles (one device): 32640 rows pad 0.4%, 1000 rows 2.4%
    assert heuristics.pingpong_tiles(32640, 512, 13824) == PingPongRSConfig()
    assert heuristics.pingpong_tiles(1000, 512, 13824) is None
    assert heuristics.pingpong_tiles(1024, 512, 4160, "float8_e4m3fn", w_nk=True) is not None
    assert heuristics.pingpong_tiles(1024, 512, 4096, "float8_e4m3fn", w_nk=True) is not None
    assert heuristics.pingpong_tiles(1024, 512, 1024, "float8_e4m3fn", w_nk=True) is None


def test_split_accumulation_is_refused():
    recipe = cg.ScalingRecipe("current_tensor_scaling", split_accumulator=(True, True, True))
    assert "split accumulation" in fused.scaling_reason(_config(), recipe)
    fast = dataclasses.replace(recipe, split_accumulator=(False, True, True))
    assert fused.scaling_reason(_config(), fast) is None
    with pytest.raises(ValueError, match="split accumulation"):
        fused.float8_tiling(PingPongRSConfig(), 1024, split=True)


def _lowered(fn, args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize(
    ("fields", "n", "w_nk"),
    [
        (dict(), 4096, False),  # 21 whole columns of 192 and a partial one of 64
        (dict(cluster=None, grid_minor_m=False), 1792, False),
        (dict(tile_n=160), 4000, True),
        (dict(tile_n=128, stages=6), 2048, True),
    ],
)
@pytest.mark.parametrize("op", ["rs", "ag"])
def test_core_lowers(op, fields, n, w_nk):
    """One device (axis None): the kernel's GEMM core."""
    if op == "rs":
        config, fn = _config(**fields), pingpong_rs.matmul_reduce_scatter
    else:
        config, fn = _config(PingPongAGConfig, **fields), pingpong_ag.all_gather_matmul
    w_shape = (n, 1024) if w_nk else (1024, n)
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((2048, 1024), w_shape)]
    text = _lowered(lambda x, w: fn(x, w, None, config.kernel, w_nk=w_nk), args)
    assert "custom_call @mosaic_gpu" in text


#: (op, tiling) of every ping-pong tiling the tuner measures
PINGPONG_CANDIDATES = [
    (op, tiles)
    for op, family in (("rs", PingPongRSConfig), ("ag", PingPongAGConfig))
    for tiles in heuristics.TUNING_CANDIDATES[op]
    if isinstance(tiles, family)
]


@pytest.mark.parametrize(("op", "tiles"), PINGPONG_CANDIDATES, ids=repr)
@pytest.mark.parametrize("check_vma", [None, True, False])
def test_tuning_candidates_lower(op, tiles, check_vma, monkeypatch):
    """Every ping-pong tiling the tuner measures (`heuristics.TUNING_CANDIDATES`) lowers as the
    GEMM core (check_vma None: the kernel on one device, axis None) and as the public op on a
    2-device mesh under either shard_map setting; n = 4160 is 21 whole columns of 192 and a
    partial one, 32 whole ones of 128 and a partial one."""
    config = cg.OverlapConfig(method="pipeline", atomic_gemm=True, kernel=tiles)
    ag = op == "ag"
    n = 4160
    if check_vma is None:
        kernel = (pingpong_ag.all_gather_matmul if ag
                  else pingpong_rs.matmul_reduce_scatter)  # fmt: skip
        f = lambda x, w: kernel(x, w, None, config.kernel)  # noqa: E731
        shapes = ((2048, 1024), (1024, n))
    else:  # the op's plan takes the fused kernel as on 2 Hopper GPUs
        monkeypatch.setattr(mosaic_tiles, "hopper_reason", lambda: None)
        monkeypatch.setattr(jax, "device_count", lambda *_: 2)
        op_fn = cg.all_gather_matmul if ag else cg.matmul_reduce_scatter
        specs = (P("x"), P(None, "x"), P(None, "x")) if ag else (P(None, "x"), P("x"), P("x"))
        f = jax.shard_map(lambda x, w: op_fn(x, w, "x", config=config), mesh=mesh1d(2),
                          in_specs=specs[:2], out_specs=specs[2], check_vma=check_vma)  # fmt: skip
        shapes = ((1024, 1024), (1024, 2 * n)) if ag else ((2048, 1024), (1024, n))
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in shapes]
    text = _lowered(f, args)
    assert "custom_call @mosaic_gpu" in text


@pytest.mark.parametrize(
    ("fields", "rows"),
    [
        (dict(tile_m=192, tile_n=128), 1000),  # 2 cluster rows of 384 and a partial one of 232
        (dict(tile_m=192, tile_n=128, cluster=None), 16384),  # 85 rows of 192 and one of 64
        (dict(), 1000),  # 3 cluster rows of 256 and a partial one of 232
    ],
)
def test_rs_core_takes_partial_rows(fields, rows):
    """On one device (the GEMM core, the serial path's Hopper GEMM) the RS kernel's rows need
    not be whole cluster tiles: its last row of tiles is partial (loads past M read zeros, the
    stores clip; values checked on Hopper GPUs, tests/gpu). On a mesh, and in the AG kernel,
    they must be."""
    config = _config(**fields)
    assert rows % config.kernel.cluster_m
    n, k = 1024, 256
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((rows, k), (k, n))]
    core = lambda x, w: pingpong_rs.matmul_reduce_scatter(x, w, None, config.kernel)  # noqa: E731
    assert "custom_call @mosaic_gpu" in _lowered(core, args)

    def body(x, w):
        return pingpong_rs.matmul_reduce_scatter(x, w, "x", config.kernel)

    f = jax.shard_map(body, mesh=mesh1d(2), in_specs=(P(None, "x"), P("x")), out_specs=P("x"),
                      check_vma=False)  # fmt: skip
    mesh_args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((2 * rows, 2 * k), (2 * k, n))]
    with pytest.raises(ValueError, match="rows per device"):
        _lowered(f, mesh_args)
    with pytest.raises(ValueError, match="rows per device"):
        tiles = _config(PingPongAGConfig, **fields).kernel
        pingpong_ag.all_gather_matmul(*args, None, tiles)


@pytest.mark.parametrize("zero_ahead", [0, 1, 2])
@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("float8", [False, True])
def test_lowers_on_a_mesh(size, float8, zero_ahead):
    """P devices: zeroing (all first, or the load warpgroups zeroing waves ahead: 22 x 4
    cluster tiles a block, 2 or more waves on 66 clusters), reduce-adds into the owners'
    outputs, the landed handshake; float8 operands (w [n, K]) with the two scales applied in
    the epilogue."""
    config = _config(zero_ahead=zero_ahead)
    if float8:
        config = config.replace(kernel=fused.float8_tiling(config.kernel, 512))
        assert config.kernel.tile_k == 128
    dtype = jnp.float8_e4m3fn if float8 else jnp.bfloat16
    n = 4160  # 21 whole columns of 192 and a partial one

    def body(x, w):
        scale = jnp.full((1,), 0.5, jnp.float32) if float8 else None
        return pingpong_rs.matmul_reduce_scatter(
            x, w, "x", config.kernel, w_nk=float8, out_dtype=jnp.bfloat16, scale=scale
        )

    w_spec, w_shape = (P(None, "x"), (n, 512 * size)) if float8 else (P("x"), (512 * size, n))
    f = jax.shard_map(body, mesh=mesh1d(size), in_specs=(P(None, "x"), w_spec),
                      out_specs=P("x"), check_vma=False)  # fmt: skip
    args = [jax.ShapeDtypeStruct(s, dtype) for s in ((1024 * size, 512 * size), w_shape)]
    text = _lowered(f, args)
    assert "custom_call @mosaic_gpu" in text


def test_kernel_refuses_bad_calls():
    config = _config()
    x = jax.ShapeDtypeStruct((2048, 1024), jnp.bfloat16)
    with pytest.raises(ValueError, match="K=1000"):
        _lowered(
            lambda x, w: pingpong_rs.matmul_reduce_scatter(x, w, None, config.kernel),
            [jax.ShapeDtypeStruct((2048, 1000), jnp.bfloat16),
             jax.ShapeDtypeStruct((1000, 4096), jnp.bfloat16)],
        )  # fmt: skip
    with pytest.raises(ValueError, match="split accumulation"):
        _lowered(
            lambda x, w: pingpong_rs.matmul_reduce_scatter(
                x, w, None, config.kernel, split_accumulator=True
            ),
            [x, jax.ShapeDtypeStruct((1024, 4096), jnp.bfloat16)],
        )
    with pytest.raises(ValueError, match="not a PingPongRSConfig"):
        _lowered(
            lambda x, w: pingpong_rs.matmul_reduce_scatter(x, w, None, None),
            [x, jax.ShapeDtypeStruct((1024, 4096), jnp.bfloat16)],
        )


@pytest.mark.parametrize(
    ("size", "float8", "fields", "n"),
    [(size, float8, fields, 4160) for size in (2, 4) for float8 in (False, True)
     for fields in (dict(), dict(cluster=None, grid_minor_m=False))]
    + [(2, False, dict(), 128)],  # one partial column: a band's one visit sends every step
)  # fmt: skip
def test_ag_lowers_on_a_mesh(size, float8, fields, n):
    """P devices: the own rows pushed from the ring's slots to every peer's inbox and flagged
    per band, each slot held until its push has read it, the peers' tiles awaiting their band,
    the gathered rows returned; float8 operands (w [n, K]) with the two scales applied in the
    epilogue; a partial last column of tiles (n = 4160: 21 whole columns of 192 and a partial
    one)."""
    config = _config(PingPongAGConfig, **fields)
    if float8:
        config = config.replace(kernel=fused.float8_tiling(config.kernel, 1024))
        assert config.kernel.tile_k == 128
    dtype = jnp.float8_e4m3fn if float8 else jnp.bfloat16

    def body(x, w):
        scale = jnp.full((1,), 0.5, jnp.float32) if float8 else None
        return pingpong_ag.all_gather_matmul(
            x, w, "x", config.kernel, w_nk=float8, out_dtype=jnp.bfloat16, scale=scale,
            return_gathered=True,
        )  # fmt: skip

    w_spec, w_shape = (P("x"), (n * size, 1024)) if float8 else (P(None, "x"), (1024, n * size))
    f = jax.shard_map(body, mesh=mesh1d(size), in_specs=(P("x"), w_spec),
                      out_specs=(P(None, "x"), P("x")), check_vma=False)  # fmt: skip
    args = [jax.ShapeDtypeStruct(s, dtype) for s in ((512 * size, 1024), w_shape)]
    text = _lowered(f, args)
    assert "custom_call @mosaic_gpu" in text


def test_ag_kernel_refuses_bad_calls():
    config = _config(PingPongAGConfig)
    w = jax.ShapeDtypeStruct((1024, 4096), jnp.bfloat16)
    with pytest.raises(ValueError, match="rows per device=1000"):
        _lowered(lambda x, w: pingpong_ag.all_gather_matmul(x, w, None, config.kernel),
                 [jax.ShapeDtypeStruct((1000, 1024), jnp.bfloat16), w])  # fmt: skip
    x = jax.ShapeDtypeStruct((2048, 1024), jnp.bfloat16)
    with pytest.raises(ValueError, match="split accumulation"):
        _lowered(lambda x, w: pingpong_ag.all_gather_matmul(
            x, w, None, config.kernel, split_accumulator=True), [x, w])  # fmt: skip
    with pytest.raises(ValueError, match="not a PingPongAGConfig"):
        _lowered(lambda x, w: pingpong_ag.all_gather_matmul(x, w, None, _config().kernel),
                 [x, w])  # fmt: skip


def test_ag_unsupported_reason_and_scaling():
    """The fused AG op takes PingPongAGConfig for PIPELINE: its rows per device must be whole
    cluster tiles, N need not be whole tiles; split accumulation is refused."""
    ag = Collective.ALL_GATHER
    w = jax.ShapeDtypeStruct((512, 4160), jnp.bfloat16)
    config = _config(PingPongAGConfig)
    ok = fused.unsupported_reason(ag, jax.ShapeDtypeStruct((1024, 512), jnp.bfloat16), w, 2,
                                  config, w_transposed=False)  # fmt: skip
    assert ok is None or "N=" not in ok and "rows" not in ok  # on the CPU: the GPU check
    rows = fused.unsupported_reason(ag, jax.ShapeDtypeStruct((1000, 512), jnp.bfloat16), w, 2,
                                    config, w_transposed=False)  # fmt: skip
    assert "rows per device=1000" in rows
    wrong = fused.unsupported_reason(ag, jax.ShapeDtypeStruct((1024, 512), jnp.bfloat16), w, 2,
                                     _config(), w_transposed=False)  # fmt: skip
    assert "another kernel's config" in wrong
    recipe = cg.ScalingRecipe("current_tensor_scaling", split_accumulator=(True, True, True))
    assert "split accumulation" in fused.scaling_reason(config, recipe)
    with pytest.raises(ValueError, match="PingPongAGConfig takes no split"):
        fused.float8_tiling(PingPongAGConfig(), 1024, split=True)


def _kernel_text(op: str, size: int, n: int, narrow: bool) -> str:
    """The lowered kernel of `op` on `size` devices (1: the core, no mesh axis) for x [2048,
    512] (AG: [1024, 512] a device) and w [512, n] a device, ping-pong tiles with narrow_tail."""
    family = PingPongRSConfig if op == "rs" else PingPongAGConfig
    config = _config(family, narrow_tail=narrow)
    kernel = (pingpong_rs.matmul_reduce_scatter if op == "rs"
              else pingpong_ag.all_gather_matmul)  # fmt: skip
    k = 512 * size if op == "rs" else 512  # the RS op's K is sharded, the AG op's rows
    rows = 1024 * size if op == "ag" and size > 1 else 2048
    w_n = n * size if op == "ag" else n
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((rows, k), (k, w_n))]
    if size == 1:
        return _lowered(lambda x, w: kernel(x, w, None, config.kernel), args)
    specs = (P(None, "x"), P("x")) if op == "rs" else (P("x"), P(None, "x"))
    f = jax.shard_map(lambda x, w: kernel(x, w, "x", config.kernel), mesh=mesh1d(size),
                      in_specs=specs, out_specs=P("x") if op == "rs" else P(None, "x"),
                      check_vma=False)  # fmt: skip
    return _lowered(f, args)


@pytest.mark.parametrize("size", [1, 2])
@pytest.mark.parametrize("op", ["rs", "ag"])
def test_narrowed_tail_lowers_and_changes_only_a_tail(op, size):
    """narrow_tail on the core and a mesh of 2: 72 cluster tiles on 66 clusters (N = 1728, 9
    columns of 192, 2048 rows in all) leave a tail of 6, run as 12 halves: the kernel changes;
    176 tiles (N = 4096, 22 columns) leave 44, more than half the clusters: it does not."""
    tail = [_kernel_text(op, size, 1728, narrow) for narrow in (False, True)]
    assert "mosaic_gpu" in tail[0] and tail[0] != tail[1]
    full = [_kernel_text(op, size, 4096, narrow) for narrow in (False, True)]
    assert full[0] == full[1]
