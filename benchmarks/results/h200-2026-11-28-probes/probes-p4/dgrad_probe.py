"""Probe: FP8 promoted dX on the fused kernels' split form against the library's serial dX
(and fast dgrad), inside the layer step; one process, all visible GPUs."""
import json, sys, time, pathlib
sys.argv = [sys.argv[0], "--out", "/tmp/unused"] + sys.argv[1:]
sys.path.insert(0, "benchmarks")
import step  # noqa: E402  (sets up devices)
import jax, numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from commgemm import autodiff  # noqa: E402
from commgemm.bench import spans, kernels  # noqa: E402

out = pathlib.Path(sys.argv[-1] if sys.argv[-1].endswith(".json") else "/tmp/r/dgrad.json")
orig = autodiff._dgrad_config


def fused_promoted(collective, cfg, quantizer, like_x, dy, w, axis_name, w_transposed):
    if quantizer.active and quantizer.mode in autodiff.TENSOR_MODES and collective in (
            autodiff.Collective.ALL_GATHER, autodiff.Collective.REDUCE_SCATTER):
        return autodiff.fused_backward_config(collective, cfg, like_x, dy, w, axis_name,
                                              w_transposed)
    return orig(collective, cfg, quantizer, like_x, dy, w, axis_name, w_transposed)


results = []
import os
quick = bool(os.environ.get("PROBE_QUICK"))
for size_name in (["quick"] if quick else os.environ.get("SIZES", "8b,13b").split(",")):
    size = step.QUICK if quick else step.SIZES[size_name]
    mesh = Mesh(np.array(jax.devices()), ("tp",))
    t0 = time.time()
    found = step.variants(size, mesh, jax.numpy.bfloat16, step.FP8, [v for v in os.environ.get("BASE", "auto,auto-fast-dgrad,none").split(",") if v])
    compiled = {}
    for name, (fn, args) in found.items():
        compiled[name] = (fn.lower(*args).compile(), args)
    autodiff._dgrad_config = fused_promoted
    try:
        if os.environ.get("NOPROMO"): raise KeyError
        fn, args = step.variants(size, mesh, jax.numpy.bfloat16, step.FP8, ["auto"])["auto"]
        compiled["auto-promoted-fused"] = (fn.lower(*args).compile(), args)
    except KeyError:
        pass
    finally:
        autodiff._dgrad_config = orig
    row = {"size": size_name, "P": mesh.devices.size, "compile_s": round(time.time() - t0, 1),
           "mosaic_calls": {n: c.as_text().count("mosaic_gpu") for n, (c, _) in compiled.items()},
           "loss": {}}
    for n, (f, a) in compiled.items():
        print("first step of", n, flush=True)
        row["loss"][n] = float(f(*a)[2])
        print("  loss", row["loss"][n], flush=True)
    if jax.default_backend() != "gpu":
        print(row); continue
    timed = spans.batch_spans_interleaved(compiled, calls=4)
    row["ms"] = {n: round(t["median"], 4) for n, t in timed.items()}
    row["rounds"] = {n: [round(r, 4) for r in t["rounds"]] for n, t in timed.items()}
    row["busy"] = {n: round(t["busy"], 3) for n, t in timed.items()}
    row["exposed_ms"] = {n: round(kernels.exposed_ms(t["events"], 4), 4) for n, t in timed.items()}
    results.append(row)
    print(json.dumps({k: row[k] for k in ("size", "P", "mosaic_calls", "loss", "ms", "exposed_ms")}), flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
