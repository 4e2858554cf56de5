"""The ping-pong cores' compiled code: each variant compiled with MOSAIC_GPU_DUMP_TO set (PTX,
ptxas's report, SASS), run once against XLA's dot, then all timed together (device periods,
medians of 6 interleaved rounds) with XLA's dot and torch's cuBLAS.

    PYTHONPATH=. python benchmarks/results/1xgpu-2026-11-27-sass/dump.py OUT_DIR
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

#: label: (op, local M x K x N, {variant: tiling fields})
ROWS = {
    "comm_heavy-rs-p2": ("rs", (16384, 4096, 4096),
                         {"default": {}, "n128": dict(tile_n=128, stages=6)}),
    "llama8b-ag-p8": ("ag", (8192, 4096, 1792),
                      {"default": {}, "n128": dict(tile_n=128, stages=6)}),
}  # fmt: skip


def core(op, tiles):
    config = cg.OverlapConfig(method="pipeline", atomic_gemm=True, kernel=tiles)
    fn = fused.all_gather_matmul if op == "ag" else fused.matmul_reduce_scatter
    return jax.jit(lambda a, b: fn(a, b, None, config, w_transposed=False))


def main() -> None:
    out = pathlib.Path(sys.argv[1])
    rows = []
    for label, (op, (m, k, n), tilings) in ROWS.items():
        family = PingPongAGConfig if op == "ag" else PingPongRSConfig
        ka, kb = jax.random.split(jax.random.key(m + k + n))
        a = jax.random.normal(ka, (m, k), jnp.bfloat16)
        b = (jax.random.normal(kb, (k, n), jnp.float32) / k**0.5).astype(jnp.bfloat16)
        ref = jnp.dot(a, b, preferred_element_type=jnp.float32)
        variants = {"xla": (jax.jit(jnp.dot), (a, b))}
        errors = {}
        for name, fields in tilings.items():
            dump = out / f"{label}-{name}"
            dump.mkdir(parents=True, exist_ok=True)
            os.environ["MOSAIC_GPU_DUMP_TO"] = str(dump)
            fn = core(op, family(**fields))
            got = fn(a, b).astype(jnp.float32)
            os.environ.pop("MOSAIC_GPU_DUMP_TO")
            errors[name] = float(jnp.abs(got - ref).max() / jnp.abs(ref).max())
            variants[name] = (fn, (a, b))
        found = device_periods_interleaved(variants, rounds=6, gap_s=5e-3)
        ms = {name: f["median"] for name, f in found.items() if "median" in f}
        ms["torch"] = torch_ms(m, k, n)
        best = min(t for t in ms.values() if t)
        row = {"row": label, "shape": [m, k, n], "ms": ms,
               "vs_best": {name: t / best for name, t in ms.items() if t},
               "rel_error": errors,
               "kernels": {name: f.get("main") for name, f in found.items()}}  # fmt: skip
        rows.append(row)
        print(label, json.dumps({k: round(v, 3) for k, v in row["vs_best"].items()}))
        (out / "timings.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
