"""Where the direct RS kernel's time goes inside one call, per compute warpgroup, from Mosaic
GPU's on-device profiler.

The kernel (`direct_rs`) names its compute warpgroups' phases: "zero" (the output's
zeroing, until it has landed), "epilogue" (a tile's sums converted, staged in smem and handed to
TMA reduce-adds; it waits on earlier stores' smem reads, and at a CTA's first tile on every
device's zeroing) and "landed" (the end: this warpgroup's adds landed, the peers' awaited).
What lies between two epilogues is a tile's K loop (`commgemm.bench.kernel_trace`: cycles of
the SM's counter, medians over the warpgroups; the "ideal" K loop is the tile's FLOPs at the
tensor cores' peak per cycle).

The profiled call runs after warm-up calls; its output is compared with the same kernel's
compiled without the profiler (`max_diff_vs_unprofiled_rel`; split tails add in arrival order,
so not bit-identical).
Writes DIR/NAME.json (summaries) and DIR/NAME-<preset>-<spec>.json.gz (the raw Chrome trace of
one device).

    PYTHONPATH=. python benchmarks/kernel_profile.py --out DIR \
        [--problems llama8b_mlp:fused-direct-wgm-cm-ct-m64-n256-t0,...]
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
import pathlib
import tempfile
import time

import jax
import numpy as np

import commgemm as cg
from commgemm.bench.kernel_trace import phase_summary
from commgemm.bench.problems import make_problem
from commgemm.cli.specs import parse_method
from commgemm.mosaic_gpu import DirectRSConfig


def rs_kernel(problem, spec: str, compiler_params: dict | None = None):
    """The direct RS kernel of `spec` alone (jitted shard_map), with extra compiler params."""
    from jax.sharding import PartitionSpec as P

    from commgemm.mosaic_gpu import direct_rs

    cfg = _config(spec)
    body = functools.partial(
        direct_rs.matmul_reduce_scatter,
        axis_name="tp",
        tiles=cfg.kernel,
        compiler_params=compiler_params,
    )
    return jax.jit(
        jax.shard_map(
            body,
            mesh=problem.mesh,
            in_specs=(P(None, "tp"), P("tp", None)),
            out_specs=P("tp", None),
            check_vma=False,
        )
    )


PROBLEMS = "llama8b_mlp:fused-direct-wgm-cm-ct-m64-n256-t0"
#: profiled ranges per warpgroup (a CTA runs about 30 tiles on the presets)
SPACE = 48


def profile(preset: str, spec: str, out: pathlib.Path, name: str, warm: int) -> dict:
    from jax.experimental.pallas import mosaic_gpu as plgpu

    problem = make_problem("rs", cg.bench.PRESETS[preset], "bfloat16")
    x, w = problem.operands()
    plain = np.asarray(rs_kernel(problem, spec)(x, w), np.float32)
    trace_dir = pathlib.Path(tempfile.mkdtemp(prefix="kprof-"))
    params = dict(profile_space=SPACE, profile_dir=str(trace_dir), reduction_scratch_bytes=0)
    if "profile_bounds_check" in plgpu.CompilerParams.__dataclass_fields__:  # jax >= 0.11
        params["profile_bounds_check"] = True
    f = rs_kernel(problem, spec, params)
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
    with gzip.open(out / f"{name}-{preset}-{spec}.json.gz", "wt") as fh:
        json.dump(trace, fh)
    m, k, n = cg.bench.PRESETS[preset]
    tiles = _config(spec).kernel
    tile_flops = 2.0 * tiles.cta_m * tiles.cta_n * (k // problem.size)
    row = {"preset": preset, "spec": spec, **phase_summary(trace["traceEvents"], tile_flops)}
    # split tails add in arrival order: not bit-identical
    scale = float(np.abs(plain).max()) or 1.0
    row["max_diff_vs_unprofiled_rel"] = float(np.abs(profiled - plain).max()) / scale
    return row


def _config(spec: str) -> cg.OverlapConfig:
    cfg = parse_method(spec, "rs")
    return cfg.replace(kernel=cfg.kernel or DirectRSConfig())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--problems", default=PROBLEMS, help="preset:spec,... (direct RS kernels)")
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
