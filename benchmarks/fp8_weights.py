"""A weight quantized before the call (`cg.quantize_weight`, as for serving: the
`QuantizedWeight` an argument of the forward's program), on one GPU: the all-gather op on a
one-device axis (its local GEMM, XLA's FP8 GEMM) with w [K, N] quantized before, with and
without its float8 values kept transposed (`keep_transposed=True`), against the same w stored
[N, K] (`w_transposed=True`, no transpose either way), the op quantizing w itself (current
scaling), and bf16; for the presets' local AG shapes at P = 2 and a decode step's few rows.
Device periods, interleaved, medians of 6 rounds; the compiled HLO of each float8 variant is
checked for transposes or copies of a float8 operand (`fp8_gemm.hlo_facts`).
Writes OUT/fp8_weights.json.

    PYTHONPATH=. python benchmarks/fp8_weights.py --out DIR
"""

from __future__ import annotations

import argparse
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from fp8_gemm import hlo_facts  # this directory, as the script runs
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import commgemm as cg
from commgemm.bench.problems import PRESETS
from commgemm.bench.record import record
from commgemm.bench.spans import device_periods_interleaved

MODE = cg.ScalingMode.CURRENT_TENSOR_SCALING
ROWS = (64, 8192)  # a decode step's tokens, a prefill's


def variants(mesh, x, w) -> dict:
    """{name: (jitted fn, args)}: the op on x and w as each variant passes w."""
    rep = P()

    def op(w_spec, w_transposed=False, scaling=MODE):
        f = jax.shard_map(lambda a, b: cg.all_gather_matmul(a, b, "x", w_transposed=w_transposed,
                                                            scaling=scaling),
                          mesh=mesh, in_specs=(P("x"), w_spec), out_specs=P("x"))  # fmt: skip
        return jax.jit(f)

    def quantized(b, keep, axis=0):
        return cg.quantize_weight(b, MODE, axis=axis, keep_transposed=keep)

    spec = lambda q: jax.tree.map(lambda _: rep, q)  # noqa: E731
    qw, kept, qw_nk = quantized(w, False), quantized(w, True), quantized(w.T, False, axis=1)
    return {
        "bf16": (op(rep, scaling=None), (x, w)),
        "fp8, quantizing w in the call": (op(rep), (x, w)),
        "fp8, w quantized before": (op(spec(qw)), (x, qw)),
        "fp8, w quantized before, kept transposed": (op(spec(kept)), (x, kept)),
        "fp8, w [N, K] quantized before (w_transposed)": (op(spec(qw_nk), True), (x, qw_nk)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--presets", default="llama8b_mlp,llama70b_mlp")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
    rows = []
    for preset in args.presets.split(","):
        _, k, n = PRESETS[preset]
        n //= 2  # the AG's local columns at P = 2
        for m in ROWS:
            kx, kw = jax.random.split(jax.random.key(m + k + n))
            x = jax.random.normal(kx, (m, k), jnp.bfloat16)
            w = (jax.random.normal(kw, (k, n), jnp.float32) / k**0.5).astype(jnp.bfloat16)
            found = variants(mesh, x, w)
            outs = {name: np.float32(fn(*a)) for name, (fn, a) in found.items()}
            ref = outs["fp8, w quantized before"]
            same = {name: bool((o == ref).all()) for name, o in outs.items() if "before" in name}
            hlo = {name: hlo_facts(fn, a) for name, (fn, a) in found.items() if name != "bf16"}
            timed = device_periods_interleaved(found, rounds=6)
            ms = {name: t.get("median") for name, t in timed.items()}
            row = {"preset": preset, "shape": [m, k, n], "ms": ms, "same_as_quantized_before": same,
                   "hlo": hlo}  # fmt: skip
            record(args.out / "fp8_weights.json", rows, row)


if __name__ == "__main__":
    main()
