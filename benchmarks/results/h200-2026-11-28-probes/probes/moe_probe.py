# ruff: noqa
"""Probe: the MoE block's step with the residual change (new) against the code before it (old),
interleaved in one process."""
import json, pathlib, sys
sys.path.insert(0, "benchmarks")
import moe_step  # noqa: E402
import jax, jax.numpy as jnp, numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
import commgemm.grouped.expert_parallel as ep  # noqa: E402
import commgemm.grouped.moe as moe  # noqa: E402
from commgemm.bench import spans  # noqa: E402
from step import first_losses  # noqa: E402


class NoRemat:
    def __getattr__(self, k):
        return getattr(jax, k)

    @staticmethod
    def checkpoint(f, *a, **k):
        return f


NEW = (ep.jax, moe.jax, ep._window, ep._place)
OLD = (NoRemat(), NoRemat(), ep._window.__wrapped__, ep._place.__wrapped__)
WIN = (NoRemat(), NoRemat(), ep._window, ep._place)  # only the windows checkpointed
ACT = (ep.jax, NoRemat(), ep._window.__wrapped__, ep._place.__wrapped__)  # only the activation
COMB = (NoRemat(), moe.jax, ep._window.__wrapped__, ep._place.__wrapped__)  # only the combine


def use(v):
    ep.jax, moe.jax, ep._window, ep._place = v


out = pathlib.Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
sizes = sys.argv[2].split(",") if len(sys.argv) > 2 else ["fine", "mixtral"]
rows = [r.split(":") for r in sys.argv[2].split(",")]
res = []
for sz, dt in rows:
    size = moe_step.QUICK if sz == "quick" else moe_step.SIZES[sz]
    if True:
        mesh = Mesh(np.array(jax.devices()), ("tp",))
        scaling = moe_step.FP8 if dt == "fp8" else None
        found = {}
        for tag, v in (("old", OLD), ("new", NEW), ("win", WIN), ("act", ACT), ("comb", COMB)):
            use(v)
            (fn, args), = moe_step.variants(size, mesh, jnp.bfloat16, scaling, ["auto"]).values()
            found[tag] = (fn, args)
            fn.lower(*args).compile()
            row = {"loss": {}}
            first_losses({tag: (fn, args)}, row)  # traces + runs under this patch
            print(sz, dt, tag, "loss", row["loss"], flush=True)
        use(NEW)
        r = {"size": sz, "dtype": dt, "ms": {}, "rounds": {}, "busy": {}}
        if jax.default_backend() == "gpu":
            for n, t in spans.batch_spans_interleaved(found, calls=4).items():
                r["ms"][n] = round(t["median"], 4); r["busy"][n] = round(t["busy"], 3)
                r["rounds"][n] = [round(x, 4) for x in t["rounds"]]
            r["new_over_old"] = round(r["ms"]["new"] / r["ms"]["old"], 4)
        res.append(r); print(json.dumps(r), flush=True)
        (out / "moe_probe.json").write_text(json.dumps(res, indent=1))
