"""Run by tests/gpu/test_multiprocess_gpu.py under `commgemm launch -n P --gpus-per-process 1`:
the fused kernels with one process per GPU, each case against a float32 reference.

Prints per case `case NAME OK ERR` (ERR: max error over the largest reference value) or, where
the kernels cannot run in this job (`peers.multiprocess_reason`), `refused REASON` after
checking that an explicit fused config raises with that reason."""

import commgemm as cg

cg.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from commgemm.mosaic_gpu import peers  # noqa: E402

n = jax.device_count()
mesh = Mesh(np.array(jax.devices()), ("x",))
rng = np.random.default_rng(7)  # the same data on every process
M, K, N = 1024 * n, 512 * n, 768 * n
x = rng.standard_normal((M, K)).astype(jnp.bfloat16)
w = rng.standard_normal((K, N)).astype(jnp.bfloat16)
dy = rng.standard_normal((M, N)).astype(jnp.bfloat16)
x32, w32, dy32 = (a.astype(np.float32) for a in (x, w, dy))
SPECS = {"ag": ((P("x", None), P(None, "x")), P(None, "x")),
         "rs": ((P(None, "x"), P("x", None)), P("x", None))}  # fmt: skip


def put(a, spec):
    return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec), lambda i: a[i])


def gathered(a):
    return np.asarray(multihost_utils.process_allgather(a, tiled=True), np.float32)


def error(got, want):
    return float(np.abs(gathered(got) - want).max() / np.abs(want).max())


def run(op, method, grad):
    cfg = cg.OverlapConfig(method=method, atomic_gemm=True)
    fn = cg.all_gather_matmul if op == "ag" else cg.matmul_reduce_scatter
    specs, out = SPECS[op]
    f = jax.shard_map(lambda a, b: fn(a, b, "x", config=cfg), mesh=mesh, in_specs=specs,
                      out_specs=out)  # fmt: skip
    a, b = put(x, specs[0]), put(w, specs[1])
    if not grad:
        return [error(jax.jit(f)(a, b), x32 @ w32)]
    loss = lambda a, b, d: jnp.sum(f(a, b).astype(jnp.float32) * d.astype(jnp.float32))  # noqa: E731
    dx, dw = jax.jit(jax.grad(loss, (0, 1)))(a, b, put(dy, out))
    return [error(dx, dy32 @ w32.T), error(dw, x32.T @ dy32)]


reason = peers.multiprocess_reason() if jax.process_count() > 1 else None
if reason is not None:
    try:
        run("ag", "pipeline", grad=False)
    except ValueError as err:
        assert reason in str(err), (reason, str(err))
        print("refused", reason, flush=True)
    else:
        raise AssertionError(f"an explicit fused config ran although: {reason}")
else:
    for op in ("ag", "rs"):
        for method, grad in (("ring_exchange", False), ("pipeline", False), ("pipeline", True)):
            errors = run(op, method, grad)
            ok = max(errors) < 2e-2  # bf16 outputs of K-long float32 sums: a few 2^-8
            print("case", f"{op}-{method}{'-grad' if grad else ''}", "OK" if ok else "BAD",
                  " ".join(f"{e:.4f}" for e in errors), flush=True)  # fmt: skip
