"""A grouped GEMM whose rows go straight back to their owners: the expert-parallel block's
second GEMM and its return exchange in one kernel (the ping-pong kernel, `grouped_pingpong`,
with this module's epilogue).

x [M, K] holds the rows a device's experts received, sorted by expert, every source's rows for
one expert together (`grouped.exchange.Layout` with `by_group`): segment r = g * P + s, rows
[first[r], first[r] + rows[r]), came from device s for local expert g and go back to rows
[dest[r], dest[r] + rows[r]) of device s's result. A tile holds one group's rows, so it meets
at most P segments: the epilogue stores each part by a ladder of TMA stores
(`grouped_pingpong.ladder_store`) into its owner's result, over NVLink for a peer's, while the
other compute warpgroup's K loop runs. No row of the GEMM's own result is written anywhere
else, and nothing is stored for the rows past the groups. The rows of this device's result
that no device sends to (the tokens a capacity dropped, the rows past the tokens) are zeroed
by the compute warpgroups after their GEMM tiles, in units of tile_m x tile_n dealt over both
warpgroups of every CTA (`zeros`: ragged_a2a's plan of fill items).

Invariants, as in `ragged_a2a`: each compute warpgroup adds 1 to its own "entered" semaphore on
every device and waits for P before its first store, so no device writes into a peer's result
before the peer runs this kernel (its earlier work, whose memory the result may reuse, done);
each, its stores landed (awaited), adds 1 to "arrived" on every device, ordered after those
stores (`signals.landed`), and warpgroup 0 of CTA 0 waits for 2 x CTAs x P of them, so the
kernel ends when every row has arrived. Waits take their counts off: each call starts where
the last left them."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from commgemm.mosaic_gpu import signals
from commgemm.mosaic_gpu import tiles as mt
from commgemm.mosaic_gpu.grouped_pingpong import ladder_store
from commgemm.mosaic_gpu.ragged_a2a import unit_of


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Returned:
    """Where a grouped GEMM's rows go (module docstring): `segments` int32 [3, G * P] (first
    row in x, rows, first row on the owner, for segment g * P + s), `fills` int32 [2, F] (first
    row and rows of this device's result that no device writes), the result's rows
    `out_rows` (static) and the mesh axis (static)."""

    segments: jax.Array
    fills: jax.Array
    out_rows: int = dataclasses.field(metadata=dict(static=True))
    axis_name: str = dataclasses.field(metadata=dict(static=True))

    def operands(self, tile_m: int, n_iters: int) -> tuple[jax.Array, jax.Array]:
        """The kernel's int32 operands: the segments, and the fills as zero units of tile_m x
        tile_n ([3, F + 1]: each item's first unit and the total, its first row, its rows)."""
        first, rows = (jnp.asarray(a, jnp.int32) for a in self.fills)
        units = (jnp.maximum(rows, 0) + tile_m - 1) // tile_m * n_iters
        firsts = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(units, dtype=jnp.int32)])
        pad = lambda a: jnp.append(a, jnp.int32(0))  # noqa: E731
        return self.segments.astype(jnp.int32), jnp.stack([firsts, pad(first), pad(rows)])

    def epilogue(self, size: int, segments_ref, zeros_ref, out_ref, ctas: int) -> Epilogue:
        """Its kernel side (`Epilogue`), in the kernel's body."""
        return Epilogue(self, size, segments_ref, zeros_ref, out_ref, ctas)


class Epilogue:
    """The kernel side of `Returned`, in the ping-pong kernel's body: `size` the devices of its
    axis, `segments_ref` and `zeros_ref` its operands (`Returned.operands`), `out_ref` this
    device's result, `ctas` the grid."""

    def __init__(self, returned: Returned, size: int, segments_ref, zeros_ref, out_ref, ctas: int):
        from jax.experimental import pallas as pl
        from jax.experimental.pallas import mosaic_gpu as plgpu

        self.axis_name, self.size = returned.axis_name, size
        self.segments_ref, self.zeros_ref, self.out_ref, self.ctas = (
            segments_ref, zeros_ref, out_ref, ctas
        )  # fmt: skip
        self.entered = pl.get_global(plgpu.SemaphoreType.REGULAR((2 * ctas,)))
        self.arrived = pl.get_global(plgpu.SemaphoreType.REGULAR((1,)))

    def _peer(self, d: int) -> dict:
        return mt.peer_id(self.axis_name, jnp.int32(d))

    def enter(self, cta, c: int) -> None:
        """Compute warpgroup c of `cta`, before its first store: every device runs the kernel."""
        from jax.experimental import pallas as pl

        slot = self.entered.at[2 * cta + c]
        for d in range(self.size):
            signals.entered(slot, device_id=self._peer(d))
        pl.semaphore_wait(slot, value=self.size, decrement=True)

    def store(self, source, group, lo, at, count, cols, tile_m: int) -> None:
        """source's rows [at, at + count) (a shared-memory tile of tile_m rows), rows [lo, lo +
        count) of x, all of `group`'s, into their owners' results at columns `cols`."""
        from jax.experimental.pallas import mosaic_gpu as plgpu

        seg = self.segments_ref
        for d in range(self.size):
            r = group * self.size + d
            start = seg[0, r]
            a = jnp.maximum(lo, start)
            rows = jnp.maximum(jnp.minimum(lo + count, start + seg[1, r]) - a, 0)
            owner = plgpu.remote_ref(self.out_ref, self._peer(d))
            ladder_store(source, owner, seg[2, r] + a - start, rows, cols, tile_m, at=at + a - lo)

    def zero(self, cta, c: int, zeros, tile_n: int, n_iters: int) -> None:
        """Compute warpgroup c of `cta`: its share of the zero units, from `zeros` (a
        shared-memory tile of tile_m zero rows, written and committed)."""
        from jax.experimental import pallas as pl

        plan, items = self.zeros_ref, self.zeros_ref.shape[1] - 1
        tile_m, lanes = zeros.shape[0], 2 * self.ctas
        me = 2 * cta + c

        @pl.loop(0, jnp.maximum(plan[0, items] - me + lanes - 1, 0) // lanes)
        def _unit(j):
            unit = me + j * lanes
            item, chunk, rows, cols = unit_of(plan, unit, items, n_iters, tile_m, tile_n)
            ladder_store(zeros, self.out_ref, plan[1, item] + chunk * tile_m, rows, cols, tile_m)

    def leave(self, cta, c: int) -> None:
        """Compute warpgroup c of `cta`, its last store issued: its stores landed, then (CTA 0,
        warpgroup 0) every device's."""
        from jax.experimental import pallas as pl
        from jax.experimental.pallas import mosaic_gpu as plgpu

        plgpu.wait_smem_to_gmem(0, wait_read_only=False)
        for d in range(self.size):
            signals.landed(self.arrived.at[0], device_id=self._peer(d))
        if c == 0:

            @pl.when(cta == 0)
            def _all_arrived():
                total = 2 * self.ctas * self.size
                pl.semaphore_wait(self.arrived.at[0], value=total, decrement=True)
