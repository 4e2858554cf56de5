"""The fused kernels' GEMM core on one GPU, bf16 and FP8, against the best GEMM of each shape.

The core of a direct kernel (`direct_ag` for AG, `direct_rs` for RS) is the kernel
run with no mesh axis: the same tiles, pipeline and epilogue, with no peer to send to (the RS
kernel then stores its tiles, except a split or streamed tail's, which it adds into zeroed
tiles as on P devices; "plan-whole" is the plan with its last wave left whole, "plan-stream"
with it streamed; "ring" is the RS ring kernel, `ring_rs`, whose core is one step: a
plain GEMM in the ring's tiling; the AG ring is the direct AG kernel), on the whole local GEMM
of the P-device op ([M, K] @ [K, N/P] for AG, [M, K/P] @ [K/P, N] for RS).
Beside it, timed interleaved by device periods in one trace per shape (medians of 6 rounds):
XLA's dot, jax's Mosaic GPU Hopper matmul with the kernels' default tiling, the op itself on a
one-device mesh with either local GEMM (`local_gemm` "xla" and "mosaic": the serial path's two
choices), XLA's tensor-scaled FP8 GEMM as the ops run it, the FP8 core (float8 x and w laid out
[N, K], the scales applied in the epilogue, as `fused` runs it); and cuBLAS through torch (bf16
and `_scaled_mm`, CUDA events, same process). A kernel that cannot run a shape (not whole
tiles) is listed under "failed". Writes OUT/fused_core.json.

    PYTHONPATH=. python benchmarks/fused_core.py --out DIR [--sizes 2,4,8] [--fp8-sweep]
        [--presets llama8b_mlp,...] [--ops ag,rs]

--fp8-sweep also times the FP8 core in `FP8_SWEEP`'s tilings (two warpgroups along M: 256 x 128
CTA tiles, the shape cuBLAS's FP8 kernels favour), a question for the FP8 plan; --bf16-sweep
the bf16 core in `BF16_SWEEP`'s (256 x 128 CTA tiles, clusters along N). Each row names the
kernel each variant ran ("kernels": the main kernel of its calls in the trace; torch's by
torch.profiler), which says which cuBLASLt kernel XLA's autotuner picked. --pp-sweep times the
ping-pong kernels in `PP_SWEEP`'s tilings.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")  # room for torch beside jax

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from fp8_gemm import torch_ms as torch_fp8_ms  # noqa: E402
from gemm_table import mosaic  # noqa: E402
from gemm_table import torch_ms as torch_bf16_ms  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import commgemm as cg  # noqa: E402
from commgemm import quantized_gemm  # noqa: E402
from commgemm.bench.problems import PRESETS  # noqa: E402
from commgemm.bench.record import record  # noqa: E402
from commgemm.bench.spans import device_periods_interleaved  # noqa: E402
from commgemm.cli.specs import fused_spec  # noqa: E402
from commgemm.mosaic_gpu import (  # noqa: E402
    DirectAGConfig,
    DirectRSConfig,
    RingRSConfig,
    fused,
    gemm_core,
    heuristics,
)
from commgemm.mosaic_gpu.configs import (  # noqa: E402
    PINGPONG_FAMILIES,
    PingPongAGConfig,
    PingPongRSConfig,
)

#: H200's dense bf16 tensor-core peak, TFLOP/s (FP8: twice that).
PEAK_BF16 = 989.0


#: The RS plan's warpgroup tiling (`heuristics.direct_rs_config`) with 128-element K-steps.
_RS_64x256 = dict(wg_along_m=True, tile_m=64, tile_n=256, cluster="m", tile_k=128)
#: Extra FP8 tilings of `--fp8-sweep`, per op (128-element K-steps): CTA tiles 256 x 128 (two
#: warpgroups along M, the shape cuBLAS's FP8 kernels favour), wider and narrower grid bands,
#: the grid along M, 2-CTA clusters, 3 stages, 64 x 256 warpgroup tiles.
FP8_SWEEP = {
    "ag": [
        DirectAGConfig(wg_along_m=True, grid_minor_m=True, tile_k=128),
        DirectAGConfig(wg_along_m=True, grid_minor_m=True, cluster="m", tile_k=128),
        DirectAGConfig(wg_along_m=True, grid_tile_width=16, tile_k=128),
        DirectAGConfig(cluster="m", grid_tile_width=16, tile_k=128),
        DirectAGConfig(grid_tile_width=16, tile_k=128),
        DirectAGConfig(grid_minor_m=True, grid_tile_width=16, tile_k=128),
        DirectAGConfig(grid_minor_m=True, cluster="m", tile_k=128),
        DirectAGConfig(grid_minor_m=True, stages=3, tile_k=128),
        DirectAGConfig(wg_along_m=True, tile_m=64, tile_n=256, grid_minor_m=True, tile_k=128),
        DirectAGConfig(wg_along_m=True, tile_m=64, tile_n=256, cluster="m", tile_k=128),
    ],
    "rs": [
        DirectRSConfig(wg_along_m=True, tile_m=128, tile_n=128, tile_k=128),
        DirectRSConfig(wg_along_m=True, tile_m=128, tile_n=128, cluster="m", tile_k=128),
        DirectRSConfig(**_RS_64x256, grid_tile_width=16),
        DirectRSConfig(**_RS_64x256, grid_tile_width=4),
        DirectRSConfig(**_RS_64x256, grid_tile_width=32),
        DirectRSConfig(**_RS_64x256, grid_minor_m=True),
        DirectRSConfig(**_RS_64x256, stages=3),
        DirectRSConfig(**_RS_64x256, chain_tiles=True),
    ],
}


#: Extra bf16 tilings of `--bf16-sweep`, per op: 256 x 128 CTA tiles (two 128 x 128 warpgroup
#: tiles along M) alone and in 2-CTA clusters along M or N, and 128 x 256 tiles in clusters
#: along N: the tile and cluster shapes of the cuBLASLt kernels XLA picks for some local shapes.
BF16_SWEEP = {
    "ag": [
        DirectAGConfig(wg_along_m=True, grid_minor_m=True),
        DirectAGConfig(wg_along_m=True, grid_minor_m=True, cluster="m"),
    ],
    "rs": [
        DirectRSConfig(wg_along_m=True, split_tail=0),
        DirectRSConfig(wg_along_m=True, cluster="m", split_tail=0),
        DirectRSConfig(wg_along_m=True, cluster="n", split_tail=0),
        DirectRSConfig(wg_along_m=True, cluster="n", grid_minor_m=True, split_tail=0),
        DirectRSConfig(cluster="n", split_tail=0),
        DirectRSConfig(wg_along_m=True, tile_m=64, tile_n=256, cluster="n", split_tail=0),
    ],
}


#: Extra bf16 tilings of `--pp-sweep`, per op: the ping-pong kernels with their last wave left
#: whole (the default narrows it: `pingpong.deal`), and in bands 16 tiles wide.
PP_SWEEP = {
    op: [family(narrow_tail=False), family(grid_tile_width=16)]
    for op, family in (("ag", PingPongAGConfig), ("rs", PingPongRSConfig))
}


def local_shapes(sizes):
    for preset, (m, k, n) in PRESETS.items():
        if preset == "notebook":
            continue
        for size in sizes:
            yield preset, "ag", size, (m, k, n // size)
            yield preset, "rs", size, (m, k // size, n)


def core_tilings(op: str, size: int, local: tuple[int, int, int]) -> dict:
    """{spec: tiling} of the direct kernel of `op`: what the fused op plans for the P-device
    problem ("plan") and the tuner's extra tilings (`heuristics.TUNING_CANDIDATES`)."""
    m, k, n = local
    if op == "ag":
        plan = heuristics.direct_ag_config(m // size, n=n)
    else:
        plan = heuristics.direct_rs_config(m, size, (m, k * size, n))
    found = {"plan": alone(plan)}
    if op == "rs":  # the ring kernel's core (ATOMIC_GEMM_RS_P2P; the AG ring is the direct one)
        found["ring"] = RingRSConfig()
    for tiles in map(alone, heuristics.TUNING_CANDIDATES[op]):
        if isinstance(tiles, (type(plan), *PINGPONG_FAMILIES)) and tiles not in found.values():
            spec = fused_spec(cg.OverlapConfig(method="pipeline", atomic_gemm=True, kernel=tiles))
            found[spec.removeprefix("fused-direct").lstrip("-") or "default"] = tiles
    if op == "rs" and getattr(found["plan"], "split_tail", 1) != 1:  # its last wave left whole
        found["plan-whole"] = dataclasses.replace(found["plan"], split_tail=1)
        # or streamed (DirectRSConfig.stream_tail)
        found["plan-stream"] = dataclasses.replace(found["plan"], split_tail=1, stream_tail=True)
    if op == "ag":  # the last wave narrowed (DirectAGConfig.narrow_tail), as gemm_core runs it
        for label in ("plan", "default", "cm"):
            if label in found and found[label].cta_n % 128 == 0:  # narrowing halves 128s
                found[f"{label}-nt"] = dataclasses.replace(found[label], narrow_tail=True)
    if op == "ag" and n % 256 and n % gemm_core.COLUMNS_192 == 0:  # 128 x 192 tiles
        for label, cluster in (("n192", None), ("n192-cm", "m")):
            tiles = dataclasses.replace(
                gemm_core.tiling(n, float8=False), cluster=cluster, grid_minor_m=True
            )
            if tiles not in found.values():  # the plan's own where N is whole 192s
                found[label] = tiles
    return found


def alone(tiles):
    """`tiles` without the fields that do nothing on one device (spread, zero_ahead), so
    tilings that run alike are timed once."""
    if isinstance(tiles, PINGPONG_FAMILIES):  # zero_ahead's default: the spec stays "pp-..."
        return tiles
    fields = {"spread": 0, "zero_ahead": 0}
    return dataclasses.replace(tiles, **{f: v for f, v in fields.items() if hasattr(tiles, f)})


def core(op: str, tiles, *, float8: bool):
    """The fused kernel of `op` and `tiles`' family with no mesh axis (its GEMM core), as a
    jitted fn(a, b): b [K, N] bf16, or with float8 the QuantizedRhs of b stored [N, K] (as the
    ops pass it)."""
    method = "ring_exchange" if isinstance(tiles, RingRSConfig) else "pipeline"
    config = cg.OverlapConfig(method=method, atomic_gemm=True, kernel=tiles)
    fn = fused.all_gather_matmul if op == "ag" else fused.matmul_reduce_scatter
    return jax.jit(lambda a, b: fn(a, b, None, config, w_transposed=float8))


def serial_op(op: str, local_gemm: str):
    """The op itself on a one-device mesh (its plan: the local GEMM, NONE) with `local_gemm`."""
    mesh = jax.sharding.Mesh(jax.devices()[:1], ("x",))
    config = cg.OverlapConfig(method="none", local_gemm=local_gemm)
    fn = cg.all_gather_matmul if op == "ag" else cg.matmul_reduce_scatter
    specs = (P("x"), P(None, "x")) if op == "ag" else (P(None, "x"), P("x"))
    out = P(None, "x") if op == "ag" else P("x")
    body = lambda a, b: fn(a, b, "x", config=config)  # noqa: E731
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--sizes", default="2,4,8")
    parser.add_argument("--no-fp8", action="store_true")
    parser.add_argument("--fp8-sweep", action="store_true")
    parser.add_argument("--bf16-sweep", action="store_true")
    parser.add_argument("--pp-sweep", action="store_true")
    parser.add_argument("--presets", default=None, help="comma-separated; default: all")
    parser.add_argument("--ops", default="ag,rs")
    parser.add_argument("--tilings", default=None, help="core tilings by label; default: all")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = []
    for preset, op, size, (m, k, n) in local_shapes(sizes):
        presets = args.presets.split(",") if args.presets else [preset]
        if op not in args.ops.split(",") or preset not in presets:
            continue
        ka, kb = jax.random.split(jax.random.key(m + k + n))
        a = jax.random.normal(ka, (m, k), jnp.bfloat16)
        b = (jax.random.normal(kb, (k, n), jnp.float32) / k**0.5).astype(jnp.bfloat16)
        ref = jnp.dot(a, b, preferred_element_type=jnp.float32)
        variants = {
            "xla bf16": (jax.jit(jnp.dot), (a, b)),
            "mosaic bf16 128x128x64 s4": (mosaic((128, 128, 64, 4)), (a, b)),
            "serial op xla": (serial_op(op, "xla"), (a, b)),
            "serial op mosaic": (serial_op(op, "mosaic"), (a, b)),
        }
        tilings = {label: tiles for label, tiles in core_tilings(op, size, (m, k, n)).items()
                   if args.tilings is None or label in args.tilings.split(",")}  # fmt: skip
        for label, tiles in tilings.items():
            variants[f"core bf16 {label}"] = (core(op, tiles, float8=False), (a, b))
        sweep = [*(BF16_SWEEP[op] if args.bf16_sweep else ()),
                 *(PP_SWEEP[op] if args.pp_sweep else ())]  # fmt: skip
        for tiles in sweep:
            spec = fused_spec(cg.OverlapConfig(method="pipeline", atomic_gemm=True, kernel=tiles))
            variants[f"core bf16 sweep {spec.removeprefix('fused-direct-')}"] = (
                core(op, tiles, float8=False), (a, b))  # fmt: skip
        refs = dict.fromkeys(variants, ref)
        if not args.no_fp8:
            qa = cg.quantize(a, "current_tensor_scaling")
            qb = cg.quantize(b, "current_tensor_scaling", axis=0)
            ref8 = jnp.dot(cg.dequantize(qa), cg.dequantize(qb), precision="highest")
            b_nk = cg.ScaledTensor(qb.data.T, qb.scale_inv)
            rhs = quantized_gemm.QuantizedRhs(b_nk, qa.scale_inv, k, "bfloat16", False)
            xla8 = jax.jit(lambda x8, r: r.matmul(x8, True, "float32", jnp.bfloat16))
            variants["xla fp8 (fast)"] = (xla8, (qa.data, rhs))
            for label, tiles in tilings.items():
                tiles = fused.float8_tiling(tiles, k)  # as the fused ops run float8
                variants[f"core fp8 {label}"] = (core(op, tiles, float8=True), (qa.data, rhs))
            for tiles in FP8_SWEEP[op] if args.fp8_sweep else ():
                spec = fused_spec(cg.OverlapConfig(method="pipeline", atomic_gemm=True,
                                                   kernel=tiles))  # fmt: skip
                variants[f"core fp8 sweep {spec.removeprefix('fused-direct-')}"] = (
                    core(op, tiles, float8=True), (qa.data, rhs))  # fmt: skip
            # split accumulation: the plan's tiling as the fused ops run it (`float8_tiling`;
            # the ping-pong kernels take none)
            split = dataclasses.replace(rhs, split_accumulator=True)
            plan = core_tilings(op, size, (m, k, n))["plan"]
            if not isinstance(plan, PINGPONG_FAMILIES):
                plan = fused.float8_tiling(plan, k, split=True)
                variants["core fp8 split plan"] = (core(op, plan, float8=True), (qa.data, split))
            variants["xla fp8 (split)"] = (xla8, (qa.data, split))
            refs.update({name: ref8 for name in variants if "fp8" in name})
        errors, failed = {}, {}
        for name in list(variants):
            fn, operands = variants[name]
            try:
                out = fn(*operands).astype(jnp.float32)
            except Exception as e:  # noqa: BLE001 - a kernel that cannot run this shape: recorded
                failed[name] = str(e)[:300]
                del variants[name]
                continue
            errors[name] = float(jnp.abs(out - refs[name]).max() / jnp.abs(refs[name]).max())
        # 5 ms between batches: a host stall inside a batch of short calls is told from them
        found = device_periods_interleaved(variants, rounds=6, gap_s=5e-3)
        ms = {name: f["median"] for name, f in found.items() if "median" in f}
        failed.update({name: f["error"] for name, f in found.items() if "error" in f})
        kernels = {name: f["main"] for name, f in found.items() if "main" in f}
        ms["torch bf16 (events)"] = torch_bf16_ms(m, k, n)
        if not args.no_fp8:
            ms["torch _scaled_mm fast (events)"] = torch_fp8_ms(m, k, n, fp8=True, fast=True)
        flops = 2.0 * m * k * n
        bf16 = {n: t for n, t in ms.items() if t and "fp8" not in n and "_scaled" not in n}
        best_bf16 = min(t for n, t in bf16.items() if not n.startswith("serial"))
        cores = [t for n, t in bf16.items() if n.startswith("core")]
        serial = {n: t for n, t in bf16.items() if n.startswith("serial")}
        row = {
            "preset": preset, "op": op, "P": size, "shape": [m, k, n], "ms": ms,
            "tflops": {name: flops / (t * 1e-3) / 1e12 for name, t in ms.items() if t},
            "best_core_bf16_vs_best_bf16": min(cores) / best_bf16 if cores else None,
            "plan_core_bf16_vs_best_bf16": ms.get("core bf16 plan", 0) / best_bf16 or None,
            # the serial path as the tuner leaves it: the faster of its two local GEMMs
            "serial_vs_xla": min(serial.values()) / ms["xla bf16"] if serial else None,
            "speedup_vs_best_bf16": {name: best_bf16 / t for name, t in ms.items() if t},
            "rel_error": errors, "failed": failed, "kernels": kernels,
        }  # fmt: skip
        row["fraction_of_peak"] = {
            name: tf / (PEAK_BF16 * (2 if "fp8" in name or "_scaled" in name else 1))
            for name, tf in row["tflops"].items()
        }
        record(args.out / "fused_core.json", rows, row)
    # torch's kernels by name, last: torch.profiler keeps CUPTI, which jax's profiler then lacks
    for done in rows if rows and rows[0]["ms"]["torch bf16 (events)"] else ():
        m, k, n = done["shape"]
        torch_bf16_ms(m, k, n, done["kernels"], "torch bf16 (events)")
        if not args.no_fp8:
            label = "torch _scaled_mm fast (events)"
            torch_fp8_ms(m, k, n, fp8=True, fast=True, kernels=done["kernels"], label=label)
    record(args.out / "fused_core.json", rows)


if __name__ == "__main__":
    main()
