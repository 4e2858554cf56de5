"""Run by tests/test_multiprocess.py under `commgemm launch`: one rank of a multi-process job.

mp_worker.py mismatch       ranks plan different num_splits: every rank must raise clearly
mp_worker.py ids            prints the buffer id of a fixed config
mp_worker.py uninitialized  runs an op without commgemm.initialize(): must raise
mp_worker.py listen         prints the address the coordinator listens on (from process 0)
mp_worker.py extra          rank 0 lowers an extra call first; every rank then runs the op
"""

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
