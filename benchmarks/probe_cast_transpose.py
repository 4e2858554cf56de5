"""Probe (leaves with its answer): a Pallas (Triton) cast-transpose for float8 quantizing,
x [M, K] bf16 times a scale -> float8 x [M, K] and x^T [K, M] from one read, against XLA's
fused cast-transpose (the one kernel XLA makes of the same two converts). Bit equality and
device periods for block shapes and warps, on the layers' operand shapes. Writes
OUT/probe_cast_transpose.json.

    PYTHONPATH=. python benchmarks/probe_cast_transpose.py --out DIR [--interpret]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from grouped_gemm import timed  # noqa: E402

E4M3 = jnp.float8_e4m3fn


def xla(x, s, dtype=E4M3):
    top = float(jnp.finfo(dtype).max)
    q = jnp.clip(x.astype(jnp.float32) * s[0], -top, top).astype(dtype)
    return q, q.T


def pallas(x, s, dtype=E4M3, bm=64, bk=64, warps=4, stages=1, interpret=False):
    m, k = x.shape
    top = float(jnp.finfo(dtype).max)

    def kernel(x_ref, s_ref, q_ref, qt_ref):
        v = jnp.clip(x_ref[...].astype(jnp.float32) * s_ref[0], -top, top).astype(dtype)
        q_ref[...] = v
        qt_ref[...] = v.T

    params = None
    if not interpret:
        from jax.experimental.pallas import triton as pltriton

        params = pltriton.CompilerParams(num_warps=warps, num_stages=stages)
    return pl.pallas_call(
        kernel,
        grid=(m // bm, k // bk),
        in_specs=[
            pl.BlockSpec((bm, bk), lambda i, j: (i, j)),
            pl.BlockSpec((1,), lambda i, j: (0,)),
        ],
        out_specs=[
            pl.BlockSpec((bm, bk), lambda i, j: (i, j)),
            pl.BlockSpec((bk, bm), lambda i, j: (j, i)),
        ],
        out_shape=[jax.ShapeDtypeStruct((m, k), dtype), jax.ShapeDtypeStruct((k, m), dtype)],
        compiler_params=params,
        interpret=interpret,
    )(x, s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--interpret", action="store_true", help="a CPU check of the values")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    shapes = [(256, 128)] if args.interpret else [(8192, 8192), (8192, 2048), (2048, 8192)]
    tilings = [(64, 64, 4), (128, 64, 4), (64, 128, 4), (128, 128, 8), (32, 128, 4)]
    rows = []
    for m, k in shapes:
        x = jax.random.normal(jax.random.key(m + k), (m, k), jnp.bfloat16) * 50
        s = jnp.asarray([448.0 / float(jnp.max(jnp.abs(x)))], jnp.float32)
        want = jax.jit(xla)(x, s)
        variants = {"xla": (jax.jit(xla), (x, s))}
        equal = {}
        for bm, bk, warps in tilings:
            name = f"pallas {bm}x{bk} w{warps}"
            fn = jax.jit(lambda a, b, bm=bm, bk=bk, w=warps: pallas(
                a, b, bm=bm, bk=bk, warps=w, interpret=args.interpret))  # fmt: skip
            try:
                got = fn(x, s)
            except Exception as err:  # noqa: BLE001
                equal[name] = f"{type(err).__name__}: {str(err)[:300]}"
                continue
            equal[name] = all(bool(jnp.array_equal(a.view(jnp.uint8), b.view(jnp.uint8)))
                              for a, b in zip(got, want, strict=True))  # fmt: skip
            variants[name] = (fn, (x, s))
        times, timing = ({}, "none") if args.interpret else timed(variants)
        moved = m * k * (2 + 1 + 1)
        row = {"m": m, "k": k, "equal_to_xla": equal, "timing": timing, "ms": times,
               "tb_per_s": {n: moved / (t * 1e-3) / 1e12 for n, t in times.items()}}  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)
    meta = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": rows}
    (args.out / "probe_cast_transpose.json").write_text(json.dumps(meta, indent=1))


if __name__ == "__main__":
    main()
