"""The ping-pong cores' band width (`grid_tile_width`: how many tiles wide the grid's walk along
M is; 8 by default) on the GEMM-core issue's rows and comm_heavy's AG rows, in 128 x 192 and
128 x 128 tiles, against XLA's dot and torch's cuBLAS (device periods, medians of 6 interleaved
rounds; every round kept). A lab probe.

    PYTHONPATH=. python benchmarks/results/1xgpu-2026-11-27-sass/bands.py OUT.json [ROWS]

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
from commgemm.mosaic_gpu import fused  # noqa: E402
from commgemm.mosaic_gpu.configs import PingPongAGConfig, PingPongRSConfig  # noqa: E402

TILINGS = [{}, *(dict(grid_tile_width=w) for w in (1, 2, 4)),
           *(dict(tile_n=128, grid_tile_width=w) for w in (1, 2))]  # fmt: skip
ROWS = {
    "llama8b-ag-p8": ("ag", (8192, 4096, 1792)),
    **{f"comm_heavy-rs-p{p}": ("rs", (16384, 8192 // p, 4096)) for p in (2, 4, 8)},
    **{f"comm_heavy-ag-p{p}": ("ag", (16384, 8192, 4096 // p)) for p in (2, 4, 8)},
}


def main() -> None:
    out = pathlib.Path(sys.argv[1])
    labels = sys.argv[2].split(",") if len(sys.argv) > 2 else list(ROWS)
    rows = []
    for label in labels:
        op, (m, k, n) = ROWS[label]
        family = PingPongAGConfig if op == "ag" else PingPongRSConfig
        fn_of = fused.all_gather_matmul if op == "ag" else fused.matmul_reduce_scatter
        ka, kb = jax.random.split(jax.random.key(m + k + n))
        a = jax.random.normal(ka, (m, k), jnp.bfloat16)
        b = (jax.random.normal(kb, (k, n), jnp.float32) / k**0.5).astype(jnp.bfloat16)
        ref = jnp.dot(a, b, preferred_element_type=jnp.float32)
        variants = {"xla": (jax.jit(jnp.dot), (a, b))}
        errors = {}
        for fields in TILINGS:
            config = cg.OverlapConfig(method="pipeline", atomic_gemm=True, kernel=family(**fields))
            name = fused_spec(config).removeprefix("fused-direct-")
            fn = jax.jit(lambda a, b, c=config, f=fn_of: f(a, b, None, c, w_transposed=False))
            got = fn(a, b).astype(jnp.float32)
            errors[name] = float(jnp.abs(got - ref).max() / jnp.abs(ref).max())
            variants[name] = (fn, (a, b))
        found = device_periods_interleaved(variants, rounds=6, gap_s=5e-3)
        ms = {name: f["median"] for name, f in found.items() if "median" in f}
        ms["torch"] = torch_ms(m, k, n)
        best = min(t for t in ms.values() if t)
        row = {"row": label, "shape": [m, k, n], "ms": ms,
               "vs_best": {name: t / best for name, t in ms.items() if t},
               "rounds": {name: f.get("rounds") for name, f in found.items()},
               "rel_error": errors,
               "kernels": {name: f.get("main") for name, f in found.items()}}  # fmt: skip
        rows.append(row)
        print(label, json.dumps({k: round(v, 3) for k, v in row["vs_best"].items()}), flush=True)
        out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
