"""One Hopper GPU: the direct kernels' GEMM core (no mesh axis) in the tilings the tuner and
the fused ops use, and the ops' serial path on it (`local_gemm="mosaic"`), against the float32
product of the same operands."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import commgemm as cg
from commgemm.mosaic_gpu import (
    DirectAGConfig,
    DirectRSConfig,
    PingPongAGConfig,
    PingPongRSConfig,
    fused,
)

pytestmark = pytest.mark.skipif(
    jax.__version_info__ < (0, 11), reason="the Mosaic GPU kernels need jax >= 0.11"
)


#: The cooperative RS plan's tiling (`heuristics.direct_rs_config` for more than 2 devices).
PLAN_RS = DirectRSConfig(wg_along_m=True, tile_m=64, tile_n=256, cluster="m", chain_tiles=True,
                         split_tail=0, zero_ahead=2)  # fmt: skip


def _operands(m, k, n, seed=0):
    ka, kb = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(ka, (m, k), jnp.bfloat16)
    w = (jax.random.normal(kb, (k, n), jnp.float32) / k**0.5).astype(jnp.bfloat16)
    return x, w


def _rel_err(out, ref):
    out = out.astype(jnp.float32)
    return float(jnp.abs(out - ref).max() / jnp.abs(ref).max())


def _ref(x, w):
    return jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32), precision="highest")


@pytest.mark.parametrize(
    ("op", "tiles", "shape"),
    [
        ("ag", DirectAGConfig(), (1024, 512, 1024)),
        ("ag", DirectAGConfig(cluster="m"), (1024, 512, 1024)),
        ("ag", DirectAGConfig(grid_minor_m=True, grid_tile_width=4), (1024, 512, 1024)),
        ("rs", DirectRSConfig(), (1024, 512, 1024)),
        ("rs", DirectRSConfig(cluster="m"), (1024, 512, 1024)),
        ("rs", DirectRSConfig(cluster="n"), (1024, 512, 1024)),
        # 144 tiles on 132 CTAs: the last 12 split along K, added into their zeroed tiles
        ("rs", DirectRSConfig(split_tail=0), (2048, 1024, 2304)),
        ("rs", DirectRSConfig(split_tail=0), (1024, 512, 1024)),  # 32 tiles: all in the tail
        # the same tails streamed: 2 K-steps a CTA, most shares across two tiles
        ("rs", DirectRSConfig(stream_tail=True), (2048, 1024, 2304)),
        ("rs", DirectRSConfig(stream_tail=True), (1024, 512, 1024)),
        # the plan's tiling: 1792 cluster tiles on 66 clusters, the last 10 in 4 K-ranges
        ("rs", PLAN_RS, (8192, 1024, 14336)),
        # and with the tail streamed: 3 of its 160 K-steps a cluster
        ("rs", dataclasses.replace(PLAN_RS, split_tail=1, stream_tail=True), (8192, 1024, 14336)),
        ("rs", DirectRSConfig(chain_tiles=True), (4096, 512, 2304)),  # 288 tiles, 2+ a CTA
        # 448 tiles on 132 CTAs: 3 waves, then the last 52 tiles as 104 half-width ones
        ("ag", DirectAGConfig(narrow_tail=True), (8192, 512, 1792)),
        ("ag", DirectAGConfig(grid_minor_m=True, narrow_tail=True), (8192, 512, 1792)),
        ("ag", DirectAGConfig(cluster="m", narrow_tail=True), (8192, 512, 1792)),  # 26 of 66
        ("ag", DirectAGConfig(narrow_tail=True), (1024, 512, 1792)),  # 56 tiles: all narrowed
        # 3 stages, 16 K-steps: the last step's slot is the next tile's first load
        # (`tiles.await_last_step`; these tiles came out wrong without it)
        (
            "rs",
            DirectRSConfig(wg_along_m=True, tile_m=64, tile_n=256, cluster="m", stages=3),
            (8192, 1024, 14336),
        ),  # fmt: skip
        ("ag", DirectAGConfig(stages=3), (8192, 1024, 7168)),
        # 128 x 192 tiles (gemm_core.tiling) for N whole 192s, not 256s
        ("ag", DirectAGConfig(wg_along_m=True, tile_m=64, tile_n=192), (1024, 512, 1728)),
        (
            "ag",
            DirectAGConfig(wg_along_m=True, tile_m=64, tile_n=192, cluster="m", grid_minor_m=True),
            (2048, 512, 3456),
        ),  # fmt: skip
    ],
)
def test_gemm_core(op, tiles, shape):
    """Every output element written once, with the right value. The output is not zeroed
    first: a call on -x runs before the checked one, so a tile left out (holding the last
    call's -x @ w where the buffer is reused, or anything) or stored twice shows."""
    x, w = _operands(*shape, seed=sum(shape))
    cfg = cg.OverlapConfig(method="pipeline", atomic_gemm=True, kernel=tiles)
    fn = fused.all_gather_matmul if op == "ag" else fused.matmul_reduce_scatter
    f = jax.jit(lambda a, b: fn(a, b, None, cfg, w_transposed=False))
    for sign in (-1, 1, -1, 1):
        out = f(sign * x, w)
        assert out.shape == (shape[0], shape[2]) and out.dtype == jnp.bfloat16
        assert _rel_err(out, _ref(sign * x, w)) < 1e-2  # bf16 rounding of the result


@pytest.mark.parametrize(
    ("n", "tiles"),
    [
        (1792, DirectAGConfig(narrow_tail=True, tile_k=128)),
        (1792, DirectAGConfig(cluster="m", narrow_tail=True, tile_k=128)),
        (1728, DirectAGConfig(wg_along_m=True, tile_m=64, tile_n=192, tile_k=128)),
    ],
)
def test_float8_core_tilings(n, tiles):
    """The float8 AG core with its last wave narrowed (448 tiles on 132 CTAs) and in 128 x 192
    tiles, against the float32 product of the same quantized operands, after a call on -x
    (`test_gemm_core`)."""
    config = cg.OverlapConfig(method="pipeline", atomic_gemm=True, kernel=tiles)
    f = jax.jit(lambda a, r: fused.all_gather_matmul(a, r, None, config, w_transposed=True))
    _check_float8_core(f, *_operands(8192, 1024, n, seed=5))


def _check_float8_core(f, x, w):
    """f(x8, QuantizedRhs of w stored [n, K]) against the float32 product of the quantized
    operands, after a call on -x."""
    from commgemm import quantized_gemm

    k = x.shape[1]
    qw = cg.quantize(w, "current_tensor_scaling", axis=0)
    for sign in (-1, 1):
        qx = cg.quantize(sign * x, "current_tensor_scaling")
        ref = jnp.dot(cg.dequantize(qx), cg.dequantize(qw), precision="highest")
        rhs = quantized_gemm.QuantizedRhs(cg.ScaledTensor(qw.data.T, qw.scale_inv), qx.scale_inv, k,
                                  "bfloat16", False)  # fmt: skip
        assert _rel_err(f(qx.data, rhs), ref) < 1.5e-2  # bf16 result, fast accumulation


def _serial(op, spec, scaling=None, check_vma=True):
    from commgemm.cli.specs import parse_method

    mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
    fn = cg.all_gather_matmul if op == "ag" else cg.matmul_reduce_scatter
    specs = (P("x"), P(None, "x")) if op == "ag" else (P(None, "x"), P("x"))
    out = P(None, "x") if op == "ag" else P("x")
    body = lambda a, b: fn(a, b, "x", config=parse_method(spec), scaling=scaling)  # noqa: E731
    return jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=out, check_vma=check_vma)
    )


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("op", ["ag", "rs"])
@pytest.mark.parametrize(
    ("scaling", "spec"),
    [(None, "none-mosaic"), ("current_tensor_scaling", "none-mosaic"),
     ("current_tensor_scaling", "none")],
)  # fmt: skip
@pytest.mark.parametrize("n", [1024, 1728])  # 1728: 128 x 192 tiles
def test_serial_path_on_the_kernel(op, scaling, spec, check_vma, n):
    """`_check_serial_path`: "mosaic" on the kernel, "auto" on it for float8 where it fits."""
    _check_serial_path(op, scaling, spec, check_vma, n)


