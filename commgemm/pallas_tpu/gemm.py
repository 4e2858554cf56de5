"""Fused collective GEMMs as Pallas TPU kernels: all-gather + GEMM and GEMM + reduce-scatter,
as a ring (RING_EXCHANGE: each step multiplies the block present while the next one travels)
or direct (PIPELINE: every device sends to every peer at once, blocks multiplied as they land).

Blocks travel HBM to HBM by remote DMA into per-step (ring) or per-sender (direct) places, each
with its own receive semaphore; the GEMM streams them through VMEM in tiles of [tm, K] x [K, tn]
(`Tiles`), accumulating in float32. Partial sums travel in the output dtype. Float8 operands
(an op's tensor-scaled `scaling=`) travel as they are, half bf16's bytes, are widened to bf16
in VMEM for the MXU (exact: bf16 holds every float8 value) and the product is multiplied by the
two tensor scales before anything is added to it or stored. Block-scaled operands (MXFP8,
NVFP4: `Blocks`) travel as their payload rows, values and block scales together, and each tile
is dequantized per block in VMEM. Invariant: a device computes on a block only after its
receive semaphore says all of it landed, and sends into a peer only after the start barrier.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from commgemm.pallas_tpu.common import LANES, Ring, barrier, dma, pallas_call
from commgemm.vma import out_struct


@dataclasses.dataclass(frozen=True)
class Tiles:
    """The VMEM tiles of the GEMM: [tm, K] rows of x by [K, tn] columns of w (K whole)."""

    tm: int
    tn: int

    @staticmethod
    def fit(rows: int, k: int, n: int, itemsize: int, budget: int) -> Tiles | None:
        """The largest tiles (rows: divisors of `rows`, multiples of 8 where possible; columns:
        multiples of LANES dividing n, or n) whose x, w and float32 output tiles (and the
        added partial sums) fit `budget` bytes of VMEM; None when even the smallest do not."""
        row_options = [d for d in range(rows, 0, -1) if rows % d == 0 and (d % 8 == 0 or d == rows)]
        col_options = [n] + [t for t in range(n - n % LANES, 0, -LANES) if t and n % t == 0]
        for tm in row_options:
            for tn in col_options:
                need = (tm * k + k * tn + tm * tn) * itemsize + 2 * tm * tn * 4
                if need <= budget:
                    return Tiles(tm, tn)
        return None


def _mxu(v: jax.Array) -> jax.Array:
    """A tile as the MXU takes it: float8 widened to bf16 (exactly), other dtypes as they are."""
    return v.astype(jnp.bfloat16) if jnp.dtype(v.dtype).itemsize == 1 else v


@dataclasses.dataclass(frozen=True)
class Blocks:
    """Block-scaled operands (MXFP8, NVFP4) as the kernels take them: x's rows are the bytes of
    `quantized_gemm.payload`, [r, K + K / size] (float8_e4m3fn values, then one `scale_dtype`
    scale per `size` of them), and move as these bytes; w comes as float8_e4m3fn values
    [K, n] beside float32 block scales [K / size, n]. Each tile is dequantized per block into
    bf16 in VMEM before the MXU, exactly: a float8_e4m3fn value (4 significant bits) times a
    power of two (E8M0), or a float4_e2m1fn value (2) times a float8_e4m3fn scale (4), fits
    bf16's 8. Tensor-wide scales (NVFP4's global ones) stay in the kernels' `scale`."""

    size: int
    scale_dtype: str

    def lhs(self, rows: jax.Array, k: int) -> jax.Array:
        """Payload rows [r, K + K / size] (uint8) -> their values [r, K] in bf16."""
        values = lax.bitcast_convert_type(rows[:, :k], jnp.float8_e4m3fn).astype(jnp.float32)
        scales = lax.bitcast_convert_type(rows[:, k:], jnp.dtype(self.scale_dtype))
        scales = jnp.repeat(scales.astype(jnp.float32), self.size, axis=1)
        return (values * scales).astype(jnp.bfloat16)

    def rhs(self, values: jax.Array, scales: jax.Array) -> jax.Array:
        """w's values [K, tn] (float8) and float32 block scales [K / size, tn] -> [K, tn] bf16."""
        scales = jnp.repeat(scales, self.size, axis=0)
        return (values.astype(jnp.float32) * scales).astype(jnp.bfloat16)


