"""Run by tests/gpu/test_multiprocess_gpu.py under `commgemm launch -n P --gpus-per-process 1`:
the MoE block (`moe_per_shard`, AUTO) with one process per GPU, its returns inside its GEMMs
(`grouped.returned`) against the same block with the GEMMs and the exchanges apart.

Prints per case `case NAME OK|BAD FUSED arrived=ARRIVED` (FUSED: whether the fused kernel was
traced, ARRIVED: whether a GEMM took its rows as they arrived, `grouped_dispatch`; OK: equal
losses and gradients bit for bit, all finite), or `refused REASON` where the NVLink kernels
cannot run in this job (`peers.multiprocess_reason`)."""

import functools

import commgemm as cg

cg.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from commgemm.grouped import returned  # noqa: E402
from commgemm.mosaic_gpu import grouped_return, peers  # noqa: E402
from commgemm.nnx import moe_per_shard  # noqa: E402

size = jax.device_count()
mesh = Mesh(np.array(jax.devices()), ("tp",))
rng = np.random.default_rng(11)  # the same data on every process
TOKENS, HIDDEN, FFN, TOP_K, EXPERTS = 512 * size, 256, 512, 2, 4 * size
x = rng.standard_normal((TOKENS, HIDDEN)).astype(jnp.bfloat16)
router = rng.standard_normal((HIDDEN, EXPERTS)).astype(np.float32)
w1 = (rng.standard_normal((EXPERTS, HIDDEN, FFN)) / HIDDEN**0.5).astype(jnp.bfloat16)
w2 = (rng.standard_normal((EXPERTS, FFN, HIDDEN)) / FFN**0.5).astype(jnp.bfloat16)


def put(a, spec):
    return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec), lambda i: a[i])


def step(scaling, capacity_factor):
    def loss(a, b, c):
        block = functools.partial(moe_per_shard, k=TOP_K, axis_name="tp", config=None,
                                  scaling=scaling, activation="gelu",
                                  capacity_factor=capacity_factor)  # fmt: skip
        f = jax.shard_map(lambda a, b, c: block(a, jnp.asarray(router), b, c), mesh=mesh,
                          in_specs=(P("tp"),) * 3, out_specs=P("tp"))  # fmt: skip
        return jnp.mean(jnp.square(f(a, b, c).astype(jnp.float32)))

    args = put(x, P("tp")), put(w1, P("tp")), put(w2, P("tp"))
    value, grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2)))(*args)
    gathered = [multihost_utils.process_allgather(g, tiled=True) for g in grads]
    return float(value), [np.asarray(g, np.float32) for g in gathered]


reason = peers.multiprocess_reason() if jax.process_count() > 1 else None
if reason is not None:
    print("refused", reason, flush=True)
else:
    traced, init, real = [], grouped_return.Epilogue.__init__, returned.fused_reason
    grouped_return.Epilogue.__init__ = lambda self, *a: traced.append(1) or init(self, *a)
    arrived, arriving = [], returned._arriving
    returned._arriving = lambda *a, **k: arrived.append(1) or arriving(*a, **k)
    for scaling, capacity_factor in ((None, None), ("current_tensor_scaling", 0.75)):
        returned.fused_reason, traced[:], arrived[:] = real, [], []
        got = step(scaling, capacity_factor)
        fused, arrive = bool(traced), bool(arrived)
        returned.fused_reason = lambda *a: "turned off"
        want = step(scaling, capacity_factor)
        ok = got[0] == want[0] and all(
            np.isfinite(a).all() and np.array_equal(a, b)
            for a, b in zip(got[1], want[1], strict=True)
        )
        name = f"{'fp8' if scaling else 'bf16'}-{'capped' if capacity_factor else 'all'}"
        print("case", name, "OK" if ok else "BAD", fused, f"arrived={arrive}", got[0], want[0],
              flush=True)  # fmt: skip
