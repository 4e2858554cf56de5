"""Where the fused kernels' time goes, in one GPU call (2xH200 stage 14).

For each problem, interleaved timing (`benchmark_interleaved`) and back-to-back device periods
(`device_periods`: GPU timestamps, setup kernels and gaps included) of:
- XLA's GEMM alone (both forms) and the collective alone: the bound;
- jax's Mosaic GPU Hopper matmul on the same local GEMM, as the fused kernels tile it, and with
  2-CTA clusters (TMA multicast of one operand): the GEMM loop with no communication;
- RS: the direct reduce-add kernel (`fused-direct`) with each `scatter_add_gemm` epilogue: the
  package's "add", the candidates "own-store" / "own-store-lag", and the diagnostics
  "local-add" (no NVLink), "store" (the bare GEMM loop in this kernel) and "remote-store"
  (plain stores over NVLink, no read-modify-write);
- AG: jax's all-gather matmul kernel (`fused`, `fused-w16`).
The candidates' outputs (other epilogues, clusters) are compared with the "add" kernel's
(bit-identical expected on 2 GPUs: one add of the two bf16 partial sums per element either way)
and every fused output with XLA's. Exits non-zero on errors or differing outputs.

    PYTHONPATH=. python benchmarks/probe.py --out DIR
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import pathlib
import time

import jax
import numpy as np

import commgemm as cg
import commgemm.algorithms.scatter_add_gemm as sag
from commgemm.algorithms.fused import tuning_config
from commgemm.bench.overlap import GEMM_ALONE
from commgemm.bench.problems import make_problem, parse_method

PROBLEMS = "rs:llama8b_mlp,rs:comm_heavy,ag:comm_heavy,rs:llama13b_mlp"


def mosaic_gemms(problem, errors: dict) -> dict:
    """jax's Hopper matmul on the op's local GEMM, per device, in a few tilings (compiled and
    run once here; a tiling that fails goes to `errors`)."""
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm

    _, operands = problem.gemm_alone()
    base = tuning_config(cg.FusedTiles())
    configs = {
        "mosaic gemm": base,
        "mosaic gemm w16": dataclasses.replace(base, grid_tile_width=16),
        "mosaic gemm cluster-m": dataclasses.replace(base, cluster_dimension=hm.MatmulDimension.M),
        "mosaic gemm cluster-n": dataclasses.replace(base, cluster_dimension=hm.MatmulDimension.N),
    }
    spec = jax.sharding.PartitionSpec(tuple(problem.mesh.axis_names))
    out = {}
    for name, config in configs.items():

        def body(a, b, config=config):
            return hm.matmul(a[0], b[0], None, config=config)[None]

        fn = problem._local(body, (spec, spec), spec)
        try:
            jax.block_until_ready(fn(*operands))
            out[name] = (fn, operands)
        except Exception as err:  # noqa: BLE001 - recorded, the others still run
            errors[name] = f"{type(err).__name__}: {err}"[:400]
    return out


def fused_variants(
    problem, op: str, x, w, epilogues: list[str], clusters: list[str]
) -> tuple[dict, dict]:
    """name -> (fn, args) and name -> output (float32 numpy)."""
    variants, outs = {}, {}
    if op == "ag":
        specs = {"fused": "fused", "fused-w16": "fused-w16"}
        for name, spec in specs.items():
            try:
                f = problem.overlapped(parse_method(spec))
                outs[name] = np.asarray(f(x, w), np.float32)
                variants[name] = (f, (x, w))
            except Exception as err:  # noqa: BLE001 - recorded, the others still run
                outs[name] = f"{type(err).__name__}: {err}"[:400]
        return variants, outs
    original = sag.matmul_reduce_scatter
    kernels = [("fused-direct", epilogue) for epilogue in epilogues]
    for cluster in clusters:  # 2-CTA clusters, with the package's epilogue and own-store
        kernels += [(f"fused-direct-{cluster}", e) for e in ("add", "own-store") if e in epilogues]
    for spec, epilogue in kernels:
        name = f"{spec} {epilogue}"
        sag.matmul_reduce_scatter = functools.partial(original, epilogue=epilogue)
        try:
            f = problem.overlapped(parse_method(spec))
            outs[name] = np.asarray(f(x, w), np.float32)  # traced here, with this epilogue
            variants[name] = (f, (x, w))
        except Exception as err:  # noqa: BLE001 - recorded, the others still run
            outs[name] = f"{type(err).__name__}: {err}"[:400]
        finally:
            sag.matmul_reduce_scatter = original
    return variants, outs


def probe(
    op: str, preset: str, iters: int, epilogues: list[str], clusters: list[str], check_only: bool
) -> dict:
    problem = make_problem(op, cg.bench.PRESETS[preset], "bfloat16")
    x, w = problem.operands()
    reference = np.asarray(problem.xla()(x, w), np.float32)
    variants = {
        GEMM_ALONE[False]: problem.gemm_alone(),
        GEMM_ALONE[True]: problem.gemm_alone(cast=True),
        "collective alone": (problem.comm_alone(), (problem.comm_operand(),)),
    }
    errors = {}
    if not check_only:
        variants |= mosaic_gemms(problem, errors)
    fused, outs = fused_variants(problem, op, x, w, epilogues, clusters)
    variants |= fused
    checks = {}
    for name, out in outs.items():
        if isinstance(out, str):
            errors[name] = out
            continue
        scale = float(np.abs(reference).max())
        checks[name] = {"max_diff_vs_xla_rel": float(np.abs(out - reference).max()) / scale}
        add = outs.get("fused-direct add")
        diagnostic = name.split(" ")[-1] in sag.PROBES  # wrong sums by design
        if op == "rs" and name != "fused-direct add" and not diagnostic:
            same = isinstance(add, np.ndarray) and np.array_equal(out, add)
            checks[name]["identical_to_add"] = bool(same)
    if check_only:
        return {"op": op, "preset": preset, "checks": checks, "errors": errors}
    timed = cg.bench.benchmark_interleaved(variants, iters=iters)
    periods = {}
    for name, (fn, args) in variants.items():
        try:
            periods[name] = cg.bench.device_periods(fn, *args, calls=16)
        except Exception as err:  # noqa: BLE001
            periods[name] = {"error": f"{type(err).__name__}: {err}"[:300]}
    medians = {name: r.median for name, r in timed.items()}
    t_gemm = min(medians[name] for name in GEMM_ALONE.values())
    bound = max(t_gemm, medians["collective alone"])
    period_ms = {
        name: float(np.median(p["periods"])) for name, p in periods.items() if "periods" in p
    }
    p_gemm = min(period_ms.get(name, np.inf) for name in GEMM_ALONE.values())
    p_bound = max(p_gemm, period_ms.get("collective alone", 0.0))
    return {
        "op": op,
        "preset": preset,
        "shape": list(cg.bench.PRESETS[preset]),
        "bound_ms": bound,
        "ms": medians,
        "vs_bound": {name: t / bound for name, t in medians.items()},
        "period_bound_ms": p_bound,
        "period_ms": period_ms,
        "period_vs_bound": {name: t / p_bound for name, t in period_ms.items()},
        "idle_ms": {
            name: float(np.median(p["idle"])) for name, p in periods.items() if "idle" in p
        },
        "kernels": {name: p.get("kernels") or p.get("error") for name, p in periods.items()},
        "checks": checks,
        "errors": errors,
        "timing": {name: r.as_dict() for name, r in timed.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--problems", default=PROBLEMS, help="op:preset,...")
    parser.add_argument("--epilogues", default=",".join(sag.EPILOGUES + sag.PROBES))
    parser.add_argument("--clusters", default="cm,cn", help="fused-direct cluster tilings")
    parser.add_argument("--check-only", action="store_true", help="outputs only, no timing")
    args = parser.parse_args()
    epilogues = args.epilogues.split(",")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for item in args.problems.split(","):
        op, preset = item.split(":")
        start = time.perf_counter()
        try:
            clusters = [c for c in args.clusters.split(",") if c]
            row = probe(op, preset, args.iters, epilogues, clusters, args.check_only)
        except Exception as err:  # noqa: BLE001
            row = {"op": op, "preset": preset, "error": f"{type(err).__name__}: {err}"[:600]}
        row["seconds"] = time.perf_counter() - start
        rows.append(row)
        (args.out / "probe.json").write_text(
            json.dumps({"devices": jax.device_count(), "rows": rows}, indent=1)
        )
        if "error" in row or args.check_only:
            print(op, preset, row.get("error") or row, flush=True)
            continue
        print(f"{op} {preset} bound {row['bound_ms']:.3f} ms ({row['seconds']:.0f} s)")
        for name in row["ms"]:
            period = row["period_vs_bound"].get(name)
            print(
                f"  {name:34s} {row['vs_bound'][name]:.3f}"
                f"  period {period if period is None else round(period, 3)}"
                f"  idle {row['idle_ms'].get(name)}  {row['checks'].get(name, '')}",
                flush=True,
            )
        for name, err in row["errors"].items():
            print(f"  {name}: {err}", flush=True)
    failed = [
        row["preset"]
        for row in rows
        if "error" in row
        or row["errors"]
        or any(c.get("identical_to_add") is False for c in row["checks"].values())
    ]
    if failed:
        raise SystemExit(f"errors or outputs differing from the add kernel's: {failed}")


if __name__ == "__main__":
    main()
