"""A/B in one run: the grouped kernel before (benchmarks/ab_old_grouped_kernel.py, HEAD) and after
the warpgroup skip, forward and dX, G in {8, 64}, with jax's kernel, ragged_dot and the dense GEMM.
    PYTHONPATH=. python3 benchmarks/ab_grouped_skip.py --out DIR"""
import argparse, json, pathlib, sys
import jax, jax.numpy as jnp
sys.path.insert(0, str(pathlib.Path(__file__).parent))
import ab_old_grouped_kernel as old
from grouped_gemm import uneven_sizes, timed, KERNELS
from commgemm.mosaic_gpu import grouped_kernel as new, gemm_core
from commgemm.mosaic_gpu import grouped as hopper

p = argparse.ArgumentParser(); p.add_argument("--out", type=pathlib.Path, required=True)
p.add_argument("--seeds", type=int, default=2)
a = p.parse_args(); a.out.mkdir(parents=True, exist_ok=True)
m, k, n = 8192, 4096, 1792
rows = []
for groups in (8, 64):
  for seed in range(a.seeds):
    keys = jax.random.split(jax.random.key(seed), 2)
    x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
    w = (jax.random.normal(keys[1], (groups, k, n), jnp.float32) / k**0.5).astype(jnp.bfloat16)
    sizes = jnp.asarray(uneven_sizes(groups, m, groups + 100 * seed))
    dy = x[:, :n]
    v = {
      "old fwd": (jax.jit(lambda a, b, s: old.grouped_matmul(a, b, s)), (x, w, sizes)),
      "new fwd": (jax.jit(lambda a, b, s: new.grouped_matmul(a, b, s)), (x, w, sizes)),
      "old dX": (jax.jit(lambda a, b, s: old.grouped_matmul(a, b, s, w_nk=True)), (dy, w, sizes)),
      "new dX": (jax.jit(lambda a, b, s: new.grouped_matmul(a, b, s, w_nk=True)), (dy, w, sizes)),
      "jax fwd": (jax.jit(lambda a, b, s: hopper.product(a, b, s, KERNELS["jax kernel"], False)), (x, w, sizes)),
      "jax dX": (jax.jit(lambda a, b, s: hopper.product(a, b, s, KERNELS["jax kernel"], True)), (dy, w, sizes)),
      "cg.grouped_matmul": (jax.jit(lambda a, b, s: __import__("commgemm").grouped_matmul(a, b, s)), (x, w, sizes)),
      "new schedule only": (jax.jit(lambda s: new.schedule(s, new.GroupedConfig(), m, n, 132).order), (sizes,)),
      "dense XLA": (jax.jit(lambda a, b: a @ b), (x, w[0])),
      "dense core": (jax.jit(lambda a, b: gemm_core.matmul(a, b, False)), (x, w[0])),
    }
    f32 = lambda t: t.astype(jnp.float32)
    ref = jax.lax.ragged_dot(f32(x), f32(w), sizes, precision="highest")
    refx = jax.lax.ragged_dot(f32(dy), jnp.swapaxes(f32(w), 1, 2), sizes, precision="highest")
    errs = {}
    for name, r in (("new fwd", ref), ("old fwd", ref), ("new dX", refx), ("old dX", refx)):
      fn, args = v[name]
      for sign in (-1, 1):  # two calls, the second on -x, so stale tiles show
        args2 = (args[0] * sign, *args[1:])
        got = f32(fn(*args2))
        errs[f"{name} {sign}"] = float(jnp.abs(got - sign * r).max() / jnp.abs(r).max())
    times, timing = timed(v)
    row = dict(groups=groups, seed=seed, timing=timing, ms=times, errs=errs,
               vs_dense={kk: t / times["dense XLA"] for kk, t in times.items()})
    rows.append(row); print(json.dumps(row), flush=True)
(a.out / "ab_grouped_skip.json").write_text(json.dumps(dict(device=jax.devices()[0].device_kind, rows=rows), indent=1))
