"""Run by tests/test_multiprocess.py under `commgemm launch`: one rank of a multi-process job.

mp_worker.py mismatch       ranks plan different num_splits: every rank must raise clearly
mp_worker.py ids            prints the buffer id of a fixed config
mp_worker.py uninitialized  runs an op without commgemm.initialize(): must raise
mp_worker.py listen         prints the address the coordinator listens on (from process 0)
mp_worker.py extra          rank 0 lowers an extra call first; every rank then runs the op
mp_worker.py tune           each rank's timings favour another candidate: all take rank 0's
mp_worker.py hosts          2 "hosts" x 4 devices: tensor parallel within, data parallel across
mp_worker.py machines     prints where every process runs (`distributed.machines`), twice
mp_worker.py agreed         each rank holds other names: every rank gets the same union, common
"""

import dataclasses
import os
import sys

import commgemm as cg
from commgemm import distributed

mode = sys.argv[1]
if mode != "uninitialized":
    cg.initialize()
distributed.PLAN_CHECK_WAIT_S = 3

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

if mode == "ids":
    print(
        "buffer id",
        cg.create_overlap_buffer(cg.OverlapConfig(method="ring_exchange", num_splits=2)),
    )
    sys.exit(0)
if mode == "agreed":
    names, me = ["a", "b", "c", "d", "e"], jax.process_index()
    mine = {"e", names[me]}  # rank 0: {a, e}, rank 1: {b, e}; "d" nowhere
    union = distributed.agreed(names, mine, every=False)
    common = distributed.agreed(names, mine, every=True)
    print("agreed", "".join(sorted(union)), "".join(sorted(common)))
    sys.exit(0)
if mode == "machines":
    first, again = distributed.machines(), distributed.machines()
    print("machines", jax.process_index(), "|".join(first), first == again)
    sys.exit(0)
if mode == "listen":
    port = int(os.environ[distributed.COORDINATOR].rsplit(":", 1)[1])
    if jax.process_index() == 0:
        rows = []
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with open(table) as f:
                rows += [line.split() for line in f.read().splitlines()[1:]]
        listening = [r[1] for r in rows if r[3] == "0A" and int(r[1].split(":")[1], 16) == port]
        hosts = {
            ".".join(str(int(h[-8:][i : i + 2], 16)) for i in (6, 4, 2, 0))
            if not h.strip("0") == ""
            else "any"
            for h, _ in (a.split(":") for a in listening)
        }
        print("coordinator on", ",".join(sorted(hosts)))
    sys.exit(0)
if mode == "tune":
    from commgemm.autotune import tuner
    from commgemm.bench import overlap

    real = overlap.overlap_report

    def skewed(*args, **kwargs):  # this rank's own fastest: candidate number process_index
        report = real(*args, **kwargs)
        rows = [dataclasses.replace(r, t_ms=1.0 + (i - jax.process_index()) % len(report.rows))
                for i, r in enumerate(report.rows)]  # fmt: skip
        return dataclasses.replace(report, rows=rows)

    overlap.overlap_report = skewed
    methods = [cg.OverlapConfig(), cg.OverlapConfig(method="ring_exchange")]
    result = tuner.tune("ag", (64, 16, 64), dtype="float32", methods=methods, iters=2,
                        path=None)  # fmt: skip
    print("winner", result.best.method.name)
    sys.exit(0)
if mode == "hosts":  # processes 0-3 one host's GPUs, 4-7 the other's: "tp" within a host
    from jax.experimental import multihost_utils

    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = Mesh(np.array(devices).reshape(2, 4), ("data", "tp"))
    rng = np.random.default_rng(0)  # the same data on every rank
    x, w = rng.standard_normal((4, 32, 16)), rng.standard_normal((16, 24))
    layouts = {  # x spec, w spec, out spec
        "ag": (P("data", "tp", None), P(None, "tp"), P("data", None, "tp")),
        "rs": (P("data", None, "tp"), P("tp", None), P("data", "tp", None)),
        "ar": (P("data", None, "tp"), P("tp", None), P("data", None, None)),
    }
    bad = []
    for name, (xs, ws, os_) in layouts.items():
        for method in ("none", "pipeline", "ring_exchange"):
            xd, wd = (
                jax.make_array_from_callback(a.shape, NamedSharding(mesh, s), a.__getitem__)
                for a, s in ((x, xs), (w, ws))
            )
            cfg = cg.OverlapConfig(method=method)
            f = jax.jit(
                lambda a, b, cfg=cfg, xs=xs, ws=ws, os_=os_: cg.gemm(
                    a, b, out_sharding=NamedSharding(mesh, os_), config=cfg, x_spec=xs, w_spec=ws
                )
            )
            out = np.asarray(multihost_utils.process_allgather(f(xd, wd), tiled=True))
            if not np.allclose(out, x @ w, rtol=1e-5, atol=1e-5):
                bad.append(f"{name} {method}")
    print("hosts ok" if not bad else f"hosts WRONG: {bad}")
    sys.exit(1 if bad else 0)
mesh = Mesh(np.array(jax.devices()), ("x",))
x = np.ones((64, 16), np.float32)
w = np.ones((16, 64), np.float32)
xd = jax.make_array_from_callback(x.shape, NamedSharding(mesh, P("x", None)), lambda i: x[i])
wd = jax.make_array_from_callback(w.shape, NamedSharding(mesh, P(None, "x")), lambda i: w[i])
if mode == "extra":
    cfg = cg.OverlapConfig(method="pipeline", num_splits=2)
    specs = dict(out_sharding=P(None, "x"), x_spec=P("x", None), w_spec=P(None, "x"))
    call = jax.jit(lambda a, b: cg.gemm(a, b, config=cfg, **specs))
    if jax.process_index() == 0:
        call.lower(xd, wd).as_text()  # traced here only
        jax.jit(lambda a, b: cg.gemm(a, b, **specs)).lower(xd, wd)
    out = call(xd, wd)
    ok = all(np.allclose(np.asarray(s.data), 16.0) for s in out.addressable_shards)
    print("result ok" if ok else "result WRONG")
    sys.exit(0 if ok else 1)
cfg = cg.OverlapConfig(method="pipeline", num_splits=2 if jax.process_index() == 0 else 4)
try:
    cg.gemm(xd, wd, out_sharding=P(None, "x"), config=cfg)
except ValueError as err:
    print("planning failed:", err)
    sys.exit(7)
print("no error raised")
