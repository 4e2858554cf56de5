"""The ping-pong cores of the rows the GEMM-core issue still misses, in other tilings and with
w read [K, n] (as the ops pass it) or [n, K] (wgmma's K-major B), against XLA's dot and torch's
cuBLAS (one GPU; device periods, medians of 6 interleaved rounds; torch by CUDA events).

    PYTHONPATH=. python benchmarks/results/1xgpu-2026-11-27-pp-tiles/probe.py OUT.json [ROWS]

ROWS: comma-separated labels of `ROWS` (default all; call 1 ran the first four).
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")  # room for torch beside jax
sys.path.insert(0, str(pathlib.Path(__file__).parents[2]))  # benchmarks/

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from gemm_table import torch_ms  # noqa: E402

import commgemm as cg  # noqa: E402
from commgemm.bench.spans import device_periods_interleaved  # noqa: E402
from commgemm.cli.specs import fused_spec  # noqa: E402
from commgemm.mosaic_gpu import fused  # noqa: E402
from commgemm.mosaic_gpu.configs import PingPongAGConfig, PingPongRSConfig  # noqa: E402

TILINGS = [
    dict(),  # the default: 128 x 192, clusters along M, grid along M, last wave halved
    dict(tile_n=128),
    dict(tile_n=128, stages=6),
    dict(tile_m=64, tile_n=256, stages=4),
]
#: 192 x 128 tiles against the default's 128 x 192 where both are whole tiles and whole waves
#: (16896 x 3840: 1320 cluster tiles of either on 66 clusters), w [K, n] only (call 2).
TALL = [dict(), dict(tile_m=192, tile_n=128), dict(tile_m=192, tile_n=128, cluster=None)]
#: 192 x 128 tiles on comm_heavy RS's local shapes: 16384 rows are not whole tiles of 192 (a
#: partial last row of tiles), 4096 columns whole 128s (call 6).
PARTIAL = [dict(), *TALL[1:]]
#: The tile computed transposed (`swap_ab`: wgmma's rows along N, its columns along M, as
#: cuBLASLt's kernels for these shapes), M-side tiles of 192 and 160 rows (call 7; the field
#: came with `swap_ab.patch`, not committed).
SWAP = [
    dict(),
    dict(swap_ab=True, tile_m=192, tile_n=128),
    dict(swap_ab=True, tile_m=192, tile_n=128, cluster=None),
    dict(swap_ab=True, tile_m=160, tile_n=128, cluster=None),
    dict(swap_ab=True, tile_m=160, tile_n=128),
]
SWAP_AG = [
    dict(),
    dict(swap_ab=True, tile_m=128, tile_n=128),
    dict(swap_ab=True, tile_m=256, tile_n=64),
]
#: 128 x 128 tiles in K-steps of 128 (3 stages) against 64: whether a short K-step's fixed
#: cost is what narrow tiles lose (call 9).
K128 = [dict(), dict(tile_n=128), dict(tile_n=128, tile_k=128, stages=3)]
#: label: (op, local M x K x N, tilings, w layouts: False [K, n], True [n, K])
ROWS = {
    "llama8b-ag-p8": ("ag", (8192, 4096, 1792), TILINGS, (False, True)),
    "comm_heavy-rs-p2": ("rs", (16384, 4096, 4096), TILINGS, (False, True)),
    "comm_heavy-rs-p4": ("rs", (16384, 2048, 4096), TILINGS, (False, True)),
    "comm_heavy-rs-p8": ("rs", (16384, 1024, 4096), TILINGS, (False, True)),
    "even-k4096": ("rs", (16896, 4096, 3840), TALL, (False,)),
    "even-k1024": ("rs", (16896, 1024, 3840), TALL, (False,)),
    **{f"partial-rs-p{p}": ("rs", (16384, 8192 // p, 4096), PARTIAL, (False,)) for p in (2, 4, 8)},
    **{f"swap-rs-p{p}": ("rs", (16384, 8192 // p, 4096), SWAP, (False,)) for p in (2, 4, 8)},
    "swap-even-k4096": ("rs", (16896, 4096, 3840), SWAP[:2], (False,)),
    "swap-ag-p8": ("ag", (8192, 4096, 1792), SWAP_AG, (False,)),
    **{f"k128-rs-p{p}": ("rs", (16384, 8192 // p, 4096), K128, (False,)) for p in (2, 4, 8)},
    "k128-ag-p8": ("ag", (8192, 4096, 1792), K128, (False,)),
}


def core(op, tiles, nk: bool):
    config = cg.OverlapConfig(method="pipeline", atomic_gemm=True, kernel=tiles)
    fn = fused.all_gather_matmul if op == "ag" else fused.matmul_reduce_scatter
    return jax.jit(lambda a, b: fn(a, b, None, config, w_transposed=nk))


def main() -> None:
    out = pathlib.Path(sys.argv[1])
    labels = sys.argv[2].split(",") if len(sys.argv) > 2 else list(ROWS)
    rows = []
    for label in labels:
        op, (m, k, n), tilings, layouts = ROWS[label]
        family = PingPongAGConfig if op == "ag" else PingPongRSConfig
        ka, kb = jax.random.split(jax.random.key(m + k + n))
        a = jax.random.normal(ka, (m, k), jnp.bfloat16)
        b = (jax.random.normal(kb, (k, n), jnp.float32) / k**0.5).astype(jnp.bfloat16)
        bt = b.T.copy()
        ref = jnp.dot(a, b, preferred_element_type=jnp.float32)
        variants = {"xla": (jax.jit(jnp.dot), (a, b))}
        for fields in tilings:
            tiles = family(**fields)
            spec = fused_spec(cg.OverlapConfig(method="pipeline", atomic_gemm=True, kernel=tiles))
            for nk in layouts:
                name = spec.removeprefix("fused-direct-") + ("-wnk" if nk else "")
                variants[name] = (core(op, tiles, nk), (a, bt if nk else b))
        errors, failed = {}, {}
        for name in list(variants):
            fn, args = variants[name]
            try:
                got = fn(*args).astype(jnp.float32)
                errors[name] = float(jnp.abs(got - ref).max() / jnp.abs(ref).max())
            except Exception as e:  # noqa: BLE001 - recorded
                failed[name] = str(e)[:300]
                del variants[name]
        found = device_periods_interleaved(variants, rounds=6, gap_s=5e-3)
        ms = {name: f["median"] for name, f in found.items() if "median" in f}
        ms["torch"] = torch_ms(m, k, n)
        best = min(t for t in ms.values() if t)
        row = {"row": label, "shape": [m, k, n], "ms": ms,
               "vs_best": {name: t / best for name, t in ms.items() if t},
               "tflops": {name: 2.0 * m * k * n / t / 1e9 for name, t in ms.items() if t},
               "rel_error": errors, "failed": failed,
               "kernels": {name: f.get("main") for name, f in found.items()}}  # fmt: skip
        rows.append(row)
        print(
            label,
            json.dumps(
                {k: round(v, 3) for k, v in sorted(row["vs_best"].items(), key=lambda kv: kv[1])}
            ),
        )
        out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
