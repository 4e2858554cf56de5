"""Does the order of a K-step's wgmma instructions matter? Mosaic GPU issues a 128-row tile's
wgmmas as (rows 0-63: k16 steps 0..3), (rows 64-127: k16 steps 0..3): four dependent
accumulations into one accumulator back to back. CUTLASS alternates the two 64-row halves
(k16 step 0: rows 0-63, rows 64-127; step 1: ...). This probe recompiles the ping-pong cores
with Mosaic GPU's `wgmma` patched in this process to issue the instructions in CUTLASS's order
(`-alt`), and times both orders with XLA's dot and torch's cuBLAS (device periods, medians of
6 interleaved rounds). A lab probe, not library code.

    PYTHONPATH=. python benchmarks/results/1xgpu-2026-11-27-sass/order.py OUT.json [ROWS]
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import pathlib
import sys
import textwrap

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")  # room for torch beside jax
sys.path.insert(0, str(pathlib.Path(__file__).parents[2]))  # benchmarks/

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from gemm_table import torch_ms  # noqa: E402
from jax.experimental import mosaic as _mosaic  # noqa: E402, F401
from jax.experimental.mosaic import gpu as mgpu  # noqa: E402

import commgemm as cg  # noqa: E402
from commgemm.bench.spans import device_periods_interleaved  # noqa: E402
from commgemm.mosaic_gpu import fused  # noqa: E402
from commgemm.mosaic_gpu.configs import PingPongAGConfig, PingPongRSConfig  # noqa: E402

ORIGINAL = mgpu.wgmma
wgmma_module = importlib.import_module("jax.experimental.mosaic.gpu.wgmma")
LOOPS = "for mi in range(m_groups):\n    for ki in range(k_groups):\n"
#: k groups outside, then each group's k16 instructions, then the 64-row groups
ALTERNATING = (
    "for ki in range(k_groups):\n"
    "   for instr in range((swizzle // utils.bytewidth(element_type))\n"
    "                      // (32 // utils.bytewidth(element_type))):\n"
    "    for mi in range(m_groups):\n"
)
#: each call issues one k16 instruction, its descriptors advanced to it
CALL = "          a_mk,\n          b_k,\n          swizzle=swizzle,\n"
ONE = (
    "          _llvm_add(a_mk, c((a_instr_params['a_k_stride'] >> 4) * instr, i64)),\n"
    "          _llvm_add(b_k, c((b_k_instr_stride >> 4) * instr, i64)),\n"
    "          swizzle=32,\n"
)


def alternating_wgmma():
    """Mosaic GPU's wgmma issuing one k16 instruction a call (A in smem), the 64-row groups
    alternating inside each k16 step."""
    source = textwrap.dedent(inspect.getsource(ORIGINAL))
    if source.count(LOOPS) != 1 or source.count(CALL) != 1:
        raise RuntimeError("Mosaic GPU's wgmma is not as expected:\n" + source)
    source = source.replace(LOOPS, ALTERNATING).replace(CALL, ONE)
    namespace = dict(vars(wgmma_module))
    exec(compile(source, wgmma_module.__file__, "exec"), namespace)
    return namespace["wgmma"]


SWAPPED_WGMMA = alternating_wgmma()


def use(fn) -> None:
    """Mosaic GPU's wgmma as both lowerings call it (lane: the package's, warpgroup: the
    module's)."""
    mgpu.wgmma = wgmma_module.wgmma = fn


#: label: (op, local M x K x N, {variant: tiling fields})
BOTH = {"default": {}, "n128": dict(tile_n=128, stages=6)}
ROWS = {
    "comm_heavy-rs-p2": ("rs", (16384, 4096, 4096), BOTH),
    "comm_heavy-rs-p8": ("rs", (16384, 1024, 4096), BOTH),
    "llama8b-ag-p8": ("ag", (8192, 4096, 1792), BOTH),
    "comm_heavy-ag-p4": ("ag", (16384, 8192, 1024), BOTH),
}


def core(op, tiles):
    config = cg.OverlapConfig(method="pipeline", atomic_gemm=True, kernel=tiles)
    fn = fused.all_gather_matmul if op == "ag" else fused.matmul_reduce_scatter
    return jax.jit(lambda a, b: fn(a, b, None, config, w_transposed=False))


def main() -> None:
    out = pathlib.Path(sys.argv[1])
    labels = sys.argv[2].split(",") if len(sys.argv) > 2 else list(ROWS)
    rows = []
    for label in labels:
        op, (m, k, n), tilings = ROWS[label]
        family = PingPongAGConfig if op == "ag" else PingPongRSConfig
        ka, kb = jax.random.split(jax.random.key(m + k + n))
        a = jax.random.normal(ka, (m, k), jnp.bfloat16)
        b = (jax.random.normal(kb, (k, n), jnp.float32) / k**0.5).astype(jnp.bfloat16)
        ref = jnp.dot(a, b, preferred_element_type=jnp.float32)
        variants = {"xla": (jax.jit(jnp.dot), (a, b))}
        errors = {}
        for order, fn_wgmma in (("", ORIGINAL), ("-alt", SWAPPED_WGMMA)):
            use(fn_wgmma)
            for name, fields in tilings.items():
                fn = core(op, family(**fields))
                got = fn(a, b).astype(jnp.float32)  # compiled here, with this order
                errors[name + order] = float(jnp.abs(got - ref).max() / jnp.abs(ref).max())
                variants[name + order] = (fn, (a, b))
        use(ORIGINAL)
        found = device_periods_interleaved(variants, rounds=6, gap_s=5e-3)
        ms = {name: f["median"] for name, f in found.items() if "median" in f}
        ms["torch"] = torch_ms(m, k, n)
        best = min(t for t in ms.values() if t)
        row = {"row": label, "shape": [m, k, n], "ms": ms,
               "vs_best": {name: t / best for name, t in ms.items() if t},
               "tflops": {name: 2.0 * m * k * n / t / 1e9 for name, t in ms.items() if t},
               "rel_error": errors,
               "kernels": {name: f.get("main") for name, f in found.items()}}  # fmt: skip
        rows.append(row)
        print(label, json.dumps({k: round(v, 3) for k, v in row["vs_best"].items()}))
        out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
