"""A/B in one trace: the kernels with and without the last-K-step wait (tiles.await_last_step).
Timing only (the variant without the wait may compute wrong tiles)."""

import contextlib
import json
import sys

import jax
import jax.numpy as jnp
from grouped_gemm import uneven_sizes

import commgemm as cg
from commgemm.bench.spans import device_periods_interleaved
from commgemm.mosaic_gpu import DirectAGConfig, fused, grouped_kernel
from commgemm.mosaic_gpu import tiles as mt


@contextlib.contextmanager
def no_wait():
    real = mt.await_last_step
    mt.await_last_step = lambda last: None
    try:
        yield
    finally:
        mt.await_last_step = real


def compiled(fn, args, off):
    with no_wait() if off else contextlib.nullcontext():
        return jax.jit(fn).lower(*args).compile()


variants = {}
key = jax.random.key(0)
for groups in (8, 64):
    m, k, n = 8192, 4096, 1792
    x = jax.random.normal(key, (m, k), jnp.bfloat16)
    w = (jax.random.normal(key, (groups, k, n), jnp.float32) / 64).astype(jnp.bfloat16)
    s = jnp.asarray(uneven_sizes(groups, m, groups))
    for off in (False, True):
        f = compiled(grouped_kernel.grouped_matmul, (x, w, s), off)
        variants[f"grouped G={groups} {'no wait' if off else 'wait'}"] = (f, (x, w, s))
for name, (m, k, n) in {
    "llama8b ag P2": (8192, 4096, 7168),
    "llama13b rs P4": (8192, 1280, 13824),
}.items():
    a = jax.random.normal(key, (m, k), jnp.bfloat16)
    b = (jax.random.normal(key, (k, n), jnp.float32) / 64).astype(jnp.bfloat16)
    cfg = cg.OverlapConfig(method="pipeline", atomic_gemm=True, kernel=DirectAGConfig(cluster="m"))
    for off in (False, True):
        f = compiled(
            lambda p, q, c=cfg: fused.all_gather_matmul(p, q, None, c, w_transposed=False),
            (a, b),
            off,
        )
        variants[f"ag core {name} {'no wait' if off else 'wait'}"] = (f, (a, b))
found = device_periods_interleaved(variants, rounds=8)
out = {k: v.get("median") for k, v in found.items()}
json.dump(out, open(sys.argv[1], "w"), indent=1)
for k_, v in out.items():
    print(k_, v)
