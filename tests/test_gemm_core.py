"""OverlapConfig.local_gemm="mosaic": the split and serial methods multiply with the Hopper
GEMM kernel (`commgemm.mosaic_gpu.gemm_core`) where it can run; with "auto" (the default) only
their fast float8 GEMMs that the ping-pong kernel takes. On the CPU: the config and
the plan refuse what cannot work, every GEMM of a method that is whole tiles lowers (for CUDA)
to the kernel and the others to XLA's dot, and AUTO takes the choice from the tune cache.
Values on a Hopper GPU: tests/gpu/test_fp8_gpu.py."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import P, mesh1d

import commgemm as cg
from commgemm.autotune import auto, cache, tuner
from commgemm.cli.specs import parse_method
from commgemm.mosaic_gpu import gemm_core
from commgemm.mosaic_gpu import tiles as mosaic_tiles

pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
AG, RS = cg.Collective.ALL_GATHER, cg.Collective.REDUCE_SCATTER


@pytest.fixture
def hopper(monkeypatch):
    """As if this process drove Hopper GPUs (for planning and lowering only)."""
    monkeypatch.setattr(mosaic_tiles, "hopper_reason", lambda: None)
    monkeypatch.setattr(mosaic_tiles, "num_sms", lambda: 132)


def test_config_values():
    assert cg.OverlapConfig(method="ring_exchange", local_gemm="mosaic").local_gemm == "mosaic"
    with pytest.raises(ValueError, match="must be one of"):
        cg.OverlapConfig(local_gemm="cublas")
    with pytest.raises(ValueError, match="not fused"):
        cg.OverlapConfig(method="pipeline", atomic_gemm=True, local_gemm="mosaic")
    with pytest.raises(ValueError, match="tune cache chooses"):
        cg.OverlapConfig(method="auto", local_gemm="mosaic")


def test_plan_refuses_it_without_hopper(rng):
    x, w = rng.normal(size=(256, 128)).astype(np.float32), rng.normal(size=(128, 256))
    f = jax.shard_map(
        lambda a, b: cg.all_gather_matmul(a, b, "x", config=parse_method("none-mosaic")),
        mesh=mesh1d(2), in_specs=(P("x"), P(None, "x")), out_specs=P(None, "x"),
    )  # fmt: skip
    with pytest.raises(ValueError, match="local_gemm='mosaic'.*cannot run: it runs on GPUs"):
        f(x, w.astype(np.float32))


def _lowered(op, spec, shape, size=2, scaling=None, grad=False, check_vma=True):
    m, k, n = shape
    fn = {"ag": cg.all_gather_matmul, "rs": cg.matmul_reduce_scatter}[op]
    cfg = parse_method(spec, op)
    specs = (P("x"), P(None, "x")) if op == "ag" else (P(None, "x"), P("x"))
    out = P(None, "x") if op == "ag" else P("x")

    def body(a, b):
        return fn(a, b, "x", config=cfg, scaling=scaling)

    f = jax.shard_map(body, mesh=mesh1d(size), in_specs=specs, out_specs=out, check_vma=check_vma)
    if grad:
        forward = f
        f = jax.grad(lambda a, b: (forward(a, b).astype(jnp.float32) ** 2).sum(), (0, 1))
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((m, k), (k, n))]
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    kernels = sum("custom_call @mosaic_gpu" in line for line in text.splitlines())
    return kernels, text


@pytest.mark.parametrize(
    ("op", "spec", "kernels"),
    [
        ("ag", "none-mosaic", 1),
        ("ag", "pipeline:2-mosaic", 2),  # two chunks of 256 gathered rows
        ("ag", "ring-mosaic", 2),  # one GEMM a ring step
        ("rs", "none-mosaic", 1),
        ("rs", "ring:2-mosaic", 4),
        ("ag", "ring:4-mosaic", 0),  # chunks of 64 rows: not whole tiles, XLA's dot
    ],
)
@pytest.mark.parametrize("check_vma", [True, False])
def test_methods_lower_to_the_kernel(hopper, op, spec, kernels, check_vma):
    found, text = _lowered(op, spec, (512, 256, 1024), check_vma=check_vma)
    assert found == kernels
    assert ("dot_general" in text) == (kernels == 0)
    assert _lowered(op, spec.removesuffix("-mosaic"), (512, 256, 1024))[0] == 0


def test_float8_and_gradients_lower_to_the_kernel(hopper):
    """Tensor-scaled FP8: the forward GEMM (fast accumulation) is the float8 kernel; the
    backward's dX multiplies e5m2 dY by e4m3 W (two formats Mosaic GPU's wgmma does not mix)
    with split accumulation, so it stays on XLA."""
    found, text = _lowered("ag", "none-mosaic", (512, 256, 1024), scaling="current_tensor_scaling")
    calls = [line for line in text.splitlines() if "custom_call @mosaic_gpu" in line]
    assert found == 1 and calls[0].count("f8E4M3FN") >= 2
    for check_vma in (True, False):
        found, _ = _lowered("ag", "none-mosaic", (512, 256, 1024), grad=True, check_vma=check_vma)
        assert found == 2  # forward and dX (the RS of dY @ w^T); dW stays XLA's
    scaled = _lowered(
        "ag", "none-mosaic", (512, 256, 1024), scaling="current_tensor_scaling", grad=True
    )
    assert scaled[0] == 1  # the float8 forward only


@pytest.mark.parametrize(
    ("x_shape", "w_shape", "dtype", "split", "takes"),
    [
        ((512, 256), (1536, 256), jnp.float8_e4m3fn, False, True),  # eight 192-wide columns
        ((512, 256), (1536, 256), jnp.float8_e4m3fn, True, False),  # promoting: XLA's
        ((512, 256), (1024, 256), jnp.float8_e4m3fn, False, False),  # pads 12.5%: XLA's
        ((512, 256), (4096, 256), jnp.float8_e4m3fn, False, True),  # pads 3.1%: float8's 3.5%
        ((512, 256), (256, 4096), jnp.bfloat16, False, False),  # bf16: XLA's dot always
        ((384, 256), (1536, 256), jnp.float8_e4m3fn, False, False),  # rows of tiles pad 33%
        ((4000, 256), (1536, 256), jnp.float8_e4m3fn, False, True),  # they pad 2.4%
        ((512, 256), (256, 1536), jnp.bfloat16, False, False),  # bf16 stays on XLA's dot
    ],
)
def test_auto_takes_fast_float8_where_the_pingpong_kernel_fits(
    hopper, x_shape, w_shape, dtype, split, takes
):
    """local_gemm "auto" runs the kernel for a fast-accumulating tensor-scaled float8 GEMM the
    ping-pong kernel takes (w [n, K] here), XLA's dot for everything else; off a Hopper GPU,
    XLA's dot always."""
    x, w = _core_operands(x_shape, w_shape, dtype)
    if split:
        import dataclasses

        w = dataclasses.replace(w, split_accumulator=True)
    transposed = dtype != jnp.bfloat16
    assert gemm_core.auto_takes(x, w, transposed, "bfloat16") is takes