@pytest.mark.parametrize("op", ["ag", "rs"])
def test_default_float8_gemm_with_a_partial_column(op):
    """The default local GEMM ("auto") on 4096 columns (21 of 192 and a partial one: 3.1% of
    padding, within float8's 3.5%) runs the float8 forward on the ping-pong kernel."""
    _check_serial_path(op, "current_tensor_scaling", "none", True, 4096)


def _check_serial_path(op, scaling, spec, check_vma, n):
    """The op on a one-device mesh with local_gemm "mosaic" runs the kernel (checked in the
    compiled program) and agrees with XLA's dot path ("none-xla"), values and gradients; the
    forward GEMM with N = 1728 runs in 128 x 192 tiles (the ping-pong kernel's, nine columns).
    With the default ("auto"), the float8 forward runs on the kernel where the ping-pong
    kernel takes it (N = 1728), else on XLA's dot."""
    x, w = _operands(1024, 512, n, seed=7)
    mosaic = _serial(op, spec, scaling, check_vma)
    xla = _serial(op, "none-xla", scaling, check_vma)
    if spec == "none":  # 1024 columns would pad 12.5% in 192-wide tiles: XLA's FP8 dot
        assert ("mosaic_gpu" in mosaic.lower(x, w).as_text()) == (n in (1728, 4096))
        assert _rel_err(mosaic(x, w), xla(x, w).astype(jnp.float32)) < 2e-2
        return
    assert "mosaic_gpu" in mosaic.lower(x, w).as_text()
    assert "mosaic_gpu" not in xla.lower(x, w).as_text()
    got, want = mosaic(x, w), xla(x, w)
    assert _rel_err(got, want.astype(jnp.float32)) < (2e-2 if scaling else 1e-2)
    assert _rel_err(got, _ref(x, w)) < (6e-2 if scaling else 1e-2)  # e4m3: 3 mantissa bits

    def grads(f):
        return jax.jit(jax.grad(lambda a, b: (f(a, b).astype(jnp.float32) ** 2).sum(), (0, 1)))

    for g, h in zip(grads(mosaic)(x, w), grads(xla)(x, w), strict=True):
        assert _rel_err(g, h.astype(jnp.float32)) < (5e-2 if scaling else 1e-2)


