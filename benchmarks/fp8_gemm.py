"""FP8 against bf16 on one GPU, for the presets' local GEMMs at P = 2 (AG and RS): XLA's bf16
dot, our tensor-scaled FP8 GEMM (commgemm.scaled: float8 operands, W stored [N, K], a bf16
result with the scales folded in) with fast or split accumulation, the float32-result form it
replaced, the same with the quantization of both operands included (what an op pays per call,
current scaling), and torch's bf16 matmul and
torch._scaled_mm (fast and split accumulation). jax variants: device periods, interleaved,
medians of 6 rounds; torch: CUDA events, median of 30 calls. Errors: max |out - ref| / max |ref|
against the float32 product of the same quantized operands. The compiled HLO of each jax
variant is checked for cuBLASLt's FP8 GEMM and for transposes or copies of a float8 operand.
Writes OUT/fp8_gemm.json.

    PYTHONPATH=. python benchmarks/fp8_gemm.py --out DIR
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")  # room for torch beside jax

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from gemm_table import events_ms  # noqa: E402  (this directory, as the script runs)

import commgemm as cg  # noqa: E402
from commgemm import quantized_gemm, scaled  # noqa: E402
from commgemm.bench.problems import PRESETS  # noqa: E402
from commgemm.bench.record import record  # noqa: E402
from commgemm.bench.spans import device_periods_interleaved  # noqa: E402


def local_shapes():
    for preset, (m, k, n) in PRESETS.items():
        if preset != "notebook":
            yield preset, "ag", (m, k, n // 2)
            yield preset, "rs", (m, k // 2, n)


def fp8_gemm(form: str, split: bool):
    """The tensor-scaled GEMM of pre-quantized operands (W stored [N, K]): "library" as
    commgemm.scaled runs it (the float8 dot asked for a bf16 result, scaled); "f32-out" the
    float8 dot asked for a float32 result (ANY_F8_ANY_F8_F32 and its FAST_ACCUM), scaled, then
    cast: the form the library ran before this table."""
    preset = jax.lax.DotAlgorithmPreset
    dims = (((1,), (1,)), ((), ()))

    def run(a8, b8, sa, sb):
        if form == "library":
            rhs = quantized_gemm.QuantizedRhs(
                cg.ScaledTensor(b8, sb), sa, a8.shape[1], "bfloat16", split
            )
            return rhs.matmul(a8, True, "float32", jnp.bfloat16)
        algo = preset.ANY_F8_ANY_F8_F32 if split else preset.ANY_F8_ANY_F8_F32_FAST_ACCUM
        out = jax.lax.dot_general(a8, b8, dims, precision=algo, preferred_element_type=jnp.float32)
        return (out * (sa * sb)).astype(jnp.bfloat16)

    return jax.jit(run)


def hlo_facts(fn, args) -> dict:
    text = fn.lower(*args).compile().as_text()
    f8_moves = re.findall(r"= f8e4m3fn\[[^\]]*\][^ ]* (transpose|copy)\(", text)
    gemm_out = re.findall(r"= \((\w+)\[[^\]]*\][^,]*, s8\[\d+\]\{0\}\) custom-call\(", text)
    return {"cublaslt_f8": "cublas$lt$matmul$f8" in text, "f8_transposes_or_copies": f8_moves,
            "gemm_result_dtype": gemm_out}  # fmt: skip


def torch_ms(m, k, n, fp8: bool, fast: bool = False, kernels=None, label="torch") -> float | None:
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
    return events_ms(call, kernels, label)


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
        ref = jnp.dot(cg.dequantize(qa), cg.dequantize(qb), precision="highest")
        variants = {"xla bf16": (jax.jit(jnp.dot), (a, b))}
        operands = (qa.data, qb.data.T, qa.scale_inv, qb.scale_inv)
        for form in ("library", "f32-out"):
            for split in (False, True):
                name = f"fp8 {form} {'split' if split else 'fast'}"
                variants[name] = (fp8_gemm(form, split), operands)
        for split in (False, True):
            recipe = cg.ScalingRecipe(split_accumulator=(split, True, True))
            name = f"fp8 {'split' if split else 'fast'} with quantize"
            variants[name] = (jax.jit(lambda x, w, r=recipe: scaled.matmul(x, w, r)), (a, b))
        if (preset, op) == ("llama8b_mlp", "rs"):  # one program kept whole, to read
            fn, operands = variants["fp8 fast with quantize"]
            (args.out / "fp8_with_quantize_llama8b_rs.hlo.txt").write_text(
                fn.lower(*operands).compile().as_text()
            )
        errors, hlo = {}, {}
        for name, (fn, operands) in variants.items():
            out = fn(*operands).astype(jnp.float32)
            errors[name] = float(jnp.abs(out - ref).max() / jnp.abs(ref).max())
            if name != "xla bf16":
                hlo[name] = hlo_facts(fn, operands)
        found = device_periods_interleaved(variants, rounds=6)
        ms = {name: f["median"] for name, f in found.items() if "median" in f}
        kernels = {name: found[name].get("kernels") for name in found if "quantize" in name}
        ms["torch bf16 (events)"] = torch_ms(m, k, n, fp8=False)
        ms["torch _scaled_mm fast (events)"] = torch_ms(m, k, n, fp8=True, fast=True)
        ms["torch _scaled_mm split (events)"] = torch_ms(m, k, n, fp8=True, fast=False)
        flops = 2.0 * m * k * n
        best_bf16 = min(ms["xla bf16"], ms["torch bf16 (events)"] or float("inf"))
        row = {
            "preset": preset, "op": op, "shape": [m, k, n], "ms": ms,
            "tflops": {name: flops / (t * 1e-3) / 1e12 for name, t in ms.items() if t},
            "speedup_vs_best_bf16": {name: best_bf16 / t for name, t in ms.items() if t},
            "rel_error": errors, "hlo": hlo, "kernels_of_one_call": kernels,
        }  # fmt: skip
        record(args.out / "fp8_gemm.json", rows, row)


if __name__ == "__main__":
    main()
