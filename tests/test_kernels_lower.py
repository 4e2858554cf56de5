"""The direct fused kernels (Mosaic GPU) lower for a CUDA target on the CPU: their Pallas code
traces and compiles to Mosaic GPU's MLIR, for several meshes and tilings. They only run on
Hopper GPUs (tests/gpu checks their outputs there); this catches what breaks
before a kernel is ever launched."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import P, mesh1d
from hypothesis import given, settings
from hypothesis import strategies as st

import commgemm as cg
from commgemm import mosaic_gpu
from commgemm.cli.specs import parse_method
from commgemm.mosaic_gpu import direct_ag, direct_rs, ring_rs
from commgemm.mosaic_gpu import tiles as mosaic_tiles

pytest.importorskip("jax.experimental.pallas.mosaic_gpu")


@pytest.fixture(autouse=True)
def _h100_sms(monkeypatch):
    monkeypatch.setattr(mosaic_tiles, "num_sms", lambda: 132)  # CPU devices have no SM count


def _calls(monkeypatch, module, name: str) -> list:
    """Replace module.name by one that also records each call's positional arguments, in the
    returned list."""
    calls, fn = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(a) or fn(*a, **k))
    return calls


def _recorded(monkeypatch, module, name: str) -> list:
    """Replace module.name (a plan function) by one that also records each result, in the
    returned list."""
    planned, plan = [], getattr(module, name)

    def recorded(*args):
        planned.append(plan(*args))
        return planned[-1]

    monkeypatch.setattr(module, name, recorded)
    return planned


class JaxOnAnH100:
    """jax as jax's dW kernel sees it on an H100: it reads its grid off
    jax.devices()[0].core_count, which CPU devices lack."""

    def __getattr__(self, name):
        return getattr(jax, name)

    @staticmethod
    def devices():
        return [type("Device", (), {"core_count": 132})()]


def lower(fn, x_spec, w_spec, out_spec, size: int, x_shape, w_shape, mesh=None) -> str:
    f = jax.shard_map(
        fn, mesh=mesh or mesh1d(size), in_specs=(x_spec, w_spec), out_specs=out_spec,
        check_vma=False,
    )  # fmt: skip
    args = (
        jax.ShapeDtypeStruct(x_shape, jnp.bfloat16),
        jax.ShapeDtypeStruct(w_shape, jnp.bfloat16),
    )
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize(
    "spec",
    [
        "fused-direct",
        "fused-direct-gm-w2",
        "fused-direct-cm",
        "fused-direct-cm-r100",
        "fused-direct-gm-r50",
        "fused-direct-nt",  # 4 x 256 = 1024 units: a tail of 100 of 132 CTAs, not narrowed
        "fused-direct-cm-nt",  # 512 units over 66 clusters: a tail of 50, not narrowed
    ],
)
def test_push_gather_gemm_lowers(size, spec):
    cfg = parse_method(spec, "ag")
    text = lower(
        lambda x, w: direct_ag.all_gather_matmul(x, w, "x", cfg.kernel),
        P("x", None),
        P(None, "x"),
        P(None, "x"),
        size,
        (4096 * size, 256),  # 256 tiles a block (128 in clusters): more than a spread's head
        (256, 2048 * size),
    )
    assert "custom_call @mosaic_gpu" in text


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize(
    "spec",
    [
        "fused-direct-cm",
        "fused-direct-cm-ct",
        "fused-direct-cm-ct-t2",  # 256 / 66 tiles: a tail of 58 tiles, split in two
        "fused-direct-wgm-cm-m64-n256-t0",
        "fused-direct-wgm-cm-ct-m64-n256-k128-s2-t0",
        "fused-direct-wgm-cm-ct-m64-n256-t0-a3",  # zeroing three waves ahead, a split tail
        "fused-direct-wgm-cm-ct-m64-n256-sk-a2",  # the tail streamed
        "fused-direct-ct-a1",
    ],
)
def test_scatter_add_gemm_lowers(size, spec):
    cfg = parse_method(spec, "rs")
    text = lower(
        lambda x, w: direct_rs.matmul_reduce_scatter(x, w, "x", cfg.kernel),
        P(None, "x"),
        P("x", None),
        P("x", None),
        size,
        (2048 * size, 512 * size),
        (512 * size, 4096),
    )
    assert "custom_call @mosaic_gpu" in text


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("fused-direct-wgm-cm-ct-m64-n256-t0-a2", (10, 4)),  # the plan's tiling: 1792 on 66
        ("fused-direct-t2", (20, 2)),  # 3584 tiles on 132 CTAs: 20 left, split in two
        ("fused-direct-cm", (0, 1)),  # split_tail 1: the tail runs whole
        ("fused-direct-wgm-cm-ct-m64-n256-sk-a2", (10, 0)),  # streamed: 10 x 32 steps on 66
    ],
)
def test_scatter_add_core_splits_its_tail(spec, expected, monkeypatch):
    """On one device (the GEMM core, axis None) the RS kernel splits (or streams) its last
    wave's tiles along K as on P devices (M 8192, K 1024, N 14336): the plan is the same, and
    the kernel lowers with the tail's tiles zeroed first and added into."""
    planned = _recorded(monkeypatch, direct_rs, "tail_plan")
    cfg = parse_method(spec, "rs")
    f = jax.jit(lambda x, w: direct_rs.matmul_reduce_scatter(x, w, None, cfg.kernel))
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((8192, 1024), (1024, 14336))]
    text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "custom_call @mosaic_gpu" in text and planned == [expected]


@pytest.mark.parametrize("check_vma", [True, False])
def test_streamed_tail_through_the_public_op(check_vma, monkeypatch):
    """cg.matmul_reduce_scatter with the cooperative plan's tiling and stream_tail, under either
    shard_map setting, plans the fused kernel (as on 2 Hopper GPUs) and lowers it with the last
    wave streamed: 2 x 8 x 16 cluster tiles on 66 clusters leave 58, within one block."""
    from commgemm.mosaic_gpu import rs_schedule

    monkeypatch.setattr(mosaic_tiles, "hopper_reason", lambda: None)
    monkeypatch.setattr(jax, "device_count", lambda *_: 2)
    planned = _recorded(monkeypatch, direct_rs, "tail_plan")
    config = parse_method("fused-direct-wgm-cm-ct-m64-n256-sk-a2", "rs")
    op = lambda x, w: cg.matmul_reduce_scatter(x, w, "x", config=config)  # noqa: E731
    f = jax.shard_map(op, mesh=mesh1d(2), in_specs=(P(None, "x"), P("x", None)),
                      out_specs=P("x", None), check_vma=check_vma)  # fmt: skip
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((4096, 1024), (1024, 4096))]
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "custom_call @mosaic_gpu" in text and planned == [(58, rs_schedule.STREAMED)]


