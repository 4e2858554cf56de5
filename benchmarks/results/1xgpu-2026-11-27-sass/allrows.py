"""The ping-pong cores' band width (`grid_tile_width`) on every preset's local shapes (AG and RS
at P = 2, 4, 8, `gemm_table.local_shapes`): bands 8 wide (the default), 1 and 2 wide, and for
the AG core 128 x 128 tiles in bands 1 wide; on comm_heavy RS P = 2 also wider bands and the
grid walked along N. Against XLA's dot and torch's cuBLAS (device periods, medians of 6
interleaved rounds; every round kept). A lab probe.

    PYTHONPATH=. python benchmarks/results/1xgpu-2026-11-27-sass/allrows.py OUT.json OP
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
from gemm_table import local_shapes, torch_ms  # noqa: E402

import commgemm as cg  # noqa: E402
from commgemm.bench.spans import device_periods_interleaved  # noqa: E402
from commgemm.cli.specs import fused_spec  # noqa: E402
from commgemm.mosaic_gpu import fused  # noqa: E402
from commgemm.mosaic_gpu.configs import PingPongAGConfig, PingPongRSConfig  # noqa: E402

TILINGS = {
    "ag": [{}, dict(grid_tile_width=1), dict(grid_tile_width=2),
           dict(tile_n=128, grid_tile_width=1)],
    "rs": [{}, dict(grid_tile_width=1), dict(grid_tile_width=2)],
}  # fmt: skip
#: comm_heavy RS P = 2 (still over 3% in bands 1, 2, 4 and 8 wide): more orders
MORE = [dict(grid_tile_width=w) for w in (3, 6, 11, 16)] + [
    dict(grid_minor_m=False, grid_tile_width=w) for w in (1, 2, 4, 8)
]


def main() -> None:
    out, op = pathlib.Path(sys.argv[1]), sys.argv[2]
    family = PingPongAGConfig if op == "ag" else PingPongRSConfig
    fn_of = fused.all_gather_matmul if op == "ag" else fused.matmul_reduce_scatter
    rows = []
    for preset, kind, size, (m, k, n) in local_shapes():
        if kind != op:
            continue
        ka, kb = jax.random.split(jax.random.key(m + k + n))
        a = jax.random.normal(ka, (m, k), jnp.bfloat16)
        b = (jax.random.normal(kb, (k, n), jnp.float32) / k**0.5).astype(jnp.bfloat16)
        ref = jnp.dot(a, b, preferred_element_type=jnp.float32)
        variants = {"xla": (jax.jit(jnp.dot), (a, b))}
        errors, failed = {}, {}
        tilings = TILINGS[op] + (MORE if (preset, kind, size) == ("comm_heavy", "rs", 2) else [])
        for fields in tilings:
            config = cg.OverlapConfig(method="pipeline", atomic_gemm=True, kernel=family(**fields))
            name = fused_spec(config).removeprefix("fused-direct-")
            fn = jax.jit(lambda a, b, c=config: fn_of(a, b, None, c, w_transposed=False))
            try:
                got = fn(a, b).astype(jnp.float32)
            except Exception as e:  # noqa: BLE001 - a tiling that does not fit: recorded
                failed[name] = str(e)[:300]
                continue
            errors[name] = float(jnp.abs(got - ref).max() / jnp.abs(ref).max())
            variants[name] = (fn, (a, b))
        found = device_periods_interleaved(variants, rounds=6, gap_s=5e-3)
        ms = {name: f["median"] for name, f in found.items() if "median" in f}
        ms["torch"] = torch_ms(m, k, n)
        best = min(t for t in ms.values() if t)
        row = {"preset": preset, "op": op, "P": size, "shape": [m, k, n], "ms": ms,
               "vs_best": {name: t / best for name, t in ms.items() if t},
               "tflops": {name: 2.0 * m * k * n / t / 1e9 for name, t in ms.items() if t},
               "rounds": {name: f.get("rounds") for name, f in found.items()},
               "rel_error": errors, "failed": failed,
               "kernels": {name: f.get("main") for name, f in found.items()}}  # fmt: skip
        rows.append(row)
        print(preset, op, size, json.dumps({k: round(v, 3) for k, v in row["vs_best"].items()}),
              flush=True)  # fmt: skip
        out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
