"""SM clock and power while one GEMM runs back to back: comm_heavy RS P = 2's local shape
(16384 x 4096 x 4096, bf16) by XLA's dot, the ping-pong core (128 x 192) and the cooperative
plan's core, each for 3 s in turn, twice (run beside `nvidia-smi --query-gpu=... -lms 50`).
Prints one JSON line a phase: variant, start and end (unix s), calls, ms a call (wall)."""

import json
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from ncu_target import k, m, make, n  # noqa: E402

a = jax.random.normal(jax.random.key(0), (m, k), jnp.bfloat16)
b = (jax.random.normal(jax.random.key(1), (k, n), jnp.float32) / k**0.5).astype(jnp.bfloat16)
fns = {v: make(v) for v in ("xla", "pp", "plan")}
for fn in fns.values():
    jax.block_until_ready(fn(a, b))
for _ in range(2):
    for name, fn in fns.items():
        start, calls = time.time(), 0
        while time.time() - start < 3.0:
            for _ in range(20):
                out = fn(a, b)
            jax.block_until_ready(out)
            calls += 20
        end = time.time()
        print(json.dumps({"variant": name, "start": start, "end": end, "calls": calls,
                          "ms": (end - start) * 1e3 / calls}), flush=True)  # fmt: skip
