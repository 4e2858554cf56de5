"""Grouped GEMMs inside a scan on one Hopper GPU: each kernel launches once a step, and the
gradients equal the unrolled loop's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import commgemm as cg
from commgemm.epilogue import gelu


def _kernels(fn, *args) -> int:
    """The Mosaic GPU kernels in fn's compiled program."""
    return fn.lower(*args).compile().as_text().count('custom_call_target="mosaic_gpu')


@pytest.mark.parametrize("scaling", [None, "current_tensor_scaling"])
def test_grouped_kernels_launch_once_a_step_in_a_scan(scaling):
    """Two grouped GEMMs with the GELU between them keeping its input (the first GEMM's result)
    for the backward, in a scan of 3 steps (the MoE block's experts under gradient accumulation
    or a scan over layers; bf16 and FP8): the compiled step holds the kernels of one step, none
    launched twice to write the scan's stacked copy of that result, and dW of the scan equals
    dW of the 3 steps unrolled."""
    steps, groups, m, k, n = 3, 4, 512, 256, 256
    sizes = jnp.array([100, 200, 62, 150], jnp.int32)
    keys = jax.random.split(jax.random.key(0), 3)
    xs = jax.random.normal(keys[0], (steps, m, k), jnp.bfloat16)
    w1 = (jax.random.normal(keys[1], (groups, k, n)) / k**0.5).astype(jnp.bfloat16)
    w2 = (jax.random.normal(keys[2], (groups, n, k)) / n**0.5).astype(jnp.bfloat16)

    def one(a, b, x):
        h = gelu(cg.grouped_matmul(x, a, sizes, scaling=scaling), False)
        return jnp.sum(jnp.square(cg.grouped_matmul(h, b, sizes, scaling=scaling)
                                  .astype(jnp.float32)))  # fmt: skip

    def scanned(a, b, xs):
        return jax.lax.scan(lambda c, x: (c + one(a, b, x), None), jnp.float32(0), xs)[0]

    def unrolled(a, b, xs):
        return sum(one(a, b, xs[i]) for i in range(steps))

    grad = jax.jit(jax.grad(scanned, argnums=(0, 1)))
    single = _kernels(jax.jit(jax.grad(one, argnums=(0, 1))), w1, w2, xs[0])
    assert single >= 4, single  # two forward GEMMs, their dX and dW (dX of x is not asked)
    assert _kernels(grad, w1, w2, xs) == single
    want = jax.jit(jax.grad(unrolled, argnums=(0, 1)))(w1, w2, xs)
    for name, g, r in zip(("dw1", "dw2"), grad(w1, w2, xs), want, strict=True):
        g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
        np.testing.assert_allclose(g, r, atol=2e-2 * np.abs(r).max(), err_msg=name)
