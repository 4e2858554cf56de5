# ruff: noqa
"""Probe: does XLA overlap the step's collectives? HLO + timing of step variants."""
import gzip, json, os, pathlib, sys
sys.path.insert(0, "benchmarks")
import step  # noqa: E402  (initializes distributed)
import jax, numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from commgemm.bench import kernels, spans  # noqa: E402

out = pathlib.Path(sys.argv[1]); tag = sys.argv[2]; names = sys.argv[3].split(",")
sizes = sys.argv[4].split(",") if len(sys.argv) > 4 else ["8b"]
dtypes = sys.argv[5].split(",") if len(sys.argv) > 5 else ["bf16"]
out.mkdir(parents=True, exist_ok=True)
w = jax.process_index() == 0
res = {"tag": tag, "xla_flags": os.environ.get("XLA_FLAGS", ""), "procs": jax.process_count(),
       "kind": jax.devices()[0].device_kind, "rows": []}
for sz in sizes:
    for dt in dtypes:
        mesh = Mesh(np.array(jax.devices()), ("tp",))
        scaling = step.FP8 if dt == "fp8" else None
        found = step.variants(step.QUICK if sz == "quick" else step.SIZES[sz], mesh, jax.numpy.bfloat16, scaling, names)
        row = {"size": sz, "dtype": dt, "loss": {}, "ms": {}, "busy": {}, "exposed": {}}
        for n, (fn, args) in found.items():
            if w:
                txt = fn.lower(*args).compile().as_text()
                with gzip.open(out / f"{tag}-{sz}-{dt}-{n}.hlo.gz", "wt") as f:
                    f.write(txt)
        step.first_losses(found, row, skip=("comm",))
        t = spans.batch_spans_interleaved(found, calls=4) if jax.default_backend() == "gpu" else {}
        for n, v in t.items():
            row["ms"][n] = round(v["median"], 4); row["busy"][n] = round(v["busy"], 3)
            row["exposed"][n] = round(kernels.exposed_ms(v["events"], 4), 4)
        res["rows"].append(row)
        if w:
            print(tag, json.dumps(row), flush=True)
            (out / f"{tag}.json").write_text(json.dumps(res, indent=1))
