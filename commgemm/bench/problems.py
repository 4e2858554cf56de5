"""Benchmark problems: presets, method specs, and the sharded callables each one times."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from commgemm.config import OverlapConfig
from commgemm.gemm import gemm

#: (M tokens, K, N) totals across the TP group.
PRESETS: dict[str, tuple[int, int, int]] = {
    "llama70b_mlp": (8192, 8192, 28672),
    "llama8b_mlp": (8192, 4096, 14336),
    "comm_heavy": (16384, 8192, 4096),
    "llama13b_mlp": (8192, 5120, 13824),  # not tuned in the suite: AUTO's cost model on its own
    "notebook": (2048, 2048, 1024),
}
OPS = ("ag", "rs", "ar", "2d")


@dataclasses.dataclass(frozen=True)
class Problem:
    """One op on one mesh: global operands and the specs of x, w and the output."""

    op: str
    shape: tuple[int, int, int]
    dtype: str
    mesh: Mesh
    x_spec: P
    w_spec: P
    out_spec: P

    @property
    def size(self) -> int:
        return self.mesh.devices.size

    def operands(self, seed: int = 0) -> tuple[jax.Array, jax.Array]:
        """Random x [M, K] and w [K, N], made on the devices with their shardings."""
        m, k, n = self.shape
        return self._random((m, k), self.x_spec, seed), self._random((k, n), self.w_spec, seed + 1)

    def overlapped(
        self, cfg: OverlapConfig, compiler_options: dict | None = None, scaling=None
    ) -> Callable:
        """`cg.gemm` under `cfg` (and `scaling`), jitted (with XLA `compiler_options` if given,
        e.g. debug options that exist as flags only)."""
        call = functools.partial(
            gemm,
            out_sharding=NamedSharding(self.mesh, self.out_spec),
            config=cfg,
            x_spec=self.x_spec,
            w_spec=self.w_spec,
            scaling=scaling,
        )
        return jax.jit(call, compiler_options=compiler_options)

    def xla(self) -> Callable:
        """What a user writes without commgemm: one dot, XLA chooses the collectives."""
        out = NamedSharding(self.mesh, self.out_spec)
        return jax.jit(lambda x, w: jnp.dot(x, w), out_shardings=out)

    def _local(self, body: Callable, in_specs, out_specs) -> Callable:
        return jax.jit(
            jax.shard_map(
                body, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
            )
        )

    def _random(self, shape: tuple[int, ...], spec: P, seed: int) -> jax.Array:
        dtype = jnp.dtype(self.dtype)
        key = jax.random.key(seed)
        make = jax.jit(
            lambda: jax.random.normal(key, shape, dtype),
            out_shardings=NamedSharding(self.mesh, spec),
        )
        return make()

    def gemm_alone(self, *, cast: bool = False) -> tuple[Callable, tuple[jax.Array, jax.Array]]:
        """The same local GEMM as the op on every device, with no communication (the bound's
        first term), and its operands: one [lm, lk] @ [lk, ln] block per device. XLA's dot
        with a 16-bit result (float32 accumulation inside, as commgemm's GEMMs ask for it), or
        with cast=True a float32 result cast after; XLA picks other kernels for the two, and
        either can be the faster (on 2 GPUs by 2 to 8%)."""
        p = self.size
        lm, lk, ln = self._local_shape()
        spec = P(tuple(self.mesh.axis_names))
        dtype = jnp.dtype(self.dtype)

        def body(a, b):
            acc = jnp.float32 if cast else dtype
            return jnp.dot(a[0], b[0], preferred_element_type=acc).astype(dtype)[None]

        fn = self._local(body, (spec, spec), spec)
        return fn, (self._random((p, lm, lk), spec, 1), self._random((p, lk, ln), spec, 2))

    def gemm_alone_quantized(self, scaling) -> tuple[Callable, tuple[jax.Array, jax.Array]]:
        """The local GEMM of the op under `scaling` (its quantizing passes included, as the
        op runs them: `commgemm.scaled.matmul`), with no communication: the bound's first term
        for a quantized op."""
        from commgemm.scaled import matmul as quantized_matmul

        p = self.size
        lm, lk, ln = self._local_shape()
        spec = P(tuple(self.mesh.axis_names))
        dtype = jnp.dtype(self.dtype)

        def body(a, b):
            return quantized_matmul(a[0], b[0], scaling).astype(dtype)[None]

        fn = self._local(body, (spec, spec), spec)
        return fn, (self._random((p, lm, lk), spec, 1), self._random((p, lk, ln), spec, 2))

    def _local_shape(self) -> tuple[int, int, int]:
        m, k, n = self.shape
        if self.op == "2d":
            rows, cols = self.mesh.devices.shape
            return m // rows, k // cols, n
        p = self.size
        return {"ag": (m, k, n // p), "rs": (m, k // p, n), "ar": (m, k // p, n)}[self.op]

    def gemm_alone_mosaic(self) -> tuple[Callable, tuple[jax.Array, jax.Array]] | None:
        """jax's Mosaic GPU Hopper matmul (`hopper_matmul_mgpu`) of the local shape on every
        device, no communication, with the fused kernels' tiles (128 x 128 x 64, 4 stages);
        None where it cannot run (no Hopper GPU, a shape those tiles do not divide)."""
        lm, lk, ln = self._local_shape()
        device = self.mesh.devices.flat[0]
        hopper = str(getattr(device, "compute_capability", "")).startswith("9")
        if device.platform != "gpu" or not hopper:
            return None
        if lm % 128 or ln % 128 or lk % 64 or self.dtype not in ("bfloat16", "float16"):
            return None
        from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm

        tiles = hm.TuningConfig(
            tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=4, grid_tile_width=8
        )
        spec = P(tuple(self.mesh.axis_names))
        fn = self._local(lambda a, b: hm.matmul(a[0], b[0], None, tiles)[None], (spec, spec), spec)
        p = self.size
        return fn, (self._random((p, lm, lk), spec, 1), self._random((p, lk, ln), spec, 2))

    def gemm_alone_torch(self) -> tuple[Callable, tuple] | None:
        """cuBLAS through torch (torch.matmul) of the local shape on this process's first
        device (its CUDA ordinal, so that each process of a multi-process run uses its own). Each
        call's result carries a CUDA event recorded after its GEMM, and its is_ready and
        block_until_ready ask that event, as a jax array's ask for its own buffer, so the
        harness times it the same way. None without torch, CUDA or a 16-bit dtype."""
        try:
            import torch
        except ImportError:
            return None
        if not torch.cuda.is_available() or self.dtype not in ("bfloat16", "float16"):
            return None
        lm, lk, ln = self._local_shape()
        dtype = getattr(torch, self.dtype)
        device = torch.device("cuda", jax.local_devices()[0].local_hardware_id)
        torch.cuda.set_device(device)  # the events and the matmul's stream on that GPU too
        a = torch.randn(lm, lk, device=device, dtype=dtype)
        b = torch.randn(lk, ln, device=device, dtype=dtype)

        class Done:
            def __init__(self, out):
                self.out, self.event = out, torch.cuda.Event()
                self.event.record()

            def is_ready(self) -> bool:
                return self.event.query()

            def block_until_ready(self):
                self.event.synchronize()
                return self

        return (lambda: Done(torch.matmul(a, b))), ()

    def comm_alone(self) -> Callable:
        """The op's collective with no GEMM, on the tensor it moves (bound's second term)."""
        names = self.mesh.axis_names
        if self.op == "ag":
            return self._local(
                lambda a: lax.all_gather(a, names[0], tiled=True), self.x_spec, P(None, None)
            )
        if self.op == "rs":
            return self._local(
                lambda a: lax.psum_scatter(a, names[0], tiled=True),
                P(None, None),
                P(names[0], None),
            )
        if self.op == "ar":
            return self._local(lambda a: lax.psum(a, names[0]), P(None, None), P(None, None))
        return self._local(
            lambda a: lax.psum(lax.all_gather(a, "x", tiled=True), "y"), P("x", None), P(None, None)
        )

    def comm_operand(self) -> jax.Array:
        """What `comm_alone` moves: x for AG; a full [M, N] partial product per device for RS and
        AR; w for the 2-D case."""
        m, k, n = self.shape
        if self.op == "ag":
            return self._random((m, k), self.x_spec, 3)
        if self.op in ("rs", "ar"):
            return self._random((m, n), P(None, None), 3)
        return self._random((k, n), P("x", None), 3)


def make_problem(op: str, shape: tuple[int, int, int], dtype: str, devices=None) -> Problem:
    """Global (M, K, N) on all `devices` (1-D mesh 'tp'; the 2-D case a ('x', 'y') mesh)."""
    if op not in OPS:
        raise ValueError(f"op={op!r} must be one of {OPS}")
    devices = list(devices if devices is not None else jax.devices())
    if op == "2d":
        rows = 2 if len(devices) % 2 == 0 and len(devices) > 1 else 1
        mesh = Mesh(np.array(devices).reshape(rows, -1), ("x", "y"))
        return Problem(op, shape, dtype, mesh, P("x", "y"), P("x", None), P("x", None))
    mesh = Mesh(np.array(devices), ("tp",))
    specs = {
        "ag": (P("tp", None), P(None, "tp"), P(None, "tp")),
        "rs": (P(None, "tp"), P("tp", None), P("tp", None)),
        "ar": (P(None, "tp"), P("tp", None), P(None, None)),
    }[op]
    return Problem(op, shape, dtype, mesh, *specs)
