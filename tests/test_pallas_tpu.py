"""The Pallas TPU kernels in Pallas' TPU interpret mode on virtual CPU devices: ring
collectives and fused collective GEMMs against float64 references, race detection, the start
barrier shown necessary, gradients through the ops, the 2-D case, and plan-time errors.

Interpret mode needs one CPU device more than the kernel's mesh (see commgemm.pallas_tpu.ops):
rings of 2 and 4 run here on the suite's 8 devices; rings of 8 and the 2 x 4 mesh run in a
process of 9 devices (`test_eight_device_rings`)."""

import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import P, cpu_env, mesh1d, mesh2d, shard

import commgemm as cg
from commgemm.mosaic_gpu import RingAGConfig
from commgemm.pallas_tpu import gemm, ring
from commgemm.pallas_tpu.common import races_found, reset_race_state

pytest.importorskip("jax.experimental.pallas.tpu")

TPU = dict(atomic_gemm=True, interpret=True)
WORKER = pathlib.Path(__file__).with_name("tpu_worker.py")


@pytest.fixture(autouse=True)
def _fresh_interpreter():
    reset_race_state()
    yield


def _unchecked(fn, mesh, in_specs, out_specs):
    return jax.jit(
        jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    )


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("bidirectional", [False, True], ids=["one-way", "both-ways"])
def test_ring_all_gather(rng, size, bidirectional):
    x = rng.standard_normal((size * 24, 40)).astype(np.float32)
    f = _unchecked(
        lambda a: ring.all_gather(
            a, "x", bidirectional=bidirectional, interpret=True, race_check=True
        ),
        mesh1d(size),
        P("x"),
        P(),
    )
    np.testing.assert_array_equal(np.asarray(f(x)), x)
    assert not races_found()


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("op", ["reduce_scatter", "all_reduce"])
def test_ring_reduce_scatter_and_all_reduce(rng, size, op):
    x = rng.standard_normal((size * size * 8, 40)).astype(np.float32)  # each device [P*8, 40]
    want = x.astype(np.float64).reshape(size, size * 8, 40).sum(0)
    fn = getattr(ring, op)
    out_spec = P("x") if op == "reduce_scatter" else P()
    f = _unchecked(
        lambda a: fn(a, "x", interpret=True, race_check=True), mesh1d(size), P("x"), out_spec
    )
    np.testing.assert_allclose(np.asarray(f(x)), want, rtol=1e-5, atol=1e-5)
    assert not races_found()


#: The ring reduce-scatter without its start barrier, in a process of its own: a fast device
#: writes into a peer's receive slots while the peer is still setting them up. The interpreter
#: reports that as a race, or, when the peer has not allocated the slots yet, fails the
#: computation (and keeps failing every later interpret-mode call of that process).
RACY_RING = """
import jax, numpy as np
jax.config.update("jax_num_cpu_devices", 8)
from jax.sharding import Mesh, PartitionSpec as P
from commgemm.pallas_tpu import ring
from commgemm.pallas_tpu.common import races_found
mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
f = jax.jit(jax.shard_map(
    lambda a: ring.reduce_scatter(a, "x", interpret=True, race_check=True, with_barrier=False),
    mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
x = np.random.default_rng(SEED).standard_normal((4 * 4 * 8, 128)).astype(np.float32)
try:
    jax.block_until_ready(f(x))
    print("VERDICT race" if races_found() else "VERDICT none")
except Exception as err:  # the peer's slots did not exist yet: the race, seen as a failure
    print("VERDICT failed", type(err).__name__)
"""


