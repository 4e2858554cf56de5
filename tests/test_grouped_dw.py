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
)
def test_group_steps_cover_each_groups_rows(sizes, m, tile_k):
    """Each group's steps start at a whole 8 of rows at most 7 rows before the group, cover
    every row of the group (its sum cut at m) and end less than tile_k rows past it; an empty
    group takes none. Against the rows' groups counted in numpy."""
    starts, ends, base, steps = (
        np.asarray(a) for a in grouped_dw.group_steps(jnp.asarray(sizes, jnp.int32), m, tile_k)
    )
    owner = np.repeat(np.arange(len(sizes)), sizes)[:m]
    for g in range(len(sizes)):
        rows = np.flatnonzero(owner == g)
        assert (starts[g], ends[g]) == ((rows[0], rows[-1] + 1) if rows.size else (starts[g],) * 2)
        if not rows.size:
            assert steps[g] == 0
            continue
        assert base[g] % ROW_ALIGN == 0 and 0 <= starts[g] - base[g] < ROW_ALIGN
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
    with pytest.raises(ValueError, match="bf16 or fp16"):
        grouped_dw.weight_grad(x.astype(jnp.float32), dy.astype(jnp.float32), sizes)
    with pytest.raises(ValueError, match="whole 64s"):
        grouped_dw.weight_grad(x, dy, sizes, PingPongTiles(tile_k=32))
    with pytest.raises(ValueError, match="fewer than 2 stages"):
        grouped_dw.weight_grad(x, dy, sizes, PingPongTiles(tile_k=256))


def _mosaic_calls(fn, *args) -> list[str]:
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    return [line for line in text.splitlines() if "custom_call" in line and "mosaic_gpu" in line]


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
