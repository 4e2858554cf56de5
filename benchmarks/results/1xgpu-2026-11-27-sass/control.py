"""A control of the device-period timing: three separately compiled copies of the default
ping-pong RS core (identical kernels) beside XLA's dot, with every round's period kept
(device periods, 6 interleaved rounds, twice), on 8192 x 14336 x 8192 (call 3's
"llama70b-rs-p2", which is not the preset's: it timed two identical kernels 1.056 and 1.000 of
the best there), on llama70b RS P = 2's local shape (8192 x 4096 x 28672, the same FLOPs), on
8192 x 7168 x 8192 and on comm_heavy RS P = 2's. A lab probe.

    PYTHONPATH=. python benchmarks/results/1xgpu-2026-11-27-sass/control.py OUT.json [ROWS]

ROWS: comma-separated labels of `ROWS` (default all; call 8 ran the first two, call 9 the
third, call 10 the fourth).
"""

from __future__ import annotations

import json
import pathlib
import sys

import jax
import jax.numpy as jnp

import commgemm as cg
from commgemm.bench.spans import device_periods_interleaved
from commgemm.mosaic_gpu import fused
from commgemm.mosaic_gpu.configs import PingPongRSConfig

ROWS = {
    "8192x7168x8192": (8192, 7168, 8192),
    "comm_heavy-rs-p2": (16384, 4096, 4096),
    "8192x14336x8192": (8192, 14336, 8192),  # call 3's "llama70b-rs-p2" (call 9)
    "llama70b-rs-p2": (8192, 4096, 28672),  # the preset's local RS shape at P = 2 (call 10)
}


def core():
    config = cg.OverlapConfig(method="pipeline", atomic_gemm=True, kernel=PingPongRSConfig())
    return jax.jit(lambda a, b: fused.matmul_reduce_scatter(a, b, None, config, w_transposed=False))


def main() -> None:
    out = pathlib.Path(sys.argv[1])
    labels = sys.argv[2].split(",") if len(sys.argv) > 2 else list(ROWS)
    rows = []
    for label in labels:
        m, k, n = ROWS[label]
        ka, kb = jax.random.split(jax.random.key(m + k + n))
        a = jax.random.normal(ka, (m, k), jnp.bfloat16)
        b = (jax.random.normal(kb, (k, n), jnp.float32) / k**0.5).astype(jnp.bfloat16)
        variants = {"xla": (jax.jit(jnp.dot), (a, b))}
        variants.update({f"default-{c}": (core(), (a, b)) for c in "abc"})
        for fn, args in variants.values():
            jax.block_until_ready(fn(*args))
        for attempt in (1, 2):
            found = device_periods_interleaved(variants, rounds=6, gap_s=5e-3)
            best = min(f["median"] for f in found.values())
            row = {"row": label, "attempt": attempt, "shape": [m, k, n],
                   "vs_best": {name: f["median"] / best for name, f in found.items()},
                   "rounds": {name: f.get("rounds") for name, f in found.items()}}  # fmt: skip
            rows.append(row)
            print(label, attempt, json.dumps({k: round(v, 3) for k, v in row["vs_best"].items()}))
            out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
