"""Run by tests/test_multiprocess.py under `commgemm launch`: one rank of a multi-process job.

mp_worker.py mismatch   ranks plan different num_splits: every rank must raise clearly
mp_worker.py ids        prints the buffer id of a fixed config
"""

import sys

import commgemm as cg

cg.initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

mode = sys.argv[1]
if mode == "ids":
    print(
        "buffer id",
        cg.create_overlap_buffer(cg.OverlapConfig(method="ring_exchange", num_splits=2)),
    )
    sys.exit(0)
mesh = Mesh(np.array(jax.devices()), ("x",))
x = np.ones((64, 16), np.float32)
w = np.ones((16, 64), np.float32)
xd = jax.make_array_from_callback(x.shape, NamedSharding(mesh, P("x", None)), lambda i: x[i])
wd = jax.make_array_from_callback(w.shape, NamedSharding(mesh, P(None, "x")), lambda i: w[i])
cfg = cg.OverlapConfig(method="pipeline", num_splits=2 if jax.process_index() == 0 else 4)
try:
    cg.gemm(xd, wd, out_sharding=P(None, "x"), config=cfg)
except ValueError as err:
    print("planning failed:", err)
    sys.exit(7)
print("no error raised")
