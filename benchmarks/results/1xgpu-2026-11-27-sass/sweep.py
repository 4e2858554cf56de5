"""The ping-pong AG core in 128 x 128 tiles on llama8b AG P = 8's local shape (8192 x 4096 x
1792: 14 whole columns, 6.8 waves of clusters), over its stages, grid order and band width, with
and without clusters, against the default (128 x 192), XLA's dot and torch's cuBLAS (device
periods, medians of 6 interleaved rounds). A lab probe.

    PYTHONPATH=. python benchmarks/results/1xgpu-2026-11-27-sass/sweep.py OUT.json [SET]

SET: a key of `SETS` (default "first").
"""

from __future__ import annotations

import itertools
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
from commgemm.mosaic_gpu.configs import PingPongAGConfig  # noqa: E402

SETS = {
    # call 11: stages, grid order, band width; one without clusters
    "first": [{}] + [
        dict(tile_n=128, stages=s, grid_minor_m=g, grid_tile_width=w)
        for s, g, w in itertools.product((5, 6), (True, False), (4, 8, 16))
    ] + [dict(tile_n=128, stages=6, cluster=None)],
    # call 12: narrower bands, 128- and 192-wide tiles, grid along M
    "bands": [dict(tile_n=128, grid_tile_width=w) for w in (1, 2, 3, 4, 5, 6, 7)]
    + [dict(grid_tile_width=w) for w in (1, 2, 3, 4, 5, 8)],
}  # fmt: skip


def main() -> None:
    out = pathlib.Path(sys.argv[1])
    m, k, n = 8192, 4096, 1792
    ka, kb = jax.random.split(jax.random.key(m + k + n))
    a = jax.random.normal(ka, (m, k), jnp.bfloat16)
    b = (jax.random.normal(kb, (k, n), jnp.float32) / k**0.5).astype(jnp.bfloat16)
    ref = jnp.dot(a, b, preferred_element_type=jnp.float32)
    variants = {"xla": (jax.jit(jnp.dot), (a, b))}
    errors = {}
    for fields in SETS[sys.argv[2] if len(sys.argv) > 2 else "first"]:
        config = cg.OverlapConfig(method="pipeline", atomic_gemm=True,
                                  kernel=PingPongAGConfig(**fields))  # fmt: skip
        name = fused_spec(config).removeprefix("fused-direct-")
        fn = jax.jit(
            lambda a, b, c=config: fused.all_gather_matmul(a, b, None, c, w_transposed=False)
        )
        errors[name] = float(jnp.abs(fn(a, b).astype(jnp.float32) - ref).max() / jnp.abs(ref).max())
        variants[name] = (fn, (a, b))
    found = device_periods_interleaved(variants, rounds=6, gap_s=5e-3)
    ms = {name: f["median"] for name, f in found.items() if "median" in f}
    ms["torch"] = torch_ms(m, k, n)
    best = min(t for t in ms.values() if t)
    row = {"row": "llama8b-ag-p8", "shape": [m, k, n], "ms": ms,
           "vs_best": {name: t / best for name, t in ms.items() if t},
           "rounds": {name: f.get("rounds") for name, f in found.items()},
           "rel_error": errors,
           "kernels": {name: f.get("main") for name, f in found.items()}}  # fmt: skip
    out.write_text(json.dumps([row], indent=1))
    for name, v in sorted(row["vs_best"].items(), key=lambda kv: kv[1]):
        print(f"{v:.3f} {name}")


if __name__ == "__main__":
    main()
