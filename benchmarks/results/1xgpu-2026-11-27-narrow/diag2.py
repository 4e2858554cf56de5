"""Where the narrow-column RS core's tiles go (call 5): `pingpong.tile_origin` wrapped to print,
from inside the kernel, the tile index and origin of the first narrow tiles, for the RS and AG
cores of 8192 x 512 x 1792 (8 columns of 192 and 2 of 128).

    PYTHONPATH=. python benchmarks/results/1xgpu-2026-11-27-narrow/diag2.py
"""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

import commgemm as cg
from commgemm.mosaic_gpu import fused, pingpong
from commgemm.mosaic_gpu.configs import PingPongAGConfig, PingPongRSConfig

origin = pingpong.tile_origin


def printing(tiles, tile, m_pairs, n_iters):
    row, col = origin(tiles, tile, m_pairs, n_iters)
    pl.when((tile >= 256) & (tile < 259))(
        lambda: pl.debug_print("tile {} row {} col {}", tile, row, col)
    )
    return row, col


def run(family):
    cfg = cg.OverlapConfig(method="pipeline", atomic_gemm=True, kernel=family(narrow_n=128))
    fn = fused.all_gather_matmul if family is PingPongAGConfig else fused.matmul_reduce_scatter
    x = jnp.ones((8192, 512), jnp.bfloat16)
    w = jnp.ones((512, 1792), jnp.bfloat16)
    print(family.__name__, flush=True)
    out = jax.jit(lambda a, b: fn(a, b, None, cfg, w_transposed=False))(x, w)
    ok = bool((jax.block_until_ready(out)[:, 1536:] == 512).all())
    print(family.__name__, "narrow columns all 512:", ok, flush=True)


pingpong.tile_origin = printing
run(PingPongRSConfig)
run(PingPongAGConfig)
