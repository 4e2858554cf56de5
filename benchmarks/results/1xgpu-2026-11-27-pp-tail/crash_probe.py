"""Which core variant failed to launch on llama8b's AG local shape at P = 8 (call 1): each spec
in its own process, 64 calls back to back, then checked against XLA's dot.

    python crash_probe.py SPEC [M K N [OP]]    (prints one line: SPEC ok|wrong <error>)
"""

import sys

import jax
import jax.numpy as jnp

from commgemm.cli.specs import parse_fused
from commgemm.mosaic_gpu import fused

spec = sys.argv[1]
m, k, n = (int(v) for v in sys.argv[2:5]) if len(sys.argv) > 2 else (8192, 4096, 1792)
op = sys.argv[5] if len(sys.argv) > 5 else "ag"
config = parse_fused(spec, op)
fn = fused.all_gather_matmul if op == "ag" else fused.matmul_reduce_scatter
f = jax.jit(lambda a, b: fn(a, b, None, config, w_transposed=False))
ka, kb = jax.random.split(jax.random.key(m + k + n))
a = jax.random.normal(ka, (m, k), jnp.bfloat16)
b = (jax.random.normal(kb, (k, n), jnp.float32) / k**0.5).astype(jnp.bfloat16)
outs = jax.block_until_ready([f(a, b) for _ in range(64)])
ref = jnp.dot(a, b, preferred_element_type=jnp.float32)
err = max(float(jnp.abs(o.astype(jnp.float32) - ref).max() / jnp.abs(ref).max()) for o in outs)
print(spec, op, m, k, n, "ok" if err < 1e-2 else "wrong", f"{err:.4f}", flush=True)