@pytest.mark.parametrize("method", ["pipeline", "ring_exchange"], ids=["direct", "ring"])
@pytest.mark.parametrize("op", ["ag", "rs"])
def test_float8_split_accumulation(op, method):
    """The float8 core of the direct and ring kernels with split accumulation (each K-step's
    product added into a float32 total) against the float32 product of the same quantized
    operands: at least as close as the fast accumulation, and within the bf16 rounding of the
    result; K long enough (8192) for the tensor cores' narrower accumulator to show."""
    from commgemm import quantized_gemm

    m, k, n = 1024, 8192, 1024
    x, w = _operands(m, k, n, seed=3)
    qx = cg.quantize(x, "current_tensor_scaling")
    qw = cg.quantize(w, "current_tensor_scaling", axis=0)
    ref = jnp.dot(cg.dequantize(qx), cg.dequantize(qw), precision="highest")
    fn = fused.all_gather_matmul if op == "ag" else fused.matmul_reduce_scatter
    config = cg.OverlapConfig(method=method, atomic_gemm=True)
    errors = {}
    for split in (False, True):
        rhs = quantized_gemm.QuantizedRhs(cg.ScaledTensor(qw.data.T, qw.scale_inv), qx.scale_inv, k,
                                  "bfloat16", split)  # fmt: skip
        out = jax.jit(lambda a, r: fn(a, r, None, config, w_transposed=True))(qx.data, rhs)  # noqa: B023
        assert out.shape == (m, n) and out.dtype == jnp.bfloat16
        errors[split] = _rel_err(out, ref)
    assert errors[True] < 1e-2, errors  # bf16 rounding of the result
    assert errors[True] <= errors[False] * 1.05, errors


