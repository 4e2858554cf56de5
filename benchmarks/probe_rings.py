"""Probe: commgemm's own ring kernels against the ones they replace, bf16 and float8, on every GPU.

The ring kernels (RING_EXCHANGE with atomic_gemm) used to be jax's `all_gather_lhs_matmul` (AG)
and a ring of jax's Hopper matmul kernel (RS); both are now ours (`push_gather_gemm` with
ring=True, `ring_scatter_gemm`), which take float8 operands. This times, per preset and op, in
one trace of interleaved device periods (6 rounds): the GEMM alone (XLA, two result forms), the
collective alone, the old ring (its code copied below), the new ring, the direct kernel, and
the ring and direct kernels on float8 (current tensor scaling, forward only); with each
variant's max error against the serial bf16 result. Writes OUT/probe_rings.json and .md.

    PYTHONPATH=. python benchmarks/probe_rings.py --out DIR [--presets a,b] [--ops ag,rs]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding

import commgemm as cg
from commgemm.bench.problems import PRESETS, make_problem
from commgemm.bench.spans import device_periods_interleaved
from commgemm.cli.specs import parse_method
from commgemm.mosaic_gpu import tiles as mosaic_tiles
from commgemm.mosaic_gpu.configs import RingAGConfig, RingRSConfig


def _tuning(tiles):
    """The replaced code's TuningConfig of jax's Hopper matmul (fused.tuning_config)."""
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm

    dim = hm.MatmulDimension
    return hm.TuningConfig(
        tile_m=tiles.tile_m, tile_n=tiles.tile_n, tile_k=tiles.tile_k,
        max_concurrent_steps=tiles.stages, grid_tile_width=tiles.grid_tile_width,
        grid_minor_dim=dim.M if tiles.grid_minor_m else dim.N,
        epi_tile_m=tiles.epi, epi_tile_n=tiles.epi,
        wg_dimension=dim.M if tiles.wg_along_m else dim.N,
        cluster_dimension={None: None, "m": dim.M, "n": dim.N}[getattr(tiles, "cluster", None)],
    )  # fmt: skip


def old_ring_ag(x, w, axis_name):
    from jax.experimental.pallas.ops.gpu import collective_matmul_mgpu

    return collective_matmul_mgpu.all_gather_lhs_matmul(
        x, w, axis_name, config=_tuning(RingAGConfig()), dtype=x.dtype
    )


def old_ring_rs(x, w, axis_name):
    """The replaced ATOMIC_GEMM_RS_P2P (fused._ring_reduce_scatter before this change)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm

    size = lax.axis_size(axis_name)
    rows, n = x.shape[0] // size, w.shape[1]
    num_sms = mosaic_tiles.num_sms()
    tiles = RingRSConfig()
    tuning = _tuning(tiles)
    signals_per_step = 2 * num_sms

    def body(x_ref, w_ref, out_ref, inbox_ref):
        received = pl.get_global(plgpu.SemaphoreType.REGULAR((max(size - 1, 1),)))
        wg = lax.axis_index("wg")
        here = lax.axis_index(axis_name)
        succ = mosaic_tiles.peer_id(axis_name, lax.rem(here + 1, jnp.int32(size)))
        for step in range(size):
            block = lax.rem(here + 2 * size - step - 1, jnp.int32(size))
            last = step == size - 1
            if step:
                pl.semaphore_wait(received.at[step - 1], value=signals_per_step, decrement=False)
            hm.kernel(
                x_ref.at[pl.ds(block * rows, rows)],
                w_ref,
                inbox_ref.at[step - 1] if step else None,
                out_ref if last else plgpu.remote_ref(inbox_ref, succ).at[step],
                config=tuning,
            )
            if not last:

                @pl.when(wg < 2)
                def _signal(sent=received.at[step]):
                    plgpu.wait_smem_to_gmem(0, wait_read_only=False)
                    pl.semaphore_signal(sent, device_id=succ)

    out, _ = plgpu.kernel(
        body,
        out_type=[
            jax.ShapeDtypeStruct((rows, n), x.dtype),
            jax.ShapeDtypeStruct((size - 1, rows, n), x.dtype),
        ],
        **mosaic_tiles.kernel_params(num_sms, tiles.cluster_size),
    )(x, w)
    return out