def test_chain_tiles_needs_two_tiles_per_cta():
    cfg = cg.OverlapConfig(
        method="pipeline", atomic_gemm=True, kernel=mosaic_gpu.DirectRSConfig(chain_tiles=True)
    )
    with pytest.raises(ValueError, match="chain_tiles needs two tiles per CTA, got 16 tiles"):
        lower(
            lambda x, w: direct_rs.matmul_reduce_scatter(x, w, "x", cfg.kernel),
            P(None, "x"),
            P("x", None),
            P("x", None),
            2,
            (512, 512),
            (512, 1024),
        )


@settings(max_examples=15, deadline=None)
@given(
    m_iters=st.integers(1, 12),
    n_iters=st.integers(1, 12),
    width=st.sampled_from([1, 2, 3, 4, 8]),
    minor_m=st.booleans(),
    cluster=st.sampled_from([None, "m"]),
)
def test_senders_are_each_bands_first_visits(m_iters, n_iters, width, minor_m, cluster):
    """ATOMIC_GEMM_AG: the tiles that push a band's rows (visit rank < senders) are the band's
    first visits in the kernel's tile order (`planar_snake`), one for each rank."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    from jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu import MatmulDimension

    tiles = mosaic_gpu.DirectAGConfig(grid_tile_width=width, grid_minor_m=minor_m, cluster=cluster)
    minor = MatmulDimension.M if minor_m else MatmulDimension.N
    order = jnp.arange(m_iters * n_iters, dtype=jnp.int32)  # the kernel's tile order
    snake = jax.vmap(lambda t: plgpu.planar_snake(t, (m_iters, n_iters), minor, width))
    ms, ns = (np.asarray(v) for v in jax.jit(snake)(order))
    visits: dict[int, list[int]] = {}
    for cta in (0, 1) if cluster == "m" else (None,):
        bands = ms if cta is None else 2 * ms + cta
        ranks = np.asarray(direct_ag._visit_rank(tiles, bands, ns, n_iters))
        for band, rank in zip(bands.tolist(), ranks.tolist(), strict=True):
            visits.setdefault(band, []).append(rank)
    count = direct_ag.senders(tiles, n_iters, k_iters=64)
    assert 1 <= count <= min(8, n_iters)
    for ranks in visits.values():
        assert sorted(ranks) == list(range(n_iters))
        assert ranks[:count] == list(range(count))
    # send_lead bounds how far after any of a band's tiles its last sender comes
    lead = direct_ag.send_lead(tiles, m_iters, n_iters, count)
    for band in range(m_iters):
        where = np.flatnonzero(ms == band)  # in tile order: the band's visits
        assert where[count - 1] - where[0] <= lead


@settings(max_examples=15, deadline=None)
@given(
    size=st.integers(2, 8),
    own=st.integers(1, 400),
    ctas=st.sampled_from([1, 7, 66, 132]),
    lead=st.integers(0, 63),
    spread=st.integers(0, 100),
)
def test_spread_schedule(size, own, ctas, lead, spread):
    """ATOMIC_GEMM_AG with DirectAGConfig.spread: every (step, tile) is run once, each block's tiles
    in tile order, and a peer's tile t comes after the own tiles up to t + lead (the sends of
    its band: the same schedule runs on every device), so no tile waits on one still to come."""
    tiles = mosaic_gpu.DirectAGConfig(spread=spread)
    head, region = direct_ag.spread_plan(tiles, own, ctas, lead)
    assert head <= own <= region <= 2 * own - head
    lin = jnp.arange(size * own, dtype=jnp.int32)
    step, tile = (np.asarray(v) for v in direct_ag.schedule_unit(lin, own, head, region))
    pairs = list(zip(step.tolist(), tile.tolist(), strict=True))
    assert sorted(pairs) == [(s, t) for s in range(size) for t in range(own)]
    assert (np.diff(tile[step == 0]) == 1).all()
    peers = step[step > 0] * own + tile[step > 0]
    assert (np.diff(peers) == 1).all()
    is_own = step == 0
    own_before = np.cumsum(is_own) - is_own  # own tiles in units [0, lin)
    needed = np.minimum(own, tile + lead + 1)
    assert (own_before[~is_own] >= needed[~is_own]).all()
    if spread == 0 or head == own:
        assert (step == lin // own).all()


@pytest.mark.parametrize(
    ("op", "spec", "size"),
    [
        ("ag", "fused", 2),
        ("ag", "fused", 4),
        ("ag", "fused-gm-w4", 4),
        ("rs", "fused", 2),
        ("rs", "fused", 4),
        ("rs", "fused-cm", 4),
        ("rs", "fused-wgm-cm-m64-n256", 4),
    ],
)
def test_ring_kernels_lower(op, spec, size):
    """ATOMIC_GEMM_AG_P2P (the direct AG kernel forwarding each block) and ATOMIC_GEMM_RS_P2P
    (one received-count semaphore per ring step) lower on 2 and 4 devices."""
    from commgemm.mosaic_gpu import fused

    cfg = parse_method(spec, op)
    if op == "ag":  # 2048 rows a device, N 1024 a device
        fn = lambda x, w: fused.all_gather_matmul(x, w, "x", cfg, w_transposed=False)  # noqa: E731
        specs = (P("x", None), P(None, "x"), P(None, "x"))
        shapes = ((2048 * size, 256), (256, 1024 * size))
    else:  # 512 rows a device, K 256 a device
        fn = lambda x, w: fused.matmul_reduce_scatter(x, w, "x", cfg, w_transposed=False)  # noqa: E731
        specs = (P(None, "x"), P("x", None), P("x", None))
        shapes = ((512 * size, 256 * size), (256 * size, 1024))
    text = lower(fn, *specs, size, *shapes)
    assert "custom_call @mosaic_gpu" in text


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("kernel", ["ag", "rs", "ring ag", "ring rs"])
def test_kernels_lower_on_a_mesh_with_more_axes(kernel, rows):
    """On a ("data", "x") mesh the kernels address a peer by its coordinate on "x" (Mosaic GPU
    refuses a bare index there: "got 1 ids for a 2D mesh")."""
    from commgemm.mosaic_gpu import fused

    mesh = jax.sharding.Mesh(np.array(jax.devices()[: 2 * rows]).reshape(rows, 2), ("data", "x"))
    size = 2
    if kernel.endswith("ag"):
        cfg = parse_method("fused" if kernel == "ring ag" else "fused-direct", "ag")
        fn = lambda x, w: fused.all_gather_matmul(x, w, "x", cfg, w_transposed=False)  # noqa: E731
        specs, shapes = (P("x", None), P(None, "x"), P(None, "x")), ((4096, 256), (256, 4096))
    else:
        spec = "fused-direct-cm" if kernel == "rs" else "fused"
        cfg = parse_method(spec, "rs")
        if kernel == "rs":
            fn = lambda x, w: direct_rs.matmul_reduce_scatter(x, w, "x", cfg.kernel)  # noqa: E731
        else:
            fn = lambda x, w: fused.matmul_reduce_scatter(x, w, "x", cfg, w_transposed=False)  # noqa: E731
        specs, shapes = (P(None, "x"), P("x", None), P("x", None)), ((2048, 1024), (1024, 4096))
    text = lower(fn, *specs, size, *shapes, mesh=mesh)
    assert "custom_call @mosaic_gpu" in text


def test_fused_ag_plans_on_a_mesh_with_more_axes(monkeypatch):
    """Both AG kernels address a peer by its coordinate on the axis: the plan takes them on a
    1-D mesh and on one of more axes."""
    from commgemm.config import Collective
    from commgemm.mosaic_gpu import fused

    monkeypatch.setattr(mosaic_tiles, "hopper_reason", lambda: None)
    monkeypatch.setattr(jax, "device_count", lambda: 2)
    reasons = {}

    def body(x, w):
        for spec in ("fused", "fused-direct"):
            cfg = parse_method(spec, "ag")
            reasons[spec] = fused.unsupported_reason(Collective.ALL_GATHER, x, w, 2, cfg,
                                                     w_transposed=False)  # fmt: skip
        return x

    two_axes = jax.sharding.Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("data", "x"))
    for mesh in (mesh1d(2), two_axes):
        reasons.clear()
        jax.shard_map(
            body, mesh=mesh, in_specs=(P("x", None), P(None, "x")), out_specs=P("x", None)
        )(  # fmt: skip
            jnp.zeros((512, 256), jnp.bfloat16), jnp.zeros((256, 1024), jnp.bfloat16)
        )
        assert reasons == {"fused": None, "fused-direct": None}


def test_compiler_params_reach_the_kernels():
    """The fused kernels' one hook (kernel_profile.py's profiler switch): extra CompilerParams
    fields passed explicitly, nothing set by default."""
    plain = mosaic_tiles.kernel_params(132, 2)["compiler_params"]
    params = mosaic_tiles.kernel_params(132, 2, {"reduction_scratch_bytes": 0})["compiler_params"]
    assert params.reduction_scratch_bytes == 0 != plain.reduction_scratch_bytes
    assert params.lowering_semantics == plain.lowering_semantics


@pytest.mark.parametrize("kernel", ["commgemm", "pingpong", "jax"])
@pytest.mark.parametrize("groups", [8, 64])
def test_hopper_grouped_gemm_lowers(groups, kernel, monkeypatch):
    """The grouped GEMM's Hopper path (the forward on commgemm's row-aligned or ping-pong
    kernel or jax's Mosaic GPU ragged dot, dX on the one `pick_tiles` picks, dW on commgemm's
    ping-pong dW kernel) lowers for a CUDA target, its backward included."""
    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu as transposed

    from commgemm.mosaic_gpu import grouped

    monkeypatch.setattr(transposed, "jax", JaxOnAnH100())

    sds = jax.ShapeDtypeStruct
    args = (sds((1024, 256), jnp.bfloat16), sds((groups, 256, 512), jnp.bfloat16))
    sizes = jnp.full((groups,), 1024 // groups, jnp.int32)

    kernels = {"commgemm": grouped.GroupedConfig(), "pingpong": grouped.PingPongTiles()}
    tiles = kernels.get(kernel, grouped.GroupedTiles())

    def loss(x, w):
        return jnp.sum(grouped.ragged_dot(x, w, sizes, tiles).astype(jnp.float32))

    text = (
        jax.jit(jax.grad(loss, (0, 1))).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    )
    calls = [line for line in text.splitlines() if "custom_call @mosaic_gpu" in line]
    # dX and dW (the forward's result is unused by the gradient): dW's is the [G, K, N] one
    assert len(calls) == 2, calls
    assert sum(f"-> tensor<{groups}x256x512xbf16>" in call for call in calls) == 1, calls


@pytest.mark.parametrize(
    "row_tiles,narrow",
    [(8, True), (70, True), (8, False)],
    ids=["narrowed-only", "whole-and-narrowed", "whole-only"],
)
@pytest.mark.parametrize("w_nk", [False, True], ids=["forward", "dX"])
def test_grouped_kernel_lowers(w_nk, row_tiles, narrow):
    """commgemm's grouped kernel (the forward, and dX's form with w read [G, N, K]) lowers for
    a CUDA target, under jax_enable_x64 as well: one Mosaic GPU call taking x, w and the
    schedule's six int32 arrays; with the last wave narrowed (16 tiles on 132 CTAs: all of
    them; 140: the last 8), and whole."""
    from commgemm.mosaic_gpu import grouped_kernel
    from commgemm.mosaic_gpu.configs import GroupedConfig

    sds = jax.ShapeDtypeStruct
    m = row_tiles * 128
    x = sds((m, 256), jnp.bfloat16)
    w = sds((8, 512, 256) if w_nk else (8, 256, 512), jnp.bfloat16)
    tiles = GroupedConfig(narrow_tail=narrow)
    text = (
        jax.jit(lambda a, b, s: grouped_kernel.grouped_matmul(a, b, s, tiles, w_nk=w_nk))
        .trace(x, w, sds((8,), jnp.int32))
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )
    calls = [line for line in text.splitlines() if "custom_call @mosaic_gpu" in line]
    assert len(calls) == 1, calls
    # row tiles, row tiles + 7 (row tile, group) pairs, row tiles x 2 output tiles
    pairs = row_tiles + 7
    schedule = ", ".join(f"tensor<{n}xi32>" for n in (pairs, pairs, pairs, row_tiles, row_tiles,
                                                        2 * row_tiles))  # fmt: skip
    assert f"{schedule}) -> tensor<{m}x512xbf16>" in calls[0], calls


@pytest.mark.parametrize("op", ["ag", "rs"])
@pytest.mark.parametrize("spec", ["fused-direct", "fused"])
@pytest.mark.parametrize(  # size None: no mesh axis, the kernel's GEMM core
    ("size", "split"), [(None, True), (2, False), (2, True), (4, False)]
)
def test_fused_kernels_lower_on_float8(spec, op, size, split):
    """The ops' quantized path into the direct and ring kernels: float8 x and w ([n, K]) reach
    the kernel as float8 (and no bf16 copy of either), with the scale as a third operand; with
    fast and split accumulation."""
    from commgemm import quantized_gemm
    from commgemm.mosaic_gpu import fused

    cfg = parse_method(spec, op)
    fn = fused.all_gather_matmul if op == "ag" else fused.matmul_reduce_scatter
    p = size or 1  # per device: AG 1024 rows and N 512, RS 1024 rows and K 512
    if op == "ag":
        x_shape, w_shape = (1024 * p, 512), (512, 512 * p)
    else:
        x_shape, w_shape = (1024 * p, 512 * p), (512 * p, 1024)

    def body(x, w):
        qx, qw = cg.quantize(x, "current_tensor_scaling"), cg.quantize(w, "current_tensor_scaling")
        rhs = quantized_gemm.QuantizedRhs(qw, qx.scale_inv, x.shape[1], "bfloat16", split)
        return fn(qx.data, rhs, None if size is None else "x", cfg, w_transposed=False)

    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in (x_shape, w_shape)]
    if size is None:
        f = jax.jit(body)
    else:
        specs = (P("x"), P(None, "x")) if op == "ag" else (P(None, "x"), P("x"))
        out = P(None, "x") if op == "ag" else P("x")
        f = jax.jit(jax.shard_map(body, mesh=mesh1d(size), in_specs=specs, out_specs=out,
                                  check_vma=False))  # fmt: skip
    text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    calls = [line for line in text.splitlines() if "custom_call @mosaic_gpu" in line]
    assert len(calls) == 1, calls
    operands, results = calls[0].rsplit(" : (", 1)[1].split(") -> ", 1)  # the call's types
    assert operands.count("f8E4M3FN") == 2 and "tensor<1xf32>" in operands, operands
    assert "bf16" in results.split(",")[0], results  # the scaled result, in x's dtype


@pytest.mark.parametrize("op", ["ag", "rs"])
@pytest.mark.parametrize(
    ("shape", "match"),
    [
        ((1024, 512, 1728), "N=1728 must be divisible by the tile 256"),  # 6.75 column tiles
        ((1000, 512, 512), "rows=1000 must be divisible by the tile 128"),
        ((1024, 544, 512), "K=544 must be divisible by the tile 64"),
    ],
)
def test_direct_kernels_refuse_partial_tiles(op, shape, match):
    """Called directly (not through an op's plan), a kernel refuses a shape that is not whole
    tiles instead of leaving the remainder unwritten."""
    m, k, n = shape
    cfg = parse_method("fused-direct", op)
    kernel = direct_ag.all_gather_matmul if op == "ag" else direct_rs.matmul_reduce_scatter
    args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((k, n), jnp.bfloat16))
    with pytest.raises(ValueError, match=match):
        jax.jit(lambda x, w: kernel(x, w, None, cfg.kernel)).trace(*args)


@pytest.mark.parametrize("spec", ["fused", "fused-direct"])
def test_rs_kernels_refuse_rows_that_do_not_split(spec):
    """The RS kernels, called directly, refuse x's rows where they do not split evenly among
    the devices that own them (before any tile check)."""
    from commgemm.mosaic_gpu import fused

    cfg = parse_method(spec, "rs")
    fn = lambda x, w: fused.matmul_reduce_scatter(x, w, "x", cfg, w_transposed=False)  # noqa: E731
    with pytest.raises(ValueError, match="rows=1025 must be divisible by the 2 devices"):
        lower(fn, P(None, "x"), P("x", None), P("x", None), 2, (1025, 1024), (1024, 512))


def test_float8_tiling():
    """Float8 calls take 128-element K-steps where K allows, keeping chained tiles only where
    K is whole rounds of stages; a tiling with K-steps of 128 or more, or a K that is not
    whole 128-element steps, is left as it is."""
    from commgemm.mosaic_gpu.fused import float8_tiling

    chained = mosaic_gpu.DirectRSConfig(chain_tiles=True, cluster="m")
    assert float8_tiling(chained, 1024) == mosaic_gpu.DirectRSConfig(
        chain_tiles=True, cluster="m", tile_k=128
    )
    assert float8_tiling(chained, 768) == mosaic_gpu.DirectRSConfig(cluster="m", tile_k=128)
    assert float8_tiling(chained, 1088) == chained
    wide = mosaic_gpu.DirectAGConfig(tile_k=256, stages=2)
    assert float8_tiling(wide, 1024) == wide
    # split accumulation: warpgroup tiles of at most 64 x 128 (two accumulators in registers)
    assert float8_tiling(
        mosaic_gpu.DirectAGConfig(), 1024, split=True
    ) == mosaic_gpu.DirectAGConfig(tile_m=64, tile_n=128, wg_along_m=True, tile_k=128)
    small = mosaic_gpu.DirectRSConfig(tile_m=64, tile_n=128, tile_k=128)
    assert float8_tiling(small, 1024, split=True) == small


def test_split_tiling():
    """The fused kernels' split form takes 256-element K-steps in at most 3 stages where K is
    whole steps of them (chained tiles kept only where K is whole rounds of stages), else the
    split form of `float8_tiling`."""
    from commgemm.mosaic_gpu.fused import float8_tiling, split_tiling

    plain = mosaic_gpu.DirectAGConfig()
    assert split_tiling(plain, 1024) == mosaic_gpu.DirectAGConfig(
        tile_m=64, tile_n=128, wg_along_m=True, tile_k=256, stages=3
    )
    assert split_tiling(plain, 640) == float8_tiling(plain, 640, split=True)  # 2.5 steps
    chained = mosaic_gpu.DirectRSConfig(chain_tiles=True, stages=2)
    assert split_tiling(chained, 1024).chain_tiles  # 4 steps, 2 stages
    assert not split_tiling(chained, 768).chain_tiles  # 3 steps
    assert split_tiling(chained, 768).tile_k == 256


@pytest.mark.parametrize("k,tile_k", [(768, 256), (640, 128)])
def test_grouped_split_form_takes_256_element_steps(k, tile_k, monkeypatch):
    """The row-aligned grouped kernel's split form (the promoted float8 dX) runs in
    `split_tiling`: K-steps of 256 where K is whole steps of them (768), else of 128 (640), and
    lowers either way; fast accumulation keeps `float8_tiling`'s 128."""
    from commgemm.mosaic_gpu import grouped_kernel
    from commgemm.mosaic_gpu.configs import GroupedConfig

    tilings = []
    original = grouped_kernel._float8_tiling
    monkeypatch.setattr(mosaic_tiles, "num_sms", lambda: 132)
    monkeypatch.setattr(
        grouped_kernel,
        "_float8_tiling",
        lambda *a, **kw: tilings.append(original(*a, **kw)) or tilings[-1],
    )
    f8, sds = jnp.float8_e4m3fn, jax.ShapeDtypeStruct
    args = (sds((512, k), f8), sds((4, 256, k), f8), sds((4,), jnp.int32))
    for split, steps in ((True, tile_k), (False, 128)):
        tilings.clear()
        f = functools.partial(grouped_kernel.grouped_matmul, w_nk=True, out_dtype=jnp.bfloat16,
                              split_accumulator=split)  # fmt: skip
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "custom_call @mosaic_gpu" in text
        assert tilings and {t.tile_k for t in tilings} == {steps}, tilings
        assert all(isinstance(t, GroupedConfig) for t in tilings)


def test_split_accumulation_needs_small_warpgroup_tiles():
    """Called directly with split accumulation, a kernel refuses warpgroup tiles that leave no
    registers for the second accumulator."""
    args = (
        jax.ShapeDtypeStruct((1024, 512), jnp.float8_e4m3fn),
        jax.ShapeDtypeStruct((512, 512), jnp.float8_e4m3fn),
    )
    for kernel, cfg in (
        (direct_ag.all_gather_matmul, parse_method("fused-direct", "ag")),
        (direct_rs.matmul_reduce_scatter, parse_method("fused-direct", "rs")),
        (ring_rs.matmul_reduce_scatter, parse_method("fused", "rs")),
    ):
        call = lambda x, w: kernel(x, w, None, cfg.kernel, w_nk=True, split_accumulator=True)  # noqa: B023, E731
        with pytest.raises(ValueError, match="at most 8192 elements"):
            jax.jit(call).trace(*args)


@settings(max_examples=30, deadline=None)
@given(
    size=st.integers(1, 8),  # 1: the kernel's GEMM core
    own=st.integers(1, 400),
    ctas=st.sampled_from([66, 132, 7, 1]),
    spread=st.sampled_from([0, 50, 100]),
    narrow=st.booleans(),
    ring=st.booleans(),
)
def test_narrow_tail_covers_every_tile_once(size, own, ctas, spread, narrow, ring):
    """ATOMIC_GEMM_AG (direct, or the ring) with narrow_tail: the main loop's whole tiles and
    the tail's two halves of each of its tiles cover every unit exactly once; the tail fits in
    one wave of CTAs, sends no rows (its units are peers' tiles, or one device's; in a ring
    the last step's), and finishes the GEMM at least half a tile's time sooner than whole
    tiles would."""
    tiles = mosaic_gpu.DirectAGConfig(spread=spread, narrow_tail=narrow)
    units = size * own
    head, region = direct_ag.spread_plan(tiles, own, ctas, 0)
    if size == 1 or ring:
        head = region = own
    senders_end = (size - 1) * own if ring else region if size > 1 else 0
    tail = direct_ag.narrow_tail(tiles, units, ctas, senders_end)
    main = units - tail
    covered = np.zeros((units, 2), np.int32)
    covered[:main] += 1
    for i in range(2 * tail):
        covered[main + i // 2, i % 2] += 1
    assert (covered[:main] == 1).all() and (covered[main:] == 1).all()
    if not narrow:
        assert tail == 0
    if tail:
        assert main % ctas == 0 and 2 * tail <= ctas
        steps, _ = direct_ag.schedule_unit(np.arange(main, units), own, head, region)
        assert size == 1 or (np.asarray(steps) > (size - 2 if ring else 0)).all()
        assert main // ctas + 0.5 <= -(-units // ctas) - 0.5
    elif narrow and units % ctas and 2 * (units % ctas) <= ctas and size == 1:
        pytest.fail("one device's partly filled last wave was left whole")


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "float8"])
@pytest.mark.parametrize(
    ("size", "spec", "m", "expected"),
    [
        (None, "fused-direct-nt", 8192, 52),  # 448 tiles: 3 waves and 52 narrowed
        (None, "fused-direct-gm-nt", 1024, 56),  # 56 tiles: all narrowed, no main loop
        (None, "fused-direct-cm-nt", 8192, 26),  # 224 cluster tiles over 66 clusters
        (2, "fused-direct-nt", 4096, 52),  # 2 x 224 tiles, the tail the peer's rows
        (2, "fused-direct-cm-nt", 4096, 26),
        (2, "fused-direct-wgm-m64-n192", 4096, 0),  # 128 x 192 tiles, N = 1728
    ],
)
def test_narrow_tail_lowers(size, spec, m, expected, fp8, monkeypatch):
    """The direct AG kernel with a narrowed tail lowers, on one device (its GEMM core) and on a
    mesh, in bf16 and float8 (N = 1792: 7 column tiles); so do 128 x 192 tiles (N = 1728)."""
    from commgemm import quantized_gemm
    from commgemm.mosaic_gpu import fused

    planned = _recorded(monkeypatch, direct_ag, "narrow_tail")
    cfg = parse_method(spec, "ag")
    k, n = 256, 1728 if "n192" in spec else 1792

    def body(x, w):
        if not fp8:
            return direct_ag.all_gather_matmul(x, w, None if size is None else "x", cfg.kernel)
        qx, qw = cg.quantize(x, "current_tensor_scaling"), cg.quantize(w, "current_tensor_scaling")
        rhs = quantized_gemm.QuantizedRhs(qw, qx.scale_inv, k, "bfloat16", False)
        return fused.all_gather_matmul(qx.data, rhs, None if size is None else "x", cfg,
                                       w_transposed=False)  # fmt: skip

    if size is None:
        f, args = jax.jit(body), ((m, k), (k, n))
    else:
        f = jax.jit(jax.shard_map(body, mesh=mesh1d(size), in_specs=(P("x"), P(None, "x")),
                                  out_specs=P(None, "x"), check_vma=False))  # fmt: skip
        args = ((size * m, k), (k, size * n))
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in args]
    text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "custom_call @mosaic_gpu" in text and planned == [expected]


