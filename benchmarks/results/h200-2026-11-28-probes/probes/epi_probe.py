# ruff: noqa
"""Probe: the layer step with the epilogue under jax.checkpoint (ckpt, the library now) against
the same without the checkpoint (plain), interleaved in one process."""
import json, pathlib, sys
sys.path.insert(0, "benchmarks")
import step  # noqa: E402
import jax, numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
import commgemm.epilogue as epi  # noqa: E402
from commgemm.bench import kernels, spans  # noqa: E402


class NoRemat:
    def __getattr__(self, k):
        return getattr(jax, k)

    @staticmethod
    def checkpoint(f, *a, **k):
        return f


out = pathlib.Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
rows = [r.split(":") for r in sys.argv[2].split(",")]  # size:dtype
names = sys.argv[3].split(",") if len(sys.argv) > 3 else ["none", "auto"]
res = []
for sz, dt in rows:
    mesh = Mesh(np.array(jax.devices()), ("tp",))
    scaling = step.FP8 if dt == "fp8" else None
    size = step.QUICK if sz == "quick" else step.SIZES[sz]
    found, row = {}, {"size": sz, "dtype": dt, "loss": {}, "ms": {}, "exposed": {}, "rounds": {}}
    for tag, mod in (("ckpt", jax), ("plain", NoRemat())):
        epi.jax = mod
        for n, (fn, args) in step.variants(size, mesh, jax.numpy.bfloat16, scaling, names).items():
            fn.lower(*args).compile()
            found[f"{n}_{tag}"] = (fn, args)
            row["loss"][f"{n}_{tag}"] = float(fn(*args)[2])
    epi.jax = jax
    if jax.default_backend() == "gpu":
        for n, t in spans.batch_spans_interleaved(found, calls=4).items():
            row["ms"][n] = round(t["median"], 4)
            row["rounds"][n] = [round(x, 4) for x in t["rounds"]]
            row["exposed"][n] = round(kernels.exposed_ms(t["events"], 4), 4)
        for n in names:
            row[f"{n}_ckpt_over_plain"] = round(row["ms"][f"{n}_ckpt"] / row["ms"][f"{n}_plain"], 4)
    res.append(row); print(json.dumps({k: v for k, v in row.items() if k != "rounds"}), flush=True)
    (out / "epi_probe.json").write_text(json.dumps(res, indent=1))
