"""The backward pass of a fused Hopper op runs the other collective's fused kernel: the plan
(`mosaic_gpu.fused.backward_config`), the gathered rows the AG kernel returns for dW, and the
lowered program (CUDA target, on the CPU: one Mosaic GPU kernel forward, one backward, no XLA
collective for dX). tests/gpu checks the values on Hopper GPUs."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import P, mesh1d

import commgemm as cg
from commgemm.autodiff import fused_backward_config
from commgemm.autotune import costmodel
from commgemm.cli.specs import parse_method
from commgemm.config import Collective, Method
from commgemm.mosaic_gpu import direct_ag
from commgemm.mosaic_gpu import tiles as mosaic_tiles
from commgemm.mosaic_gpu.configs import DirectAGConfig, DirectRSConfig

pytest.importorskip("jax.experimental.pallas.mosaic_gpu")

#: dY's float8 format in the float8 lowering tests: e5m2 (the default recipe's) where Mosaic GPU
#: takes e5m2 x e4m3 wgmma (jax >= 0.11), else e4m3.
DY_FLOAT8 = "float8_e5m2" if jax.__version_info__ >= (0, 11) else "float8_e4m3fn"


@pytest.fixture
def hopper(monkeypatch):
    """The plan as it sees a Hopper GPU: CPU devices have no SM count or compute capability."""
    monkeypatch.setattr(mosaic_tiles, "num_sms", lambda: 132)
    monkeypatch.setattr(mosaic_tiles, "hopper_reason", lambda: None)


@pytest.mark.parametrize("size", [2, 4, 8])
def test_gathered_rows_are_in_device_order(size):
    """The inbox's slot j holds the rows of device (d - j - 1) mod P; `gathered_rows` puts them
    and the own rows back in device order, equal to all_gather(x)."""
    m, k = 3, 5
    x = jnp.asarray(np.random.default_rng().standard_normal((size * m, k)))

    def body(x):
        everyone = jax.lax.all_gather(x, "x")  # [P, m, K]
        d = jax.lax.axis_index("x")
        inbox = jnp.stack([everyone[(d - j - 1) % size] for j in range(size - 1)])
        return direct_ag.gathered_rows(x, inbox, "x") - everyone.reshape(size * m, k)

    f = jax.shard_map(body, mesh=mesh1d(size), in_specs=P("x", None), out_specs=P("x"))
    diff = jax.jit(f)(x)
    np.testing.assert_array_equal(diff, 0)


def _plan(
    op: str, spec: str, size: int, rows: int, k: int, n: int, *, w_transposed=False,
    planner=fused_backward_config,
):  # fmt: skip
    """`planner` (default fused_backward_config) for a forward `op` of config `spec` on x
    [rows, K] (local view), w [K, n] local, inside shard_map over `size` devices."""
    cfg = parse_method(spec, op)
    collective = Collective.ALL_GATHER if op == "ag" else Collective.REDUCE_SCATTER
    out_rows = rows * size if op == "ag" else rows // size
    w = jnp.zeros((n, k) if w_transposed else (k, n), jnp.bfloat16)
    dy = jnp.zeros((out_rows, n), jnp.bfloat16)
    planned = []

    def body(x):
        planned.append(planner(collective, cfg, x, dy, w, "x", w_transposed))
        return x

    jax.shard_map(body, mesh=mesh1d(size), in_specs=P("x"), out_specs=P("x"))(
        jnp.zeros((rows * size, k), jnp.bfloat16)
    )
    return planned[0]


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("op", ["ag", "rs"])
@pytest.mark.parametrize("spec", ["fused", "fused-direct"])
def test_backward_runs_the_other_fused_kernel(spec, op, size, hopper, monkeypatch):
    """dX of an AG forward on the RS kernel of its family, of an RS forward on the AG kernel
    (on more than 2 GPUs the ring AG); in dY's dtype, the direct ones in the cost model's
    tiling of dY's shape."""
    monkeypatch.setattr(jax, "device_count", lambda: size)
    back = _plan(op, spec, size, 1024, 512, 1024)
    assert back.atomic_gemm and back.collective is None and back.out_dtype == "bfloat16"
    if op == "rs" and size > 2:  # dX's AG on the ring kernel on more than 2 GPUs
        assert back.method is Method.RING_EXCHANGE and back.kernel is None
    else:
        assert back.method is parse_method(spec, op).method
    if back.method is Method.PIPELINE:  # the cost model's tiling of the dX problem's kernel
        assert isinstance(back.kernel, DirectRSConfig if op == "ag" else DirectAGConfig)