@pytest.mark.parametrize("split", [False, True], ids=["fast", "split"])
@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_grouped_kernel_lowers_on_float8(dtype, split):
    """The grouped kernel on float8 x and w [G, N, K] with the scale as an operand (its masking
    of straddling rows selects in fp16: Mosaic GPU computes on no 8-bit type), accumulating
    fast or split (each K-step's product added into a float32 total)."""
    from commgemm.mosaic_gpu import grouped_kernel

    sds = jax.ShapeDtypeStruct
    x, w = sds((1024, 256), dtype), sds((8, 512, 256), dtype)
    text = (
        jax.jit(lambda a, b, s, c: grouped_kernel.grouped_matmul(
            a, b, s, w_nk=True, scale=c, out_dtype=jnp.bfloat16, split_accumulator=split))
        .trace(x, w, sds((8,), jnp.int32), sds((1,), jnp.float32))
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )  # fmt: skip
    calls = [line for line in text.splitlines() if "custom_call @mosaic_gpu" in line]
    assert len(calls) == 1, calls
    operands, result = calls[0].rsplit(" : (", 1)[1].split(") -> ", 1)
    assert operands.count("f8E") == 2 and "tensor<1xf32>" in operands, operands
    assert result.startswith("tensor<1024x512xbf16>"), result