@pytest.mark.parametrize(
    ("tiles", "shape", "w_nk"),
    [
        (PingPongRSConfig(), (8192, 1024, 14336), False),  # 74 columns of 192 and one of 128
        # last waves narrowed (`pingpong.deal`): 288 cluster tiles on 66 clusters leave 24, run
        # as halves; 704 CTA tiles (22 columns, the last partial) on 132 CTAs leave 44
        (PingPongRSConfig(), (8192, 512, 1728), False),
        (PingPongRSConfig(cluster=None), (4096, 256, 4096), False),
        (PingPongRSConfig(), (2048, 512, 4160), True),
        (PingPongRSConfig(cluster=None, grid_minor_m=False), (1024, 512, 1792), False),
        (PingPongRSConfig(tile_n=160), (2048, 1024, 4000), True),  # 160-wide: w [n, K] only
        (PingPongRSConfig(tile_n=128, stages=6, grid_tile_width=4), (4096, 640, 2048), True),
        (PingPongRSConfig(stages=3), (256, 256, 192), False),  # one tile a CTA of one cluster
    ],
)
@pytest.mark.parametrize("op", ["rs", "ag"])
def test_pingpong_core(op, tiles, shape, w_nk):
    """The ping-pong kernels' GEMM core (one device: tiles stored, nothing zeroed or sent),
    partial last columns of tiles and narrowed last waves included, after a call on -x
    (`test_gemm_core`)."""
    x, w = _operands(*shape, seed=sum(shape) + 1)
    if op == "ag":
        tiles = PingPongAGConfig(**{f: v for f, v in vars(tiles).items() if f != "zero_ahead"})
    cfg = cg.OverlapConfig(method="pipeline", atomic_gemm=True, kernel=tiles)
    fn = fused.all_gather_matmul if op == "ag" else fused.matmul_reduce_scatter
    f = jax.jit(lambda a, b: fn(a, b, None, cfg, w_transposed=w_nk))
    stored = w.T.copy() if w_nk else w
    for sign in (-1, 1, -1, 1):
        out = f(sign * x, stored)
        assert out.shape == (shape[0], shape[2]) and out.dtype == jnp.bfloat16
        assert _rel_err(out, _ref(sign * x, w)) < 1e-2  # bf16 rounding of the result


@pytest.mark.parametrize(
    ("tiles", "shape"),
    [
        # 192 x 128 tiles in clusters of 384 rows: 42 whole cluster rows and one of 256
        (PingPongRSConfig(tile_m=192, tile_n=128), (16384, 512, 4096)),
        (PingPongRSConfig(), (8064, 512, 1728)),  # 31.5 cluster rows; a last wave halved
        (PingPongRSConfig(tile_m=192, tile_n=128, cluster=None), (1000, 256, 640)),
    ],
)
def test_pingpong_rs_core_partial_rows(tiles, shape):
    """The ping-pong RS kernel's core where M is not whole cluster tiles: the last row of tiles
    reads zeros past M and its stores clip, after a call on -x."""
    x, w = _operands(*shape, seed=sum(shape) + 2)
    cfg = cg.OverlapConfig(method="pipeline", atomic_gemm=True, kernel=tiles)
    f = jax.jit(lambda a, b: fused.matmul_reduce_scatter(a, b, None, cfg, w_transposed=False))
    for sign in (-1, 1):
        out = f(sign * x, w)
        assert out.shape == (shape[0], shape[2]) and out.dtype == jnp.bfloat16
        assert _rel_err(out, _ref(sign * x, w)) < 1e-2  # bf16 rounding of the result


