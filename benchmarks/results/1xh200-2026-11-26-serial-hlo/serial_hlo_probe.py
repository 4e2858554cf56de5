"""Probe: what the serial op on a one-device mesh compiles to beside the bare dot (llama70b's
P = 2 local shapes), and the two timed alone. Run from the repository root with OUT set."""

import json
import os
import re
import sys

sys.path.insert(0, "benchmarks")

import fused_core  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from commgemm.bench.spans import device_periods_interleaved  # noqa: E402

SKIP = r" (parameter|get-tuple-element|tuple|bitcast|constant)\("
out = os.environ["OUT"]
res = {}
for op, (m, k, n) in (("rs", (8192, 4096, 28672)), ("ag", (8192, 8192, 14336))):
    a = jax.random.normal(jax.random.key(0), (m, k), jnp.bfloat16)
    b = (jax.random.normal(jax.random.key(1), (k, n), jnp.float32) / k**0.5).astype(jnp.bfloat16)
    serial = fused_core.serial_op(op, "xla")
    variants = {"dot": (jax.jit(jnp.dot), (a, b)), "op xla": (serial, (a, b))}
    for name, (fn, args) in variants.items():
        text = fn.lower(*args).compile().as_text()
        named = [line for line in text.splitlines() if re.search(r"^\s*(ROOT )?%\S+ = ", line)]
        ops = [line.strip() for line in named if not re.search(SKIP, line)]
        with open(f"{out}/{op}_{name.replace(' ', '_')}.hlo.txt", "w") as file:
            file.write(text)
        res[f"{op} {name} ops"] = [line[:200] for line in ops][:40]
    found = device_periods_interleaved(variants, rounds=6)
    res[f"{op} ms"] = {name: f.get("median") for name, f in found.items()}
with open(f"{out}/serial_hlo.json", "w") as file:
    json.dump(res, file, indent=1)
print(json.dumps({key: value for key, value in res.items() if key.endswith("ms")}))