@pytest.mark.parametrize("check_vma", [True, False])
def test_prequantized_grouped_kernel_in_shard_map(check_vma, monkeypatch):
    """cg.grouped_matmul on ScaledTensors inside shard_map (both check_vma settings) runs one
    float8 kernel per shard, on the shard's rows (as on a Hopper GPU)."""
    monkeypatch.setattr(mosaic_tiles, "hopper_reason", lambda: None)
    sizes = jnp.array([300, 0, 212], jnp.int32)

    def body(xd, xs, wd, ws):
        x, w = cg.ScaledTensor(xd, xs), cg.ScaledTensor(wd, ws, axis=2)
        return cg.grouped_matmul(x, w, sizes)

    f = jax.shard_map(body, mesh=mesh1d(2), in_specs=(P("x"), P(), P(), P()), out_specs=P("x"),
                      check_vma=check_vma)  # fmt: skip
    f8, f32 = jnp.float8_e4m3fn, jnp.float32
    shapes = (((1024, 256), f8), ((), f32), ((3, 512, 256), f8), ((), f32))
    args = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    calls = [line for line in text.splitlines() if "custom_call @mosaic_gpu" in line]
    assert len(calls) == 1 and "tensor<512x512xbf16>" in calls[0], calls


@pytest.mark.parametrize(
    "grad_dtype,split,delayed",
    [("float8_e4m3fn", False, False), ("float8_e4m3fn", True, False),
     ("float8_e4m3fn", False, True), ("float8_e5m2", True, False)],
    ids=["e4m3-fast", "e4m3-split", "e4m3-delayed", "e5m2-split"],
)  # fmt: skip
def test_float8_grouped_backward_lowers(grad_dtype, split, delayed, monkeypatch):
    """The float8 grouped op's gradient (tensor scaling, current or delayed with a dy_state, as
    on a Hopper GPU) runs dX on commgemm's float8 kernel, dY's float8 values times w's as
    quantized ([G, K, N]: one kernel whose operands are both f8, [M, K] out), and dW on the
    float8 dW kernel where the recipe lets dW accumulate fast (x's and dY's float8 values
    transposed, [G, K, N] out), else on the 16-bit dW kernel; the forward's kernel is not
    needed by the gradient. dY in e5m2 against e4m3 weights needs jax >= 0.11's wgmma (what
    the GPUs run)."""
    if grad_dtype == "float8_e5m2" and jax.__version_info__ < (0, 11):
        pytest.skip("e5m2 x e4m3 wgmma needs jax >= 0.11")
    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu as transposed

    monkeypatch.setattr(mosaic_tiles, "hopper_reason", lambda: None)
    monkeypatch.setattr(transposed, "jax", JaxOnAnH100())
    state = cg.ScalingState.create() if delayed else None
    mode = "delayed_tensor_scaling" if delayed else "current_tensor_scaling"
    sizes = jnp.array([300, 0, 500, 100], jnp.int32)

    def loss(x, w, dy_state):
        recipe = cg.ScalingRecipe(
            mode, grad_dtype=grad_dtype, x_state=state, w_state=state, dy_state=dy_state,
            split_accumulator=(False, split, split),
        )  # fmt: skip
        return jnp.sum(cg.grouped_matmul(x, w, sizes, scaling=recipe).astype(jnp.float32))

    sds = jax.ShapeDtypeStruct
    args = (sds((1024, 512), jnp.bfloat16), sds((4, 512, 768), jnp.bfloat16), state)
    text = jax.jit(jax.grad(loss, (0, 1, 2) if delayed else (0, 1))).trace(*args)
    text = text.lower(lowering_platforms=("cuda",))
    calls = [ln for ln in text.as_text().splitlines()
             if "custom_call @mosaic_gpu" in ln]  # fmt: skip
    float8 = [c for c in calls if c.rsplit(" : (", 1)[1].count("f8E") == 2]
    assert len(calls) == 2 and len(float8) == (1 if split else 2), calls
    assert any(") -> tensor<1024x512xbf16>" in c for c in float8), float8  # dX
    dw = [c for c in calls if c.endswith("-> tensor<4x512x768xbf16>")]
    assert len(dw) == 1 and (dw[0] in float8) == (not split), dw


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("op", ["ag", "dispatch"])
def test_collective_grouped_float8_lowers(op, check_vma, monkeypatch):
    """The collective grouped ops' forward under tensor scaling (as on a Hopper GPU): one float8
    kernel per block of rows, each taking the block's float8 payload as it travelled and the
    experts' float8 values [G, N, K] (both operands f8, the scales one f32 operand), a bf16
    result; no dequantized copy reaches a kernel."""
    monkeypatch.setattr(mosaic_tiles, "hopper_reason", lambda: None)
    size, m, groups = 2, 256, 4
    ring = cg.OverlapConfig(method="ring_exchange")

    def body(x, w, sizes):
        if op == "ag":
            return cg.all_gather_grouped_matmul(x, w, sizes[0], "x", config=ring,
                                                scaling="current_tensor_scaling")  # fmt: skip
        return cg.all_to_all_grouped_matmul(x, w, sizes[0], "x", config=ring,
                                            scaling="current_tensor_scaling")[0]  # fmt: skip

    w_spec, out_spec = (P(None, None, "x"), P(None, "x")) if op == "ag" else (P("x"), P("x"))
    f = jax.shard_map(body, mesh=mesh1d(size), in_specs=(P("x"), w_spec, P("x")),
                      out_specs=out_spec, check_vma=check_vma)  # fmt: skip
    sds = jax.ShapeDtypeStruct
    sizes = sds((size, groups), jnp.int32)  # dispatch: 2 of the 4 experts on each shard
    args = (sds((size * m, 256), jnp.bfloat16), sds((groups, 256, 512), jnp.bfloat16), sizes)
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    calls = [line for line in text.splitlines() if "custom_call @mosaic_gpu" in line]
    assert len(calls) == size, calls
    n = 512 // size if op == "ag" else 512
    for call in calls:
        operands, result = call.rsplit(" : (", 1)[1].split(") -> ", 1)
        assert operands.count("f8E4M3FN") == 2 and "tensor<1xf32>" in operands, operands
        assert f"tensor<{m}x256xf8E4M3FN>" in operands and f"x{n}x256xf8E4M3FN>" in operands
        assert result.startswith(f"tensor<{m}x{n}xbf16>"), result


