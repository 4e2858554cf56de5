"""The ping-pong RS core in 128 x 208 tiles on comm_heavy's RS shapes (N = 4096: 20 columns of
208 pad 1.6%, where 22 of 192 pad 3.1%), w read [n, K] (a 208-wide block of w [K, n] is not
whole 128-byte rows), 4 stages (5 do not fit beside the 64-row epilogue buffer, and a narrower
buffer does not lower), the accumulator bound lifted: against the default core (w [K, n] and
[n, K], 5 and 4 stages), XLA's dot and torch's cuBLAS (device periods, medians of 6
interleaved rounds). ptxas's report of each 208-wide kernel goes to the log
(MOSAIC_GPU_DUMP_PTXAS). A lab probe.

    PYTHONPATH=. python benchmarks/results/1xgpu-2026-11-27-sass/wide208.py OUT.json
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
from commgemm.mosaic_gpu import configs, fused, pingpong, pingpong_scatter_gemm  # noqa: E402
from commgemm.mosaic_gpu.configs import PingPongRSConfig  # noqa: E402

configs.ACC_REGISTERS = 208
#: variant: (tiling fields, w read [n, K], epilogue rows: EPI, patched in this process)
VARIANTS = {
    "default": ({}, False, 64),
    "default-wnk": ({}, True, 64),
    "n208-s4-wnk": (dict(tile_n=208, stages=4), True, 64),
    "default-s4-wnk": (dict(stages=4), True, 64),
}


def set_epi(rows: int) -> None:
    for module in (configs, pingpong, pingpong_scatter_gemm):
        module.EPI = rows


def core(tiles, nk: bool):
    config = cg.OverlapConfig(method="pipeline", atomic_gemm=True, kernel=tiles)
    return jax.jit(lambda a, b: fused.matmul_reduce_scatter(a, b, None, config, w_transposed=nk))


def main() -> None:
    out = pathlib.Path(sys.argv[1])
    rows = []
    for p in (2, 4, 8):
        m, k, n = 16384, 8192 // p, 4096
        ka, kb = jax.random.split(jax.random.key(m + k + n))
        a = jax.random.normal(ka, (m, k), jnp.bfloat16)
        b = (jax.random.normal(kb, (k, n), jnp.float32) / k**0.5).astype(jnp.bfloat16)
        bt = b.T.copy()
        ref = jnp.dot(a, b, preferred_element_type=jnp.float32)
        variants = {"xla": (jax.jit(jnp.dot), (a, b))}
        errors, failed = {}, {}
        for name, (fields, nk, epi) in VARIANTS.items():
            set_epi(epi)
            if "n208" in name:
                os.environ["MOSAIC_GPU_DUMP_PTXAS"] = "1"
                print(f"== ptxas: {name}, P = {p}", flush=True)
            try:
                fn = core(PingPongRSConfig(**fields), nk)
                got = fn(a, bt if nk else b).astype(jnp.float32)
                errors[name] = float(jnp.abs(got - ref).max() / jnp.abs(ref).max())
                variants[name] = (fn, (a, bt if nk else b))
            except Exception as e:  # noqa: BLE001 - recorded
                failed[name] = str(e)[:400]
            os.environ.pop("MOSAIC_GPU_DUMP_PTXAS", None)
            set_epi(64)
        found = device_periods_interleaved(variants, rounds=6, gap_s=5e-3)
        ms = {name: f["median"] for name, f in found.items() if "median" in f}
        ms["torch"] = torch_ms(m, k, n)
        best = min(t for t in ms.values() if t)
        row = {"row": f"comm_heavy-rs-p{p}", "shape": [m, k, n], "ms": ms,
               "vs_best": {name: t / best for name, t in ms.items() if t},
               "tflops": {name: 2.0 * m * k * n / t / 1e9 for name, t in ms.items() if t},
               "rel_error": errors, "failed": failed,
               "kernels": {name: f.get("main") for name, f in found.items()}}  # fmt: skip
        rows.append(row)
        print(row["row"], json.dumps({k: round(v, 3) for k, v in row["vs_best"].items()}))
        print("failed", failed, flush=True)
        out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
