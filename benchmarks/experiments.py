"""Diagnostics for the performance issue, on a GPU machine (one process, all GPUs):

1. the scheduled GPU HLO of each method: the order of collective starts / dones and GEMMs, and
   whether XLA combined the chunk collectives;
2. the local GEMM with a float32 result then a cast, against a bf16 result (cuBLAS accumulates
   in float32 either way).

    PYTHONPATH=. python benchmarks/experiments.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re

import jax
import jax.numpy as jnp

import commgemm as cg

EVENT = re.compile(
    r"^\s*(?:ROOT )?%?(\S+) = .*? (all-gather-start|all-gather-done|reduce-scatter|"
    r"all-reduce-start|all-reduce-done|collective-permute-start|collective-permute-done|"
    r"custom-call|fusion|all-gather|collective-permute)\((.*)$"
)


def schedule(text: str) -> list[str]:
    """The ENTRY computation's collectives and GEMMs, in scheduled order."""
    entry = text[text.index("ENTRY") :]
    entry = entry[: entry.index("\n}\n")] if "\n}\n" in entry else entry
    events = []
    for line in entry.splitlines():
        m = EVENT.match(line)
        if not m:
            continue
        name, kind, rest = m.groups()
        if kind in ("custom-call", "fusion") and not re.search(r"gemm|cublas|dot", line, re.I):
            continue
        shape = line.split("=", 1)[1].strip().split(" ")[0]
        events.append(f"{kind} {name} {shape[:60]}")
    return events


def gemm_variants(shape: tuple[int, int, int], iters: int) -> dict:
    m, k, n = shape
    x = jax.random.normal(jax.random.key(0), (m, k), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (k, n), jnp.bfloat16)
    f32_cast = jax.jit(
        lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    )
    bf16_out = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.bfloat16))
    plain = jax.jit(lambda a, b: a @ b)
    out = {}
    for name, f in (("f32_then_cast", f32_cast), ("bf16_out", bf16_out), ("plain", plain)):
        out[name] = cg.bench.benchmark(f, x, w, iters=iters).median
    out["hlo_f32_then_cast"] = schedule(f32_cast.lower(x, w).compile().as_text())
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict = {"gemm": {}, "schedules": {}}
    size = len(jax.devices())
    for preset in ():
        m, k, n = cg.bench.PRESETS[preset]
        result["gemm"][preset] = gemm_variants((m, k, n // size), args.iters)
        print(preset, {a: b for a, b in result["gemm"][preset].items() if "hlo" not in a})
    m, k, n = cg.bench.PRESETS["comm_heavy"]
    for op in ("ag", "rs"):
        problem = cg.bench.make_problem(op, (m, k, n), "bfloat16")
        x, w = problem.operands()
        for spec in ("pipeline:4", "ring:2", "ring:4"):
            text = problem.overlapped(cg.bench.parse_method(spec)).lower(x, w).compile().as_text()
            events = schedule(text)
            result["schedules"][f"{op} {spec}"] = events
            (args.out / f"hlo_{op}_{spec.replace(':', '_')}.txt").write_text(text)
            print(f"--- {op} {spec}")
            print("\n".join(events))
    (args.out / "experiments.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
