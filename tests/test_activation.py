"""The experts' activation on a buffer's live rows (`commgemm.grouped.activation`): the kernel's
math against jax.nn.gelu in float64, its tiles, the step with it lowering for CUDA (under
check_vma too), the fallback, named activations through `expert_mlp` and the MoE layer. The
kernel's results: tests/gpu/test_activation_gpu.py."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import P, mesh1d, shard
from hypothesis import given, settings
from hypothesis import strategies as st

import commgemm as cg
from commgemm.grouped import activation as act
from commgemm.mosaic_gpu import rows as kernel
from commgemm.mosaic_gpu import tiles


@settings(max_examples=20, deadline=None)
@given(approximate=st.booleans(), scale=st.floats(0.1, 8))
def test_kernel_math_matches_float64(approximate, scale):
    """The kernel's float32 math (`value_and_slope`) on fresh values against jax.nn.gelu and
    its autodiff derivative in float64: within a few float32 ulps of x^2 (1 + tanh or 1 + erf
    cancel for large negative x, in float32 as in jax.nn.gelu's own float32 form)."""
    x = np.random.default_rng().standard_normal(4096) * scale
    value, slope = act.value_and_slope(jnp.asarray(x, jnp.float32), approximate)
    f = functools.partial(jax.nn.gelu, approximate=approximate)
    want = f(jnp.asarray(x))
    dwant = jax.vmap(jax.grad(f))(jnp.asarray(x))
    ulps = 16 * np.finfo(np.float32).eps * np.maximum(1, x * x)
    np.testing.assert_array_less(np.abs(np.asarray(value, np.float64) - want), ulps)
    np.testing.assert_array_less(np.abs(np.asarray(slope, np.float64) - dwant), ulps)


@pytest.mark.parametrize(
    "f, dtype, want",
    [(1408, jnp.bfloat16, 128), (1408, jnp.float16, 128), (88, jnp.bfloat16, 8),
     (12, jnp.bfloat16, None), (4096, jnp.float32, 64)],
)  # fmt: skip
def test_tile_cols(f, dtype, want):
    """A unit's columns: 256 bytes' worth, down to a power of two dividing the row (16 bytes at
    least), or None."""
    assert kernel.tile_cols(f, dtype) == want


def test_fallback_and_names():
    """Off a GPU: the activation over every row (GELU(0) = 0 past a GEMM's groups); None is the
    identity; an unknown name is refused."""
    assert act.kernel_reason((64, 128), jnp.bfloat16) is not None  # the CPU backend
    y = jnp.asarray(np.random.default_rng().standard_normal((16, 32)), jnp.float32)
    np.testing.assert_array_equal(act.activation_rows(y, jnp.int32(16), "gelu"),
                                  jax.nn.gelu(y, approximate=False))  # fmt: skip
    assert act.activation_rows(y, jnp.int32(3), None) is y
    with pytest.raises(ValueError, match="activation='relu'"):
        act.activation_rows(y, jnp.int32(3), "relu")


def _expert_mlp_loss(size: int, activation, check_vma: bool, seed: int, m: int = 16):
    """(loss(x, w1, w2): the squares' sum of `expert_mlp` (NONE) on `size` shards, its args
    drawn from `seed`)."""
    from commgemm.grouped.expert_parallel import expert_mlp

    rng, per_shard, k, f, n = np.random.default_rng(seed), 2, 32, 64, 16
    experts = size * per_shard
    x = jnp.asarray(rng.standard_normal((size * m, k)), jnp.bfloat16)
    w1 = jnp.asarray(rng.standard_normal((experts, k, f)) / 6, jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((experts, f, n)) / 8, jnp.bfloat16)
    sizes = np.stack([np.bincount(rng.integers(0, experts, m), minlength=experts)
                      for _ in range(size)]).astype(np.int32)  # fmt: skip
    cfg = cg.OverlapConfig(method="none")

    def loss(a, b, c):
        body = lambda a, b, c, g: expert_mlp(a, b, c, g[0], "x", activation=activation,  # noqa: E731
                                             config=cfg)[0]  # fmt: skip
        out = shard(body, mesh1d(size), (P("x"),) * 4, P("x"), check_vma=check_vma)(a, b, c, sizes)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    return loss, (x, w1, w2)


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "no-vma"])
@pytest.mark.parametrize("size", [1, 2, 4])
def test_expert_mlp_named_activation(size, check_vma):
    """`expert_mlp` (NONE) with "gelu" by name (off a GPU: over every row) against the block in
    float64 with jax.nn.gelu: forward and gradients."""
    seed = int(np.random.default_rng().integers(1 << 30))
    loss, args = _expert_mlp_loss(size, "gelu", check_vma, seed)
    got = jax.value_and_grad(loss, (0, 1, 2))(*args)
    exact = functools.partial(jax.nn.gelu, approximate=False)
    loss, _ = _expert_mlp_loss(size, exact, check_vma, seed)
    want = jax.value_and_grad(loss, (0, 1, 2))(*[a.astype(jnp.float64) for a in args])
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=2e-2)
    for a, b in zip(got[1], want[1], strict=True):
        b = np.asarray(b)
        np.testing.assert_allclose(np.asarray(a, np.float64), b, rtol=5e-2,
                                   atol=3e-2 * np.abs(b).max())  # fmt: skip


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "no-vma"])
def test_kernel_lowers_under_check_vma(monkeypatch, check_vma):
    """`expert_mlp`'s step with the kernel lowers for a CUDA target, under shard_map's default
    check_vma too (the kernel's results and gradient typed as varying as y): one Mosaic GPU
    call forward, one backward."""
    monkeypatch.setattr(act, "kernel_reason", lambda shape, dtype: None)
    monkeypatch.setattr(tiles, "num_sms", lambda: 132)  # CPU devices have no SM count
    loss, args = _expert_mlp_loss(2, "gelu", check_vma, 0, m=64)  # [128, 64] rows
    step = jax.jit(jax.value_and_grad(loss, (0, 1, 2)))
    text = step.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 2


def test_moe_layer_refuses_unknown_activation():
    """ParallelMoE names its activation: an unknown one fails at construction."""
    from flax import nnx

    from commgemm.nnx import ParallelMoE

    with pytest.raises(ValueError, match="activation='swish'"):
        ParallelMoE(16, 32, 2, mesh=mesh1d(2, "tp"), rngs=nnx.Rngs(0), activation="swish")
