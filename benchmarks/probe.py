"""Where the fused kernels' time goes, and A/B of their variants, in one GPU call (2xH200
stages 14 to 16; stage 14 ran at commit 5c3e0f1, with own-store epilogues since removed).

For each problem, device periods of every variant interleaved (`device_periods_interleaved`:
GPU timestamps, calls back to back, setup kernels and gaps included, rounds in shuffled
order), beside the interleaved host timing (`benchmark_interleaved`), of:
- XLA's GEMM alone (both forms) and the collective alone: the bound;
- "mosaic": jax's Mosaic GPU Hopper matmul on the same local GEMM, as the fused kernels tile
  it, bands 16 wide, and with 2-CTA clusters: the GEMM loop with no communication;
- fused specs (`parse_method`), with "@<epilogue>" for fused-direct's other epilogues
  (`scatter_add_gemm.EPILOGUES`; stage 34 had "@add-late-zero") and diagnostics (`PROBES`,
  e.g. "@store", "@add-unzeroed": wrong sums), and "@fenced" for the direct AG kernel's
  release-fenced flags. Stage 15 had "+alt" (an alternating block order), stage 16 "+lag" (a
  lagged schedule), both since removed.
RS outputs are compared with the first fused-direct spec's (bit-identical expected on 2 GPUs:
one add of the two bf16 partial sums per element either way; not where a split tail adds
partial sums in arrival order), every fused output with XLA's (RS_TOLERANCE).
Exits non-zero on errors or differing outputs.

    PYTHONPATH=. python benchmarks/probe.py --out DIR [--problems rs:llama8b_mlp,...]
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
import commgemm.algorithms.push_gather_gemm as pgg
import commgemm.algorithms.scatter_add_gemm as sag
from commgemm.algorithms.fused import tuning_config
from commgemm.bench.overlap import GEMM_ALONE
from commgemm.bench.problems import make_problem, parse_method

#: largest |out - XLA's| / max|XLA's| of a correct RS kernel: two bf16 partial sums added in
#: bf16 (a few bf16 ulps of the largest element)
RS_TOLERANCE = 0.02
PROBLEMS = "rs:llama8b_mlp,rs:comm_heavy,ag:comm_heavy,rs:llama13b_mlp,rs:llama70b_mlp"
VARIANTS = {
    "rs": "mosaic,fused-direct,fused-direct-cm,fused-direct-cm-w16,fused-direct@store",
    "ag": "mosaic,fused,fused-w16",
}


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


def fused_variant(problem, item: str, x, w):
    """A jitted fused op for 'spec[@epilogue]' (the epilogue traced in here; "@fenced": the
    direct AG kernel with release-fenced flags)."""
    item, _, epilogue = item.partition("@")
    if epilogue == "fenced":
        module, name, options = pgg, "all_gather_matmul", {"fenced": True}
    else:
        module, name, options = sag, "matmul_reduce_scatter", {"epilogue": epilogue or "add"}
    original = getattr(module, name)
    setattr(module, name, functools.partial(original, **options))
    try:
        f = problem.overlapped(parse_method(item))
        jax.block_until_ready(f(x, w))  # traced now, with these options
        return f
    finally:
        setattr(module, name, original)


def probe(op: str, preset: str, items: list[str], iters: int, rounds: int) -> dict:
    problem = make_problem(op, cg.bench.PRESETS[preset], "bfloat16")
    x, w = problem.operands()
    reference = np.asarray(problem.xla()(x, w), np.float32)
    scale = float(np.abs(reference).max())
    variants = {
        GEMM_ALONE[False]: problem.gemm_alone(),
        GEMM_ALONE[True]: problem.gemm_alone(cast=True),
        "collective alone": (problem.comm_alone(), (problem.comm_operand(),)),
    }
    errors, checks, first = {}, {}, None
    for item in items:
        if item == "mosaic":
            variants |= mosaic_gemms(problem, errors)
            continue
        try:
            f = fused_variant(problem, item, x, w)
        except Exception as err:  # noqa: BLE001 - recorded, the others still run
            errors[item] = f"{type(err).__name__}: {err}"[:400]
            continue
        variants[item] = (f, (x, w))
        out = np.asarray(f(x, w), np.float32)
        diff = float(np.abs(out - reference).max()) / scale
        checks[item] = {"max_diff_vs_xla_rel": diff}
        spec, _, epilogue = item.partition("@")
        if op == "rs" and epilogue in ("", *sag.CORRECT_SUMS):  # the diagnostics' are wrong
            checks[item]["ok"] = diff < RS_TOLERANCE
            tiles = parse_method(spec).fused_tiles or cg.FusedTiles()
            if tiles.split_tail == 1:  # split tails add in arrival order
                if first is None:
                    first = out
                else:
                    checks[item]["identical_to_first"] = bool(np.array_equal(out, first))
    periods = cg.bench.device_periods_interleaved(variants, rounds=rounds, calls=8)
    timed = cg.bench.benchmark_interleaved(variants, iters=iters)
    medians = {name: r.median for name, r in timed.items()}
    t_gemm = min(medians[name] for name in GEMM_ALONE.values())
    bound = max(t_gemm, medians["collective alone"])
    period_ms = {name: p["median"] for name, p in periods.items()}
    p_bound = max(min(period_ms[n] for n in GEMM_ALONE.values()), period_ms["collective alone"])
    return {
        "op": op,
        "preset": preset,
        "shape": list(cg.bench.PRESETS[preset]),
        "period_bound_ms": p_bound,
        "period_ms": period_ms,
        "period_vs_bound": {name: t / p_bound for name, t in period_ms.items()},
        "period_rounds_vs_bound": {
            name: [t / p_bound for t in p["rounds"]] for name, p in periods.items()
        },
        "idle_ms": {name: p["idle"] for name, p in periods.items()},
        "kernels": {name: p["kernels"] for name, p in periods.items()},
        "bound_ms": bound,
        "ms": medians,
        "vs_bound": {name: t / bound for name, t in medians.items()},
        "checks": checks,
        "errors": errors,
        "timing": {name: r.as_dict() for name, r in timed.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--iters", type=int, default=20, help="host-timed cycles")
    parser.add_argument("--rounds", type=int, default=6, help="device-period rounds")
    parser.add_argument("--problems", default=PROBLEMS, help="op:preset,...")
    parser.add_argument("--rs", default=VARIANTS["rs"], help="RS variants")
    parser.add_argument("--ag", default=VARIANTS["ag"], help="AG variants")
    parser.add_argument("--name", default="probe", help="the JSON's name under --out")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for item in args.problems.split(","):
        op, preset = item.split(":")
        start = time.perf_counter()
        try:
            items = getattr(args, op).split(",")
            row = probe(op, preset, items, args.iters, args.rounds)
        except Exception as err:  # noqa: BLE001
            row = {"op": op, "preset": preset, "error": f"{type(err).__name__}: {err}"[:600]}
        row["seconds"] = time.perf_counter() - start
        rows.append(row)
        (args.out / f"{args.name}.json").write_text(
            json.dumps({"devices": jax.device_count(), "rows": rows}, indent=1)
        )
        if "error" in row:
            print(op, preset, row["error"], flush=True)
            continue
        print(f"{op} {preset}: vs_bound by device periods (host timing), {row['seconds']:.0f} s")
        for name, ratio in row["period_vs_bound"].items():
            rounds = " ".join(f"{r:.2f}" for r in row["period_rounds_vs_bound"][name])
            print(
                f"  {name:34s} {ratio:.3f} ({row['vs_bound'][name]:.3f}) rounds {rounds}"
                f"  idle {row['idle_ms'][name] * 1e3:.0f} us  {row['checks'].get(name, '')}",
                flush=True,
            )
        for name, err in row["errors"].items():
            print(f"  {name}: {err}", flush=True)
    failed = [
        row["preset"]
        for row in rows
        if "error" in row
        or row["errors"]
        or any(
            c.get("identical_to_first") is False or c.get("ok") is False
            for c in row["checks"].values()
        )
    ]
    if failed:
        raise SystemExit(f"errors or outputs differing from the first kernel's: {failed}")


if __name__ == "__main__":
    main()
