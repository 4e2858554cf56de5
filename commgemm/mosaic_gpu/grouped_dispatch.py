"""A grouped GEMM whose rows arrive while it multiplies: the expert-parallel dispatch (a ragged
all-to-all into the experts' rows) and the GEMM that reads them in one kernel (the ping-pong
kernel, `grouped_pingpong`, with this module's senders and waits).

x [M, K], the rows this device's experts receive, is the kernel's second result: the first
`senders` CTAs of every device push their device's rows (`src`, in the regions of the
exchange's send layout) into their owners' x over NVLink, while the other CTAs run the GEMM on
the rows that have arrived. Senders take chunks of up to BAND rows of one region (all K
columns, in pairs of blocks of `STAGING_BYTES`-byte rows: TMA loads into shared memory, then a
ladder of TMA stores, `grouped_pingpong.ladder_store`, of the live rows only), in the order of
their place on the receiver (group-major), and after a chunk's stores have landed add 1 to
the semaphore of each band of BAND rows of x it wrote (`signals.landed`). The load
warpgroup of a GEMM CTA waits, before a tile's loads, for its live rows' bands to hold the
chunks that land there (`expected`, counted in XLA from the receive layout), then fences the
async proxy, so the TMA loads read what arrived.

Invariants: each sender warpgroup adds 1 to its own "entered" semaphore on every device and
waits for P before its first store (no device writes into a peer's x before the peer runs
this kernel); every band semaphore holds exactly its expected count once all chunks landed,
and the GEMM CTAs' load warpgroups, their waits done, add 1 to "finished", which the first
GEMM CTA awaits before it sets every band back to 0: each call starts from zeros. x's rows
past the regions' live ones are not written (their readers take the groups' rows only)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from commgemm.mosaic_gpu import signals
from commgemm.mosaic_gpu import tiles as mt
from commgemm.mosaic_gpu.grouped_pingpong import ladder_store
from commgemm.mosaic_gpu.ragged_a2a import item_of

#: Rows of a sender's chunk and of a band of x (one semaphore each); at least a tile's rows.
BAND = 128
#: Bytes of a staged row: blocks of BAND x (this / itemsize), two per sender warpgroup.
STAGING_BYTES = 256
#: CTAs of each device that send; the others multiply.
SENDERS = 16


def staging_cols(k: int, dtype) -> int | None:
    """Columns of a staged block for rows of k elements of `dtype`, or None where K is not
    whole pairs of them."""
    cols = STAGING_BYTES // jnp.dtype(dtype).itemsize
    return cols if k % (2 * cols) == 0 else None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Dispatched:
    """Where a grouped GEMM's rows come from (module docstring): `src` [R, K] this device's
    rows, `items` int32 [5, I + 1] (each send item's first chunk and the total; its first row
    in src, rows, first row on the peer, peer; in group-major order), `expected` int32 [bands]
    (the chunks that land in each band of this device's x), the mesh axis and the senders
    (static)."""

    src: jax.Array
    items: jax.Array
    expected: jax.Array
    axis_name: str = dataclasses.field(metadata=dict(static=True))
    senders: int = dataclasses.field(default=SENDERS, metadata=dict(static=True))

    def operands(self) -> tuple[jax.Array, ...]:
        """The kernel's operands before w: the items, the expected counts, src."""
        return self.items, self.expected, self.src

    def run_scoped(self, scoped, scratch: tuple, ring_bytes: int) -> None:
        """In the kernel's body: `pl.run_scoped` of the ping-pong's `scoped` on its `scratch`
        (`grouped_pingpong.ring_scratch`), the senders' blocks [2, 2, BAND, cols] (warpgroup,
        block) in a union with the ring's operand slots (`ring_bytes`), which must hold them:
        scoped(*scratch, blocks=blocks)."""
        from jax.experimental import pallas as pl
        from jax.experimental.pallas import mosaic_gpu as plgpu

        k, dtype = self.src.shape[1], self.src.dtype
        cols = staging_cols(k, dtype)
        if cols is None or 4 * BAND * STAGING_BYTES > ring_bytes:
            raise ValueError(
                f"dispatched grouped kernel: rows of {k} x {jnp.dtype(dtype).name}"
                f" in {ring_bytes} bytes of ring: no room for the senders' blocks"
            )
        blocks = plgpu.SMEM((2, 2, BAND, cols), dtype)

        def inner(union, *rest):
            ring, staging = union  # a union's groups
            scoped(*ring, *rest, blocks=staging)

        pl.run_scoped(inner, plgpu.RefUnion(scratch[:2], blocks), *scratch[2:],
                      collective_axes="wg")  # fmt: skip

    def arrivals(self, size: int, items_ref, expected_ref, src_ref, x_ref, ctas: int):
        """Its kernel side (`Arrivals`), in the kernel's body."""
        return Arrivals(self, size, items_ref, expected_ref, src_ref, x_ref, ctas)


def plan(src: jax.Array, first, rows, dest, peer, recv_first, recv_rows, m: int,
         axis_name: str) -> Dispatched:  # fmt: skip
    """The `Dispatched` of src [R, K] by its send items (first row, rows, first row on the
    peer, peer: [I] each, in the order senders take them) and this device's receive regions
    (first row, rows: [J] each) over x's m rows."""
    first, rows, dest, peer = (jnp.asarray(a, jnp.int32) for a in (first, rows, dest, peer))
    chunks = (jnp.maximum(rows, 0) + BAND - 1) // BAND
    firsts = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(chunks, dtype=jnp.int32)])
    pad = lambda a: jnp.append(a, jnp.int32(0))  # noqa: E731
    items = jnp.stack([firsts, pad(first), pad(rows), pad(dest), pad(peer)])
    return Dispatched(src, items, expected_chunks(recv_first, recv_rows, m), axis_name, SENDERS)


