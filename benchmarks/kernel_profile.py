"""Where the direct RS kernel's time goes inside one call, per compute warpgroup, from Mosaic
GPU's on-device profiler (2xH200 stage 34).

The kernel (`scatter_add_gemm`) names its compute warpgroups' phases: "zero" (the output's
zeroing, until it has landed), "epilogue" (a tile's sums converted, staged in smem and handed to
TMA reduce-adds; it waits on earlier stores' smem reads, and at a CTA's first tile on every
device's zeroing) and "landed" (the end: this warpgroup's adds landed, the peers' awaited).
What lies between two epilogues is a tile's K loop. The profiler stamps each phase with the SM's
cycle counter, so the figures are cycles of one warpgroup, comparable within a warpgroup; the
"ideal" K loop is the tile's FLOPs at 4096 bf16 FLOP per cycle per SM (H100/H200 dense peak).

The profiled call runs after warm-up calls; its output is checked against the same kernel
compiled without the profiler. Writes DIR/NAME.json (summaries) and DIR/NAME-<preset>.json.gz
(the raw Chrome trace of one device).

    PYTHONPATH=. python benchmarks/kernel_profile.py --out DIR \
        [--problems llama8b_mlp:fused-direct-wgm-cm-ct-m64-n256-t0,...]
"""

from __future__ import annotations

import argparse
import gzip
import json
import pathlib
import statistics
import sys
import tempfile
import time

import jax
import numpy as np

import commgemm as cg
from commgemm.algorithms import mosaic_tiles as mt
from commgemm.bench.problems import make_problem

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from probe import fused_variant  # noqa: E402

PROBLEMS = "llama8b_mlp:fused-direct-wgm-cm-ct-m64-n256-t0"
#: profiled ranges per warpgroup (a CTA runs about 30 tiles on the presets)
SPACE = 48
PEAK_FLOP_PER_CYCLE = 4096


def ranges(events: list[dict]) -> dict[int, list[tuple[str, float, float]]]:
    """(name, begin, end) per trace (warpgroup), in the trace's units (cycles / 1000)."""
    out: dict[int, list] = {}
    open_: dict[tuple[int, str], float] = {}
    for e in events:
        key = (e["tid"], e["name"])
        if e["ph"] == "B":
            open_[key] = e["ts"]
        elif key in open_:
            out.setdefault(e["tid"], []).append((e["name"], open_.pop(key), e["ts"]))
    return out