def test_barrier_prevents_a_race(rng):
    """With the start barrier the interpreter's race detector reports nothing; without it
    (in its own process, RACY_RING) it reports a race or the computation fails."""
    x = rng.standard_normal((4 * 4 * 8, 128)).astype(np.float32)
    f = _unchecked(
        lambda a: ring.reduce_scatter(a, "x", interpret=True, race_check=True, with_barrier=True),
        mesh1d(4),
        P("x"),
        P("x"),
    )
    jax.block_until_ready(f(x))
    assert not races_found()
    env = cpu_env()
    script = RACY_RING.replace("SEED", str(int(rng.integers(1 << 30))))
    root = pathlib.Path(__file__).parent.parent
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300, cwd=root)  # fmt: skip
    verdict = [ln for ln in done.stdout.splitlines() if ln.startswith("VERDICT ")]
    assert verdict, done.stderr[-3000:]
    assert verdict[0] == "VERDICT race" or verdict[0].startswith("VERDICT failed"), verdict


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("direct", [False, True], ids=["ring", "direct"])
def test_fused_kernels_report_no_race(rng, size, direct):
    m, k, n = 16, 64, 128
    x, w = rng.standard_normal((size * m, k)), rng.standard_normal((k, size * n))
    x, w = x.astype(np.float32), w.astype(np.float32)
    tiles = gemm.Tiles(8, 128)
    ag = _unchecked(
        lambda a, b: gemm.all_gather_matmul(
            a, b, "x", tiles, direct=direct, interpret=True, race_check=True
        )[0],
        mesh1d(size),
        (P("x"), P(None, "x")),
        P(None, "x"),
    )
    np.testing.assert_allclose(np.asarray(ag(x, w)), x @ w, rtol=1e-4, atol=1e-4)
    xr, wr = rng.standard_normal((size * m, size * k)), rng.standard_normal((size * k, n))
    xr, wr = xr.astype(np.float32), wr.astype(np.float32)
    rs = _unchecked(
        lambda a, b: gemm.matmul_reduce_scatter(
            a, b, "x", tiles, direct=direct, interpret=True, race_check=True
        ),
        mesh1d(size),
        (P(None, "x"), P("x")),
        P("x"),
    )
    np.testing.assert_allclose(np.asarray(rs(xr, wr)), xr @ wr, rtol=1e-4, atol=1e-4)
    assert not races_found()


OPS = {
    "ag": (cg.all_gather_matmul, P("x", None), P(None, "x"), P(None, "x")),
    "rs": (cg.matmul_reduce_scatter, P(None, "x"), P("x", None), P("x", None)),
}


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("method", ["ring_exchange", "pipeline"])
@pytest.mark.parametrize("shape", [(16, 64, 128), (24, 40, 96)], ids=["even", "uneven"])
def test_ops_values_and_gradients(rng, size, op, method, shape):
    """The ops with the TPU kernels (interpreted), under shard_map's default check_vma: the
    float64 reference's values and gradients; the backward runs the same kernels (AG <-> RS)."""
    fn, xs, ws, os = OPS[op]
    m, k, n = shape
    if op == "ag":
        x, w = rng.standard_normal((size * m, k)), rng.standard_normal((k, size * n))
    else:
        x, w = rng.standard_normal((size * m, size * k)), rng.standard_normal((size * k, n))
    x, w = x.astype(np.float32), w.astype(np.float32)
    cfg = cg.OverlapConfig(method=method, **TPU)
    f = shard(lambda a, b: fn(a, b, "x", config=cfg), mesh1d(size), (xs, ws), os)
    np.testing.assert_allclose(np.asarray(f(x, w)), x.astype(np.float64) @ w, rtol=2e-4, atol=2e-4)
    got = jax.jit(jax.grad(lambda a, b: jnp.sum(jnp.sin(f(a, b))), (0, 1)))(x, w)
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    want = jax.grad(lambda a, b: jnp.sum(jnp.sin(a @ b)), (0, 1))(x64, w64)
    for g, r in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("method", ["ring_exchange", "pipeline"])
def test_notebook_2d_case(rng, method):
    """x P('x','y') @ w P('x', None) -> P('x', None) on a 2 x 2 mesh, the K reduction by the TPU
    GEMM + reduce-scatter kernel along 'y'."""
    x = rng.standard_normal((2 * 16, 2 * 64)).astype(np.float32)
    w = rng.standard_normal((2 * 64, 128)).astype(np.float32)
    cfg = cg.OverlapConfig(method=method, **TPU)
    f = shard(
        lambda a, b: cg.matmul_2d(a, b, row_axis="x", k_axis="y", config=cfg),
        mesh2d(2, 2),
        (P("x", "y"), P("x", None)),
        P("x", None),
    )
    np.testing.assert_allclose(np.asarray(f(x, w)), x.astype(np.float64) @ w, rtol=2e-4, atol=2e-4)


