"""How fast a tile of 64 output columns runs computed transposed (out^T = w^T x^T: wgmma's 64
rows along N, its 256 columns along M; `swap_ab.patch` of 2026-11-27-pp-tiles brought to this
tree as `swap_ab_head.patch`): every tile so, against the default core, on comm_heavy RS and
llama8b AG P = 8, with XLA's dot and torch's cuBLAS (device periods, medians of 6 interleaved
rounds). Asks what a partial last column of 64 would cost as such tiles. A lab probe.

    PYTHONPATH=. python benchmarks/results/1xgpu-2026-11-27-sass/swapped.py OUT.json
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
from commgemm.mosaic_gpu import fused  # noqa: E402
from commgemm.mosaic_gpu.configs import PingPongAGConfig, PingPongRSConfig  # noqa: E402

SWAPPED = dict(swap_ab=True, tile_m=256, tile_n=64, stages=4)
VARIANTS = {"default": {}, "swap256x64": SWAPPED, "swap256x64-nc": dict(SWAPPED, cluster=None)}
ROWS = {
    "comm_heavy-rs-p2": ("rs", (16384, 4096, 4096)),
    "comm_heavy-rs-p8": ("rs", (16384, 1024, 4096)),
    "llama8b-ag-p8": ("ag", (8192, 4096, 1792)),
}


def core(op, tiles):
    config = cg.OverlapConfig(method="pipeline", atomic_gemm=True, kernel=tiles)
    fn = fused.all_gather_matmul if op == "ag" else fused.matmul_reduce_scatter
    return jax.jit(lambda a, b: fn(a, b, None, config, w_transposed=False))


def main() -> None:
    out = pathlib.Path(sys.argv[1])
    rows = []
    for label, (op, (m, k, n)) in ROWS.items():
        family = PingPongAGConfig if op == "ag" else PingPongRSConfig
        ka, kb = jax.random.split(jax.random.key(m + k + n))
        a = jax.random.normal(ka, (m, k), jnp.bfloat16)
        b = (jax.random.normal(kb, (k, n), jnp.float32) / k**0.5).astype(jnp.bfloat16)
        ref = jnp.dot(a, b, preferred_element_type=jnp.float32)
        variants = {"xla": (jax.jit(jnp.dot), (a, b))}
        errors, failed = {}, {}
        for name, fields in VARIANTS.items():
            try:
                fn = core(op, family(**fields))
                got = fn(a, b).astype(jnp.float32)
                errors[name] = float(jnp.abs(got - ref).max() / jnp.abs(ref).max())
                variants[name] = (fn, (a, b))
            except Exception as e:  # noqa: BLE001 - recorded
                failed[name] = str(e)[:400]
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
        print(label, json.dumps({k: round(v, 3) for k, v in row["vs_best"].items()}))
        print("errors", errors, "failed", failed, flush=True)
        out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