def _ring_float8_grad_lines(recipe, check_vma, size, m, groups, n) -> list[str]:
    """The lines of the gradient's program (lowered for CUDA) of the all-gather ring's blocks
    under `recipe`: x [size * m, 256] rows over "x", w [groups, 256, n] columns over "x"."""
    ring = cg.OverlapConfig(method="ring_exchange")

    def body(x, w, sizes):
        return cg.all_gather_grouped_matmul(x, w, sizes[0], "x", config=ring, scaling=recipe)

    f = jax.shard_map(body, mesh=mesh1d(size), in_specs=(P("x"), P(None, None, "x"), P("x")),
                      out_specs=P(None, "x"), check_vma=check_vma)  # fmt: skip
    loss = lambda x, w, s: jnp.sum(f(x, w, s).astype(jnp.float32) ** 2)  # noqa: E731
    sds = jax.ShapeDtypeStruct
    args = (sds((size * m, 256), jnp.bfloat16), sds((groups, 256, n), jnp.bfloat16),
            sds((size, groups), jnp.int32))  # fmt: skip
    text = jax.jit(jax.grad(loss, (0, 1))).trace(*args).lower(lowering_platforms=("cuda",))
    return text.as_text().splitlines()


@pytest.mark.parametrize("check_vma", [True, False])
def test_collective_grouped_float8_backward_lowers(check_vma, monkeypatch):
    """The gradient of the all-gather ring's float8 blocks (as on a Hopper GPU): per block, the
    forward's float8 kernel, dX on the float8 kernel (dY's float8 values times the experts' as
    quantized, [G, K, n]: both operands f8, [m, K] out) and dW on a 16-bit kernel (the
    default recipe's wgrad is split); no 16-bit dX kernel beside the float8 one. dY in e4m3
    under jax 0.10 (e5m2 against e4m3 weights needs jax >= 0.11's wgmma)."""
    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu as transposed

    monkeypatch.setattr(mosaic_tiles, "hopper_reason", lambda: None)
    monkeypatch.setattr(transposed, "jax", JaxOnAnH100())
    size, m, groups, n = 2, 256, 4, 1024
    grad_dtype = "float8_e5m2" if jax.__version_info__ >= (0, 11) else "float8_e4m3fn"
    recipe = cg.ScalingRecipe("current_tensor_scaling", grad_dtype=grad_dtype)
    lines = _ring_float8_grad_lines(recipe, check_vma, size, m, groups, n)
    calls = [ln for ln in lines if "custom_call @mosaic_gpu" in ln]
    operands = [c.rsplit(" : (", 1)[1].split(") -> ", 1) for c in calls]
    float8 = [(o, r) for o, r in operands if o.count("f8E") == 2]
    dx = [(o, r) for o, r in float8 if r.startswith(f"tensor<{m}x256xbf16>")]
    assert len(calls) == 3 * size and len(float8) == 2 * size and len(dx) == size, calls
    f8 = "f8E5M2" if grad_dtype == "float8_e5m2" else "f8E4M3FN"
    for o, _ in dx:  # dY [m, n] (float8) times w [G, K, n] as quantized
        assert f"tensor<{m}x{n // size}x{f8}>" in o and f"x256x{n // size}xf8E4M3FN>" in o, o


