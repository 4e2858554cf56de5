"""The ping-pong cores with narrow columns of tiles (`narrow_n=128`: N covered by 192- and
128-wide columns, dealt to balance the clusters' work, `pingpong.deal`) against whole columns
(the default, the last one partial), on the rows the GEMM-core issue still misses and on
comm_heavy's AG shapes, against XLA's dot and torch's cuBLAS (one GPU; device periods, medians
of 6 interleaved rounds; torch by CUDA events). w read [K, n], as the ops pass it.

    PYTHONPATH=. python benchmarks/results/1xgpu-2026-11-27-narrow/probe.py OUT.json [ROWS]

ROWS: comma-separated labels of `ROWS` (default all).
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
from commgemm.mosaic_gpu import fused, pingpong  # noqa: E402
from commgemm.mosaic_gpu import tiles as mt  # noqa: E402
from commgemm.mosaic_gpu.configs import PingPongAGConfig, PingPongRSConfig  # noqa: E402

TILINGS = [dict(), dict(narrow_n=128), dict(narrow_n=128, grid_tile_width=16)]
#: label: (op, local M x K x N, tilings, w layouts: False [K, n], True [n, K])
ROWS = {
    "llama8b-ag-p8": ("ag", (8192, 4096, 1792), TILINGS, (False,)),
    **{
        f"comm_heavy-rs-p{p}": ("rs", (16384, 8192 // p, 4096), TILINGS, (False,))
        for p in (2, 4, 8)
    },
    **{
        f"comm_heavy-ag-p{p}": ("ag", (16384, 8192, 4096 // p), TILINGS, (False,))
        for p in (2, 4, 8)
    },
    "llama8b-rs-p8": ("rs", (8192, 512, 14336), TILINGS[:2], (False,)),  # whole columns kept
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
        deals = {}
        for fields in tilings:
            tiles = family(**fields)
            ctas = mt.num_sms() // tiles.cluster_size
            deals[str(fields)] = repr(pingpong.deal(tiles, m // tiles.cluster_m, n, 1, ctas))
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
               "rel_error": errors, "failed": failed, "deals": deals,
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
