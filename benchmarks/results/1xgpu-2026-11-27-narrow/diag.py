"""Which tiles of the narrow-column cores come out wrong (call 2): per 128-row tile and column
of tiles, the largest error against the float32 product, for the RS and AG cores on the same
operands, three calls each; and whether a wrong tile holds another tile's right values.

    PYTHONPATH=. python benchmarks/results/1xgpu-2026-11-27-narrow/diag.py
"""

import jax
import jax.numpy as jnp
import numpy as np

import commgemm as cg
from commgemm.mosaic_gpu import fused, pingpong
from commgemm.mosaic_gpu.configs import PingPongAGConfig, PingPongRSConfig


def check(op, fields, shape, w_nk=False):
    m, k, n = shape
    family = PingPongRSConfig if op == "rs" else PingPongAGConfig
    tiles = family(narrow_n=128, **fields)
    dealt = pingpong.deal(tiles, m // tiles.cluster_m, n, 1, 132 // tiles.cluster_size)
    ka, kb = jax.random.split(jax.random.key(sum(shape)))
    x = jax.random.normal(ka, (m, k), jnp.bfloat16)
    w = (jax.random.normal(kb, (k, n), jnp.float32) / k**0.5).astype(jnp.bfloat16)
    ref = np.asarray(jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32)))
    cfg = cg.OverlapConfig(method="pipeline", atomic_gemm=True, kernel=tiles)
    fn = fused.all_gather_matmul if op == "ag" else fused.matmul_reduce_scatter
    f = jax.jit(lambda a, b: fn(a, b, None, cfg, w_transposed=w_nk))
    wide, narrow = dealt.columns
    edges = [192 * j for j in range(wide + 1)] + [
        192 * wide + 128 * j for j in range(1, narrow + 1)
    ]
    for call in range(3):
        out = np.asarray(f(x, w.T.copy() if w_nk else w).astype(jnp.float32))
        bad = []
        for r in range(m // 128):
            for c in range(len(edges) - 1):
                sl = (slice(128 * r, 128 * r + 128), slice(edges[c], min(edges[c + 1], n)))
                err = np.abs(out[sl] - ref[sl]).max() / np.abs(ref).max()
                if not err < 1e-2:
                    bad.append((r, c, float(err), bool(np.isnan(out[sl]).any())))
        print(
            op,
            fields,
            shape,
            "w_nk" if w_nk else "",
            dealt,
            "call",
            call,
            "bad tiles",
            len(bad),
            "of",
            (m // 128) * (len(edges) - 1),
            flush=True,
        )
        cols = sorted({c for _, c, _, _ in bad})
        rows = sorted({r for r, _, _, _ in bad})
        print("  bad columns", cols[:40], "rows", rows[:20], "...", len(rows), flush=True)
        for r, c, err, nan in bad[:6]:
            sl = (slice(128 * r, 128 * r + 128), slice(edges[c], min(edges[c + 1], n)))
            print("  ", r, c, round(err, 3), "nan" if nan else "", out[sl][0, :4], ref[sl][0, :4])


for op in ("rs", "ag"):
    check(op, {}, (8192, 512, 1792))
check("rs", {}, (8192, 512, 1792), w_nk=True)
check("rs", dict(cluster=None), (8192, 256, 1792))
check("rs", dict(grid_minor_m=False), (8192, 512, 1792))
check("rs", {}, (2048, 256, 128))