def summarize(events: list[dict], tile_flops: float) -> dict:
    """Medians over compute warpgroups of each phase (cycles) and its share of the span."""
    per_wg = []
    for tid, items in ranges(events).items():
        items.sort(key=lambda r: r[1])
        start, end = items[0][1], items[-1][2]
        zero = [e - b for name, b, e in items if name == "zero"]
        landed = [e - b for name, b, e in items if name == "landed"]
        epis = [(b, e) for name, b, e in items if name == "epilogue"]
        if not epis:
            continue
        prev = next((e for name, b, e in items if name == "zero"), start)
        kloops = []
        for b, e in epis:
            kloops.append(b - prev)
            prev = e
        block = (tid - 1) // 3
        per_wg.append(
            {
                "block": block,
                "span": (end - start) * 1e3,
                "zero": sum(zero) * 1e3,
                "landed": sum(landed) * 1e3,
                "first_kloop": kloops[0] * 1e3,
                "kloop": [k * 1e3 for k in kloops[1:]],
                "epilogue": [(e - b) * 1e3 for b, e in epis],
                "tiles": len(epis),
            }
        )

    def med(values):
        return statistics.median(values) if values else 0.0

    def total(w, key):
        if key == "kloop":
            return w["first_kloop"] + sum(w["kloop"])
        return sum(w[key]) if isinstance(w[key], list) else w[key]

    def share(key):
        return med([total(w, key) / w["span"] for w in per_wg])

    # with an even number of clusters a CTA's main tiles all have one owner: even clusters this
    # device's own tiles (local adds), odd clusters the peer's (adds over NVLink)
    parity = {0: [], 1: []}
    for w in per_wg:
        parity[(w["block"] // 2) % 2].extend(w["epilogue"][1:])
    block_parity = {0: [], 1: []}
    for w in per_wg:
        block_parity[w["block"] % 2].extend(w["epilogue"][1:])
    return {
        "warpgroups": len(per_wg),
        "tiles_per_warpgroup": med([w["tiles"] for w in per_wg]),
        "span_cycles": med([w["span"] for w in per_wg]),
        "zero_cycles": med([w["zero"] for w in per_wg]),
        "first_kloop_cycles": med([w["first_kloop"] for w in per_wg]),
        "kloop_cycles": med([k for w in per_wg for k in w["kloop"]]),
        "kloop_p90_cycles": float(np.percentile([k for w in per_wg for k in w["kloop"]], 90)),
        "ideal_kloop_cycles": tile_flops / PEAK_FLOP_PER_CYCLE,
        "epilogue_cycles": med([e for w in per_wg for e in w["epilogue"][1:]]),
        "first_epilogue_cycles": med([w["epilogue"][0] for w in per_wg]),
        "epilogue_cycles_even_clusters": med(parity[0]),
        "epilogue_cycles_odd_clusters": med(parity[1]),
        "epilogue_cycles_even_blocks": med(block_parity[0]),
        "epilogue_cycles_odd_blocks": med(block_parity[1]),
        "landed_cycles": med([w["landed"] for w in per_wg]),
        "share": {key: share(key) for key in ("zero", "kloop", "epilogue", "landed")},
        "span_spread_cycles": max(w["span"] for w in per_wg) - min(w["span"] for w in per_wg),
    }


def profile(preset: str, spec: str, out: pathlib.Path, name: str, warm: int) -> dict:
    from jax.experimental.pallas import mosaic_gpu as plgpu

    problem = make_problem("rs", cg.bench.PRESETS[preset], "bfloat16")
    x, w = problem.operands()
    plain = np.asarray(fused_variant(problem, spec, x, w)(x, w), np.float32)
    trace_dir = pathlib.Path(tempfile.mkdtemp(prefix="kprof-"))
    params = dict(profile_space=SPACE, profile_dir=str(trace_dir), reduction_scratch_bytes=0)
    if "profile_bounds_check" in plgpu.CompilerParams.__dataclass_fields__:  # jax >= 0.11
        params["profile_bounds_check"] = True
    mt.COMPILER_OVERRIDES.update(params)
    try:
        f = fused_variant(problem, spec, x, w)
    finally:
        mt.COMPILER_OVERRIDES.clear()
    for _ in range(warm):
        jax.block_until_ready(f(x, w))
    jax.effects_barrier()
    for path in trace_dir.glob("*.json"):  # the warm-up calls' trace: the file is written once
        path.unlink()
    profiled = np.asarray(f(x, w), np.float32)
    jax.effects_barrier()
    time.sleep(1)
    files = sorted(trace_dir.glob("*.json"))
    if not files:
        raise RuntimeError(f"no trace written to {trace_dir}")
    trace = json.loads(files[0].read_text())
    with gzip.open(out / f"{name}-{preset}-{spec.replace('@', '_')}.json.gz", "wt") as fh:
        json.dump(trace, fh)
    m, k, n = cg.bench.PRESETS[preset]
    tiles = _config(spec).fused_tiles
    tile_flops = 2.0 * tiles.cta_m * tiles.cta_n * (k // problem.size)
    row = {"preset": preset, "spec": spec, **summarize(trace["traceEvents"], tile_flops)}
    row["identical_to_unprofiled"] = bool(np.array_equal(plain, profiled))
    return row


def _config(spec: str) -> cg.OverlapConfig:
    from commgemm.bench.problems import parse_method

    cfg = parse_method(spec.partition("@")[0])
    return cfg.replace(fused_tiles=cfg.fused_tiles or cg.FusedTiles())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--problems", default=PROBLEMS, help="preset:spec[@epilogue],... (RS)")
    parser.add_argument("--name", default="kernel_profile")
    parser.add_argument("--warm", type=int, default=5)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for item in args.problems.split(","):
        preset, spec = item.split(":", 1)
        try:
            row = profile(preset, spec, args.out, args.name, args.warm)
        except Exception as err:  # noqa: BLE001 - recorded, the others still run
            row = {"preset": preset, "spec": spec, "error": f"{type(err).__name__}: {err}"[:800]}
        rows.append(row)
        (args.out / f"{args.name}.json").write_text(json.dumps(rows, indent=1))
        print(json.dumps({k: v for k, v in row.items()}, indent=None)[:1500], flush=True)


if __name__ == "__main__":
    main()
