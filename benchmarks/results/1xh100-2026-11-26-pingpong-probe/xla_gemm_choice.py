"""Probe: which kernel and tiling XLA's autotuner picks for the presets' local GEMMs (bf16 and
tensor-scaled FP8), read from the compiled HLO's backend configs.

    PYTHONPATH=. python benchmarks/xla_gemm_choice.py --out DIR

Writes DIR/xla_gemm_choice.json: for each local shape, the compiled program's GEMM calls
(custom-call targets, Triton GEMM configs) as XLA prints them.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re

import jax
import jax.numpy as jnp
from jax import lax

from commgemm.bench.problems import PRESETS


def gemm_lines(text: str) -> list[str]:
    """The lines of a compiled HLO text that run a GEMM: cuBLAS custom calls and Triton GEMM
    fusions with their configs."""
    keep = []
    for line in text.splitlines():
        if re.search(r"__cublas|triton_gemm_config|__triton|kCustom|cudnn", line):
            keep.append(re.sub(r"\s+", " ", line.strip())[:1500])
    return keep


def dot_nk(x, y):
    """x [M, K] times y [N, K], bf16 out."""
    return lax.dot_general(x, y, (((1,), (1,)), ((), ())), preferred_element_type=jnp.bfloat16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for preset, (m, k, n) in PRESETS.items():
        if preset == "notebook":
            continue
        for size in (2, 4, 8):
            for op, (mm, kk, nn) in (("ag", (m, k, n // size)), ("rs", (m, k // size, n))):
                a = jnp.zeros((mm, kk), jnp.bfloat16)
                b = jnp.zeros((kk, nn), jnp.bfloat16)
                dot = lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.bfloat16)  # noqa: E731
                text = jax.jit(dot).lower(a, b).compile().as_text()
                row = {"preset": preset, "op": op, "P": size, "shape": [mm, kk, nn],
                       "bf16": gemm_lines(text)}  # fmt: skip
                if size == 2:
                    a8 = a.astype(jnp.float8_e4m3fn)
                    b8 = jnp.zeros((nn, kk), jnp.float8_e4m3fn)
                    row["fp8"] = gemm_lines(jax.jit(dot_nk).lower(a8, b8).compile().as_text())
                rows.append(row)
                print(json.dumps(row)[:600], flush=True)
    (args.out / "xla_gemm_choice.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
