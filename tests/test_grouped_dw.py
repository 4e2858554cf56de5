"""commgemm's grouped dW Hopper kernel (`grouped_dw`), off the GPU: the steps each group's
rows take and each unit's first step in its CTA's ring, its checks, and that it lowers for a
CUDA target (also through `cg.grouped_matmul`'s backward). tests/gpu/test_gemm_core_gpu.py
checks its values on Hopper."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from commgemm.mosaic_gpu import grouped, grouped_dw
from commgemm.mosaic_gpu import tiles as mosaic_tiles
from commgemm.mosaic_gpu.configs import ROW_ALIGN, PingPongTiles

pytest.importorskip("jax.experimental.pallas.mosaic_gpu")


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 700), min_size=1, max_size=12),
    m=st.integers(1, 2500),
    tile_k=st.sampled_from([64, 128]),
    align=st.sampled_from([ROW_ALIGN, grouped_dw.TOKEN_ALIGN]),
)
def test_group_steps_cover_each_groups_rows(sizes, m, tile_k, align):
    """Each group's steps start at a whole `align` of rows (8: the 16-bit kernel's; 16: the
    float8 one's) less than `align` rows before the group, cover every row of the group (its
    sum cut at m) and end less than tile_k rows past it; an empty group takes none. Against
    the rows' groups counted in numpy."""
    sizes_ = jnp.asarray(sizes, jnp.int32)
    starts, ends, base, steps = (
        np.asarray(a) for a in grouped_dw.group_steps(sizes_, m, tile_k, align)
    )
    owner = np.repeat(np.arange(len(sizes)), sizes)[:m]
    for g in range(len(sizes)):
        rows = np.flatnonzero(owner == g)
        assert (starts[g], ends[g]) == ((rows[0], rows[-1] + 1) if rows.size else (starts[g],) * 2)
        if not rows.size:
            assert steps[g] == 0
            continue
        assert base[g] % align == 0 and 0 <= starts[g] - base[g] < align
        covered_end = base[g] + steps[g] * tile_k
        assert covered_end >= ends[g] > covered_end - tile_k