def _old(problem):
    kernel = old_ring_ag if problem.op == "ag" else old_ring_rs
    axis = problem.mesh.axis_names[0]
    body = lambda a, b: kernel(a, b, axis)  # noqa: E731
    f = jax.shard_map(body, mesh=problem.mesh, in_specs=(problem.x_spec, problem.w_spec),
                      out_specs=problem.out_spec, check_vma=False)  # fmt: skip
    return jax.jit(f, out_shardings=NamedSharding(problem.mesh, problem.out_spec))


def probe(preset: str, op: str) -> dict:
    problem = make_problem(op, PRESETS[preset], "bfloat16")
    x, w = problem.operands()
    reference = problem.overlapped(cg.OverlapConfig())(x, w)
    fp8 = "current_tensor_scaling"
    made = {
        "gemm alone": problem.gemm_alone(),
        "gemm alone (f32 result)": problem.gemm_alone(cast=True),
        "collective alone": (problem.comm_alone(), (problem.comm_operand(),)),
        "serial (NONE)": (problem.overlapped(cg.OverlapConfig()), (x, w)),
        "ring before": (_old(problem), (x, w)),
        "ring": (problem.overlapped(parse_method("fused", op)), (x, w)),
        "direct": (problem.overlapped(parse_method("fused-direct", op)), (x, w)),
        "ring fp8": (problem.overlapped(parse_method("fused", op), scaling=fp8), (x, w)),
        "direct fp8": (problem.overlapped(parse_method("fused-direct", op), scaling=fp8), (x, w)),
    }
    errors, failed, timed = {}, {}, {}
    for name, (fn, args) in made.items():
        try:
            out = jax.block_until_ready(fn(*args))
        except Exception as err:  # noqa: BLE001 - recorded, the others still run
            failed[name] = f"{type(err).__name__}: {err}"[:400]
            continue
        timed[name] = (fn, args)
        if args[0] is x:
            ref = reference.astype(jnp.float32)
            err = jnp.abs(out.astype(jnp.float32) - ref).max() / jnp.abs(ref).max()
            errors[name] = float(err)
    periods = device_periods_interleaved(timed, rounds=6)
    ms = {name: p.get("median") for name, p in periods.items()}
    return {
        "preset": preset, "op": op, "shape": PRESETS[preset], "devices": problem.size,
        "period_ms": ms, "errors": errors, "failed": failed,
        "period_errors": {n: p["error"] for n, p in periods.items() if "error" in p},
    }  # fmt: skip


def _cell(ms: dict, name: str) -> str:
    return f"{ms[name]:.3f}" if ms.get(name) else "-"


def _ratio(ms: dict, a: str, b: str) -> str:
    return f"{ms[a] / ms[b]:.3f}" if ms.get(a) and ms.get(b) else "-"


def table(rows: list[dict]) -> str:
    cols = ["gemm alone", "collective alone", "serial (NONE)", "ring before", "ring", "direct",
            "ring fp8", "direct fp8"]  # fmt: skip
    lines = ["| preset | op | " + " | ".join(cols) + " | ring / before | ring fp8 / ring |",
             "|" + "---|" * (len(cols) + 4)]  # fmt: skip
    for r in rows:
        ms = r["period_ms"]
        cells = [_cell(ms, c) for c in cols]
        cells += [_ratio(ms, "ring", "ring before"), _ratio(ms, "ring fp8", "ring")]
        lines.append(f"| {r['preset']} | {r['op']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--presets", default="llama8b_mlp,comm_heavy,llama13b_mlp,llama70b_mlp")
    parser.add_argument("--ops", default="ag,rs")
    args = parser.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for preset in args.presets.split(","):
        for op in args.ops.split(","):
            start = time.time()
            rows.append(probe(preset, op))
            print(preset, op, f"{time.time() - start:.0f} s", rows[-1], flush=True)
            (out / "probe_rings.json").write_text(json.dumps(rows, indent=1))
            (out / "probe_rings.md").write_text(table(rows) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
