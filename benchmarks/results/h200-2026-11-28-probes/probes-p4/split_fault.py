"""One FP8 op, promoted accumulation (the fused kernels' split form), explicit fused config:
python lab/split_fault.py OP SPEC M K N  (AG: x [M, K] rows sharded; RS: K sharded)."""
import sys
from commgemm.devices import setup_devices
setup_devices()
import jax, jax.numpy as jnp, numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402
import commgemm as cg  # noqa: E402
from commgemm.cli.specs import parse_method  # noqa: E402

op, spec, m, k, n = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
split = sys.argv[6] != "fast" if len(sys.argv) > 6 else True
mesh = Mesh(np.array(jax.devices()), ("tp",)); p = mesh.devices.size
cfg = parse_method(spec, op)
recipe = cg.ScalingRecipe("current_tensor_scaling", split_accumulator=(split, split, True))
rng = np.random.default_rng(0)
if op == "ag":
    x = rng.standard_normal((m, k)); w = rng.standard_normal((k, n)) / np.sqrt(k)
    f = jax.shard_map(lambda a, b: cg.all_gather_matmul(a, b, "tp", config=cfg, scaling=recipe),
                      mesh=mesh, in_specs=(P("tp", None), P()), out_specs=P("tp", None), check_vma=False)
    xs, ws = P("tp", None), P()
else:
    x = rng.standard_normal((m, k * p)); w = rng.standard_normal((k * p, n)) / np.sqrt(k * p)
    f = jax.shard_map(lambda a, b: cg.matmul_reduce_scatter(a, b, "tp", config=cfg, scaling=recipe),
                      mesh=mesh, in_specs=(P(None, "tp"), P("tp", None)), out_specs=P("tp", None))
    xs, ws = P(None, "tp"), P("tp", None)
xa = jax.device_put(jnp.asarray(x, jnp.bfloat16), NamedSharding(mesh, xs))
wa = jax.device_put(jnp.asarray(w, jnp.bfloat16), NamedSharding(mesh, ws))
hlo = jax.jit(f).lower(xa, wa).compile().as_text()
print("mosaic calls", hlo.count("mosaic_gpu"), flush=True)
y = np.asarray(jax.jit(f)(xa, wa).astype(jnp.float32))
ref = x @ w
if op == "ag":
    y = y[:m]
err = np.abs(y - ref).max() / np.abs(ref).max()
print(f"RESULT {op} {spec} {m}x{k}x{n} split={split} P={p}: rel err {err:.4f}", "OK" if err < 0.1 else "WRONG", flush=True)
