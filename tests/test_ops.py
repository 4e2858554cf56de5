"""Every per-shard op x method x {bidirectional, not} x num_splits against a float64 reference."""

import itertools

import jax
import ml_dtypes
import numpy as np
import pytest
from helpers import (
    P,
    assert_close,
    config_id,
    configs,
    mesh1d,
    mesh2d,
    random,
    reference,
    shard,
)
from jax.sharding import NamedSharding

import commgemm as cg

AG, RS, AR = cg.Collective.ALL_GATHER, cg.Collective.REDUCE_SCATTER, cg.Collective.ALL_REDUCE
SIZES = (2, 4, 8)
# Per-device (m, K, n): even and uneven shapes (48, 80, 24 as in the issue).
SHAPES = ((16, 32, 8), (48, 80, 24))


def _cases(collective):
    return [
        pytest.param(size, shape, cfg, id=f"P{size}-{'x'.join(map(str, shape))}-{config_id(cfg)}")
        for size, shape, cfg in itertools.product(SIZES, SHAPES, configs(collective))
    ]


def run_all_gather_matmul(rng, size, shape, cfg, dtype=np.float32):
    m, k, n = shape
    x, w = random(rng, (size * m, k), dtype), random(rng, (k, size * n), dtype)
    f = shard(
        lambda a, b: cg.all_gather_matmul(a, b, "x", config=cfg),
        mesh1d(size),
        (P("x", None), P(None, "x")),
        P(None, "x"),
    )
    return f(x, w), reference(x, w), k


def run_k_sharded(op, rng, size, shape, cfg, dtype=np.float32):
    """x [M, K] and w [K, n] both sharded on K; M = size*m rows."""
    m, k, n = shape
    x, w = random(rng, (size * m, size * k), dtype), random(rng, (size * k, n), dtype)
    out_spec = P("x", None) if op is cg.matmul_reduce_scatter else P(None, None)
    f = shard(
        lambda a, b: op(a, b, "x", config=cfg),
        mesh1d(size),
        (P(None, "x"), P("x", None)),
        out_spec,
    )
    return f(x, w), reference(x, w), size * k


@pytest.mark.parametrize("size,shape,cfg", _cases(AG))
def test_all_gather_matmul(rng, size, shape, cfg):
    out, ref, k = run_all_gather_matmul(rng, size, shape, cfg)
    assert_close(out, ref, np.float32, k)


@pytest.mark.parametrize("size,shape,cfg", _cases(RS))
def test_matmul_reduce_scatter(rng, size, shape, cfg):
    if shape[0] % cfg.num_splits:
        pytest.skip("rows not divisible by num_splits")
    out, ref, k = run_k_sharded(cg.matmul_reduce_scatter, rng, size, shape, cfg)
    assert_close(out, ref, np.float32, k)


@pytest.mark.parametrize("size,shape,cfg", _cases(AR))
def test_matmul_all_reduce(rng, size, shape, cfg):
    out, ref, k = run_k_sharded(cg.matmul_all_reduce, rng, size, shape, cfg)
    assert_close(out, ref, np.float32, k)


BF16_CONFIGS = [
    cg.OverlapConfig(method="none"),
    cg.OverlapConfig(method="pipeline", num_splits=2),
    cg.OverlapConfig(method="ring_exchange", bidirectional=True, num_splits=2),
]


@pytest.mark.parametrize("cfg", BF16_CONFIGS, ids=config_id)
@pytest.mark.parametrize("size", (2, 8))
def test_bfloat16(rng, size, cfg):
    bf16 = ml_dtypes.bfloat16
    shape = (16, 64, 16)
    out, ref, k = run_all_gather_matmul(rng, size, shape, cfg, bf16)
    assert out.dtype == bf16
    assert_close(out, ref, bf16, k)
    for op in (cg.matmul_reduce_scatter, cg.matmul_all_reduce):
        out, ref, k = run_k_sharded(op, rng, size, shape, cfg, bf16)
        assert out.dtype == bf16
        assert_close(out, ref, bf16, k)


@pytest.mark.parametrize("op", [cg.all_gather_matmul, cg.matmul_reduce_scatter])
def test_auto_bfloat16_where_the_fused_kernels_tiles_divide(rng, op):
    """AUTO plans bf16 calls the Hopper kernels' tiles divide, on a mesh of every device, by
    asking whether the fused kernels would run: off a GPU that check must answer, not fail
    (it read the GPU's SM count from a CPU device), and the call runs a plan that is right."""
    bf16, size, shape = ml_dtypes.bfloat16, jax.device_count(), (256, 256, 256)
    auto = cg.OverlapConfig(method="auto")
    if op is cg.all_gather_matmul:
        out, ref, k = run_all_gather_matmul(rng, size, shape, auto, bf16)
    else:
        out, ref, k = run_k_sharded(op, rng, size, shape, auto, bf16)
    assert out.dtype == bf16
    assert_close(out, ref, bf16, k)


def test_out_dtype_and_float32_reduction(rng):
    """bf16 inputs, float32 out and float32 partial sums: float32-level error on bf16 inputs."""
    bf16 = ml_dtypes.bfloat16
    cfg = cg.OverlapConfig(method="ring_exchange", out_dtype="float32", reduce_dtype="float32")
    out, ref, k = run_k_sharded(cg.matmul_reduce_scatter, rng, 4, (8, 64, 8), cfg, bf16)
    assert out.dtype == np.float32
    assert_close(out, ref, np.float32, k)