@pytest.mark.parametrize("wgrad_split", [False, True], ids=["fast-wgrad", "split-wgrad"])
@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "no-vma"])
def test_collective_grouped_float8_dw_lowers(check_vma, wgrad_split, monkeypatch):
    """The all-gather ring's float8 blocks (as on a Hopper GPU) with a fast wgrad: each block's
    dW on the float8 dW kernel (the payload's and dY's float8 values, [K, M'] and [n, M'], each
    transposed by one Pallas Triton call), [G, K, n] out; with wgrad split, on a 16-bit kernel
    and no transposes of rows. Either way the experts' [G, N, K] float8 copy is one more Triton
    call. The groups' row floor lowered to these blocks' 64 rows a group."""
    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu as transposed

    from commgemm.mosaic_gpu import grouped_dw

    monkeypatch.setattr(mosaic_tiles, "hopper_reason", lambda: None)
    monkeypatch.setattr(mosaic_tiles, "num_sms", lambda: 132)
    monkeypatch.setattr(transposed, "jax", JaxOnAnH100())
    monkeypatch.setattr(grouped_dw, "FLOAT8_MIN_GROUP_ROWS", 64)
    size, m, groups, n = 2, 256, 4, 1024
    recipe = cg.ScalingRecipe("current_tensor_scaling", grad_dtype="float8_e4m3fn",
                              split_accumulator=(False, False, wgrad_split))  # fmt: skip
    lines = _ring_float8_grad_lines(recipe, check_vma, size, m, groups, n)
    calls = [ln for ln in lines if "custom_call @mosaic_gpu" in ln]
    dw = [c for c in calls if f"-> tensor<{groups}x256x{n // size}xbf16>" in c]
    float8_dw = [c for c in dw if f"tensor<256x{m}xf8E4M3FN>" in c]
    assert len(dw) == size and len(float8_dw) == (0 if wgrad_split else size), dw
    triton = [ln for ln in lines if "xla.gpu.triton" in ln]
    rows = [ln for ln in triton if re.search(r": \(tensor<1x\d+x\d+xui8>\)", ln)]  # dW's x, dY
    assert len(rows) == (0 if wgrad_split else 2 * size), triton
    assert len(triton) - len(rows) == 1, triton  # the experts' [G, N, K] copy, once a call