def test_auto_picks_a_tpu_kernel_when_interpreting(rng):
    from commgemm.autotune.auto import resolve_auto

    sds = jax.ShapeDtypeStruct
    cfg = cg.OverlapConfig(method="auto", interpret=True)
    x, w = sds((128, 256), jnp.float32), sds((256, 128), jnp.float32)
    chosen = resolve_auto(cfg, cg.Collective.ALL_GATHER, x, w, 4, w_transposed=False)
    assert chosen.atomic_gemm and chosen.interpret and chosen.kernel is None


@pytest.mark.parametrize(
    "changes,why",
    [
        (dict(out_dtype="bfloat16"), "out_dtype=bfloat16 differs"),
        (dict(num_splits=2), "num_splits, bidirectional and aggregate"),
        (dict(kernel=RingAGConfig()), "configures the Hopper kernels"),
    ],
    ids=["out_dtype", "num_splits", "hopper-config"],
)
def test_plan_errors(rng, changes, why):
    cfg = cg.OverlapConfig(method="ring_exchange", **TPU).replace(**changes)
    x, w = rng.standard_normal((32, 64)).astype(np.float32), np.ones((64, 512), np.float32)
    f = shard(lambda a, b: cg.all_gather_matmul(a, b, "x", config=cfg), mesh1d(4),
              (P("x", None), P(None, "x")), P(None, "x"))  # fmt: skip
    with pytest.raises(ValueError, match=why):
        f(x, w)
    with pytest.raises(ValueError, match="interpret=True needs atomic_gemm=True"):
        cg.OverlapConfig(method="ring_exchange", interpret=True)


def test_vmem_budget_refuses_too_large_blocks():
    from commgemm.pallas_tpu.ops import unsupported_reason

    sds = jax.ShapeDtypeStruct
    cfg = cg.OverlapConfig(method="ring_exchange", **TPU)
    big = sds((8, 1 << 20), jnp.float32), sds((1 << 20, 128), jnp.float32)  # K of a million
    reason = unsupported_reason(cg.Collective.ALL_GATHER, *big, 4, cfg, w_transposed=False)
    assert "fits the 16 MiB VMEM budget" in reason


def test_eight_device_rings(rng):
    """Rings of 8 and the 2 x 4 mesh, in a process of 9 CPU devices (the interpreter's spare)."""
    env = cpu_env()
    done = subprocess.run(
        [sys.executable, str(WORKER), str(int(rng.integers(1 << 30)))],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=pathlib.Path(__file__).parent.parent,
    )
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert line, done.stderr[-3000:]
    results = json.loads(line[0].removeprefix("RESULTS "))
    assert all(results.values()), results
    assert len(results) == 11


