"""Do the fused Mosaic GPU kernels run with one process per GPU? (`run.sh multiprocess`)

Run under `commgemm launch -n P --gpus-per-process 1` (or alone: one process for all GPUs).
Prints, per case, OK with the max relative error, or the error's last lines. jax's own Mosaic
GPU collective matmul is the control. COMMGEMM_LIFT_PROCESS_CHECK=1 lifts commgemm's checks for
several processes (NCCL >= 2.29.2, one machine: `mosaic_gpu.peers`), to see what the kernels
themselves do (docs/multiprocess.md)."""

import os
import sys
import traceback

import commgemm as cg

cg.initialize()

import functools  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

rank, n = jax.process_index(), jax.device_count()
mesh = Mesh(np.array(jax.devices()), ("x",))


def say(*a):
    print(f"[rank {rank}/{jax.process_count()}]", *a, flush=True)


def case(name, fn):
    try:
        say(name, "OK", fn())
    except Exception as err:  # noqa: BLE001
        lines = "".join(traceback.format_exception(err)).strip().splitlines()
        say(name, "FAILED:", " | ".join(lines[-6:])[:1500])


try:
    import jax.experimental.mosaic.gpu as mgpu

    say("supports_cross_device_collectives:", mgpu.supports_cross_device_collectives())
except Exception as err:  # noqa: BLE001
    say("supports_cross_device_collectives raised", err)
say(
    "jax",
    jax.__version__,
    "devices",
    n,
    "local",
    jax.local_device_count(),
    "XLA_FLAGS",
    os.environ.get("XLA_FLAGS", ""),
)


def put(a, spec):
    return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec), lambda i: a[i])


def rel(out, ref):
    out = np.asarray(
        jax.experimental.multihost_utils.process_allgather(out, tiled=True), np.float32
    )
    return float(np.abs(out - ref).max() / np.abs(ref).max())


import jax.experimental.multihost_utils  # noqa: E402

rng = np.random.default_rng(0)
M, K, N = 1024 * n, 512 * n, 768 * n
x = rng.standard_normal((M, K)).astype(jnp.bfloat16)
w = rng.standard_normal((K, N)).astype(jnp.bfloat16)
ref = x.astype(np.float32) @ w.astype(np.float32)


def control():
    from jax.experimental.pallas.ops.gpu import collective_matmul_mgpu as cm

    cfg = cm.TuningConfig(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=2)
    body = functools.partial(
        cm.all_gather_lhs_matmul, axis_name="x", config=cfg, dtype=jnp.bfloat16
    )
    f = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P("x", None), P(None, "x")),
            out_specs=P(None, "x"),
            check_vma=False,
        )
    )
    return rel(f(put(x, P("x", None)), put(w, P(None, "x"))), ref)


def ours(op, method, grad=False):
    def run():
        from commgemm.mosaic_gpu import fused, tiles

        if os.environ.get("COMMGEMM_LIFT_PROCESS_CHECK"):  # the refusal lifted, to see what fails
            fused._gpu_reason = lambda: tiles.hopper_reason()
        cfg = cg.OverlapConfig(method=method, atomic_gemm=True)
        if op == "ag":
            specs, out = (P("x", None), P(None, "x")), P(None, "x")
            body = lambda a, b: cg.all_gather_matmul(a, b, "x", config=cfg)  # noqa: E731
        else:
            specs, out = (P(None, "x"), P("x", None)), P("x", None)
            body = lambda a, b: cg.matmul_reduce_scatter(a, b, "x", config=cfg)  # noqa: E731
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=out))
        a, b = put(x, specs[0]), put(w, specs[1])
        if not grad:
            return rel(f(a, b), ref)
        g = jax.jit(jax.grad(lambda a, b: jnp.sum(f(a, b).astype(jnp.float32)), (0, 1)))
        dx, dw = g(a, b)
        want = np.ones_like(ref) @ w.astype(np.float32).T
        return rel(dx, want)

    return run


case("control: jax collective_matmul_mgpu AG", control)
for op in ("ag", "rs"):
    for method in ("ring_exchange", "pipeline"):
        case(f"commgemm {op} {method} forward", ours(op, method))
    case(f"commgemm {op} pipeline dX", ours(op, "pipeline", grad=True))
say("done")
sys.stdout.flush()