@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("op", ["local", "ag"])
def test_kept_transposed_experts_lower(op, keep, monkeypatch):
    """A `QuantizedWeight` of the experts with its values kept transposed
    (`quantize_weight(..., keep_transposed=True)`) reaches the float8 kernel as it is: the
    forward's program (the local op, and the all-gather ring's blocks, as on a Hopper GPU) has
    no transpose of float8 experts; without the kept copy it transposes them (a Triton call
    on CUDA)."""
    from commgemm.quant import ScaledTensor

    monkeypatch.setattr(mosaic_tiles, "hopper_reason", lambda: None)
    size, m, groups, k, n = 2, 256, 4, 256, 512
    mode, ring = cg.ScalingMode.CURRENT_TENSOR_SCALING, cg.OverlapConfig(method="ring_exchange")
    sds = jax.ShapeDtypeStruct

    def weight(value, data, scale, transposed):
        return cg.QuantizedWeight(value, ScaledTensor(data, scale, mode=mode, axis=1), transposed)

    if op == "local":
        f = lambda x, w, s: cg.grouped_matmul(x, w, s, scaling=mode)  # noqa: E731
        rows, cols = 1024, n
    else:
        body = lambda x, w, s: cg.all_gather_grouped_matmul(  # noqa: E731
            x, w, s[0], "x", config=ring, scaling=mode)  # fmt: skip
        w_spec = weight(P(None, None, "x"), P(None, None, "x"), P(), P(None, "x") if keep else None)
        f = jax.shard_map(body, mesh=mesh1d(size), in_specs=(P("x"), w_spec, P("x")),
                          out_specs=P(None, "x"))  # fmt: skip
        rows, cols = size * m, n
    f8 = jnp.float8_e4m3fn
    kept = sds((groups, cols, k), f8) if keep else None
    w = weight(sds((groups, k, cols), jnp.bfloat16), sds((groups, k, cols), f8),
               sds((), jnp.float32), kept)  # fmt: skip
    sizes = sds((groups,) if op == "local" else (size, groups), jnp.int32)
    text = jax.jit(f).trace(sds((rows, k), jnp.bfloat16), w, sizes)
    text = text.lower(lowering_platforms=("cuda",)).as_text()
    experts = re.compile(r"\(tensor<\d+x\d+x\d+x(f8E4M3FN|ui8)>\)")  # 3-D float8 (or its bytes)
    moves = ("stablehlo.transpose", "xla.gpu.triton")  # XLA's, or the Triton kernel's on CUDA
    transposes = [ln for ln in text.splitlines()
                  if any(op in ln for op in moves) and experts.search(ln)]  # fmt: skip
    calls = [ln for ln in text.splitlines() if "custom_call @mosaic_gpu" in ln]
    assert calls and all(c.rsplit(" : (", 1)[1].count("f8E4M3FN") == 2 for c in calls), calls
    assert bool(transposes) is not keep, transposes