@pytest.mark.parametrize("op", list(OPS))
def test_bfloat16_operands(rng, op):
    """bf16 operands and output, float32 accumulation: within bf16 rounding of the float64
    reference (|error| <= 2e-2 max|reference|, partial sums also rounded on the way)."""
    fn, xs, ws, os = OPS[op]
    size, (m, k, n) = 4, (16, 64, 128)
    shape_x, shape_w = (
        ((size * m, k), (k, size * n)) if op == "ag" else ((size * m, size * k), (size * k, n))
    )
    x = rng.standard_normal(shape_x).astype(jnp.bfloat16)
    w = rng.standard_normal(shape_w).astype(jnp.bfloat16)
    cfg = cg.OverlapConfig(method="ring_exchange", **TPU)
    f = shard(lambda a, b: fn(a, b, "x", config=cfg), mesh1d(size), (xs, ws), os)
    out = f(x, w)
    assert out.dtype == jnp.bfloat16
    ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    assert np.abs(np.asarray(out, np.float64) - ref).max() <= 2e-2 * np.abs(ref).max()


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("direct", [False, True], ids=["ring", "direct"])
def test_float8_kernels(rng, size, direct):
    """The kernels on float8 operands (x e4m3 or e5m2 against w e4m3) and a scale: the scaled
    float64 product of the float8 values, in the asked dtype; AG gathers the float8 rows
    themselves, bit for bit; no race."""
    m, k, n = 16, 64, 128
    tiles, scale = gemm.Tiles(8, 128), np.float32(0.37)
    for x_dtype in (jnp.float8_e4m3fn, jnp.float8_e5m2):
        x = jnp.asarray(rng.standard_normal((size * m, size * k)), x_dtype)
        w = jnp.asarray(rng.standard_normal((size * k, size * n)), jnp.float8_e4m3fn)
        x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
        ag = _unchecked(
            lambda a, b: gemm.all_gather_matmul(a, b, "x", tiles, direct=direct, interpret=True,
                                                race_check=True, scale=scale, out_dtype="float32"),
            mesh1d(size), (P("x"), P(None, "x")), (P(None, "x"), P()),
        )  # fmt: skip
        out, gathered = ag(x[:, :k], w[:k])
        assert out.dtype == np.float32 and gathered.dtype == x_dtype
        np.testing.assert_array_equal(np.asarray(gathered).view(np.uint8),
                                      np.asarray(x[:, :k]).view(np.uint8))  # fmt: skip
        np.testing.assert_allclose(out, scale * (x64[:, :k] @ w64[:k]), rtol=1e-5, atol=1e-4)
        rs = _unchecked(
            lambda a, b: gemm.matmul_reduce_scatter(a, b, "x", tiles, direct=direct,
                                                    interpret=True, race_check=True,
                                                    scale=scale, out_dtype="float32"),
            mesh1d(size), (P(None, "x"), P("x")), P("x"),
        )  # fmt: skip
        out = rs(x, w[:, :n])
        assert out.dtype == np.float32
        np.testing.assert_allclose(out, scale * (x64 @ w64[:, :n]), rtol=1e-5, atol=1e-4)
    assert not races_found()


def _block_operands(rng, mode, x_shape, w_shape):
    """x's payload rows and w's kernel operands (float8 values [K, n], float32 block scales
    [K / block, n]) under block mode `mode`, with their float64 dequantized values."""
    from commgemm import quantized_gemm

    qx = cg.quantize(jnp.asarray(rng.standard_normal(x_shape), jnp.float32), mode)
    qw = cg.quantize(jnp.asarray(rng.standard_normal(w_shape), jnp.float32), mode, axis=0)
    nvfp4 = qx.mode is cg.ScalingMode.NVFP4_1D_SCALING
    blocks = gemm.Blocks(16 if nvfp4 else 32, "float8_e4m3fn" if nvfp4 else "float8_e8m0fnu")
    x64 = np.asarray(quantized_gemm.block_values(qx, jnp.float32), np.float64)
    w64 = np.asarray(quantized_gemm.block_values(qw, jnp.float32), np.float64)
    w_operands = (qw.data.astype(jnp.float8_e4m3fn), qw.scale_inv.astype(jnp.float32).T)
    return quantized_gemm.payload(qx), w_operands, blocks, x64, w64