def test_auto_takes_nothing_off_hopper():
    x, w = _core_operands((512, 256), (1536, 256), jnp.float8_e4m3fn)
    assert gemm_core.auto_takes(x, w, True, "bfloat16") is False


@pytest.mark.parametrize("op", ["ag", "rs"])
@pytest.mark.parametrize("check_vma", [True, False])
def test_float8_forward_runs_the_kernel_by_default(hopper, op, check_vma):
    """A tensor-scaled op with the default local GEMM ("auto") multiplies its float8 forward on
    the kernel where the ping-pong kernel takes the shape (here 1536 columns: eight of 192),
    as "mosaic" does; "xla" keeps XLA's dot; a bf16 op stays on XLA's dot."""
    shape = (512, 256, 1536) if op == "ag" else (512, 512, 1536)
    scaling = "current_tensor_scaling"
    for spec, kernels in (("none", 1), ("none-xla", 0), ("none-mosaic", 1)):
        found, _ = _lowered(op, spec, shape, size=1, scaling=scaling, check_vma=check_vma)
        assert found == kernels, spec
    assert _lowered(op, "none", shape, size=1, check_vma=check_vma)[0] == 0


def test_gemm_reason(hopper):
    x, w = (
        jax.ShapeDtypeStruct((256, 128), jnp.bfloat16),
        jax.ShapeDtypeStruct((128, 512), jnp.bfloat16),
    )
    assert gemm_core.gemm_reason(x, w, False, "bfloat16") is None
    assert "N=128 must be divisible by the tile 256" in gemm_core.gemm_reason(
        x, w, True, "bfloat16"
    )
    assert "its result is bfloat16" in gemm_core.gemm_reason(x, w, False, "float32")
    # N whole 192s but not 256s (llama13b's 1728 and 3456) takes 128 x 192 tiles; 1088 neither
    for n, reason in ((1728, None), (3456, None), (1088, "N=1088 must be divisible by the tile")):
        w_n = jax.ShapeDtypeStruct((128, n), jnp.bfloat16)
        found = gemm_core.gemm_reason(x, w_n, False, "bfloat16")
        assert found is None if reason is None else reason in found
    assert gemm_core.tiling(1728, float8=True).cta_n == 192
    assert gemm_core.tiling(1792, float8=False) == gemm_core.TILES
    f32 = jax.ShapeDtypeStruct((256, 128), jnp.float32)
    assert "bf16 or fp16" in gemm_core.gemm_reason(f32, w, False, "float32")
    # float8: one format on both sides (dX's e5m2 dY against e4m3 W stays on XLA's dot)
    from commgemm.quantized_gemm import QuantizedRhs

    w8 = cg.ScaledTensor(jax.ShapeDtypeStruct((512, 128), jnp.float8_e4m3fn), jnp.ones(()))
    fast = QuantizedRhs(w8, jnp.ones(()), 128, "bfloat16", False)
    split = QuantizedRhs(w8, jnp.ones(()), 128, "bfloat16", True)
    e4m3 = jax.ShapeDtypeStruct((256, 128), jnp.float8_e4m3fn)
    e5m2 = jax.ShapeDtypeStruct((256, 128), jnp.float8_e5m2)
    assert gemm_core.gemm_reason(e4m3, fast, True, "bfloat16") is None
    assert "promoted FP8 GEMM is faster" in gemm_core.gemm_reason(e4m3, split, True, "bfloat16")
    assert "one float8 format" in gemm_core.gemm_reason(e5m2, fast, True, "bfloat16")


