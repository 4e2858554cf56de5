"""Where the layers' training step spends its device time, on all GPUs of the host: one AdamW
step of examples/train_transformer.py's decoder, commgemm.nnx with each method against
`--method xla` (XLA's own partitioning of the same model), in float32 and bf16 compute.
For each variant: the step's device period (medians of interleaved rounds; host-timed steps
beside it, `wall_ms`), and from one traced
batch of steps on GPU 0 the kernel time by kind (GEMM, collective, attention, other), how
much of the collectives' time no other kernel ran beside (exposed), and the longest kernels.

    PYTHONPATH=. python benchmarks/layers_profile.py --out DIR [--quick]

Writes DIR/layers_profile.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import statistics
import sys
import time

from commgemm.devices import setup_devices

setup_devices()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import commgemm as cg  # noqa: E402
from commgemm.bench import kernels, spans  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).parent.parent / "examples"))
import train_transformer as example  # noqa: E402

STEPS = 4  # steps in the traced batch
FULL = dict(hidden=2048, heads=16, ffn=8192, layers=4, batch=4, seq=2048, vocab=8192)
QUICK = dict(hidden=64, heads=8, ffn=128, layers=1, batch=2, seq=64, vocab=128)


def wall_periods(variants: dict, rounds: int = 4) -> dict[str, float]:
    """Host-timed ms per step, the median of `rounds` interleaved batches of STEPS steps each
    (a step of tens of ms dwarfs the dispatch): a figure for every variant, also where the
    device trace cannot be split into steps."""
    times = collections.defaultdict(list)
    for _ in range(rounds):
        for name, (fn, fn_args) in variants.items():
            start = time.perf_counter()
            jax.block_until_ready([fn(*fn_args) for _ in range(STEPS)])
            times[name].append((time.perf_counter() - start) * 1e3 / STEPS)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--quick", action="store_true", help="tiny shapes: a smoke run")
    parser.add_argument("--methods", default="xla,none,auto")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    devices = jax.devices()
    mesh = Mesh(np.array(devices).reshape(1, -1), ("data", "tp"))
    size = QUICK if args.quick else FULL
    result = {"devices": len(devices), "backend": jax.default_backend(), "jax": jax.__version__,
              "decoder": size, "rows": []}  # fmt: skip
    gpu = jax.default_backend() == "gpu"
    for dtype in args.dtypes.split(","):
        shape = example.Shape(**size, dtype=None if dtype == "float32" else dtype)
        tokens = jnp.asarray(
            np.random.default_rng(0).integers(0, shape.vocab, (shape.batch, shape.seq + 1)),
            jnp.int32,
        )
        variants = {}
        for name in args.methods.split(","):
            config = None if name == "xla" else cg.OverlapConfig(method=name)
            model, optimizer = example.build(shape, mesh, config)
            variants[name] = (example.train_step, (model, optimizer, tokens))
        row = {"dtype": dtype, "ms": {}, "profile": {}}
        result["rows"].append(row)
        save = lambda: (args.out / "layers_profile.json").write_text(json.dumps(result, indent=1))  # noqa: E731
        if gpu:  # saved after each stage: a run cut short keeps what it measured
            # batches 50 ms apart: a step that issues slower than it runs idles inside them
            found = spans.device_periods_interleaved(variants, rounds=4, gap_s=0.05)
            row["ms"] = {n: f.get("median") for n, f in found.items()}
            row["period_errors"] = {n: f["error"] for n, f in found.items() if "error" in f}
            save()
            row["wall_ms"] = wall_periods(variants)
            save()
            for name, (fn, fn_args) in variants.items():
                row["profile"][name] = kernels.profile(fn, fn_args, STEPS)
                save()
        else:
            for name, (fn, fn_args) in variants.items():
                row["ms"][name] = float(fn(*fn_args))  # a smoke run: the loss
        print(json.dumps(row), flush=True)
        save()


if __name__ == "__main__":
    main()
