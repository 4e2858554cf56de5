"""What the narrow-column cores' load warpgroup loads (call 9): `pingpong.Unit`'s column hook
wrapped to print, from inside the kernel, cluster 0's first CTA's unit i and the column its
w block is read from (every K-step), for the RS and AG cores of 8192 x 512 x 1792 on ones.

    PYTHONPATH=. python benchmarks/results/1xgpu-2026-11-27-narrow/diag5.py
"""

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

import commgemm as cg
from commgemm.mosaic_gpu import fused, pingpong
from commgemm.mosaic_gpu.configs import PingPongAGConfig, PingPongRSConfig

unit_type = pingpong.Unit


def printing_column(column):
    def wrapped(i):
        col = column(i)
        first = (lax.axis_index("cluster_grid") == 0) & (lax.axis_index("cluster") == 0)
        pl.when(first)(lambda: pl.debug_print("load unit {} column {}", i, col))
        return col

    return wrapped


def run(family):
    def unit(**hooks):
        return unit_type(**{**hooks, "column": printing_column(hooks["column"])})

    pingpong.Unit = unit
    cfg = cg.OverlapConfig(method="pipeline", atomic_gemm=True, kernel=family(narrow_n=128))
    fn = fused.all_gather_matmul if family is PingPongAGConfig else fused.matmul_reduce_scatter
    x = jnp.ones((8192, 512), jnp.bfloat16)
    w = jnp.ones((512, 1792), jnp.bfloat16)
    print(family.__name__, flush=True)
    out = jax.jit(lambda a, b: fn(a, b, None, cfg, w_transposed=False))(x, w)
    out = jax.block_until_ready(out)
    print(family.__name__, "narrow columns all 512:", bool((out[:, 1536:] == 512).all()))


run(PingPongRSConfig)
run(PingPongAGConfig)