@pytest.mark.parametrize(
    "cfg",
    [
        cg.OverlapConfig(),
        cg.OverlapConfig(method="ring_exchange", bidirectional=True, num_splits=2),
    ],
    ids=config_id,
)
def test_batch_dims_sequence_parallel(rng, cfg):
    """x [B, S, H] sharded on S: AG along axis 1 and RS back along axis 1."""
    size, b, s, h, f = 4, 3, 8, 16, 12
    x, w1 = random(rng, (b, size * s, h)), random(rng, (h, size * f))
    ag = shard(
        lambda a, w: cg.all_gather_matmul(a, w, "x", config=cfg, axis=1),
        mesh1d(size),
        (P(None, "x", None), P(None, "x")),
        P(None, None, "x"),
    )
    assert_close(ag(x, w1), reference(x, w1), np.float32, h)
    y, w2 = random(rng, (b, size * s, size * f)), random(rng, (size * f, h))
    rs = shard(
        lambda a, w: cg.matmul_reduce_scatter(a, w, "x", config=cfg, axis=1),
        mesh1d(size),
        (P(None, None, "x"), P("x", None)),
        P(None, "x", None),
    )
    assert_close(rs(y, w2), reference(y, w2), np.float32, size * f)


@pytest.mark.parametrize("op", ["ag", "rs", "ar"])
def test_transposed_operands(rng, op):
    """w given as [n, K] (the reference's rhs_transposed), x as [K, m] (lhs_transposed)."""
    size, cfg = 4, cg.OverlapConfig(method="ring_exchange")
    if op == "ag":
        x, w = random(rng, (32, size * 8)), random(rng, (size * 6, 32))  # x^T [K, P*m]; w^T
        f = shard(
            lambda a, b: cg.all_gather_matmul(
                a, b, "x", config=cfg, x_transposed=True, w_transposed=True
            ),
            mesh1d(size),
            (P(None, "x"), P("x", None)),
            P(None, "x"),
        )
        assert_close(f(x, w), reference(x.T, w.T), np.float32, 32)
    else:
        fn = cg.matmul_reduce_scatter if op == "rs" else cg.matmul_all_reduce
        x, w = random(rng, (size * 8, size * 4)), random(rng, (6, size * 4))
        f = shard(
            lambda a, b: fn(a, b, "x", config=cfg, w_transposed=True),
            mesh1d(size),
            (P(None, "x"), P(None, "x")),
            P("x" if op == "rs" else None, None),
        )
        assert_close(f(x, w), reference(x, w.T), np.float32, size * 4)


@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter", "all_reduce"])
def test_bulk_overlap(rng, collective):
    size = 4
    x, w, c = random(rng, (size * 8, 16)), random(rng, (16, 8)), random(rng, (size * 8, 6))
    out_c = {
        "all_gather": P(None, None),
        "reduce_scatter": P("x", None),
        "all_reduce": P(None, None),
    }[collective]
    in_c = P("x", None) if collective == "all_gather" else P(None, None)
    f = shard(
        lambda a, b, d: cg.bulk_overlap(a, b, d, "x", collective=collective),
        mesh1d(size),
        (P("x", None), P(None, None), in_c),
        (P("x", None), out_c),
    )
    out, comm = f(x, w, c)
    assert_close(out, reference(x, w), np.float32, 16)
    expected = c if collective == "all_gather" else size * c.astype(np.float64)
    np.testing.assert_allclose(np.asarray(comm), expected, rtol=1e-6, atol=1e-5)


def test_buffer_id_accepted(rng):
    cfg = cg.OverlapConfig(method="ring_exchange", bidirectional=True)
    buf = cg.create_overlap_buffer(cfg, tp_size=4)
    out, ref, k = run_all_gather_matmul(rng, 4, (8, 16, 8), buf)
    assert_close(out, ref, np.float32, k)


@pytest.mark.parametrize("method", ["none", "pipeline", "ring_exchange"])
def test_float64_operands_keep_float64(rng, method):
    """float64 operands under the default config (accumulate_dtype "float32") accumulate in
    float64: every op, the 2-D op, the bulk op and the global gemm agree with the float64
    reference to float64 rounding (1e-12), not float32's (~1e-7)."""
    size, cfg = 4, cg.OverlapConfig(method=method)
    tol = dict(rtol=1e-12, atol=1e-12)
    out, ref, _ = run_all_gather_matmul(rng, size, (8, 24, 8), cfg, np.float64)
    np.testing.assert_allclose(out, ref, **tol)
    for op in (cg.matmul_reduce_scatter, cg.matmul_all_reduce):
        out, ref, _ = run_k_sharded(op, rng, size, (8, 24, 8), cfg, np.float64)
        assert out.dtype == np.float64
        np.testing.assert_allclose(out, ref, **tol)
    x2, w2 = random(rng, (2 * 4, 4 * 6), np.float64), random(rng, (4 * 6, 10), np.float64)
    two = shard(
        lambda a, b: cg.matmul_2d(a, b, row_axis="x", k_axis="y", config=cfg),
        mesh2d(2, 4),
        (P("x", "y"), P("x", None)),
        P("x", None),
    )
    np.testing.assert_allclose(two(x2, w2), reference(x2, w2), **tol)
    x, w = random(rng, (size * 8, 24), np.float64), random(rng, (24, 10), np.float64)
    bulk = shard(
        lambda a, b, c: cg.bulk_overlap(a, b, c, "x", collective="all_gather"),
        mesh1d(size),
        (P("x", None), P(), P("x", None)),
        (P("x", None), P()),
    )
    np.testing.assert_allclose(bulk(x, w, x)[0], reference(x, w), **tol)
    xs = jax.device_put(x, NamedSharding(mesh1d(size), P("x", None)))
    ws = jax.device_put(w.repeat(size, 1), NamedSharding(mesh1d(size), P(None, "x")))
    got = cg.gemm(xs, ws, out_sharding=P(None, "x"), config=cfg)
    np.testing.assert_allclose(got, reference(x, w.repeat(size, 1)), **tol)
