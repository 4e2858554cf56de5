"""What the Pallas TPU kernels share: device ids on the mesh, the start barrier, the kernel call
(native on a TPU, Pallas' TPU interpret mode elsewhere) and the VMEM budget that bounds tiles."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

#: Scoped VMEM a kernel may use, by TPU generation (bytes): the compiler's default scoped limit
#: (16 MiB on v5e, 32 MiB on v5p and v6e; Pallas TPU docs, "TPU pipelining" / CompilerParams
#: vmem_limit_bytes), of 128 / 95 / 128 MiB physical. Interpret mode has no VMEM: the smallest.
VMEM_BUDGET = {"v5e": 16 << 20, "v5p": 32 << 20, "v6e": 32 << 20, "interpret": 16 << 20}
#: Tile granularity of the MXU and the vector registers: second-minor 8 (float32) / 16 (bf16),
#: minor 128; the GEMM tiles along N are multiples of 128.
LANES = 128


@dataclasses.dataclass
class Ring:
    """This device's place on the ring of mesh axis `axis` (the other mesh axes fixed).

    The kernel reads this device's mesh coordinates from its first operand (`coordinates`, in
    SMEM) rather than from `lax.axis_index`: values computed from the latter are typed as
    varying under shard_map's check_vma, which Pallas' TPU interpreter cannot mix with the
    kernel's own values."""

    axis: str
    size: int
    coords: list | None = None

    def __post_init__(self) -> None:
        self.names = tuple(jax.sharding.get_abstract_mesh().axis_names)

    def coordinates(self) -> jax.Array:
        """This device's mesh coordinates, int32 [number of mesh axes] (the kernel's first
        operand)."""
        return jnp.stack([lax.axis_index(n).astype(jnp.int32) for n in self.names])

    def bind(self, coords_ref) -> None:
        """Read the coordinates inside the kernel (before anything else)."""
        self.coords = [coords_ref[i] for i in range(len(self.names))]

    def index(self) -> jax.Array:
        return self.coords[self.names.index(self.axis)]

    def device(self, position) -> tuple:
        """The MESH device id of ring position `position` in this device's row of the mesh."""
        return tuple(
            position if n == self.axis else c for n, c in zip(self.names, self.coords, strict=True)
        )

    def neighbour(self, shift: int) -> jax.Array:
        """The ring position `shift` places from this device's (int32, any shift)."""
        offset = shift % self.size
        return lax.rem(self.index() + jnp.int32(offset), jnp.int32(self.size))


def barrier(ring: Ring, shifts: tuple[int, ...], *, enabled: bool = True) -> None:
    """The start handshake: signal the devices at `shifts` round the ring (the ones that will
    write into this device's memory, and that this device writes into) and wait for as many
    signals. Invariant after it: every peer this device writes into has entered the kernel and
    set up the buffers it receives into. (`enabled=False` only for the test that shows the race
    the handshake prevents.)"""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    if not enabled:
        return
    sem = pltpu.get_barrier_semaphore()
    for shift in shifts:
        pl.semaphore_signal(
            sem,
            1,
            device_id=ring.device(ring.neighbour(shift)),
            device_id_type=pl.DeviceIdType.MESH,
        )
    pl.semaphore_wait(sem, len(shifts))


def _first_axis_order(axes: frozenset) -> list:
    """The axis order the interpreter first met for mesh axes `axes` ({(name, size)}) in this
    process (a one-element list, filled by the caller), forgotten by `jax.clear_caches()`."""
    return []


try:  # a jax cache, so that jax.clear_caches(), which clears the stale state, clears it too
    from jax._src.util import cache as _jax_cache

    _first_axis_order = _jax_cache(max_size=None, trace_context_in_key=False)(_first_axis_order)
except (ImportError, TypeError):  # pragma: no cover - a jax without it: remembered for good
    import functools

    _first_axis_order = functools.cache(_first_axis_order)


def check_interpret_mesh(names: tuple[str, ...]) -> None:
    """Refuses an interpreted kernel on mesh axes that an earlier one met in another order.

    Pallas' TPU interpreter lowers a kernel with the device ids of the mesh axes in order, and
    jax's caches keep that lowering for a mesh of the same axes and sizes in any order (the
    axis environment compares as a dict): the second order would compute with the first's
    device ids (NaN or wrong results, or an IndexError in a semaphore). `jax.clear_caches()`
    between the two meshes clears both that state and this record."""
    mesh = jax.sharding.get_abstract_mesh()
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    order = tuple(n for n in names)
    seen = _first_axis_order(frozenset((n, sizes[n]) for n in order))
    if not seen:
        seen.append(order)
    elif seen[0] != order:
        raise ValueError(
            f"the interpreted TPU kernels already ran on mesh axes {seen[0]} in this process; on "
            f"the same axes in the order {order}, jax's caches would hand the interpreter the "
            "first order's device ids (wrong results). Call jax.clear_caches() before using "
            "the new mesh, or keep one axis order"
        )


def pallas_call(
    kernel, ring: Ring, *, out_shape, in_memory, out_memory, scratch, interpret: bool, race_check
):
    """`pl.pallas_call` of a collective kernel: the ring's coordinates first (SMEM; bound before
    `kernel(*refs)` runs), operands in HBM (`pl.ANY`) or VMEM, a barrier semaphore
    (collective_id), and interpret mode where asked (race detection with race_check). The
    kernel is traced with 32-bit types whatever jax_enable_x64 says (its operands are 32-bit
    or narrower)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    space = {"hbm": pl.ANY, "vmem": pltpu.VMEM, "smem": pltpu.SMEM}
    spec = lambda m: pl.BlockSpec(memory_space=space[m])  # noqa: E731
    outs = [spec(m) for m in out_memory]

    def bound(coords_ref, *refs):
        ring.bind(coords_ref)
        kernel(*refs)

    call = pl.pallas_call(
        bound,
        out_shape=out_shape,
        in_specs=[spec("smem")] + [spec(m) for m in in_memory],
        out_specs=outs if isinstance(out_shape, (list, tuple)) else outs[0],
        scratch_shapes=scratch,
        compiler_params=pltpu.CompilerParams(collective_id=0),
        interpret=pltpu.InterpretParams(detect_races=race_check, dma_execution_mode="eager")
        if interpret
        else False,
    )

    if interpret:
        check_interpret_mesh(ring.names)

    def run(*operands):
        # traced with 32-bit types: under jax_enable_x64 Python ints would become i64 indices,
        # which Pallas' TPU lowering refuses (its slices and DMAs take i32)
        with jax.enable_x64(False):
            return call(ring.coordinates(), *operands)

    return run


def dma(src, dst, send_sem, recv_sem, device):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.make_async_remote_copy(
        src, dst, send_sem, recv_sem, device_id=device, device_id_type=pl.DeviceIdType.MESH
    )


def signal(sem, device) -> None:
    from jax.experimental import pallas as pl

    pl.semaphore_signal(sem, 1, device_id=device, device_id_type=pl.DeviceIdType.MESH)


def races_found() -> bool:
    """Whether Pallas' TPU interpreter found a race since its state was last reset."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc

    return bool(ipc.races.races_found)


def reset_race_state() -> None:
    from jax.experimental.pallas import tpu as pltpu

    pltpu.reset_tpu_interpret_mode_state()