def _core_operands(x_shape, w_shape, dtype):
    """x and w of these shapes as gemm_core takes them (float8: w a QuantizedRhs)."""
    x = jax.ShapeDtypeStruct(x_shape, dtype)
    if dtype == jnp.bfloat16:
        return x, jax.ShapeDtypeStruct(w_shape, dtype)
    from commgemm.quantized_gemm import QuantizedRhs

    data = cg.ScaledTensor(jax.ShapeDtypeStruct(w_shape, dtype), jnp.ones(()))
    return x, QuantizedRhs(data, jnp.ones(()), x_shape[1], "bfloat16", False)


@pytest.mark.parametrize(
    ("x_shape", "w_shape", "dtype", "w_transposed", "kernel"),
    [
        ((512, 256), (256, 1536), jnp.bfloat16, False, "rs"),  # eight 192-wide columns
        ((512, 256), (1728, 256), jnp.bfloat16, True, "rs"),  # nine, w [n, K]
        ((512, 256), (256, 1024), jnp.bfloat16, False, "ag"),  # six columns pad 12.5%
        ((384, 256), (256, 1536), jnp.bfloat16, False, "ag"),  # 384 rows: not 256-row pairs
        ((512, 256), (256, 1000), jnp.bfloat16, False, None),  # neither kernel's N
        ((512, 256), (1536, 256), jnp.float8_e4m3fn, True, "rs"),  # 128-element K-steps
        ((512, 192), (1536, 192), jnp.float8_e4m3fn, True, None),  # K not whole 128s
        ((512, 256), (256, 1536), jnp.float8_e4m3fn, False, "rs"),  # w [K, n]: read [n, K]
    ],
)
def test_local_gemm_takes_the_pingpong_kernel_where_it_fits(
    hopper, monkeypatch, x_shape, w_shape, dtype, w_transposed, kernel
):
    """The local "mosaic" GEMM runs the ping-pong RS kernel ("rs") with no peers where
    `heuristics.pingpong_tiles` gives its tiling, the AG kernel's core ("ag") elsewhere, and
    neither (XLA's dot: `gemm_reason` says why) where neither takes the shape."""
    from commgemm.mosaic_gpu import PingPongRSConfig, fused

    x, w = _core_operands(x_shape, w_shape, dtype)
    reason = gemm_core.gemm_reason(x, w, w_transposed, "bfloat16")
    assert (reason is None) == (kernel is not None)
    if kernel is None:
        return
    called = []
    for name, op in (("all_gather_matmul", "ag"), ("matmul_reduce_scatter", "rs")):
        run = getattr(fused, name)
        monkeypatch.setattr(fused, name, lambda *a, _r=run, _op=op, **kw: (
            called.append((_op, a[3].kernel)), _r(*a, **kw))[1])  # fmt: skip
    f = jax.jit(lambda a, b: gemm_core.matmul(a, b, w_transposed))
    text = f.trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    assert "custom_call @mosaic_gpu" in text and [op for op, _ in called] == [kernel]
    assert isinstance(called[0][1], PingPongRSConfig) == (kernel == "rs")