def test_pingpong_rs_float8_core_partial_rows():
    """The float8 core (128-element K-steps, w [n, K], the scales in the epilogue) on 4000 rows:
    15 cluster rows of 256 and a partial one of 160 (what local_gemm "auto" takes: 2.4% of
    padding)."""
    config = cg.OverlapConfig(method="pipeline", atomic_gemm=True,
                              kernel=fused.float8_tiling(PingPongRSConfig(), 1024))  # fmt: skip
    f = jax.jit(lambda a, r: fused.matmul_reduce_scatter(a, r, None, config, w_transposed=True))
    _check_float8_core(f, *_operands(4000, 1024, 1536, seed=4000))


@pytest.mark.parametrize("n", [14336, 4160])
@pytest.mark.parametrize("family", [PingPongRSConfig, PingPongAGConfig])
def test_pingpong_float8_core(family, n):
    """The ping-pong kernels on float8 x and w [n, K] (128-element K-steps), the two scales
    applied in the epilogue, against the float32 product of the quantized operands (n = 14336:
    a last wave of 12 cluster tiles, run as halves)."""
    config = cg.OverlapConfig(method="pipeline", atomic_gemm=True,
                              kernel=fused.float8_tiling(family(), 1024))  # fmt: skip
    fn = fused.matmul_reduce_scatter if family is PingPongRSConfig else fused.all_gather_matmul
    f = jax.jit(lambda a, r: fn(a, r, None, config, w_transposed=True))
    _check_float8_core(f, *_operands(4096, 1024, n, seed=n))


@pytest.mark.parametrize(
    ("op", "spec", "shape"),
    [
        ("ag", "fused-direct-pp-cm-n128-s6", (8192, 4096, 1792)),
        ("rs", "fused-direct-pp-gm-cm-nt", (16384, 4096, 4096)),  # and its last wave halved
    ],
)
def test_clustered_pingpong_core_back_to_back(op, spec, shape):
    """64 calls of a clustered ping-pong core enqueued back to back, each equal to the
    reference: before the load warpgroup awaited the last slots' releases, a CTA could exit
    while its cluster peer still arrived on its barriers, and these calls failed to launch
    (CUDA_ERROR_LAUNCH_FAILED on an H200; BENCHMARKS.md)."""
    from commgemm.cli.specs import parse_fused

    x, w = _operands(*shape, seed=sum(shape))
    config = parse_fused(spec, op)
    fn = fused.all_gather_matmul if op == "ag" else fused.matmul_reduce_scatter
    f = jax.jit(lambda a, b: fn(a, b, None, config, w_transposed=False))
    outs = jax.block_until_ready([f(x, w) for _ in range(64)])
    ref = _ref(x, w)
    assert max(_rel_err(out, ref) for out in outs) < 1e-2  # bf16 rounding of the result


@pytest.mark.parametrize(
    "tiles",
    [None, (128, 2, 4), (64, 5, 1)],
    ids=["default", "steps-of-128", "band-1"],
)
@pytest.mark.parametrize(
    "sizes",
    [[1024], [100, 0, 300, 1, 500], [0, 0, 0], [7] * 40 + [400], [3, 61, 5, 900], [13] * 64],
    ids=["one", "uneven", "none", "tiny", "unaligned", "many-small"],
)
def test_grouped_weight_grad_against_ragged_dot(sizes, tiles):
    """commgemm's grouped dW kernel alone (`grouped_dw`): one group, empty groups, no rows at
    all, 40 seven-row groups inside one step, groups starting off whole 8s, 64 groups of 13
    rows, sums short of the rows; in steps of 64 and 128 rows and two bands. Against the float32
    transpose of the ragged dot; the rows past the sum hold NaN in x and inf in dy (they must
    contribute nothing)."""
    from commgemm.mosaic_gpu import grouped_dw
    from commgemm.mosaic_gpu.configs import PingPongTiles

    m, k, n = 1024, 256, 384
    tiling = tiles and PingPongTiles(tile_k=tiles[0], stages=tiles[1], band=tiles[2])
    sizes = jnp.asarray(sizes, jnp.int32)
    kx, kd = jax.random.split(jax.random.key(sizes.shape[0]), 2)
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    x = jnp.where(jnp.arange(m)[:, None] >= int(sizes.sum()), jnp.nan, x)
    dy = jax.random.normal(kd, (m, n), jnp.bfloat16)
    dy = jnp.where(jnp.arange(m)[:, None] >= int(sizes.sum()), jnp.inf, dy)
    got = jax.jit(lambda a, d, s: grouped_dw.weight_grad(a, d, s, tiling))(x, dy, sizes)
    assert got.dtype == x.dtype
    _check_grouped_dw(got, x.astype(jnp.float32), dy.astype(jnp.float32), sizes)


