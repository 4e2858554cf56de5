"""ATOMIC_GEMM_AG on the ping-pong schedule: all-gather + GEMM in one kernel, each compute
warpgroup a whole output tile, its epilogue under the other's K loop (`pingpong`).

x [m, K] (this device's rows), w [K, n] -> all_gather(x) @ w [P*m, n], rows in device order, as
`direct_ag`'s direct kernel: the units walk this device's own row block first, then the
peers' (step s: the rows of device (d - s) mod P, from inbox slot s - 1). The first `senders`
tiles of each band of rows (tile_m rows of the own block) each push every senders-th of the
band's K-steps to every peer's inbox straight from the ring's slot, over NVLink; the slot goes
back to the loads once the push has read it, awaited a K-step later. Once its pushes landed, a
tile raises the band's flag on every peer. The load warpgroup awaits a band's flags before
loading a peer tile's rows. The last column of tiles may be partial: TMA zero-fills the loads
past n and clips the stores.
Invariant: a flag is raised only after its sender's stores have landed (awaited), ordered
after them (`signals.landed`); every own tile precedes every peer tile in each CTA's
order, so no CTA waits on a band whose senders wait on it.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jax import lax

from commgemm.mosaic_gpu import pingpong, signals
from commgemm.mosaic_gpu import tiles as mt
from commgemm.mosaic_gpu.configs import EPI, PingPongAGConfig
from commgemm.mosaic_gpu.direct_ag import SENDERS, gathered_rows
from commgemm.mosaic_gpu.pingpong import shape_reason

__all__ = ["all_gather_matmul", "shape_reason", "visit_rank"]


def visit_rank(tiles: PingPongAGConfig, m_pair, n_idx, n_iters: int):
    """Which visit of its band of rows cluster tile (m_pair, n_idx) is, 0 the first, in the
    order of `pingpong.tile_origin`: along N each strip of bands walks the columns in order;
    along M the strips of `grid_tile_width` cluster rows alternate direction."""
    if not tiles.grid_minor_m:
        return n_idx
    strip = m_pair // tiles.grid_tile_width
    return jnp.where(lax.rem(strip, jnp.int32(2)) == 0, n_idx, n_iters - 1 - n_idx)


def all_gather_matmul(
    x: jax.Array,
    w: jax.Array,
    axis_name: str | None,
    tiles: PingPongAGConfig,
    *,
    w_nk: bool = False,
    out_dtype=None,
    scale: jax.Array | None = None,
    split_accumulator: bool = False,
    return_gathered: bool = False,
    compiler_params: Mapping | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """x [m, K] (rows sharded over axis_name), w [K, n] (local; [n, K] with w_nk) -> [P*m, n],
    all_gather(x) @ w (times `scale` [1] float32, if given) in `out_dtype` (default x's dtype),
    rows in device order. Float8 x and w (w_nk) multiply on float8 tensor cores with fast
    accumulation, the rows travel as float8 (`split_accumulator` is refused: a second
    accumulator does not fit beside a whole tile's). axis_name None: one device (the kernel's
    GEMM core). `return_gathered`: also all_gather(x) [P*m, K], in device order, from the rows
    the kernel received."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    size = mt.axis_position(axis_name)[0]
    tiles = pingpong.checked_tiles(tiles, PingPongAGConfig, split_accumulator)
    dtype = x.dtype
    out_dtype = jnp.dtype(out_dtype or dtype)
    m, k, n = x.shape[0], x.shape[1], w.shape[0 if w_nk else 1]
    if reason := shape_reason(tiles, m, k, n, dtype, w_nk=w_nk, out_dtype=out_dtype):
        raise ValueError(f"PingPongAGConfig: {reason}")
    tile_m, tile_n, tile_k = tiles.tile_m, tiles.tile_n, tiles.tile_k
    pair = tiles.cluster_size
    m_pairs, n_iters, k_iters = m // tiles.cluster_m, -(-n // tile_n), k // tile_k
    step_tiles = m_pairs * n_iters
    units = size * step_tiles
    ctas = mt.num_sms() // pair
    dealt = pingpong.deal(tiles, units, ctas)
    # a halved tail follows a full wave: on P > 1 devices it holds no own tile (none sends)
    assert size == 1 or units - dealt.tail >= step_tiles, (units, dealt)
    bands = m // tile_m
    num_senders = max(1, min(SENDERS, n_iters, k_iters))

    def body(x_ref, w_ref, *refs):
        scale_ref, out_ref, *inbox = refs if scale is not None else (None, *refs)
        if size > 1:
            arrived = pl.get_global(plgpu.SemaphoreType.REGULAR((size - 1, bands)))
        here = mt.axis_position(axis_name)[1]
        in_cluster = lax.axis_index("cluster")
        cid = lax.axis_index("cluster_grid")
        # the peers, in the order of their inbox slots for this device's rows
        peers = [
            mt.peer_id(axis_name, lax.rem(here + j + 1, jnp.int32(size))) for j in range(size - 1)
        ]

        def where(i):
            """(step, this CTA's first row in its block, first column, band, visit rank) of
            this CTA's i-th unit."""
            lin, half = dealt.tile(cid, i)
            step, tile = lin // step_tiles, lax.rem(lin, jnp.int32(step_tiles))
            row0, col = pingpong.tile_origin(tiles, tile, m_pairs, n_iters)
            row = row0 + in_cluster * tile_m + half * (tile_m // 2)
            rank = visit_rank(tiles, row0 // tiles.cluster_m, col // tile_n, n_iters)
            return step, row, col, row // tile_m, rank

        def load_x(i, kk, dest, barrier):
            step, row, *_ = where(i)
            at = (pl.ds(row, dest.shape[0]), pl.ds(kk * tile_k, tile_k))
            pl.when(step == 0)(lambda: plgpu.copy_gmem_to_smem(x_ref.at[at], dest, barrier))
            if size > 1:
                pl.when(step > 0)(
                    lambda: plgpu.copy_gmem_to_smem(inbox[0].at[step - 1].at[at], dest, barrier)
                )

        def before_unit(i):
            step, _, _, band, _ = where(i)

            @pl.when(step > 0)
            def _():  # the band's rows have landed in inbox slot step - 1
                pl.semaphore_wait(arrived.at[step - 1, band], value=num_senders, decrement=False)

        def begin(c, i):
            """(step, row, column, band, rank, whether it sends) of unit i: once a unit."""
            step, row, col, band, rank = where(i)
            return step, row, col, band, rank, (step == 0) & (rank < num_senders)

        def release(c, state, kk, x_slot, arrive):
            """Send K-step kk's block where this unit sends it; its slot is held until the send
            has read it, awaited at the next K-step (a step of the tensor cores' time) or at
            the last."""
            _, row, _, _, rank, sender = state
            now = sender & (kk % num_senders == rank)
            before = sender & (kk > 0) & ((kk - 1) % num_senders == rank)
            last = kk == k_iters - 1

            @pl.when(now)
            def _send():
                at = (pl.ds(row, tile_m), pl.ds(kk * tile_k, tile_k))
                for j, peer in enumerate(peers):
                    plgpu.copy_smem_to_gmem(
                        x_slot,
                        plgpu.remote_ref(inbox[0], peer).at[j].at[at],
                        commit_group=j == len(peers) - 1,
                    )

            @pl.when(before)
            def _previous_read():  # one commit group a send: the one before this step's
                if num_senders == 1:  # then every step sends
                    plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                else:
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                arrive(kk - 1)

            @pl.when(now & last)
            def _read():
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

            pl.when(~now | last)(lambda: arrive(kk))

        def before_stores(c, state):
            *_, band, _, sender = state

            @pl.when(sender)
            def _band_sent():
                plgpu.wait_smem_to_gmem(0, wait_read_only=False)  # its pushes have landed
                for j, peer in enumerate(peers):
                    signals.landed(arrived.at[j, band], device_id=peer)

        def store(state, r, out_smem):
            step, row, col, *_ = state
            source = lax.rem(here + size - step, jnp.int32(size))
            rows = pl.ds(source * m + row + r * EPI, EPI)
            plgpu.copy_smem_to_gmem(out_smem, out_ref.at[rows, pl.ds(col, tile_n)])

        def compute_end(c):
            plgpu.wait_smem_to_gmem(0, wait_read_only=False)

        unit = pingpong.Unit(
            load_x=load_x,
            column=lambda i: where(i)[2],
            store=store,
            begin=begin,
            before_unit=before_unit if size > 1 else None,
            release=release if size > 1 else None,
            before_stores=before_stores if size > 1 else None,
            compute_end=compute_end,
        )
        pingpong.run(
            tiles,
            unit,
            tiles_dealt=dealt,
            k_iters=k_iters,
            w_ref=w_ref,
            dtype=dtype,
            w_dtype=w.dtype,
            out_dtype=out_dtype,
            w_nk=w_nk,
            scale_ref=scale_ref,
        )

    out_type = [jax.ShapeDtypeStruct((size * m, n), out_dtype)]
    if size > 1:  # the peers' rows
        out_type.append(jax.ShapeDtypeStruct((size - 1, m, k), dtype))
    with jax.named_scope("fused_ag_gemm_pingpong"):
        out, *inbox = plgpu.kernel(
            body, out_type=out_type, **mt.kernel_params(mt.num_sms(), pair, compiler_params)
        )(x, w, *([] if scale is None else [scale]))
    if return_gathered:
        return out, (gathered_rows(x, inbox[0], axis_name) if inbox else x)
    return out
