"""The narrow-column cores' stores (call 6): `pingpong.Unit`'s store hook wrapped to print, from
inside the kernel, each narrow tile's unit state (RS: unit, x row, row, column, owner distance;
AG: step, row, column, band, rank, sender) and row block, for units of rows below 512, for the
RS and AG cores of 8192 x 512 x 1792 on ones.

    PYTHONPATH=. python benchmarks/results/1xgpu-2026-11-27-narrow/diag3.py
"""

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

import commgemm as cg
from commgemm.mosaic_gpu import fused, pingpong
from commgemm.mosaic_gpu.configs import PingPongAGConfig, PingPongRSConfig

unit_type = pingpong.Unit


def printing_store(store, row_at):
    def wrapped(state, r, out_smem, cols):
        if cols == 128:
            fmt = "narrow store r {} " + " ".join("{}" for _ in state)
            pl.when(state[row_at] < 512)(lambda: pl.debug_print(fmt, r, *state))
        return store(state, r, out_smem, cols)

    return wrapped


def run(family, row_at):
    def unit(**hooks):
        return unit_type(**{**hooks, "store": printing_store(hooks["store"], row_at)})

    pingpong.Unit = unit
    cfg = cg.OverlapConfig(method="pipeline", atomic_gemm=True, kernel=family(narrow_n=128))
    fn = fused.all_gather_matmul if family is PingPongAGConfig else fused.matmul_reduce_scatter
    x = jnp.ones((8192, 512), jnp.bfloat16)
    w = jnp.ones((512, 1792), jnp.bfloat16)
    print(family.__name__, flush=True)
    out = jax.jit(lambda a, b: fn(a, b, None, cfg, w_transposed=False))(x, w)
    out = jax.block_until_ready(out)
    print(family.__name__, "narrow columns all 512:", bool((out[:, 1536:] == 512).all()))
    print("  narrow column values:", jnp.unique(out[:, 1536:].astype(jnp.float32))[:8], flush=True)


assert dataclasses.is_dataclass(unit_type)
run(PingPongRSConfig, 2)
run(PingPongAGConfig, 1)
