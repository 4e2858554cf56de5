# ruff: noqa
"""Probe: does an NCCL collective run beside an independent GEMM? cuBLAS vs our GEMM core
with its grid cut by `margin` SMs."""
import json, pathlib, sys
from commgemm.devices import setup_devices
from commgemm.distributed import initialize
setup_devices(); initialize()
import jax, jax.numpy as jnp, numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402
from commgemm.bench import kernels, spans  # noqa: E402
from commgemm.mosaic_gpu import fused, gemm_core, tiles as mt  # noqa: E402

fused._gpu_reason = lambda: mt.hopper_reason()
out = pathlib.Path(sys.argv[1]); tag = sys.argv[2]; out.mkdir(parents=True, exist_ok=True)
margins = [int(m) for m in (sys.argv[3] if len(sys.argv) > 3 else "0,8,16,32").split(",")]
mesh = Mesh(np.array(jax.devices()), ("x",))
n = mesh.devices.size
SMS = mt.num_sms()
rng = np.random.default_rng(0)
def put(shape, spec):
    a = (rng.standard_normal(shape) * 0.1).astype(jnp.bfloat16)
    return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec), lambda i: a[i])
M, H, F = 16384, 4096, 7168
a = put((M, H), P("x", None))            # AG: [M/n, H] -> [M, H]
d = put((n * M, H), P("x", None))        # RS: [M, H] -> [M/n, H]
b = put((n * M, H), P("x", None))        # GEMM [M, H] @ [H, F]
c = put((H, n * F), P(None, "x"))
sm = lambda f, i, o: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=i, out_specs=o))  # noqa
X, Y = P("x", None), P(None, "x")
ag = lambda a: jax.lax.all_gather(a, "x", axis=0, tiled=True)  # noqa
rs = lambda d: jax.lax.psum_scatter(d, "x", scatter_dimension=0, tiled=True)  # noqa
def core(m):
    def g(b, c):
        mt.num_sms = lambda: SMS - m
        return gemm_core.matmul(b, c, False)
    return g
found = {"ag": (sm(ag, X, X), (a,)), "rs": (sm(rs, X, X), (d,)),
         "gemm_xla": (sm(jnp.dot, (X, Y), X), (b, c)),
         "ag+xla": (sm(lambda a, b, c: (ag(a), b @ c), (X, X, Y), (X, X)), (a, b, c)),
         "rs+xla": (sm(lambda d, b, c: (rs(d), b @ c), (X, X, Y), (X, X)), (d, b, c))}
for m in margins:
    g = core(m)
    found[f"gemm_core{m}"] = (sm(g, (X, Y), X), (b, c))
    found[f"ag+core{m}"] = (sm(lambda a, b, c, g=g: (ag(a), g(b, c)), (X, X, Y), (X, X)), (a, b, c))
    found[f"rs+core{m}"] = (sm(lambda d, b, c, g=g: (rs(d), g(b, c)), (X, X, Y), (X, X)), (d, b, c))
import re  # noqa: E402
orig = mt.num_sms
for k, (fn, args) in list(found.items()):
    mm = re.search(r"core(\d+)", k)
    mt.num_sms = (lambda v=SMS - int(mm.group(1)): v) if mm else orig
    try:
        fn.lower(*args).compile(); jax.block_until_ready(fn(*args))
    except Exception as e:  # noqa: BLE001
        print(k, "FAILED", str(e)[:300]); del found[k]
mt.num_sms = orig
res = {"tag": tag, "procs": jax.process_count(), "sms": SMS, "kind": jax.devices()[0].device_kind}
t = spans.batch_spans_interleaved(found, calls=8)
for k, v in t.items():
    res[k] = {"ms": round(v["median"], 4), "exposed": round(kernels.exposed_ms(v["events"], 8), 4)}
    if k in ("ag+xla", "rs+xla", f"ag+core{margins[-1]}", f"rs+core{margins[-1]}"):
        ev = sorted(v["events"])[:12]
        t0 = ev[0][0]
        res[k]["timeline"] = [(round((s - t0) / 1e3, 1), round((e - t0) / 1e3, 1), nm[:50]) for s, e, nm in ev]
if jax.process_index() == 0:
    (out / f"{tag}.json").write_text(json.dumps(res, indent=1))
    for k, v in res.items():
        print(tag, k, v if not isinstance(v, dict) else {kk: vv for kk, vv in v.items() if kk != "timeline"}, flush=True)
