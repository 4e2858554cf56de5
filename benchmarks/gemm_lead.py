"""The issue's GEMM lead: XLA's GEMM for llama70b_mlp's local shape took 2.79 ms where cuBLAS
through torch took 2.48 ms. Times that GEMM ([8192, 8192] @ [8192, 14336] bf16, one GPU) as
XLA compiles it under this process's XLA_FLAGS, as jax's Mosaic GPU Hopper matmul (the fused
kernels' GEMM), and as torch.matmul (cuBLAS, CUDA events), all interleaved in one process; and
records which kernel XLA chose (a Triton fusion or a cuBLAS call, from the compiled HLO).
--shape picks another local GEMM (comm_heavy AG's: 16384,8192,2048).

    PYTHONPATH=. python benchmarks/gemm_lead.py --out DIR --name default
    XLA_FLAGS=--xla_gpu_enable_triton_gemm=false PYTHONPATH=. python benchmarks/gemm_lead.py ...
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import statistics

import jax
import jax.numpy as jnp

import commgemm as cg


def torch_ms(m: int, k: int, n: int, iters: int) -> float | None:
    try:
        import torch
    except ImportError:
        return None
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        torch.matmul(a, b)
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(4):
            torch.matmul(a, b)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 4)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--shape", default="8192,8192,14336", help="the local GEMM: M,K,N")
    args = parser.parse_args()
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm

    from commgemm.algorithms.fused import tuning_config

    m, k, n = (int(v) for v in args.shape.split(","))
    device = jax.devices()[0]
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.device_put(jax.random.normal(ka, (m, k), jnp.bfloat16), device)
    b = jax.device_put(jax.random.normal(kb, (k, n), jnp.bfloat16), device)
    xla = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32).astype(x.dtype))
    hlo = xla.lower(a, b).compile().as_text()
    kernels = sorted(set(re.findall(r"custom_call_target=\"([^\"]+)\"|(gemm_fusion\w*)", hlo)))
    variants = {"xla": (xla, (a, b)), "xla-bf16-dot": (jax.jit(jnp.dot), (a, b))}
    for width in (1, 8):
        config = tuning_config(cg.FusedTiles(grid_tile_width=width))
        variants[f"mosaic-w{width}"] = (
            jax.jit(lambda x, y, c=config: hm.matmul(x, y, None, config=c)),
            (a, b),
        )
    results = cg.bench.benchmark_interleaved(variants, iters=args.iters)
    out = {
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "shape": [m, k, n],
        "xla_kernels": ["".join(k) for k in kernels],
        "ms": {name: r.median for name, r in results.items()},
        "torch_cublas_ms": torch_ms(m, k, n, args.iters),
        "tflops": {name: 2 * m * k * n / r.median / 1e9 for name, r in results.items()},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"gemm_lead_{args.name}.json").write_text(json.dumps(out, indent=1))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
