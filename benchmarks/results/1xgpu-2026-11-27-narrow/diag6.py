"""A narrow unit's deal as each warpgroup computes it (call 12): `pingpong.Deal.tile` wrapped
to print, from inside the kernel, its cluster, unit, tile, and the cluster's wide-unit count,
for cluster 0's unit 4 (a narrow tile), in the RS and AG cores of 8192 x 512 x 1792 on ones;
and `lax.axis_index("wg")`, the warpgroup that computed it.

    PYTHONPATH=. python benchmarks/results/1xgpu-2026-11-27-narrow/diag6.py
"""

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

import commgemm as cg
from commgemm.mosaic_gpu import fused, pingpong
from commgemm.mosaic_gpu.configs import PingPongAGConfig, PingPongRSConfig

tile_of = pingpong.Deal.tile


def printing_tile(self, cid, i):
    tile, half = tile_of(self, cid, i)
    wide = self._wide(cid)[0] if self.narrow else -1
    seen = (cid == 4 - 4) & (i == 4) & (lax.axis_index("cluster") == 0)
    fmt = "wg {} cid {} unit {} tile {} wide {}"
    wg = lax.axis_index("wg")
    pl.when(seen)(lambda: pl.debug_print(fmt, wg, cid, i, tile, wide))
    return tile, half


def run(family):
    cfg = cg.OverlapConfig(method="pipeline", atomic_gemm=True, kernel=family(narrow_n=128))
    fn = fused.all_gather_matmul if family is PingPongAGConfig else fused.matmul_reduce_scatter
    x = jnp.ones((8192, 512), jnp.bfloat16)
    w = jnp.ones((512, 1792), jnp.bfloat16)
    print(family.__name__, flush=True)
    out = jax.jit(lambda a, b: fn(a, b, None, cfg, w_transposed=False))(x, w)
    out = jax.block_until_ready(out)
    print(family.__name__, "narrow columns all 512:", bool((out[:, 1536:] == 512).all()))


pingpong.Deal.tile = printing_tile
run(PingPongRSConfig)
run(PingPongAGConfig)