def _cache_with(path, kind, spec, shape, size=2, scalings=(None,)):
    """A tune cache whose winner for AG `shape` is `spec`, under the plain key and those of
    `scalings` (quantized calls read their mode's key)."""
    entry = cache.PlanEntry(parse_method(spec, "ag"), 1.0, 1.0, "device periods", "")
    plans = {
        cache.plan_key(kind, size, "ag", shape, "bfloat16", scaling): entry.as_json()
        for scaling in scalings
    }
    path.write_text(json.dumps({"version": cache.VERSION, "plans": plans, "machines": {}}))


@pytest.mark.parametrize("spec", ["none-mosaic", "ring:2-mosaic", "ring:2", "none-xla"])
def test_auto_takes_the_local_gemm_from_the_tune_cache(tmp_path, monkeypatch, spec):
    """The tuner's measured winner decides; on a machine without the kernel the same plan runs
    on XLA's dot."""
    path = tmp_path / "tune.json"
    monkeypatch.setenv("COMMGEMM_TUNE_CACHE", str(path))
    cache._read_cached.cache_clear()
    x, w = (
        jax.ShapeDtypeStruct((256, 128), jnp.bfloat16),
        jax.ShapeDtypeStruct((128, 512), jnp.bfloat16),
    )
    _cache_with(path, jax.devices()[0].device_kind, spec, (512, 128, 1024))
    resolve = lambda: auto.resolve_auto(cg.OverlapConfig(method="auto"), AG, x, w, 2,  # noqa: E731
                                        w_transposed=False)  # fmt: skip
    here = resolve()
    plain = "xla" if spec.endswith("-xla") else "auto"  # "mosaic" becomes "auto" off Hopper
    assert here.local_gemm == plain
    assert here.replace(collective=None) == parse_method(spec).replace(local_gemm=plain)
    monkeypatch.setattr(mosaic_tiles, "hopper_reason", lambda: None)
    assert resolve().replace(collective=None) == parse_method(spec)


def test_tuner_measures_both_gemms_where_the_kernel_runs(monkeypatch):
    plain = tuner.default_candidates("rs", (2048, 1024, 1024), 2, "bfloat16")
    assert all(c.local_gemm == "auto" for c in plain)
    monkeypatch.setattr(mosaic_tiles, "hopper_reason", lambda: None)
    both = tuner.default_candidates("rs", (2048, 1024, 1024), 2, "bfloat16")
    split = [c for c in both if not c.atomic_gemm]
    assert {c.replace(local_gemm="auto") for c in split if c.local_gemm == "mosaic"} == {
        c for c in split if c.local_gemm == "auto"
    }
    assert any(c.local_gemm == "mosaic" for c in split)
    odd = tuner.default_candidates("rs", (2000, 1024, 1000), 2, "bfloat16")  # not whole tiles
    assert all(c.local_gemm == "auto" for c in odd)


def test_auto_keeps_a_promoting_forward_off_the_fused_kernels(hopper, tmp_path, monkeypatch):
    """AUTO's fused pick takes quantized operands when the recipe's forward accumulates fast
    (the default); a recipe that promotes the forward runs the split algorithm on XLA's
    promoted GEMM instead (the kernels' split form is slower). Asked for explicitly, the fused
    kernel runs its split form."""
    path = tmp_path / "tune.json"
    monkeypatch.setenv("COMMGEMM_TUNE_CACHE", str(path))
    cache._read_cached.cache_clear()
    shape, size = (1024, 128, 2048), 8  # the fused kernels span every device
    _cache_with(path, jax.devices()[0].device_kind, "fused-direct", shape, size,
                scalings=(None, "current_tensor_scaling"))  # fmt: skip
    promoted = cg.ScalingRecipe(split_accumulator=(True, True, True))
    for spec, scaling, kernels in [
        ("auto", None, 1),
        ("auto", "current_tensor_scaling", 1),
        ("auto", promoted, 0),
        ("fused-direct", promoted, 1),
    ]:
        assert _lowered("ag", spec, shape, size, scaling=scaling)[0] == kernels, (spec, scaling)


@pytest.mark.parametrize("scaling", [None, "current_tensor_scaling"])
def test_192_column_tiles_lower_to_the_kernel(hopper, scaling):
    """N / P = 1728 (whole 192s, not 256s): the serial path's GEMM runs the kernel in 128 x 192
    tiles, bf16 and float8, instead of falling back to XLA's dot."""
    found, text = _lowered("ag", "none-mosaic", (512, 256, 2 * 1728), scaling=scaling)
    assert found == 1 and "dot_general" not in text
