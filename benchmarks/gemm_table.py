"""The presets' local GEMMs on one GPU: XLA's dot, jax's Mosaic GPU Hopper matmul (a few
tilings, the best kept) and cuBLAS through torch, for AG and RS at P = 2, 4 and 8, bf16. The
jax variants are timed interleaved by device periods (medians of 6 rounds, one trace per
shape); torch's by CUDA events (median of 30 calls after 5 warm-up ones), in the same process.
Writes OUT/gemm_table.json.

    PYTHONPATH=. python benchmarks/gemm_table.py --out DIR
"""

from __future__ import annotations

import argparse
import os
import pathlib

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")  # room for torch beside jax

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from commgemm.bench.problems import PRESETS  # noqa: E402
from commgemm.bench.record import record  # noqa: E402
from commgemm.bench.spans import device_periods_interleaved  # noqa: E402

TILINGS = [(128, 128, 64, 4), (128, 256, 64, 4), (256, 128, 64, 4)]


def local_shapes():
    for preset, (m, k, n) in PRESETS.items():
        if preset == "notebook":
            continue
        for size in (2, 4, 8):
            yield preset, "ag", size, (m, k, n // size)
            yield preset, "rs", size, (m, k // size, n)


def mosaic(tiling):
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm

    tm, tn, tk, stages = tiling
    config = hm.TuningConfig(tile_m=tm, tile_n=tn, tile_k=tk, max_concurrent_steps=stages,
                             grid_tile_width=8)  # fmt: skip
    return jax.jit(lambda a, b: hm.matmul(a, b, None, config))


def events_ms(call, kernels: dict | None = None, label: str = "torch") -> float:
    """Median of 30 calls of a torch `call` by CUDA events, after 5 warm-up calls; with
    `kernels`, kernels[label] = the CUDA kernels one call ran (torch.profiler), " + "-joined."""
    import torch

    for _ in range(5):
        call()
    if kernels is not None:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        kernels[label] = " + ".join(names)
    times = []
    for _ in range(30):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def torch_ms(m: int, k: int, n: int, kernels: dict | None = None, label: str = "torch"):
    try:
        import torch
    except ImportError:
        return None
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    return events_ms(lambda: torch.matmul(a, b), kernels, label)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for preset, op, size, (m, k, n) in local_shapes():
        ka, kb = jax.random.split(jax.random.key(m + k + n))
        a = jax.random.normal(ka, (m, k), jnp.bfloat16)
        b = (jax.random.normal(kb, (k, n), jnp.float32) / k**0.5).astype(jnp.bfloat16)
        variants = {"xla dot": (jax.jit(jnp.dot), (a, b))}
        ref = variants["xla dot"][0](a, b).astype(jnp.float32)
        for tiling in TILINGS:
            if m % tiling[0] or n % tiling[1] or k % tiling[2]:
                continue
            f = mosaic(tiling)
            try:
                err = float(jnp.abs(f(a, b).astype(jnp.float32) - ref).max())
            except Exception as e:  # noqa: BLE001 - a tiling that does not fit: recorded
                rows.append({"preset": preset, "op": op, "P": size, "tiling": tiling,
                             "error": str(e)[:200]})  # fmt: skip
                continue
            variants[f"mosaic {tiling}"] = (f, (a, b))
            assert err <= 0.05 * float(jnp.abs(ref).max()), (tiling, err)
        found = device_periods_interleaved(variants, rounds=6)
        ms = {name: f["median"] for name, f in found.items() if "median" in f}
        ms["torch cuBLAS (events)"] = torch_ms(m, k, n)
        flops = 2.0 * m * k * n
        mosaic_best = min((t for name, t in ms.items() if name.startswith("mosaic")), default=None)
        row = {
            "preset": preset, "op": op, "P": size, "shape": [m, k, n], "ms": ms,
            "tflops": {name: flops / (t * 1e-3) / 1e12 for name, t in ms.items() if t},
            "mosaic_best_vs_xla": mosaic_best / ms["xla dot"] if mosaic_best else None,
        }  # fmt: skip
        record(args.out / "gemm_table.json", rows, row)


if __name__ == "__main__":
    main()