def test_dx_all_gather_on_four_gpus_takes_the_direct_kernel_where_the_ring_cannot(
    hopper, monkeypatch
):
    """dX of an RS forward gathers dY into 384 columns a device: not whole 256-column tiles
    (the ring's), whole 192s (the direct AG plan's), so the direct kernel runs it."""
    monkeypatch.setattr(jax, "device_count", lambda: 4)
    back = _plan("rs", "fused-direct", 4, 4096, 384, 1024)
    assert back.atomic_gemm and back.method is Method.PIPELINE
    assert back.kernel.cta_n == 192


def test_backward_falls_back_to_the_cost_models_xla_plan_where_the_kernel_cannot_run(
    hopper, monkeypatch
):
    """dX of an AG forward reduce-scatters dY's rows [P*m, n] over K = 320 columns: not whole
    256-column tiles of the cooperative RS kernel, and two 192-wide columns of the ping-pong
    one would pad 20% of them (`heuristics.PINGPONG_PAD`), so dX runs the XLA method the cost
    model picks for its own shape (here, a CPU with no measured margins: the model's pick as
    it is); off a Hopper GPU (no monkeypatch) likewise."""
    monkeypatch.setattr(jax, "device_count", lambda: 2)
    back = _plan("ag", "fused-direct", 2, 1024, 320, 1024)
    # dX: dY [2 x 1024, 1024] @ W^T [1024, 320] reduce-scattered over 2: M, K, N 2048, 2048, 320
    fig = costmodel.default_figures("cpu")
    want, _ = costmodel.choose(Collective.REDUCE_SCATTER, (2048, 2048, 320), 2048, 2, 2, fig,
                               backend="cpu")  # fmt: skip
    assert not back.atomic_gemm and back.kernel is None
    assert (back.method, back.num_splits, back.bidirectional) == (
        want.method, want.num_splits, want.bidirectional
    )  # fmt: skip
    monkeypatch.undo()
    back = _plan("rs", "fused", 2, 1024, 512, 1024)
    # dX: dY [512, 1024] gathered over 2, @ W^T [1024, 512]: M, K, N 1024, 1024, 1024
    want, _ = costmodel.choose(Collective.ALL_GATHER, (1024, 1024, 1024), 512, 2, 2, fig,
                               backend="cpu")  # fmt: skip
    assert not back.atomic_gemm and (back.method, back.num_splits) == (
        want.method, want.num_splits
    )  # fmt: skip


@pytest.mark.parametrize("size", [2, 4])
def test_fused_forwards_dx_off_the_kernels_is_serial_on_gpus(monkeypatch, size):
    """Where dX cannot run a fused kernel (here: off a Hopper GPU), a GPU runs it serial even
    where the cost model alone predicts a split ring faster (comm_heavy's AG shape as dX of an
    RS forward): the split rings ran 0.995x to 1.22x serial's time on 2 GPUs and up to 1.66x
    on 4 (`AUTO_MARGINS`)."""
    rows, n, k_local = 16384, 8192, 4096 // size
    alone, _ = costmodel.choose(Collective.ALL_GATHER, (rows, n, 4096), rows // size, size, 2,
                                costmodel.default_figures("gpu"))  # fmt: skip
    assert alone.method is not Method.NONE  # what the model alone would run
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    back = _plan("rs", "fused", size, rows, k_local, n)
    assert back.method is Method.NONE and not back.atomic_gemm and back.num_splits == 1


def test_backward_of_an_ag_forward_runs_the_pingpong_kernel_where_it_fits(hopper, monkeypatch):
    """dX of an AG forward on 2 devices over K = 1536 columns (eight of 192) runs the RS plan's
    kernel, the ping-pong one (`heuristics.direct_rs_config`); over K = 4096 (22 columns
    padding 3.1%) the cooperative one."""
    from commgemm.mosaic_gpu import DirectRSConfig, PingPongRSConfig

    monkeypatch.setattr(jax, "device_count", lambda: 2)
    back = _plan("ag", "fused-direct", 2, 1024, 1536, 1024)
    assert back.method is Method.PIPELINE and back.kernel == PingPongRSConfig(narrow_tail=False)
    back = _plan("ag", "fused-direct", 2, 1024, 4096, 1024)
    assert back.method is Method.PIPELINE and isinstance(back.kernel, DirectRSConfig)


