"""Probe: the ping-pong grouped kernel (`grouped_pingpong`) run as a dense GEMM (one group) in
tiles wider than 128 x 128, against XLA's dot, on the RS presets' local shapes (where XLA's pick
is cuBLASLt's 128 x 160 non-cooperative kernel, BENCHMARKS.md "Which GEMM kernels XLA and
torch run"). Device periods, medians of 6 interleaved rounds. Writes OUT/pingpong_dense.json.

    PYTHONPATH=. python benchmarks/pingpong_dense_probe.py --out DIR
"""

from __future__ import annotations

import argparse
import pathlib

import jax
import jax.numpy as jnp

from commgemm.bench.record import record
from commgemm.bench.spans import device_periods_interleaved
from commgemm.mosaic_gpu import grouped_pingpong
from commgemm.mosaic_gpu.configs import PingPongTiles

SHAPES = {  # local M x K x N of the RS presets
    "llama8b RS P2": (8192, 2048, 14336),
    "llama8b RS P8": (8192, 512, 14336),
    "llama70b RS P4": (8192, 2048, 28672),
    "llama13b RS P8": (8192, 640, 13824),
    "comm_heavy RS P8": (16384, 1024, 4096),
}
TILINGS = {
    "pp 128x128 s5": PingPongTiles(),
    "pp 128x128 s6": PingPongTiles(stages=6),
    "pp 192x128": PingPongTiles(tile_m=192),
    "pp 192x128 b8": PingPongTiles(tile_m=192, band=8),
    "pp 128x192": PingPongTiles(tile_n=192),
    "pp 256x64 s6": PingPongTiles(tile_m=256, tile_n=64, stages=6),
}


def dense(tiles):
    def f(a, b):
        sizes = jnp.full((1,), a.shape[0], jnp.int32)
        return grouped_pingpong.grouped_matmul(a, b[None], sizes, tiles)

    return jax.jit(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--lower-only", action="store_true", help="lower for CUDA (CPU check)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for label, (m, k, n) in SHAPES.items():
        ka, kb = jax.random.split(jax.random.key(m + k + n))
        a = jax.random.normal(ka, (m, k), jnp.bfloat16)
        b = (jax.random.normal(kb, (k, n), jnp.float32) / k**0.5).astype(jnp.bfloat16)
        variants, errors, failed = {"xla": (jax.jit(jnp.dot), (a, b))}, {}, {}
        for name, tiles in TILINGS.items():
            if n % tiles.tile_n:
                continue
            f = dense(tiles)
            try:
                if args.lower_only:
                    f.trace(a, b).lower(lowering_platforms=("cuda",))
                    continue
                out = f(a, b).astype(jnp.float32)
            except Exception as e:  # noqa: BLE001 - a tiling that does not build: recorded
                failed[name] = str(e)[:300]
                continue
            ref = jnp.dot(a, b, preferred_element_type=jnp.float32)
            errors[name] = float(jnp.abs(out - ref).max() / jnp.abs(ref).max())
            variants[name] = (f, (a, b))
        if args.lower_only:
            print(label, "failed:", failed)
            continue
        found = device_periods_interleaved(variants, rounds=6, gap_s=5e-3)
        ms = {name: f["median"] for name, f in found.items() if "median" in f}
        failed.update({name: f["error"] for name, f in found.items() if "error" in f})
        row = {"shape": label, "mnk": [m, k, n], "ms": ms,
               "vs_xla": {name: t / ms["xla"] for name, t in ms.items() if "xla" in ms},
               "rel_error": errors, "failed": failed}  # fmt: skip
        record(args.out / "pingpong_dense.json", rows, row)


if __name__ == "__main__":
    main()
