"""FP8 against bf16 on one GPU, for the presets' local GEMMs at P = 2 (AG and RS): XLA's bf16
dot, our tensor-scaled FP8 GEMM (commgemm.scaled: float8 operands, scales applied to the float32
result) with fast or split accumulation and W stored [K, N] or [N, K], the same with the
quantization of both operands included (what an op pays per call), and torch's bf16 matmul and
torch._scaled_mm (fast and split accumulation). jax variants: device periods, interleaved,
medians of 6 rounds; torch: CUDA events, median of 30 calls. Errors: max |out - ref| / max |ref|
against the float32 product of the same quantized operands. The compiled HLO of each jax
variant is checked for cuBLASLt's FP8 GEMM and for transposes or copies of a float8 operand.
Writes OUT/fp8_gemm.json.

    PYTHONPATH=. python benchmarks/fp8_gemm.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")  # room for torch beside jax

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import commgemm as cg  # noqa: E402
from commgemm import scaled  # noqa: E402
from commgemm.bench.problems import PRESETS  # noqa: E402
from commgemm.bench.spans import device_periods_interleaved  # noqa: E402


def local_shapes():
    for preset, (m, k, n) in PRESETS.items():
        if preset != "notebook":
            yield preset, "ag", (m, k, n // 2)
            yield preset, "rs", (m, k // 2, n)


def fp8_gemm(split: bool, transposed: bool):
    """Our tensor-scaled GEMM on pre-quantized operands (QuantizedRhs.matmul, as the ops run)."""

    def run(a8, b8, sa, sb):
        rhs = scaled.QuantizedRhs(cg.ScaledTensor(b8, sb), sa, a8.shape[1], "bfloat16", split)
        return rhs.matmul(a8, transposed, "float32", jnp.bfloat16)

    return jax.jit(run)


def hlo_facts(fn, args) -> dict:
    text = fn.lower(*args).compile().as_text()
    f8_moves = re.findall(r"= f8e4m3fn\[[^\]]*\][^ ]* (transpose|copy)\(", text)
    return {"cublaslt_f8": "cublas$lt$matmul$f8" in text, "f8_transposes_or_copies": f8_moves}


def torch_ms(m, k, n, fp8: bool, fast: bool = False) -> float | None:
    try:
        import torch
    except ImportError:
        return None
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    if fp8:
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
        one = torch.ones((), device="cuda")
        call = lambda: torch._scaled_mm(a8, b8.t(), one, one, out_dtype=torch.bfloat16,  # noqa: E731
                                        use_fast_accum=fast)  # fmt: skip
    else:
        bt = b.t().contiguous()
        call = lambda: torch.matmul(a, bt)  # noqa: E731
    for _ in range(5):
        call()
    times = []
    for _ in range(30):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for preset, op, (m, k, n) in local_shapes():
        ka, kb = jax.random.split(jax.random.key(m + k + n))
        a = jax.random.normal(ka, (m, k), jnp.bfloat16)
        b = (jax.random.normal(kb, (k, n), jnp.float32) / k**0.5).astype(jnp.bfloat16)
        qa, qb = cg.quantize(a, "current_tensor_scaling"), cg.quantize(b, "current_tensor_scaling")
        b8t = qb.data.T
        ref = jnp.dot(cg.dequantize(qa), cg.dequantize(qb), precision="highest")
        variants = {"xla bf16": (jax.jit(jnp.dot), (a, b))}
        for split in (False, True):
            for transposed in (False, True):
                name = f"fp8 {'split' if split else 'fast'} w{'[N,K]' if transposed else '[K,N]'}"
                operands = (qa.data, b8t if transposed else qb.data, qa.scale_inv, qb.scale_inv)
                variants[name] = (fp8_gemm(split, transposed), operands)
        for split in (False, True):
            recipe = cg.ScalingRecipe(split_accumulator=(split, True, True))
            name = f"fp8 {'split' if split else 'fast'} with quantize"
            variants[name] = (jax.jit(lambda x, w, r=recipe: scaled.matmul(x, w, r)), (a, b))
        errors, hlo = {}, {}
        for name, (fn, operands) in variants.items():
            out = fn(*operands).astype(jnp.float32)
            errors[name] = float(jnp.abs(out - ref).max() / jnp.abs(ref).max())
            if name != "xla bf16":
                hlo[name] = hlo_facts(fn, operands)
        found = device_periods_interleaved(variants, rounds=6)
        ms = {name: f["median"] for name, f in found.items() if "median" in f}
        ms["torch bf16 (events)"] = torch_ms(m, k, n, fp8=False)
        ms["torch _scaled_mm fast (events)"] = torch_ms(m, k, n, fp8=True, fast=True)
        ms["torch _scaled_mm split (events)"] = torch_ms(m, k, n, fp8=True, fast=False)
        flops = 2.0 * m * k * n
        best_bf16 = min(t for name, t in ms.items() if t and "bf16" in name)
        row = {
            "preset": preset, "op": op, "shape": [m, k, n], "ms": ms,
            "tflops": {name: flops / (t * 1e-3) / 1e12 for name, t in ms.items() if t},
            "speedup_vs_best_bf16": {name: best_bf16 / t for name, t in ms.items() if t},
            "rel_error": errors, "hlo": hlo,
        }  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)
        (args.out / "fp8_gemm.json").write_text(json.dumps(
            {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": rows},
            indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