@dataclasses.dataclass(frozen=True)
class _Gemm:
    """What each block product of a kernel reads: its tiling and VMEM scratch (`_scratch`), w,
    the (1,) float32 SMEM ref of the operands' tensor scales (1 unquantized), and with `blocks`
    w's block scales [K / size, n] and their VMEM tile."""

    tiles: Tiles
    k: int
    w_ref: object
    scale: object
    xv: object
    wv: object
    ov: object
    addv: object
    blocks: Blocks | None = None
    ws_ref: object = None
    wsv: object = None

    def block(self, x_rows, out_rows, add_rows=None) -> None:
        """out_rows [r, n] = scale * (x_rows [r, K] @ w [K, n]) (+ add_rows), tile by tile
        through VMEM."""
        from jax.experimental import pallas as pl
        from jax.experimental.pallas import tpu as pltpu

        r, n = out_rows.shape
        tm, tn = self.tiles.tm, self.tiles.tn

        @pl.loop(0, r // tm)
        def _rows(i):
            pltpu.sync_copy(x_rows.at[pl.ds(i * tm, tm)], self.xv)

            @pl.loop(0, n // tn)
            def _cols(j):
                cols = pl.ds(j * tn, tn)
                pltpu.sync_copy(self.w_ref.at[:, cols], self.wv)
                if self.blocks is None:
                    lhs, rhs = _mxu(self.xv[...]), _mxu(self.wv[...])
                else:
                    pltpu.sync_copy(self.ws_ref.at[:, cols], self.wsv)
                    lhs = self.blocks.lhs(self.xv[...], self.k)
                    rhs = self.blocks.rhs(self.wv[...], self.wsv[...])
                acc = jnp.dot(lhs, rhs, preferred_element_type=jnp.float32) * self.scale[0]
                if add_rows is not None:
                    pltpu.sync_copy(add_rows.at[pl.ds(i * tm, tm), cols], self.addv)
                    acc = acc + self.addv[...].astype(jnp.float32)
                self.ov[...] = acc.astype(self.ov.dtype)
                pltpu.sync_copy(self.ov, out_rows.at[pl.ds(i * tm, tm), cols])


def _scratch(tiles: Tiles, x, w, out_dtype, blocks: Blocks | None) -> list:
    """The VMEM tiles of `_Gemm`: x's rows [tm, x's width], w's columns [K, tn], the output
    and an added tile [tm, tn], and with `blocks` w's block scales [K / size, tn]."""
    from jax.experimental.pallas import tpu as pltpu

    k = w.shape[0]
    vmem = [
        pltpu.VMEM((tiles.tm, x.shape[1]), x.dtype),
        pltpu.VMEM((k, tiles.tn), w.dtype),
        pltpu.VMEM((tiles.tm, tiles.tn), out_dtype),
        pltpu.VMEM((tiles.tm, tiles.tn), out_dtype),
    ]
    if blocks is not None:
        vmem.append(pltpu.VMEM((k // blocks.size, tiles.tn), jnp.float32))
    return vmem


def _operands(x, w, scale, w_scales, blocks: Blocks | None):
    """The kernels' operands after the ring's coordinates (x, w, scale[, w_scales]) and the
    memory spaces they live in."""
    if (blocks is None) != (w_scales is None):
        raise ValueError("block-scaled operands need both blocks= and w_scales=")
    if blocks is None:
        return (x, w, scale), ["hbm", "hbm", "smem"]
    return (x, w, scale, w_scales), ["hbm", "hbm", "smem", "hbm"]


def _bind(tiles: Tiles, k: int, blocks: Blocks | None, inputs, scratch) -> _Gemm:
    """A kernel's `_Gemm` from its input refs (x, w, scale[, w_scales]) and VMEM scratch."""
    xv, wv, ov, addv, *wsv = scratch
    ws_ref = inputs[3] if blocks is not None else None
    return _Gemm(
        tiles, k, inputs[1], inputs[2], xv, wv, ov, addv, blocks, ws_ref, wsv[0] if wsv else None
    )


def _scale_and_dtype(x: jax.Array, scale: jax.Array | None, out_dtype) -> tuple[jax.Array, object]:
    """The (1,) float32 scale the kernels read (1 where None) and the result's dtype."""
    one = jnp.ones((1,), jnp.float32) if scale is None else scale
    return jnp.asarray(one, jnp.float32).reshape(1), jnp.dtype(out_dtype or x.dtype)


def all_gather_matmul(
    x: jax.Array,
    w: jax.Array,
    axis_name: str,
    tiles: Tiles,
    *,
    direct: bool = False,
    interpret: bool = False,
    race_check: bool = False,
    scale: jax.Array | None = None,
    out_dtype=None,
    blocks: Blocks | None = None,
    w_scales: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """x [m, K] local rows, w [K, n] -> (all_gather(x) @ w [P*m, n], all_gather(x) [P*m, K]).

    Float8 x and w: the product times `scale` (the two tensor scales), in `out_dtype`; the
    rows gathered as float8. Block-scaled (`blocks`): x the payload rows [m, K + K / size],
    gathered as they are, w the float8 values beside `w_scales` [K / size, n]. Otherwise scale
    is 1 and the result in x's dtype.

    Ring: at step t the block of device (d - t) mod P, already here, is multiplied while it is
    sent on to the next device. Direct: this device's block goes to every peer first; then the
    blocks are multiplied in ring order, each once its own semaphore says it landed.
    """
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    size = lax.axis_size(axis_name)
    ring = Ring(axis_name, size)
    (m, width), (k, n) = x.shape, w.shape
    shifts = tuple(range(1, size)) if direct else (1, -1)
    scale, out_dtype = _scale_and_dtype(x, scale, out_dtype)
    operands, in_memory = _operands(x, w, scale, w_scales, blocks)
    vmem = _scratch(tiles, x, w, out_dtype, blocks)
    num_in = len(operands)

    def kernel(*refs):
        (x_ref, *_), (o_ref, g_ref) = refs[:num_in], refs[num_in : num_in + 2]
        vm_end = num_in + 2 + len(vmem)
        gemm = _bind(tiles, k, blocks, refs[:num_in], refs[num_in + 2 : vm_end])
        _, send_sems, recv_sems = refs[vm_end:]
        barrier(ring, shifts)
        me = ring.index()
        pltpu.sync_copy(x_ref, g_ref.at[pl.ds(me * m, m)])

        def rows(src):
            return pl.ds(src * m, m)

        sends = []
        if direct:  # this device's block to every peer, into its place there
            for j, shift in enumerate(shifts):
                move = dma(
                    g_ref.at[rows(me)],
                    g_ref.at[rows(me)],
                    send_sems.at[j],
                    recv_sems.at[shift - 1],
                    ring.device(ring.neighbour(shift)),
                )
                move.start()
                sends.append(move)
        for t in range(size):
            src = ring.neighbour(-t)
            if t:  # the block of device me - t has landed
                slot = t - 1  # ring: sent at step t - 1; direct: sent with shift t
                dma(
                    g_ref.at[rows(src)],
                    g_ref.at[rows(src)],
                    send_sems.at[0],
                    recv_sems.at[slot],
                    ring.device(me),
                ).wait_recv()
            if not direct and t < size - 1:  # pass it on while multiplying it
                move = dma(
                    g_ref.at[rows(src)],
                    g_ref.at[rows(src)],
                    send_sems.at[t],
                    recv_sems.at[t],
                    ring.device(ring.neighbour(1)),
                )
                move.start()
                sends.append(move)
            gemm.block(g_ref.at[rows(src)], o_ref.at[rows(src)])
        for move in sends:
            move.wait_send()

    return pallas_call(
        kernel,
        ring,
        out_shape=[
            out_struct((size * m, n), out_dtype, (x, w)),
            out_struct((size * m, width), x.dtype, (x,)),
        ],
        in_memory=in_memory,
        out_memory=["hbm", "hbm"],
        scratch=vmem
        + [
            pltpu.SemaphoreType.DMA,
            pltpu.SemaphoreType.DMA((size - 1,)),
            pltpu.SemaphoreType.DMA((size - 1,)),
        ],
        interpret=interpret,
        race_check=race_check,
    )(*operands)


def matmul_reduce_scatter(
    x: jax.Array,
    w: jax.Array,
    axis_name: str,
    tiles: Tiles,
    *,
    direct: bool = False,
    interpret: bool = False,
    race_check: bool = False,
    scale: jax.Array | None = None,
    out_dtype=None,
    blocks: Blocks | None = None,
    w_scales: jax.Array | None = None,
) -> jax.Array:
    """x [M, k], w [k, n] (K sharded) -> [M/P, n], this device's rows of sum_d x_d @ w_d.

    Float8 x and w: each partial product times `scale` (the two tensor scales, shared by the
    shards), the partial sums travelling and the result in `out_dtype`, never in float8.
    Block-scaled (`blocks`): x the payload rows [M, k + k / size], w the float8 values beside
    `w_scales` [k / size, n].

    Ring: at step t a device computes its partial product of row block (d - t - 1) mod P, adds
    the partial sum received for it, and sends the sum on; at the last step the block is its own.
    Direct: a device computes its partial of every peer's block and sends each to its owner
    (peers' blocks first), then adds its own partial and the P-1 received ones in a fixed order.
    """
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    size = lax.axis_size(axis_name)
    ring = Ring(axis_name, size)
    r, (k, n) = x.shape[0] // size, w.shape
    shifts = tuple(range(1, size)) if direct else (1, -1)
    scale, out_dtype = _scale_and_dtype(x, scale, out_dtype)
    operands, in_memory = _operands(x, w, scale, w_scales, blocks)
    vmem = _scratch(tiles, x, w, out_dtype, blocks)
    num_in = len(operands)

    def kernel(*refs):
        (x_ref, *_), (o_ref, inbox, staged) = refs[:num_in], refs[num_in : num_in + 3]
        vm_end = num_in + 3 + len(vmem)
        gemm = _bind(tiles, k, blocks, refs[:num_in], refs[num_in + 3 : vm_end])
        send_sems, recv_sems = refs[vm_end:]
        barrier(ring, shifts)
        me = ring.index()

        def block(b):
            return x_ref.at[pl.ds(b * r, r)]

        sends = []
        if direct:
            for j, shift in enumerate(shifts):  # the owner me + shift; its inbox slot for me
                owner = ring.neighbour(shift)
                gemm.block(block(owner), staged.at[j])
                move = dma(
                    staged.at[j],
                    inbox.at[size - shift - 1],
                    send_sems.at[j],
                    recv_sems.at[size - shift - 1],
                    ring.device(owner),
                )
                move.start()
                sends.append(move)
            gemm.block(block(me), o_ref)
            for j in range(size - 1):  # fixed order: the same result on every call
                dma(
                    staged.at[0], inbox.at[j], send_sems.at[0], recv_sems.at[j], ring.device(me)
                ).wait_recv()
                _add_into(o_ref, inbox.at[j], tiles, gemm.ov, gemm.addv)
        else:
            for t in range(size):
                b = ring.neighbour(-t - 1)
                received = None
                if t:
                    dma(
                        staged.at[0],
                        inbox.at[t - 1],
                        send_sems.at[0],
                        recv_sems.at[t - 1],
                        ring.device(me),
                    ).wait_recv()
                    received = inbox.at[t - 1]
                dest = o_ref if t == size - 1 else staged.at[t]
                gemm.block(block(b), dest, received)
                if t < size - 1:
                    move = dma(
                        staged.at[t],
                        inbox.at[t],
                        send_sems.at[t],
                        recv_sems.at[t],
                        ring.device(ring.neighbour(1)),
                    )
                    move.start()
                    sends.append(move)
        for move in sends:
            move.wait_send()

    out, _, _ = pallas_call(
        kernel,
        ring,
        out_shape=[
            out_struct((r, n), out_dtype, (x, w)),
            out_struct((size - 1, r, n), out_dtype, (x, w)),  # received partial sums
            out_struct((size - 1, r, n), out_dtype, (x, w)),  # partial sums sent
        ],
        in_memory=in_memory,
        out_memory=["hbm", "hbm", "hbm"],
        scratch=vmem + [pltpu.SemaphoreType.DMA((size - 1,)), pltpu.SemaphoreType.DMA((size - 1,))],
        interpret=interpret,
        race_check=race_check,
    )(*operands)
    return out


def _add_into(o_ref, add_ref, tiles: Tiles, ov, addv) -> None:
    """o_ref [r, n] += add_ref [r, n], tile by tile (float32 adds)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    r, n = o_ref.shape
    tm, tn = tiles.tm, tiles.tn

    @pl.loop(0, r // tm)
    def _rows(i):
        @pl.loop(0, n // tn)
        def _cols(j):
            at = (pl.ds(i * tm, tm), pl.ds(j * tn, tn))
            pltpu.sync_copy(o_ref.at[at], ov)
            pltpu.sync_copy(add_ref.at[at], addv)
            ov[...] = (ov[...].astype(jnp.float32) + addv[...].astype(jnp.float32)).astype(ov.dtype)
            pltpu.sync_copy(ov, o_ref.at[at])
