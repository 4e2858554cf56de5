"""`commgemm demo`: every collective x method on all local devices, checked against a float64
reference and timed."""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import commgemm as cg


@dataclasses.dataclass
class DemoRow:
    op: str
    method: str
    max_error: float
    tolerance: float
    ms: float

    @property
    def ok(self) -> bool:
        return bool(np.isfinite(self.max_error) and self.max_error <= self.tolerance)


def demo_configs(op: str) -> list[tuple[str, cg.OverlapConfig]]:
    out = [
        ("NONE (serial)", cg.OverlapConfig()),
        ("PIPELINE x4", cg.OverlapConfig(method="pipeline", num_splits=4)),
        ("RING_EXCHANGE", cg.OverlapConfig(method="ring_exchange")),
        ("RING_EXCHANGE bidi", cg.OverlapConfig(method="ring_exchange", bidirectional=True)),
        ("RING_EXCHANGE x2", cg.OverlapConfig(method="ring_exchange", num_splits=2)),
    ]
    if op != "2d":
        out.append(("AUTO", cg.OverlapConfig(method="auto")))
    if op == "ag":
        out.append(
            ("RING_EXCHANGE aggregate", cg.OverlapConfig(method="ring_exchange", aggregate=True))
        )
    return out


def tpu_configs(interpret: bool) -> list[tuple[str, cg.OverlapConfig]]:
    """The Pallas TPU kernels' rows (interpreted off a TPU)."""
    suffix = " (TPU kernel, interpreted)" if interpret else " (TPU kernel)"
    return [
        (
            f"RING_EXCHANGE{suffix}",
            cg.OverlapConfig(method="ring_exchange", atomic_gemm=True, interpret=interpret),
        ),
        (
            f"PIPELINE direct{suffix}",
            cg.OverlapConfig(method="pipeline", atomic_gemm=True, interpret=interpret),
        ),
    ]


def _plan(devices: list) -> list[tuple[str, list, list]]:
    """(op, devices, configs) to run: every op on all devices; on a CPU (one process) also the
    TPU kernels in interpret mode on the largest power of two of devices below the count (the
    interpreter needs a spare CPU device), natively on a TPU."""
    out = [(op, devices, demo_configs(op)) for op in ("ag", "rs", "ar", "2d")]
    backend = jax.default_backend()
    if backend in ("cpu", "tpu") and jax.process_count() == 1 and len(devices) > 2:
        count = len(devices) if backend == "tpu" else 1 << (len(devices) - 1).bit_length() - 1
        configs = tpu_configs(interpret=backend != "tpu")
        out += [(op, devices[:count], configs) for op in ("ag", "rs", "2d")]
    return out


def _problem(op: str, size: int, rng: np.random.Generator, m: int, k: int, n: int):
    """Global x, w and the three specs of `op` on a 1-D mesh 'tp' (2-D: mesh ('x', 'y'))."""
    if op == "ag":
        return (
            rng.standard_normal((m, k)),
            rng.standard_normal((k, n)),
            (P("tp", None), P(None, "tp"), P(None, "tp")),
        )
    if op in ("rs", "ar"):
        out = P("tp", None) if op == "rs" else P(None, None)
        return (
            rng.standard_normal((m, k)),
            rng.standard_normal((k, n)),
            (P(None, "tp"), P("tp", None), out),
        )
    return (
        rng.standard_normal((m, k)),
        rng.standard_normal((k, n)),
        (P("x", "y"), P("x", None), P("x", None)),
    )


def place(a: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global array from a value every process holds (works across processes)."""
    return jax.make_array_from_callback(a.shape, sharding, lambda index: a[index])


def max_error(out: jax.Array, ref: np.ndarray) -> float:
    """max |out - ref| over every shard, read where it lives and combined across processes."""
    local = max(
        float(np.abs(np.asarray(s.data, np.float64) - ref[s.index]).max())
        for s in out.addressable_shards
    )
    if jax.process_count() == 1:
        return local
    from jax.experimental import multihost_utils

    return float(np.max(multihost_utils.process_allgather(np.float64(local))))


def _unit_roundoff(dtype: str) -> float:
    """Rounding unit of the GEMM: bf16 outputs 2^-8; float32 on a GPU runs as TF32 (2^-10)."""
    if dtype == "bfloat16":
        return 2.0**-8
    return 2.0**-10 if jax.default_backend() == "gpu" else 2.0**-23


def _mesh(op: str, devices: list) -> Mesh:
    size = len(devices)
    if op == "2d":
        rows = 2 if size % 2 == 0 and size > 1 else 1
        return Mesh(np.array(devices).reshape(rows, size // rows), ("x", "y"))
    return Mesh(np.array(devices), ("tp",))


def run_demo(
    m: int = 1024,
    k: int = 1024,
    n: int = 1024,
    iters: int = 5,
    seed: int = 0,
    dtype: str = "float32",
    progress: Callable[[str], None] | None = None,
) -> list[DemoRow]:
    """Runs every op x method; returns one row each (max |error| vs float64, median ms).
    `progress(name)` is called as each op x method starts."""
    rng = np.random.default_rng(seed)
    rows = []
    for op, devices, configs in _plan(jax.devices()):
        mesh = _mesh(op, devices)
        x, w, (xs, ws, os) = _problem(op, len(devices), rng, m, k, n)
        x, w = x.astype(dtype), w.astype(dtype)
        ref = x.astype(np.float64) @ w.astype(np.float64)
        tolerance = (
            16 * _unit_roundoff(dtype) * np.sqrt(k) * float(np.abs(ref).max() / np.sqrt(k) + 1)
        )
        xd, wd = place(x, NamedSharding(mesh, xs)), place(w, NamedSharding(mesh, ws))
        for name, cfg in configs:
            if op == "2d" and cfg.aggregate:
                continue
            if progress is not None:
                progress(f"{op} {name}")
            call = functools.partial(
                cg.gemm, out_sharding=NamedSharding(mesh, os), config=cfg, x_spec=xs, w_spec=ws
            )
            f = jax.jit(call)
            err = max_error(f(xd, wd), ref)
            times = []
            for _ in range(iters):
                start = time.perf_counter()
                f(xd, wd).block_until_ready()
                times.append(time.perf_counter() - start)
            rows.append(DemoRow(op, name, err, tolerance, 1e3 * float(np.median(times))))
    return rows
