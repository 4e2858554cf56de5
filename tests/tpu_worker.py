"""Run by tests/test_pallas_tpu.py: rings of 8 and the 2 x 4 mesh in a process of 9 CPU
devices (Pallas' TPU interpreter needs one device more than the mesh); prints RESULTS {json}."""

import json
import sys

import jax

jax.config.update("jax_num_cpu_devices", 9)
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import commgemm as cg  # noqa: E402
from commgemm.pallas_tpu import ring  # noqa: E402
from commgemm.pallas_tpu.common import races_found  # noqa: E402

rng = np.random.default_rng(int(sys.argv[1]))
results = {}
mesh = Mesh(np.array(jax.devices()[:8]), ("x",))


def sm(f, i, o):
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=i, out_specs=o, check_vma=False))


x = rng.standard_normal((8 * 16, 128)).astype(np.float32)
for bidi in (False, True):
    f = sm(
        lambda a, bidi=bidi: ring.all_gather(
            a, "x", bidirectional=bidi, interpret=True, race_check=True
        ),
        P("x"),
        P(),
    )
    results[f"ag-bidi{bidi}"] = bool(np.array_equal(np.asarray(f(x)), x))
xs = rng.standard_normal((8 * 8 * 8, 128)).astype(np.float32)
want = xs.astype(np.float64).reshape(8, 64, 128).sum(0)
f = sm(lambda a: ring.reduce_scatter(a, "x", interpret=True, race_check=True), P("x"), P("x"))
results["rs"] = bool(np.allclose(np.asarray(f(xs)), want, atol=1e-4))
f = sm(lambda a: ring.all_reduce(a, "x", interpret=True, race_check=True), P("x"), P())
results["ar"] = bool(np.allclose(np.asarray(f(xs)), want, atol=1e-4))
for method in ("ring_exchange", "pipeline"):
    cfg = cg.OverlapConfig(method=method, atomic_gemm=True, interpret=True)
    a, b = (
        rng.standard_normal((8 * 16, 64)).astype(np.float32),
        rng.standard_normal((64, 8 * 128)).astype(np.float32),
    )
    f = jax.jit(
        jax.shard_map(
            lambda p, q, cfg=cfg: cg.all_gather_matmul(p, q, "x", config=cfg),
            mesh=mesh,
            in_specs=(P("x"), P(None, "x")),
            out_specs=P(None, "x"),
        )
    )
    results[f"fused-ag-{method}"] = bool(
        np.allclose(np.asarray(f(a, b)), a.astype(np.float64) @ b, atol=2e-4)
    )
    a, b = (
        rng.standard_normal((8 * 16, 8 * 32)).astype(np.float32),
        rng.standard_normal((8 * 32, 128)).astype(np.float32),
    )
    f = jax.jit(
        jax.shard_map(
            lambda p, q, cfg=cfg: cg.matmul_reduce_scatter(p, q, "x", config=cfg),
            mesh=mesh,
            in_specs=(P(None, "x"), P("x")),
            out_specs=P("x"),
        )
    )
    results[f"fused-rs-{method}"] = bool(
        np.allclose(np.asarray(f(a, b)), a.astype(np.float64) @ b, atol=2e-4)
    )
mesh2 = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("x", "y"))
a, b = (
    rng.standard_normal((2 * 16, 4 * 32)).astype(np.float32),
    rng.standard_normal((4 * 32, 128)).astype(np.float32),
)
for method in ("ring_exchange", "pipeline"):
    cfg = cg.OverlapConfig(method=method, atomic_gemm=True, interpret=True)
    f = jax.jit(
        jax.shard_map(
            lambda p, q, cfg=cfg: cg.matmul_2d(p, q, row_axis="x", k_axis="y", config=cfg),
            mesh=mesh2,
            in_specs=(P("x", "y"), P("x", None)),
            out_specs=P("x", None),
        )
    )
    results[f"2d-2x4-{method}"] = bool(
        np.allclose(np.asarray(f(a, b)), a.astype(np.float64) @ b, atol=2e-4)
    )
results["no_race"] = not races_found()
print("RESULTS", json.dumps(results))