def expected_chunks(first, rows, m: int) -> jax.Array:
    """int32 [ceil(m / BAND)]: how many senders' chunks (BAND rows of a region from its first
    row on) touch each band of x, for regions (first row [J], rows [J]) of x's m rows."""
    first, rows = jnp.asarray(first, jnp.int32), jnp.maximum(jnp.asarray(rows, jnp.int32), 0)
    chunks = (rows + BAND - 1) // BAND
    ends = jnp.cumsum(chunks, dtype=jnp.int32)
    q = jnp.arange(-(-m // BAND) + first.shape[0], dtype=jnp.int32)  # a bound on the chunks
    region = jnp.minimum(jnp.searchsorted(ends, q, side="right"), first.shape[0] - 1)
    c = q - (ends - chunks)[region]
    at = first[region] + c * BAND
    last = first[region] + jnp.minimum(c * BAND + BAND, rows[region]) - 1
    live = q < ends[-1]
    bands = -(-m // BAND)
    lo, hi = at // BAND, last // BAND
    count = jnp.zeros((bands,), jnp.int32)
    count = count.at[jnp.where(live, lo, bands)].add(1, mode="drop")
    return count.at[jnp.where(live & (hi != lo), hi, bands)].add(1, mode="drop")


def _zero_semaphore(sem) -> None:
    """Sets semaphore `sem` (this device's) to 0: a relaxed store, ordered before the kernel's
    end."""
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    from jax.experimental.pallas import mosaic_gpu as plgpu

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
    def _store(_, sem_ref):
        from jax._src.lib.mlir import ir
        from jax._src.lib.mlir.dialects import llvm

        llvm.inline_asm(ir.Type.parse("!llvm.void"),
                        [mgpu_utils.memref_ptr(sem_ref), mgpu_utils.single_thread_predicate(
                            mgpu_utils.ThreadSubset.WARPGROUP)],
                        "@$1 st.relaxed.sys.global.b32 [$0], 0;", "l,b",
                        has_side_effects=True)  # fmt: skip

    _store(sem)


class Arrivals:
    """The kernel side of `Dispatched`, in the ping-pong kernel's body: `size` the devices of
    its axis, its operands' refs, `x_ref` this device's x (the kernel's second result), `ctas`
    the grid (the first `senders` send)."""

    def __init__(self, dispatched: Dispatched, size, items_ref, expected_ref, src_ref, x_ref,
                 ctas: int):  # fmt: skip
        from jax.experimental import pallas as pl
        from jax.experimental.pallas import mosaic_gpu as plgpu

        self.axis_name, self.size, self.senders = dispatched.axis_name, size, dispatched.senders
        self.items_ref, self.expected_ref, self.src_ref, self.x_ref = (
            items_ref, expected_ref, src_ref, x_ref
        )  # fmt: skip
        self.gemm_ctas = ctas - self.senders
        self.entered = pl.get_global(plgpu.SemaphoreType.REGULAR((2 * self.senders,)))
        self.bands = pl.get_global(plgpu.SemaphoreType.REGULAR((expected_ref.shape[0],)))
        self.finished = pl.get_global(plgpu.SemaphoreType.REGULAR((1,)))

    def _peer(self, d: int) -> dict:
        return mt.peer_id(self.axis_name, jnp.int32(d))

    def send(self, lane, staging, loaded) -> None:
        """Sender warpgroup `lane` (of 2 x senders): its chunks, through `staging` (plain
        shared memory [2, BAND, cols]) and `loaded` (a barrier of two arrivals)."""
        from jax.experimental import pallas as pl
        from jax.experimental.pallas import mosaic_gpu as plgpu

        plan, items, lanes = self.items_ref, self.items_ref.shape[1] - 1, 2 * self.senders
        cols = staging.shape[2]
        pairs = self.src_ref.shape[1] // (2 * cols)
        for d in range(self.size):
            pl.semaphore_signal(self.entered.at[lane], device_id=self._peer(d))
        pl.semaphore_wait(self.entered.at[lane], value=self.size, decrement=True)

        @pl.loop(0, jnp.maximum(plan[0, items] - lane + lanes - 1, 0) // lanes)
        def _chunk(j):
            q = lane + j * lanes
            item = item_of(plan, q, items)
            chunk = q - plan[0, item]
            rows = jnp.minimum(BAND, plan[2, item] - chunk * BAND)
            src, dst = plan[1, item] + chunk * BAND, plan[3, item] + chunk * BAND
            peer = plan[4, item]

            @pl.loop(0, pairs)
            def _pair(b):
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # both blocks' stores read
                for h in (0, 1):
                    block = pl.ds((2 * b + h) * cols, cols)
                    source = self.src_ref.at[pl.ds(src, BAND), block]
                    plgpu.copy_gmem_to_smem(source, staging.at[h], loaded)
                plgpu.barrier_wait(loaded)
                for h in (0, 1):
                    block = pl.ds((2 * b + h) * cols, cols)
                    for d in range(self.size):  # a TMA store's peer is static: one branch each

                        @pl.when(peer == d)
                        def _to(d=d, h=h, block=block):
                            owner = plgpu.remote_ref(self.x_ref, self._peer(d))
                            ladder_store(staging.at[h], owner, dst, rows, block, BAND)

            plgpu.wait_smem_to_gmem(0, wait_read_only=False)  # the chunk has landed
            lo, hi = dst // BAND, (dst + rows - 1) // BAND
            for d in range(self.size):

                @pl.when(peer == d)
                def _arrived(d=d):
                    signals.landed(self.bands.at[lo], device_id=self._peer(d))

                    @pl.when(hi != lo)
                    def _next():
                        signals.landed(self.bands.at[hi], device_id=self._peer(d))

    def roles(self, cta, gemm, staging, loaded) -> None:
        """CTA `cta`'s part: gemm() (the ping-pong's warpgroups) past the first `senders`
        CTAs; on those, compute warpgroup c sends (`send`) through staging[c] and loaded[c]."""
        from jax.experimental import pallas as pl

        pl.when(cta >= self.senders)(gemm)
        for c in (0, 1):
            send = functools.partial(self.send, 2 * cta + c, staging.at[c], loaded.at[c])
            pl.when((cta < self.senders) & (lax.axis_index("wg") == c))(send)

    def wait(self, first, rows) -> None:
        """A GEMM CTA's load warpgroup, before loading x's rows [first, first + rows) (rows <=
        BAND): until they have arrived."""
        from jax.experimental import pallas as pl

        @pl.when(rows > 0)
        def _wait():
            for band in (first // BAND, (first + rows - 1) // BAND):
                pl.semaphore_wait(self.bands.at[band], self.expected_ref[band], decrement=False)
            signals.fence_async_proxy()

    def finish(self, gemm_cta) -> None:
        """GEMM CTA `gemm_cta`'s load warpgroup, its waits done; the first then sets the bands
        back to 0 once every GEMM CTA's are."""
        from jax.experimental import pallas as pl

        pl.semaphore_signal(self.finished.at[0])

        @pl.when(gemm_cta == 0)
        def _reset():
            pl.semaphore_wait(self.finished.at[0], value=self.gemm_ctas, decrement=True)

            @pl.loop(0, self.bands.shape[0])
            def _band(b):
                _zero_semaphore(self.bands.at[b])
