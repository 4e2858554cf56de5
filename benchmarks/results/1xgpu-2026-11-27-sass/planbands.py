"""The cooperative RS plan's core (`heuristics.direct_rs_config` on 2 devices: 64 x 256
warpgroup tiles, a 128 x 256 CTA tile that pads nothing on N = 4096, 2-CTA clusters, chained
tiles, split tail) on comm_heavy RS P = 2's local shape, its grid walked along N or M in bands
1, 2, 4, 8, 16 tiles wide, against the ping-pong core (bands 8 and 6 wide), XLA's dot and
torch's cuBLAS (device periods, medians of 6 interleaved rounds). A lab probe.

    PYTHONPATH=. python benchmarks/results/1xgpu-2026-11-27-sass/planbands.py OUT.json
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")  # room for torch beside jax
sys.path.insert(0, str(pathlib.Path(__file__).parents[2]))  # benchmarks/

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from fused_core import core, core_tilings  # noqa: E402
from gemm_table import torch_ms  # noqa: E402

from commgemm.bench.spans import device_periods_interleaved  # noqa: E402
from commgemm.mosaic_gpu.configs import PingPongRSConfig  # noqa: E402


def main() -> None:
    out = pathlib.Path(sys.argv[1])
    m, k, n = 16384, 4096, 4096
    plan = core_tilings("rs", 2, (m, k, n))["plan"]
    tilings = {f"plan-{'m' if minor else 'n'}{w}": dataclasses.replace(
        plan, grid_minor_m=minor, grid_tile_width=w)
        for minor in (False, True) for w in (1, 2, 4, 8, 16)}  # fmt: skip
    tilings |= {"pp": PingPongRSConfig(), "pp-w6": PingPongRSConfig(grid_tile_width=6)}
    ka, kb = jax.random.split(jax.random.key(m + k + n))
    a = jax.random.normal(ka, (m, k), jnp.bfloat16)
    b = (jax.random.normal(kb, (k, n), jnp.float32) / k**0.5).astype(jnp.bfloat16)
    ref = jnp.dot(a, b, preferred_element_type=jnp.float32)
    variants = {"xla": (jax.jit(jnp.dot), (a, b))}
    errors, failed = {}, {}
    for name, tiles in tilings.items():
        fn = core("rs", tiles, float8=False)
        try:
            got = fn(a, b).astype(jnp.float32)
        except Exception as e:  # noqa: BLE001 - recorded
            failed[name] = str(e)[:300]
            continue
        errors[name] = float(jnp.abs(got - ref).max() / jnp.abs(ref).max())
        variants[name] = (fn, (a, b))
    found = device_periods_interleaved(variants, rounds=6, gap_s=5e-3)
    ms = {name: f["median"] for name, f in found.items() if "median" in f}
    ms["torch"] = torch_ms(m, k, n)
    best = min(t for t in ms.values() if t)
    row = {"row": "comm_heavy-rs-p2", "shape": [m, k, n], "ms": ms, "plan": repr(plan),
           "vs_best": {name: t / best for name, t in ms.items() if t},
           "rounds": {name: f.get("rounds") for name, f in found.items()},
           "rel_error": errors, "failed": failed,
           "kernels": {name: f.get("main") for name, f in found.items()}}  # fmt: skip
    out.write_text(json.dumps([row], indent=1))
    for name, v in sorted(row["vs_best"].items(), key=lambda kv: kv[1]):
        print(f"{v:.3f} {name}")
    print("failed", failed)


if __name__ == "__main__":
    main()
