"""GPU check of the fused kernels (ATOMIC_GEMM_AG_P2P / _RS_P2P / _RS), which cannot run on the CPU:
outputs and gradients against a float32 reference (HIGHEST precision) on fresh random data, for
several shapes (presets and others), tilings and w layouts, on all GPUs; and the plan-time
errors. Exits non-zero if any check fails.

    PYTHONPATH=. python benchmarks/fused_check.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import commgemm as cg
from commgemm.cli.specs import parse_method

#: (M, K, N) global shapes; AG needs M/P % 128, N/P % 256, K % 64; RS M/P % 128, N % 256.
SHAPES = [(512, 256, 512), (2048, 1024, 1536), (4096, 3072, 2048), (8192, 4096, 14336)]
TILINGS = ["fused", "fused-w8", "fused-wgm"]
#: bf16 output: |error| <= REL * max|reference| (8 mantissa bits; RS partial sums also rounded).
REL = 1.5e-2


def sharded(op: str, mesh: Mesh, cfg: cg.OverlapConfig, w_transposed: bool):
    if op == "ag":
        specs, out = (
            (P("x", None), P(None, "x") if not w_transposed else P("x", None)),
            P(None, "x"),
        )
        fn = cg.all_gather_matmul
    else:
        specs, out = (
            (P(None, "x"), P("x", None) if not w_transposed else P(None, "x")),
            P("x", None),
        )
        fn = cg.matmul_reduce_scatter
    return jax.shard_map(
        lambda a, b: fn(a, b, "x", config=cfg, w_transposed=w_transposed),
        mesh=mesh,
        in_specs=specs,
        out_specs=out,
        check_vma=False,
    )


def relative_error(a: jax.Array, b: jax.Array) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def check(op, shape, spec, w_transposed, mesh, seed, grads=True) -> dict:
    m, k, n = shape
    kx, kw, kg = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w = (jax.random.normal(kw, (k, n), jnp.float32) / k**0.5).astype(jnp.bfloat16)
    g = jax.random.normal(kg, (m, n), jnp.bfloat16)
    stored = w.T if w_transposed else w
    f = jax.jit(sharded(op, mesh, parse_method(spec), w_transposed))
    out = f(x, stored)
    ref = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32), precision="highest")
    result = dict(
        op=op,
        shape=shape,
        spec=spec,
        w_transposed=w_transposed,
        out_rel_error=relative_error(out, ref),
    )

    if not grads:
        result["ok"] = result["out_rel_error"] <= REL
        return result

    def loss(fn):
        return lambda a, b: jnp.sum(fn(a, b).astype(jnp.float32) * g.astype(jnp.float32))

    dx, dw = jax.jit(jax.grad(loss(f), argnums=(0, 1)))(x, stored)

    def ref_fn(a, b):
        b = b.T if w_transposed else b
        return jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32), precision="highest")

    rdx, rdw = jax.jit(jax.grad(loss(ref_fn), argnums=(0, 1)))(x, stored)
    result |= dict(dx_rel_error=relative_error(dx, rdx), dw_rel_error=relative_error(dw, rdw))
    result["ok"] = all(result[e] <= REL for e in ("out_rel_error", "dx_rel_error", "dw_rel_error"))
    return result


def repeat_check(op, shape, spec, mesh, calls: int, seed: int) -> dict:
    """`calls` calls enqueued back to back (no sync between them), alternating two inputs: each
    output must equal, bit for bit, that input's output from a call run alone (with two
    devices the fused kernels' adds happen in a fixed rounding order; not with split_tail),
    and be within REL of the float32 reference. Catches state (semaphores, zeroing) leaking
    from call to call."""
    m, k, n = shape
    f = jax.jit(sharded(op, mesh, parse_method(spec), False))
    inputs, alone, refs = [], [], []
    for i in range(2):
        kx, kw = jax.random.split(jax.random.key(seed * 10 + i))
        x = jax.random.normal(kx, (m, k), jnp.bfloat16)
        w = (jax.random.normal(kw, (k, n), jnp.float32) / k**0.5).astype(jnp.bfloat16)
        inputs.append((x, w))
        alone.append(np.asarray(jax.block_until_ready(f(x, w)), np.float32))
        refs.append(jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32), precision="highest"))
    outs = [f(*inputs[i % 2]) for i in range(calls)]
    same = [
        bool(np.array_equal(np.asarray(o, np.float32), alone[i % 2])) for i, o in enumerate(outs)
    ]
    worst = max(relative_error(o, refs[i % 2]) for i, o in enumerate(outs))
    # a split tail adds a tile's K-ranges in arrival order: the last bit may vary between calls
    tiles = parse_method(spec).fused_tiles
    bitwise = tiles is None or tiles.split_tail == 1
    ok = (all(same) or not bitwise) and worst <= REL
    return dict(
        op=op,
        shape=shape,
        spec=spec,
        calls=calls,
        bitwise_equal=sum(same),
        out_rel_error=worst,
        ok=ok,
    )


def errors(mesh) -> list[dict]:
    """Plan-time errors the fused path must raise (not hang, not fall back silently)."""
    cases = [
        (
            "rows not divisible by the tile",
            "ag",
            (2 * 64, 256, 512),
            jnp.bfloat16,
            "must be divisible by the tile",
        ),
        ("float32 operands", "ag", (512, 256, 512), jnp.float32, "bfloat16 or float16"),
    ]
    out = []
    for name, op, (m, k, n), dtype, expect in cases:
        x, w = jnp.zeros((m, k), dtype), jnp.zeros((k, n), dtype)
        try:
            jax.jit(sharded(op, mesh, parse_method("fused"), False))(x, w)
            out.append(dict(case=name, ok=False, error="no error raised"))
        except ValueError as err:
            out.append(dict(case=name, ok=expect in str(err), error=str(err)[:300]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--shapes", default="all", help="indices into SHAPES, e.g. 3 (or all)")
    parser.add_argument("--ops", default="ag,rs")
    parser.add_argument("--tilings", default=",".join(TILINGS), help="on the largest shape")
    parser.add_argument("--name", default="fused_check")
    parser.add_argument("--base", default="fused", help="the spec checked on every shape")
    parser.add_argument("--no-grads", action="store_true", help="outputs only (faster)")
    parser.add_argument(
        "--repeat", type=int, default=0, help="also N back-to-back calls per op (repeat_check)"
    )
    args = parser.parse_args()
    shapes = SHAPES if args.shapes == "all" else [SHAPES[int(i)] for i in args.shapes.split(",")]
    ops = args.ops.split(",")
    tilings = [t for t in args.tilings.split(",") if t and t != args.base]
    args.out.mkdir(parents=True, exist_ok=True)
    mesh = Mesh(np.array(jax.devices()), ("x",))
    results, seed = [], 0
    cases = [(s, op, args.base, wt) for s in shapes for op in ops for wt in (False, True)]
    cases += [(shapes[-1], op, spec, False) for op in ops for spec in tilings]
    for shape, op, spec, w_transposed in cases:
        seed += 1
        try:
            r = check(op, shape, spec, w_transposed, mesh, seed, grads=not args.no_grads)
        except Exception as err:  # record and go on
            r = dict(
                op=op,
                shape=shape,
                spec=spec,
                ok=False,
                error=f"{type(err).__name__}: {str(err)[:500]}",
            )
        results.append(r)
        print(json.dumps(r), flush=True)
    if args.repeat:
        for op in ops:
            seed += 1
            try:
                r = repeat_check(op, shapes[-1], args.base, mesh, args.repeat, seed)
            except Exception as err:  # record and go on
                r = dict(op=op, spec=args.base, ok=False, error=f"{type(err).__name__}: {err}")
            results.append(r)
            print(json.dumps(r), flush=True)
    errs = errors(mesh)
    for e in errs:
        print(json.dumps(e), flush=True)
    ok = all(r["ok"] for r in results + errs)
    (args.out / f"{args.name}.json").write_text(
        json.dumps(
            dict(devices=len(jax.devices()), rel_tolerance=REL, ok=ok, checks=results, errors=errs),
            indent=1,
        )
    )
    print(
        f"fused check: {sum(r['ok'] for r in results)}/{len(results)} numeric, "
        f"{sum(e['ok'] for e in errs)}/{len(errs)} errors; ok={ok}"
    )
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