def _check_grouped_dw(got, x32, dy32, sizes) -> None:
    """got [G, K, N] against the float32 x_g^T @ dy_g of x32 [M, K] and dy32 [M, N] (rows past
    the groups' sum taken as zeros, whatever they hold), within 1.5e-2 of max |dW|."""
    m = x32.shape[0]
    owner = jnp.repeat(jnp.arange(sizes.shape[0]), sizes, total_repeat_length=m)
    inside = (jnp.arange(m) < int(sizes.sum()))[:, None]
    x32, dy32 = jnp.where(inside, x32, 0.0), jnp.where(inside, dy32, 0.0)
    one_hot = (owner[None, :] == jnp.arange(sizes.shape[0])[:, None]) & inside[:, 0][None]
    want = jnp.einsum("gm,mk,mn->gkn", one_hot.astype(jnp.float32), x32, dy32,
                      precision="highest")  # fmt: skip
    assert got.shape == want.shape
    scale = max(float(jnp.abs(want).max()), 1.0)  # no rows at all: dW is zero
    assert float(jnp.abs(got.astype(jnp.float32) - want).max()) <= 1.5e-2 * scale


@pytest.mark.parametrize("dtypes", [("e4m3", "e5m2"), ("e4m3", "e4m3")])
@pytest.mark.parametrize(
    "sizes",
    [[1024], [100, 0, 300, 1, 500], [0, 0, 0], [7] * 40 + [400], [3, 61, 5, 900], [13] * 64],
    ids=["one", "uneven", "none", "tiny", "unaligned", "many-small"],
)
def test_float8_grouped_weight_grad_against_ragged_dot(sizes, dtypes):
    """The float8 dW kernel (`grouped_dw.float8_weight_grad`): the shapes of the 16-bit test,
    x e4m3 and dy e5m2 (dX's cotangent format) or e4m3, their scales in the epilogue. Against
    the float32 product of the dequantized values; the rows past the sum hold NaN (they are
    never read)."""
    from commgemm.mosaic_gpu import grouped_dw

    m, k, n = 1024, 256, 384
    formats = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}
    sizes = jnp.asarray(sizes, jnp.int32)
    kx, kd = jax.random.split(jax.random.key(7 * sizes.shape[0]), 2)
    inside = (jnp.arange(m) < int(sizes.sum()))[:, None]
    x = jnp.where(inside, jax.random.normal(kx, (m, k)), jnp.nan).astype(formats[dtypes[0]])
    dy = jnp.where(inside, jax.random.normal(kd, (m, n)), jnp.nan).astype(formats[dtypes[1]])
    sx, sd = jnp.float32(0.5), jnp.float32(3.0)
    fn = jax.jit(grouped_dw.float8_weight_grad)
    got = fn(x, sx, dy, sd, sizes)
    assert got.dtype == jnp.bfloat16
    _check_grouped_dw(got, x.astype(jnp.float32) * sx, dy.astype(jnp.float32) * sd, sizes)
