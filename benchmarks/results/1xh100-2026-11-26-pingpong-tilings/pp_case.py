"""One case of the ping-pong kernel on the GPU, in its own process: G M K N [lib]."""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from commgemm.mosaic_gpu import grouped_pingpong

g, m, k, n = map(int, sys.argv[1:5])
lib = len(sys.argv) > 5
rng = np.random.default_rng(0)
x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
w = jnp.asarray(rng.standard_normal((g, k, n)) / k**0.5, jnp.bfloat16)
sizes = np.bincount(rng.integers(0, g, m), minlength=g) if g > 1 else np.array([m])
sizes = jnp.asarray(sizes, jnp.int32)
try:
    if lib:  # the library's grouped GEMM and its gradient (dX on the ping-pong kernel)
        import commgemm as cg

        loss = lambda a, b: cg.grouped_matmul(a, b, sizes).astype(jnp.float32).sum()  # noqa: E731
        f = jax.jit(jax.grad(loss, (0,)))
        (dx,) = f(x, w)
        wt = jnp.swapaxes(w, 1, 2).astype(jnp.float32)
        ref = jax.lax.ragged_dot(jnp.ones((m, n), jnp.float32), wt, sizes)
        err = float(jnp.abs(dx.astype(jnp.float32) - ref).max() / jnp.abs(ref).max())
    else:
        out = jax.jit(lambda a, b, s: grouped_pingpong.grouped_matmul(a, b, s))(x, w, sizes)
        ref = jax.lax.ragged_dot(x.astype(jnp.float32), w.astype(jnp.float32), sizes)
        err = float(jnp.abs(out.astype(jnp.float32) - ref).max() / jnp.abs(ref).max())
    print(json.dumps({"case": sys.argv[1:], "ok": True, "rel_error": err}))
except Exception as e:  # noqa: BLE001 - a crash is the finding
    print(json.dumps({"case": sys.argv[1:], "ok": False, "error": str(e)[:200]}))