@settings(max_examples=30, deadline=None)
@given(
    steps=st.lists(st.integers(0, 9), min_size=1, max_size=10),
    per_group=st.integers(1, 6),
    ctas=st.integers(1, 16),
)
def test_unit_offsets_count_each_ctas_steps(steps, per_group, ctas):
    """Unit u's offset is the steps of the units before it on its CTA (u % ctas): the ring's
    step counter the load warpgroup keeps, counted in Python."""
    got = np.asarray(grouped_dw.unit_offsets(jnp.asarray(steps, jnp.int32), per_group, ctas))
    units = [steps[u // per_group] for u in range(len(steps) * per_group)]
    assert got.shape == (len(units),)
    for u in range(len(units)):
        assert got[u] == sum(units[v] for v in range(u % ctas, u, ctas)), u


def test_bad_operands_raise(monkeypatch):
    """Operands and tilings the kernel cannot take: clear errors before any kernel is built."""
    monkeypatch.setattr(mosaic_tiles, "num_sms", lambda: 132)
    x, dy = jnp.zeros((256, 256), jnp.bfloat16), jnp.zeros((256, 384), jnp.bfloat16)
    sizes = jnp.asarray([100, 156], jnp.int32)
    with pytest.raises(ValueError, match="one dtype"):
        grouped_dw.weight_grad(x, dy.astype(jnp.float16), sizes)
    with pytest.raises(ValueError, match=r"\[M, N\]"):
        grouped_dw.weight_grad(x, dy[:128], sizes)
    with pytest.raises(ValueError, match="G >= 1"):
        grouped_dw.weight_grad(x, dy, sizes[:0])
    with pytest.raises(ValueError, match="N=320"):
        grouped_dw.weight_grad(x, jnp.zeros((256, 320), jnp.bfloat16), sizes)
    with pytest.raises(ValueError, match="bfloat16/float16"):
        grouped_dw.weight_grad(x.astype(jnp.float32), dy.astype(jnp.float32), sizes)
    with pytest.raises(ValueError, match="whole 64s"):
        grouped_dw.weight_grad(x, dy, sizes, PingPongTiles(tile_k=32))
    with pytest.raises(ValueError, match="fewer than 2 stages"):
        grouped_dw.weight_grad(x, dy, sizes, PingPongTiles(tile_k=256))


def _mosaic_calls(fn, *args) -> list[str]:
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    return [line for line in text.splitlines() if "custom_call @mosaic_gpu" in line]


@pytest.mark.parametrize("x64", [False, True])
@pytest.mark.parametrize("groups", [1, 8, 64])
def test_weight_grad_lowers(groups, x64, monkeypatch):
    """The kernel lowers for a CUDA target (under jax_enable_x64 too): one Mosaic GPU call
    taking the groups' four int32 arrays, the units' offsets, x and dy, giving [G, K, N]."""
    monkeypatch.setattr(mosaic_tiles, "num_sms", lambda: 132)
    sds = jax.ShapeDtypeStruct
    args = (sds((1000, 256), jnp.bfloat16), sds((1000, 384), jnp.bfloat16),
            sds((groups,), jnp.int32))  # fmt: skip
    with jax.enable_x64(x64):
        calls = _mosaic_calls(grouped_dw.weight_grad, *args)
    assert len(calls) == 1, calls
    assert f"-> tensor<{groups}x256x384xbf16>" in calls[0], calls[0]
    assert f"tensor<{groups * 2 * 3}xi32>" in calls[0], calls[0]  # the units' offsets


def test_grouped_backward_takes_the_kernel(monkeypatch):
    """`grouped.weight_grad` (dW of the grouped GEMM's backward) runs the kernel by default and
    where its tiles fit, jax's transposed ragged dot where asked for, XLA's ragged dot (no
    Mosaic GPU call) where K is no whole tile."""
    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu as transposed

    monkeypatch.setattr(mosaic_tiles, "num_sms", lambda: 132)
    h100 = type("Device", (), {"core_count": 132})()  # jax's kernel reads its grid off it
    monkeypatch.setattr(transposed.jax, "devices", lambda *a: [h100])
    sds = jax.ShapeDtypeStruct
    sizes = sds((4,), jnp.int32)
    x, dy = sds((512, 256), jnp.bfloat16), sds((512, 384), jnp.float32)  # dy cast to x's dtype
    ours = _mosaic_calls(grouped.weight_grad, x, dy, sizes)
    assert len(ours) == 1 and "tensor<24xi32>" in ours[0], ours  # 4 x 2 x 3 units' offsets
    jaxs = _mosaic_calls(lambda a, d, s: grouped.weight_grad(a, d, s, grouped.GroupedTiles()),
                         x, dy, sizes)  # fmt: skip
    assert len(jaxs) == 1 and "tensor<24xi32>" not in jaxs[0], jaxs
    assert not _mosaic_calls(grouped.weight_grad, sds((512, 200), jnp.bfloat16), dy, sizes)


def test_float8_bad_operands_raise(monkeypatch):
    """The float8 form's checks: float8 operands of one row count, whole tiles."""
    monkeypatch.setattr(mosaic_tiles, "num_sms", lambda: 132)
    f8 = jnp.float8_e4m3fn
    x, dy = jnp.zeros((256, 256), f8), jnp.zeros((256, 384), jnp.float8_e5m2)
    sizes, one = jnp.asarray([100, 156], jnp.int32), jnp.ones((), jnp.float32)
    with pytest.raises(ValueError, match="float8_e4m3fn/float8_e5m2"):
        grouped_dw.float8_weight_grad(x.astype(jnp.bfloat16), one, dy, one, sizes)
    with pytest.raises(ValueError, match=r"\[M, N\]"):
        grouped_dw.float8_weight_grad(x, one, dy[:128], one, sizes)
    with pytest.raises(ValueError, match="G >= 1"):
        grouped_dw.float8_weight_grad(x, one, dy, one, sizes[:0])
    with pytest.raises(ValueError, match="K=192"):
        grouped_dw.float8_weight_grad(x[:, :192], one, dy, one, sizes)


@pytest.mark.parametrize("x64", [False, True])
@pytest.mark.parametrize("groups", [1, 8, 64])
def test_float8_weight_grad_lowers(groups, x64, monkeypatch):
    """The float8 form lowers for a CUDA target: one Mosaic GPU call taking x and dy
    transposed ([K, M'], [N, M'] float8, M' the rows rounded up to 128) and the scale, giving
    [G, K, N] bf16, under jax_enable_x64 too. (Both e4m3: jax < 0.11's wgmma takes no mixed
    pair; the GPU tests run e4m3 x e5m2.)"""
    monkeypatch.setattr(mosaic_tiles, "num_sms", lambda: 132)
    sds, f8, f32 = jax.ShapeDtypeStruct, jnp.float8_e4m3fn, jnp.float32
    m, cols = 1000, 1024
    args = (sds((m, 256), f8), sds((), f32), sds((m, 384), f8), sds((), f32))
    with jax.enable_x64(x64):  # sizes int64 under x64: the kernel takes int32
        sizes = sds((groups,), jnp.int64 if x64 else jnp.int32)
        calls = _mosaic_calls(grouped_dw.float8_weight_grad, *args, sizes)
    assert len(calls) == 1, calls
    assert f"-> tensor<{groups}x256x384xbf16>" in calls[0], calls[0]
    assert f"tensor<256x{cols}xf8E4M3FN>" in calls[0], calls[0]
    assert f"tensor<384x{cols}xf8E4M3FN>" in calls[0], calls[0]
    text = jax.jit(grouped_dw.float8_weight_grad).trace(*args, sizes)
    text = text.lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 2  # x and dy transposed by the Triton kernel


@pytest.mark.parametrize("wgrad_split", [False, True], ids=["fast-wgrad", "split-wgrad"])
def test_float8_backward_takes_the_float8_dw_kernel(wgrad_split, monkeypatch):
    """`cg.grouped_matmul` under tensor scaling, as on a Hopper GPU: its dW runs the float8 dW
    kernel (x's and dY's float8 values transposed) where the recipe
    lets dW accumulate fast and the groups hold FLOAT8_MIN_GROUP_ROWS rows on average, the
    16-bit dW kernel where the recipe asks for split accumulation or the groups are smaller.
    (dY in e4m3: jax < 0.11's wgmma takes no mixed pair.)"""
    import commgemm as cg

    monkeypatch.setattr(mosaic_tiles, "hopper_reason", lambda: None)
    monkeypatch.setattr(mosaic_tiles, "num_sms", lambda: 132)
    split = (False, False, wgrad_split)
    recipe = cg.ScalingRecipe(grad_dtype="float8_e4m3fn", split_accumulator=split)
    sds = jax.ShapeDtypeStruct

    def loss(x, w, sizes):
        return cg.grouped_matmul(x, w, sizes, scaling=recipe).astype(jnp.float32).sum()

    for m in (4 * grouped_dw.FLOAT8_MIN_GROUP_ROWS, 4 * grouped_dw.FLOAT8_MIN_GROUP_ROWS - 8):
        args = (sds((m, 256), jnp.bfloat16), sds((4, 256, 384), jnp.bfloat16),
                sds((4,), jnp.int32))  # fmt: skip
        calls = _mosaic_calls(jax.grad(loss, argnums=(0, 1)), *args)
        cols = -(-m // 128) * 128  # the tokens rounded up to 128
        float8_dw = [c for c in calls if f"tensor<256x{cols}xf8E4M3FN>" in c]
        dw = [c for c in calls if "-> tensor<4x256x384xbf16>" in c]
        fast = not wgrad_split and m >= 4 * grouped_dw.FLOAT8_MIN_GROUP_ROWS
        assert len(dw) == 1 and len(float8_dw) == int(fast), (m, calls)
        assert any(f"-> tensor<{m}x256xbf16>" in c for c in calls), calls  # dX on a kernel


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "no-vma"])
def test_float8_dw_inside_shard_map(check_vma, monkeypatch):
    """The op's float8 dW inside shard_map (rows over 2 devices, w replicated), as on a Hopper
    GPU, under check_vma on and off: the gradient traces and lowers, dW on the float8 kernel
    (its [256, M'] float8 operand) and summed over the rows' axis like the 16-bit dW."""
    from helpers import mesh1d, shard
    from jax.sharding import PartitionSpec as P

    import commgemm as cg

    monkeypatch.setattr(mosaic_tiles, "hopper_reason", lambda: None)
    monkeypatch.setattr(mosaic_tiles, "num_sms", lambda: 132)
    recipe = cg.ScalingRecipe(grad_dtype="float8_e4m3fn", split_accumulator=(False,) * 3)

    def body(x, w, sizes):
        return cg.grouped_matmul(x, w, sizes, scaling=recipe)

    f = shard(body, mesh1d(2), (P("x"), P(), P()), P("x"), check_vma=check_vma)
    loss = lambda x, w, s: jnp.sum(f(x, w, s).astype(jnp.float32))  # noqa: E731
    sds = jax.ShapeDtypeStruct
    m = 2 * 4 * grouped_dw.FLOAT8_MIN_GROUP_ROWS  # 4 groups of that many rows on each shard
    args = (sds((m, 256), jnp.bfloat16), sds((4, 256, 384), jnp.bfloat16), sds((4,), jnp.int32))
    text = jax.jit(jax.grad(loss, (0, 1))).trace(*args).lower(lowering_platforms=("cuda",))
    text = text.as_text()
    calls = [ln for ln in text.splitlines() if "custom_call @mosaic_gpu" in ln]
    assert [c for c in calls if f"tensor<256x{m // 2}xf8E4M3FN>" in c], calls  # a shard's rows
    assert "all-reduce" in text or "all_reduce" in text  # dW summed over the rows' shards