@pytest.mark.parametrize(
    ("spec", "op", "w_transposed", "check_vma", "scaling"),
    [("fused", "ag", False, True, None), ("fused", "rs", True, True, None),
     ("fused-direct", "ag", True, True, None), ("fused-direct", "rs", False, True, None),
     ("fused", "ag", True, False, None), ("fused-direct", "rs", True, False, None),
     ("fused", "ag", False, True, "current_tensor_scaling"),
     ("fused-direct", "rs", True, True, "current_tensor_scaling"),
     ("fused-direct", "ag", True, False, "current_tensor_scaling"),
     ("fused", "rs", False, True, "current_tensor_scaling"),
     ("fused-direct-pp-gm-cm", "rs", False, True, None),
     ("fused-direct-pp-gm-cm", "rs", True, False, None),
     ("fused-direct-pp-gm-cm", "rs", False, True, "current_tensor_scaling"),
     ("fused-direct-pp-gm-cm", "ag", False, True, None),
     ("fused-direct-pp-gm-cm", "ag", True, False, None),
     ("fused-direct-pp-gm-cm", "ag", True, True, "current_tensor_scaling")],
)  # fmt: skip
def test_grad_lowers_to_two_kernels(
    spec, op, w_transposed, check_vma, scaling, hopper, monkeypatch
):
    """jax.grad of a fused op lowers (CUDA target) to its kernel and the other collective's
    kernel for dX, with no XLA collective-permute (the ring's) and, for dW, no all-gather:
    the AG kernel's received rows are dW's operand. Under tensor scaling with fast dgrad both
    kernels take float8 operands (dX: e5m2 dY, e4m3 W) and the only XLA collectives left are
    the amaxes' all-reduces."""
    if scaling is not None:  # dY in e5m2 where this jax's Mosaic GPU takes mixed float8 wgmma;
        # fast dgrad, which runs dX on the fused kernel
        scaling = cg.ScalingRecipe(scaling, grad_dtype=DY_FLOAT8,
                                   split_accumulator=(False, False, True))  # fmt: skip
    size = 2
    monkeypatch.setattr(jax, "device_count", lambda: size)
    cfg = parse_method(spec, op)
    fn = cg.all_gather_matmul if op == "ag" else cg.matmul_reduce_scatter
    k, n = (512, 2048) if op == "ag" else (1024, 1024)
    x_spec, w_spec = (P("x", None), P(None, "x")) if op == "ag" else (P(None, "x"), P("x", None))
    if w_transposed:
        w_spec = P(*reversed(tuple(w_spec)))

    def loss(x, w):
        y = jax.shard_map(
            lambda x, w: fn(x, w, "x", config=cfg, w_transposed=w_transposed, scaling=scaling),
            mesh=mesh1d(size), in_specs=(x_spec, w_spec), out_specs=x_spec, check_vma=check_vma,
        )(x, w)  # fmt: skip
        return jnp.sum(y.astype(jnp.float32) ** 2)

    x = jax.ShapeDtypeStruct((2048, k), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((n, k) if w_transposed else (k, n), jnp.bfloat16)
    text = jax.jit(jax.grad(loss, (0, 1))).trace(x, w).lower(lowering_platforms=("cuda",))
    text = text.as_text()
    assert len(re.findall(r"stablehlo\.custom_call @mosaic_gpu", text)) == 2
    assert not re.search(r"stablehlo\.(all_gather|collective_permute|reduce_scatter)", text)
    if scaling is not None:
        kernels = re.findall(r"stablehlo\.custom_call @mosaic_gpu\w*\((.*)", text)
        assert all("f8E4M3FN" in line for line in kernels)
        dy_type = {"float8_e5m2": "f8E5M2", "float8_e4m3fn": "f8E4M3FN"}[DY_FLOAT8]
        assert sum(dy_type in line for line in kernels) >= 1


@pytest.mark.parametrize("op", ["ag", "rs"])
def test_quantized_backward_plan(op, hopper, monkeypatch):
    """A tensor-scaled fused op's dX with fast dgrad takes the bf16 op's fused plan (the
    float8 operands are the kernel's concern); with promoted dgrad (the default), or under a
    block mode (which the fused kernels do not take), the XLA method the cost model picks for
    dX (`autodiff.unfused_backward`)."""
    from commgemm import autodiff
    from commgemm.quant import ScalingMode

    monkeypatch.setattr(jax, "device_count", lambda: 2)

    def plan(mode=None, split=False):
        def planner(collective, cfg, x, dy, w, axis_name, w_transposed):
            quantizer = autodiff.Quantizer(mode, split=(True, split, True))
            return autodiff._dgrad_config(
                collective, cfg, quantizer, x[:0], dy, w, axis_name, w_transposed
            )

        return _plan(op, "fused-direct", 2, 1024, 512, 1024,
                     planner=fused_backward_config if mode is None else planner)  # fmt: skip

    tensor, block = ScalingMode.CURRENT_TENSOR_SCALING, ScalingMode.MXFP8_1D_SCALING
    bf16 = plan()
    assert bf16.atomic_gemm and bf16.method is Method.PIPELINE
    assert plan(tensor, split=False) == bf16

    def unfused(collective, cfg, x, dy, w, axis_name, w_transposed):
        return autodiff.unfused_backward(
            collective, cfg, x[:0], dy, w, axis_name, w_transposed, quantized=True
        )

    want = _plan(op, "fused-direct", 2, 1024, 512, 1024, planner=unfused)
    assert not want.atomic_gemm and want.kernel is None
    for xla in (plan(tensor, split=True), plan(block)):
        assert xla == want