@pytest.mark.parametrize(
    ("direct", "mode"), [(False, "mxfp8_1d_scaling"), (True, "nvfp4_1d_scaling")]
)
def test_block_scaled_kernels(rng, direct, mode):
    """The kernels on block-scaled operands: x's payload rows (values and block scales as
    bytes) gathered bit for bit, each tile dequantized per block in VMEM: the float64 product
    of the dequantized values times `scale`; RS likewise; no race."""
    size, m, k, n = 2, 16, 64, 128
    tiles, scale = gemm.Tiles(8, 128), np.float32(0.37)
    rows, (w8, ws), blocks, x64, w64 = _block_operands(rng, mode, (size * m, k), (k, size * n))
    kw = dict(direct=direct, interpret=True, race_check=True, scale=scale, out_dtype="float32",
              blocks=blocks)  # fmt: skip
    ag = _unchecked(
        lambda a, b, c: gemm.all_gather_matmul(a, b, "x", tiles, w_scales=c, **kw),
        mesh1d(size), (P("x"), P(None, "x"), P(None, "x")), (P(None, "x"), P()),
    )  # fmt: skip
    out, gathered = ag(rows, w8, ws)
    assert gathered.dtype == np.uint8 and gathered.shape == rows.shape
    np.testing.assert_array_equal(np.asarray(gathered), np.asarray(rows))
    want = scale * (x64 @ w64)  # float32 accumulation: within 1e-5 of the largest result
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    rows, (w8, ws), blocks, x64, w64 = _block_operands(rng, mode, (size * m, size * k),
                                                        (size * k, n))  # fmt: skip
    block_cols = rows.shape[1] // size  # each device's K values and their scales, as bytes
    local = np.concatenate([np.asarray(rows)[:, :size * k].reshape(size * m, size, k),
                            np.asarray(rows)[:, size * k:].reshape(size * m, size, -1)],
                           axis=2).reshape(size * m, size * block_cols)  # fmt: skip
    rs = _unchecked(
        lambda a, b, c: gemm.matmul_reduce_scatter(a, b, "x", tiles, w_scales=c, **kw),
        mesh1d(size), (P(None, "x"), P("x"), P("x")), P("x"),
    )  # fmt: skip
    want = scale * (x64 @ w64)
    np.testing.assert_allclose(rs(local, w8, ws), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert not races_found()


def test_tpu_block_operands_come_in_pairs():
    """The TPU kernels' block format and w's block scales are given together or not at all."""
    x, w = jnp.zeros((64, 66), jnp.uint8), jnp.zeros((64, 128), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="need both blocks= and w_scales="):
        gemm._operands(x, w, jnp.ones((1,)), None, gemm.Blocks(32, "float8_e8m0fnu"))
    with pytest.raises(ValueError, match="need both blocks= and w_scales="):
        gemm._operands(x, w, jnp.ones((1,)), jnp.ones((2, 128)), None)


@pytest.mark.parametrize(
    ("op", "direct", "operands", "x64"),
    [(op, direct, "bf16", False) for op in ("ag", "rs") for direct in (False, True)]
    + [("ag", False, "float8", True), ("rs", True, "float8", False),
       ("ag", True, "mxfp8", False), ("rs", False, "mxfp8", True),
       ("ag", False, "nvfp4", False), ("rs", True, "nvfp4", True)],
)  # fmt: skip
def test_kernels_lower_for_a_tpu(op, direct, operands, x64):
    """The kernels lower to Mosaic TPU for a TPU target (Pallas' TPU lowering, here on the CPU:
    what breaks before a kernel reaches a TPU), on 4 devices, 16-bit, float8 and block-scaled
    operands, with jax's default 32-bit types and with x64 on. Mosaic's own TPU compiler does
    not run here."""
    size, m, k, n = 4, 256, 256, 512
    tiles = gemm.Tiles(128, 256)
    sds = jax.ShapeDtypeStruct
    block = {"mxfp8": (32, "float8_e8m0fnu"), "nvfp4": (16, "float8_e4m3fn")}.get(operands)
    kw = dict(direct=direct, out_dtype="bfloat16")
    if operands == "bf16":
        x_dtype = w_dtype = jnp.bfloat16
    elif operands == "float8":
        x_dtype = w_dtype = jnp.float8_e4m3fn
        kw["scale"] = jnp.ones((1,), jnp.float32)
    else:
        x_dtype, w_dtype = jnp.uint8, jnp.float8_e4m3fn
        kw["blocks"] = gemm.Blocks(*block)
    width = k + k // block[0] if block else k  # a payload row's bytes
    if op == "ag":
        fn, specs, out = gemm.all_gather_matmul, (P("x"), P(None, "x")), (P(None, "x"), P("x"))
        x, w, ws = (size * m, width), (k, size * n), (k // 32, size * n)
    else:
        fn, specs, out = gemm.matmul_reduce_scatter, (P(None, "x"), P("x")), P("x")
        x, w, ws = (size * m, size * width), (size * k, n), (size * k // 32, n)
    args = [sds(x, x_dtype), sds(w, w_dtype)]
    if block:
        ws = (ws[0] * 32 // block[0], ws[1])
        args.append(sds(ws, jnp.float32))
        specs = (*specs, specs[1])
    body = lambda a, b, *c: fn(a, b, "x", tiles, w_scales=c[0] if c else None, **kw)  # noqa: E731
    f = _unchecked(body, mesh1d(size), specs, out)
    with jax.enable_x64(x64):
        text = f.trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    assert text.count("tpu_custom_call") == 1


@pytest.mark.parametrize(
    ("size", "op", "method", "mode"),
    [(size, op, method, mode) for size in (2, 4) for op in OPS
     for method in ("ring_exchange", "pipeline") for mode in ("current_tensor_scaling",)]
    + [(2, "ag", "ring_exchange", "mxfp8_1d_scaling"), (2, "ag", "pipeline", "nvfp4_1d_scaling"),
       (2, "rs", "ring_exchange", "nvfp4_1d_scaling"), (2, "rs", "pipeline", "mxfp8_1d_scaling")],
    # every op x method, both block modes
)  # fmt: skip
def test_quantized_ops(rng, size, op, method, mode):
    """The ops with scaling= on the TPU kernels, tensor and block modes: the float64 product of
    the same quantized operands, and the straight-through gradients from the same kernels
    (AG <-> RS; dY quantized to e5m2, or in the block mode's format with W again along N), to
    float32 accumulation (block tiles are dequantized exactly in VMEM)."""
    from test_scaled import ATOL, RTOL, _dq

    fn, xs, ws, os = OPS[op]
    m, k, n = 8, 64, 128
    if op == "ag":
        x, w = rng.standard_normal((size * m, k)), rng.standard_normal((k, size * n))
    else:
        x, w = rng.standard_normal((size * m, size * k)), rng.standard_normal((size * k, n))
    x, w = x.astype(np.float32), w.astype(np.float32)
    cfg = cg.OverlapConfig(method=method, **TPU)
    f = shard(lambda a, b: fn(a, b, "x", config=cfg, scaling=mode), mesh1d(size), (xs, ws), os)
    y, vjp = jax.vjp(f, x, w)
    qx, qw = _dq(x, mode, -1), _dq(w, mode, 0)
    np.testing.assert_allclose(y, qx @ qw, rtol=RTOL, atol=ATOL * np.sqrt(x.shape[1]))
    g = rng.standard_normal(y.shape).astype(np.float32)
    dx, dw = jax.jit(vjp)(g)
    tensor = mode == "current_tensor_scaling"
    g_dtype = jnp.float8_e5m2 if tensor else jnp.float8_e4m3fn
    qg = np.asarray(cg.dequantize(cg.quantize(jnp.asarray(g), mode, dtype=g_dtype), jnp.float64))
    w_dgrad = qw if tensor else _dq(w, mode, 1)
    for got, want, depth in ((dx, qg @ w_dgrad.T, w.shape[1]), (dw, qx.T @ qg, x.shape[0])):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL * np.sqrt(depth))


def test_quantized_2d_case_and_choices(rng):
    """matmul_2d with scaling= on the TPU kernels (x and W's K block quantized, the fused GEMM +
    reduce-scatter on float8); AUTO's TPU kernel pick gives way to the XLA methods for
    quantized operands (not run on TPU hardware)."""
    from test_scaled import ATOL, RTOL, _dq

    from commgemm.plan import _quantized_config

    mode = "current_tensor_scaling"
    x = rng.standard_normal((2 * 16, 2 * 64)).astype(np.float32)
    w = rng.standard_normal((2 * 64, 128)).astype(np.float32)
    cfg = cg.OverlapConfig(method="ring_exchange", **TPU)
    f = shard(
        lambda a, b: cg.matmul_2d(a, b, row_axis="x", k_axis="y", config=cfg, scaling=mode),
        mesh2d(2, 2),
        (P("x", "y"), P("x", None)),
        P("x", None),
    )
    want = _dq(x, mode, -1) @ _dq(w, mode, 0)
    np.testing.assert_allclose(f(x, w), want, rtol=RTOL, atol=ATOL * np.sqrt(x.shape[1]))
    recipe, auto = cg.ScalingRecipe(mode), cg.OverlapConfig(method="auto", interpret=True)
    assert not _quantized_config(cfg, recipe, auto).atomic_gemm
    assert _quantized_config(cfg, recipe, cfg).atomic_gemm
    ag = shard(lambda a, b: cg.all_gather_matmul(a, b, "x", config=auto, scaling=mode),
               mesh1d(2), (P("x", None), P(None, "x")), P(None, "x"))  # fmt: skip
    np.testing.assert_allclose(ag(x, w), want, rtol=RTOL, atol=ATOL * np.sqrt(x.shape[1]))
