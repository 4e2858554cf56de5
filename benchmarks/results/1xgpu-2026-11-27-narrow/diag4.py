"""The narrow-column RS core with more registers for its load warpgroup (call 7; the tree of
`narrow_n.patch` with `pingpong.run`'s register counts read from PP_LOAD_REGS and
PP_COMPUTE_REGS, not committed): whether the narrow tiles come out right.

    PYTHONPATH=. python benchmarks/results/1xgpu-2026-11-27-narrow/diag4.py
"""

import os

import jax
import jax.numpy as jnp

import commgemm as cg
from commgemm.mosaic_gpu import fused
from commgemm.mosaic_gpu.configs import PingPongAGConfig, PingPongRSConfig


def check(family, shape, load, compute):
    os.environ["PP_LOAD_REGS"], os.environ["PP_COMPUTE_REGS"] = str(load), str(compute)
    m, k, n = shape
    ka, kb = jax.random.split(jax.random.key(sum(shape)))
    x = jax.random.normal(ka, (m, k), jnp.bfloat16)
    w = (jax.random.normal(kb, (k, n), jnp.float32) / k**0.5).astype(jnp.bfloat16)
    ref = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32))
    cfg = cg.OverlapConfig(method="pipeline", atomic_gemm=True, kernel=family(narrow_n=128))
    fn = fused.all_gather_matmul if family is PingPongAGConfig else fused.matmul_reduce_scatter
    f = jax.jit(lambda a, b: fn(a, b, None, cfg, w_transposed=False))
    for sign in (1, -1):
        out = f(sign * x, w).astype(jnp.float32)
        err = float(jnp.abs(out - sign * ref).max() / jnp.abs(ref).max())
        print(family.__name__, shape, "registers", load, compute, "error", err, flush=True)


for load, compute in ((40, 232), (56, 224), (80, 216)):
    check(PingPongRSConfig, (8192, 512, 1792), load, compute)
check(PingPongRSConfig, (16384, 256, 4096), 56, 224)
check(PingPongAGConfig, (8192, 512, 1792), 56, 224)