@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("spec", ["none", "fused-direct"])
def test_kept_transposed_dense_lowers(spec, keep, monkeypatch):
    """The all-gather's float8 forward on a QuantizedWeight [K, n] passed in (quantized before,
    as for serving), on XLA's GEMM and on the direct fused kernel (as on a Hopper GPU):
    without the kept copy the program transposes w's float8 values to [n, K], with it none."""
    from commgemm.quant import ScaledTensor

    monkeypatch.setattr(mosaic_tiles, "hopper_reason", lambda: None)
    sds, spec_w, mode = jax.ShapeDtypeStruct, P(None, "x"), cg.ScalingMode.CURRENT_TENSOR_SCALING
    specs = cg.QuantizedWeight(spec_w, ScaledTensor(spec_w, P(), mode=mode),
                               P("x", None) if keep else None)  # fmt: skip
    cfg = parse_method(spec, "ag")
    f = jax.shard_map(lambda a, b: cg.all_gather_matmul(a, b, "x", config=cfg, scaling=mode),
                      mesh=mesh1d(8), in_specs=(P("x"), specs), out_specs=P(None, "x"))  # fmt: skip
    f8 = jnp.float8_e4m3fn  # per device: 256 rows, K 512, n 256 (the fused kernels' whole mesh)
    qw = cg.QuantizedWeight(sds((512, 2048), jnp.bfloat16),
                            ScaledTensor(sds((512, 2048), f8), sds((), jnp.float32), mode=mode),
                            sds((2048, 512), f8) if keep else None)  # fmt: skip
    text = jax.jit(f).trace(sds((2048, 512), jnp.bfloat16), qw)
    text = text.lower(lowering_platforms=("cuda",)).as_text()
    transposes = [ln for ln in text.splitlines()  # XLA's or the Triton kernel's (on CUDA)
                  if ("stablehlo.transpose" in ln and "xf8E4M3FN>) ->" in ln)
                  or "xla.gpu.triton" in ln]  # fmt: skip
    assert bool(transposes) is not keep, transposes
    kernels = [ln for ln in text.splitlines() if "custom_call @mosaic_gpu" in ln]
    assert len(kernels) == (spec != "none"), kernels


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "no-vma"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn, jnp.float32])
@pytest.mark.parametrize("size, groups", [(2, 1), (4, 1), (2, 3)])
def test_ragged_all_to_all_kernel_lowers(size, groups, dtype, check_vma, monkeypatch):
    """The expert-parallel exchange on its NVLink kernel (`mosaic_gpu.ragged_a2a`), as on a
    Hopper GPU, one region per peer or several (peer-major out, group-major in): forward and
    (for 16-bit and wider rows) its transpose each one Mosaic GPU call, the rows' arrival
    signalled after the stores (`signals.landed`), the entries relaxed (`signals.entered`)."""
    from commgemm.grouped import exchange
    from commgemm.mosaic_gpu import signals

    landed, entered = (_calls(monkeypatch, signals, name) for name in ("landed", "entered"))

    monkeypatch.setattr(exchange, "kernel_reason", lambda dtype, k: None)
    rows, most, k, regions = 1000, 700, 512, size * groups

    def body(x, sb, sc, rb, rc):
        send = exchange.Layout(sb[0], sc[0])
        recv = exchange.Layout(rb[0], rc[0], by_group=groups > 1)
        return exchange.ragged_all_to_all(x, send, recv, "x", most, size * most)

    f = jax.shard_map(body, mesh=mesh1d(size), in_specs=(P("x"),) * 5, out_specs=P("x"),
                      check_vma=check_vma)  # fmt: skip
    ints = lambda n: jax.ShapeDtypeStruct((size, n), jnp.int32)  # noqa: E731
    args = (jax.ShapeDtypeStruct((size * rows, k), dtype), ints(regions + 1), ints(regions),
            ints(regions + 1), ints(regions))  # fmt: skip
    wide = jnp.dtype(dtype).itemsize >= 2

    def fn(x, *layouts):  # the exchange, and its transpose on its result where differentiable
        y, pullback = jax.vjp(lambda v: f(v, *layouts), x)
        return pullback(y) if wide else y

    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert len(re.findall(r"custom_call @mosaic_gpu", text)) == (2 if wide else 1)
    assert len(landed) == len(entered) == size * (2 if wide else 1)  # one each to every device


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("op", ["ag", "rs"])
def test_pingpong_kernels_lower_through_the_public_ops(op, size, monkeypatch):
    """The ping-pong AG and RS kernels (`-pp`), their flags raised after the awaited stores
    (`signals.landed`), lower for a CUDA target through the public ops, as on P Hopper GPUs."""
    from commgemm.mosaic_gpu import pingpong_ag, pingpong_rs, signals

    monkeypatch.setattr(mosaic_tiles, "hopper_reason", lambda: None)
    monkeypatch.setattr(jax, "device_count", lambda *_: size)
    module, name = (pingpong_ag, "all_gather_matmul") if op == "ag" else (
        pingpong_rs, "matmul_reduce_scatter")  # fmt: skip
    called, landed = _calls(monkeypatch, module, name), _calls(monkeypatch, signals, "landed")
    config = parse_method("fused-direct-pp-gm-cm", op)
    if op == "ag":
        fn, specs = cg.all_gather_matmul, (P("x", None), P(None, "x"), P(None, "x"))
        shapes = ((2048 * size, 1024), (1024, 2048 * size))
    else:
        fn, specs = cg.matmul_reduce_scatter, (P(None, "x"), P("x", None), P("x", None))
        shapes = ((2048 * size, 1024 * size), (1024 * size, 2048))
    f = jax.shard_map(lambda x, w: fn(x, w, "x", config=config), mesh=mesh1d(size),
                      in_specs=specs[:2], out_specs=specs[2])  # fmt: skip
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in shapes]
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "custom_call @mosaic_gpu" in text and called and landed
