"""Probe (leaves with its answer): where a float8 GEMM's training step spends its time beside
the GEMMs, and whether quantizing straight into the layouts cuBLASLt's FP8 GEMMs want (the
K-minor copies: w^T for the forward, x^T and dY^T for dW) from the 16-bit values, in the
forward for x and w, saves the float8 transposes XLA inserts. One GEMM's forward and backward
(loss 0.5 |y - t|^2), M 8192 tokens, for the layers' up (K 2048, N 8192) and down (K 8192,
N 2048) shapes: bf16; commgemm's `scaled.matmul` (current tensor scaling); a replica of it;
the replica quantizing into both layouts. Device periods, kernels per step by name, and the
optimized HLO's fusions that transpose. Writes OUT/probe_fp8_layouts.json, OUT/*.hlo.txt.

    PYTHONPATH=. python benchmarks/probe_fp8_layouts.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
from jax import lax

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from grouped_gemm import timed  # noqa: E402
from layers_step import kernels  # noqa: E402

from commgemm import scaled  # noqa: E402

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
FAST, SPLIT = (
    lax.DotAlgorithmPreset.ANY_F8_ANY_F8_ANY_FAST_ACCUM,
    lax.DotAlgorithmPreset.ANY_F8_ANY_F8_ANY,
)


def scale_of(a, dtype):
    amax = jnp.max(jnp.abs(a)).astype(jnp.float32)
    return float(jnp.finfo(dtype).max) / jnp.maximum(amax, 1e-12)


def q(a, s, dtype, transposed=False):
    a, top = (a.T if transposed else a), float(jnp.finfo(dtype).max)
    return jnp.clip(a.astype(jnp.float32) * s, -top, top).astype(dtype)


def dot(a, b, dims, alg, out=jnp.bfloat16):
    if jax.default_backend() != "gpu":  # a check of the values on the CPU
        a, b, alg = a.astype(jnp.float32), b.astype(jnp.float32), None
    return lax.dot_general(a, b, (dims, ((), ())), precision=alg, preferred_element_type=out)


def make(both_layouts: bool):
    @jax.custom_vjp
    def f(x, w):
        return fwd(x, w)[0]

    def fwd(x, w):
        sx, sw = scale_of(x, E4M3), scale_of(w, E4M3)
        qx = q(x, sx, E4M3)
        if both_layouts:
            qwt = q(w, sw, E4M3, transposed=True)  # [N, K]
            y = dot(qx, qwt, ((1,), (1,)), FAST)
            res = (q(x, sx, E4M3, transposed=True), q(w, sw, E4M3), sx * sw)  # x^T, w
        else:
            qw = q(w, sw, E4M3)
            y = dot(qx, qw, ((1,), (0,)), FAST)
            res = (qx, qw, sx * sw)
        return y * (1 / (sx * sw)).astype(y.dtype), (*res, sx, sw)

    def bwd(res, dy):
        xs, qw, _, sx, sw = res
        sd = scale_of(dy, E5M2)
        qd = q(dy, sd, E5M2)
        dx = dot(qd, qw, ((1,), (1,)), SPLIT) * (1 / (sd * sw)).astype(jnp.bfloat16)
        if both_layouts:
            dw = dot(xs, q(dy, sd, E5M2, transposed=True), ((1,), (1,)), SPLIT)
        else:
            dw = dot(xs, qd, ((0,), (0,)), SPLIT)
        return dx, (dw * (1 / (sx * sd)).astype(jnp.bfloat16)).astype(jnp.bfloat16)

    f.defvjp(fwd, bwd)
    return f


def rel(a, b) -> float:
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return float(jnp.abs(a - b).max() / jnp.abs(b).max())


def step(fn):
    def loss(x, w, t):
        return 0.5 * jnp.sum(jnp.square(fn(x, w).astype(jnp.float32) - t))

    return jax.jit(jax.grad(loss, (0, 1)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    m, rows = 8192, []
    for name, k, n in (("up", 2048, 8192), ("down", 8192, 2048)):
        keys = jax.random.split(jax.random.key(k), 3)
        x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
        w = (jax.random.normal(keys[1], (k, n), jnp.float32) / k**0.5).astype(jnp.bfloat16)
        t = jax.random.normal(keys[2], (m, n), jnp.float32)
        fns = {
            "bf16": step(lambda a, b: a @ b),
            "commgemm fp8": step(lambda a, b: scaled.matmul(a, b, "current_tensor_scaling")),
            "replica fp8": step(make(False)),
            "both layouts fp8": step(make(True)),
        }
        args_ = (x, w, t)
        ref = fns["bf16"](*args_)
        errors = {}
        for v, fn in fns.items():
            got = fn(*args_)
            errors[v] = [rel(a, b) for a, b in zip(got, ref, strict=True)]
            hlo = fn.lower(*args_).compile().as_text()
            (args.out / f"{name}-{v.replace(' ', '_')}.hlo.txt").write_text(hlo)
        times, timing = timed({v: (fn, args_) for v, fn in fns.items()})
        ks = {v: kernels(fn, args_) for v, fn in fns.items()}
        row = {"shape": name, "m": m, "k": k, "n": n, "timing": timing, "ms": times,
               "errors_vs_bf16": errors, "kernels": ks}  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)
    meta = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": rows}
    (args.out / "probe_fp8_layouts.json").write_text(json.dumps(meta, indent=1))


if __name__ == "__main__":
    main()
