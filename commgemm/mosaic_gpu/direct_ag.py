"""ATOMIC_GEMM_AG and ATOMIC_GEMM_AG_P2P: all-gather + GEMM in one kernel, each band of x rows
flagged as it lands.

x [m, K] (this device's rows), w [K, n] -> all_gather(x) @ w [P*m, n], rows in device order.
One persistent Mosaic GPU kernel walks the tiles of all P row blocks, its own block first.
While CTAs multiply the first `senders` tiles of a band of rows (cta_m rows), each writes its
share of the x blocks it loaded into shared memory (every senders-th K block) into a peer's
inbox over NVLink, then raises that band's flag there. A tile of a peer's block waits only
for its own band's flags, not for the whole block. Slot j of a device's inbox holds the rows
of device (d - j - 1) mod P.
  Direct (ATOMIC_GEMM_AG, method PIPELINE): the own rows go to every peer at once; where
      sending them outlasts their GEMM, `spread` interleaves the own tiles with the peers'
      after the first wave (`spread_plan`, `schedule_unit`).
  Ring (ATOMIC_GEMM_AG_P2P, method RING_EXCHANGE, `ring=True`): at step s a device multiplies
      the rows of device (d - s) mod P and forwards them, band by band, into slot s of the next
      device's inbox (steps 0 to P - 2), so each link carries every block once and a device
      sends one block a step. On two devices the two are the same kernel.
Invariant: a flag is raised only after its sender's stores have landed (awaited), and
ordered after them (`signals.landed`). 2-CTA clusters along M only (the pair shares w).
With DirectAGConfig.narrow_tail, a last wave of tiles that fills at most half the CTAs runs
each of its tiles as two of half the columns (`narrow_tail`), in a shared-memory scope of its
own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jax import lax

from commgemm.mosaic_gpu import signals
from commgemm.mosaic_gpu import tiles as mt
from commgemm.mosaic_gpu.configs import DirectAGConfig, RingAGConfig

#: Tiles of a band (its first visits) that share pushing the band's rows: with one, a band's
#: transfer had one store in flight and ran slower than the GEMM (docs/performance.md).
SENDERS = 8


def senders(tiles: DirectAGConfig, n_iters: int, k_iters: int) -> int:
    """How many tiles of a band push its rows (SENDERS, at most the columns of the
    band's first visits: its first strip along N, or every column along M)."""
    width = n_iters if tiles.grid_minor_m else min(tiles.grid_tile_width, n_iters)
    return max(1, min(SENDERS, width, k_iters))


def send_lead(tiles: DirectAGConfig, m_iters: int, n_iters: int, num_senders: int) -> int:
    """How far, in the kernel's tile order, a band's last sending visit can come after any of
    the band's tiles: along N a band's senders are consecutive in its first strip; along M a
    band is visited once every strip-width tiles."""
    if tiles.grid_minor_m:
        return (num_senders - 1) * min(tiles.grid_tile_width, m_iters)
    return num_senders - 1


def spread_plan(tiles: DirectAGConfig, own: int, ctas: int, lead: int) -> tuple[int, int]:
    """(head, region) of the schedule of `own` tiles per block (DirectAGConfig.spread): the first
    `head` units are own tiles (a wave of CTAs, plus `lead`: nothing of the peers' has been
    sent before), then the rest of the own tiles spread evenly over units [head, region),
    peers' tiles filling the gaps. At most one unit in two is a peer's, so a peer's tile always
    comes after the sends of its band (`schedule_unit`); region == own: own block first."""
    head = min(own, ctas + lead + 2)
    return head, own + tiles.spread * (own - head) // 100


def schedule_unit(lin, own: int, head: int, region: int):
    """(step, tile) of the kernel's `lin`-th unit of work (`spread_plan`): step 0 is one of this
    device's `own` tiles, step s > 0 a tile of the rows that arrived in inbox slot s - 1."""
    if region == own:
        return lin // own, lin - (lin // own) * own
    stretch = region - head
    x = jnp.minimum(jnp.maximum(lin - head, 0), stretch)
    placed = x * (own - head) // stretch  # own tiles in units [head, lin)
    is_own = (lin < head) | ((lin < region) & ((x + 1) * (own - head) // stretch > placed))
    peer = lin - head - placed  # peers' tiles in units [0, lin)
    step = jnp.where(is_own, 0, 1 + peer // own)
    tile = jnp.where(is_own, jnp.where(lin < head, lin, head + placed), peer - (peer // own) * own)
    return step, tile


def narrow_tail(tiles: DirectAGConfig, units: int, ctas: int, senders_end: int) -> int:
    """How many of the kernel's last units run as two half-width tiles each
    (DirectAGConfig.narrow_tail; `tiles.narrowed`): the last, partly filled wave's (unit u runs
    on CTA u mod ctas), where their halves fit in one wave and none of them sends rows (the
    units from `senders_end` on send nothing). That wave then takes about half a tile's time
    instead of a whole one's. 0: no narrowed tail."""
    tail = mt.narrow_tail_units(tiles, units, ctas)
    return 0 if units - tail < senders_end else tail


def _visit_rank(tiles: DirectAGConfig, m_idx: jax.Array, n_idx: jax.Array, n_iters: int):
    """Which visit of band `m_idx` by `plgpu.planar_snake` column `n_idx` is (0 the first):
    along N a strip walks its columns in order; along M the strips of `grid_tile_width`
    bands alternate direction."""
    if not tiles.grid_minor_m:
        return n_idx
    strip = m_idx // (tiles.grid_tile_width * (2 if tiles.cluster == "m" else 1))
    return jnp.where(lax.rem(strip, jnp.int32(2)) == 0, n_idx, n_iters - 1 - n_idx)


def all_gather_matmul(
    x: jax.Array,
    w: jax.Array,
    axis_name: str,
    tiles: DirectAGConfig | RingAGConfig | None = None,
    *,
    w_nk: bool = False,
    out_dtype=None,
    scale: jax.Array | None = None,
    split_accumulator: bool = False,
    ring: bool = False,
    return_gathered: bool = False,
    compiler_params: Mapping | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """x [m, K] (rows sharded over axis_name), w [K, n] (local; [n, K] with w_nk) -> [P*m, n],
    all_gather(x) @ w (times `scale` [1] float32, if given) in `out_dtype` (default x's dtype),
    rows in device order. Float8 x and w (w_nk) multiply on float8 tensor cores; the rows
    travel as float8; `split_accumulator` promotes the partial sums to float32 every K-step
    (`tiles.accumulated`). `ring`: forward each block to the next device instead of pushing the
    own rows to every peer (module docstring; no `spread`). axis_name None: one device (the
    kernel's GEMM core). `return_gathered`: also all_gather(x) [P*m, K], in device order, from
    the rows the kernel received (`gathered_rows`)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    size = mt.axis_position(axis_name)[0]
    tiles = tiles or DirectAGConfig()
    if isinstance(tiles, RingAGConfig):  # the ring's tiling: no clusters, spread or narrowing
        tiles = DirectAGConfig(**dataclasses.asdict(tiles))
    dtype = x.dtype
    out_dtype = jnp.dtype(out_dtype or dtype)
    m, k, n = mt.checked_shape(tiles, x, w, w_nk=w_nk, split=split_accumulator)
    m_iters, n_iters, k_iters = m // tiles.cluster_m, n // tiles.cluster_n, k // tiles.tile_k
    bands = m // tiles.cta_m
    step_tiles = m_iters * n_iters
    num_senders = senders(tiles, n_iters, k_iters)
    sms = mt.num_sms()
    lead = send_lead(tiles, m_iters, n_iters, num_senders)
    head, region = spread_plan(tiles, step_tiles, sms // tiles.cluster_size, lead)
    if size == 1 or ring:  # one device, or the steps in ring order
        head = region = step_tiles
    if region > step_tiles and step_tiles * step_tiles >= 2**31:
        raise ValueError(f"DirectAGConfig.spread needs fewer tiles a block, got {step_tiles}")
    num_units = size * step_tiles
    # the units that send rows come before senders_end: the own tiles (units below region),
    # in a ring every step's but the last; on one device nothing is sent
    senders_end = (size - 1) * step_tiles if ring else region if size > 1 else 0
    tail = narrow_tail(tiles, num_units, sms // tiles.cluster_size, senders_end)
    main_units = num_units - tail

    def body(x_ref, w_ref, *refs):
        scale_ref, out_ref, inbox_ref = refs if scale is not None else (None, *refs)
        arrived = pl.get_global(plgpu.SemaphoreType.REGULAR((max(size - 1, 1), bands)))
        here = mt.axis_position(axis_name)[1]
        wg = lax.axis_index("wg")
        # the peers this device sends to, in the order of their inbox slots for its own rows
        # (a ring: the next device only)
        peers = [
            mt.peer_id(axis_name, lax.rem(here + j + 1, jnp.int32(size)))
            for j in range(min(size - 1, 1) if ring else size - 1)
        ]

        def destinations(step):
            """(peer, inbox slot) pairs that the rows multiplied at `step` are sent to."""
            if ring:
                return [(peer, step) for peer in peers]
            return list(zip(peers, range(size - 1), strict=True))

        def walk(tiling, units: int, unit_of):
            """Run `units` units in `tiling`: unit_of(i) is (lin, part), the kernel's lin-th unit
            (`schedule_unit`) whole (part None) or its part-th half (`tiles.narrowed`)."""
            num_slots = mt.epilogue_slots(tiling)

            @mt.tile_smem(
                tiling, dtype, k_iters, x_ref, w_ref, release=1, out_dtype=out_dtype, w_nk=w_nk
            )
            def _scope(pipeline_allocs, out_smem):
                @plgpu.nd_loop((units,), collective_axes="cluster_grid")
                def _tiles(info):
                    (i,) = info.index
                    lin, part = unit_of(i)
                    run_unit(tiling, num_slots, pipeline_allocs, out_smem, lin, part)

                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        def run_unit(tiling, num_slots, pipeline_allocs, out_smem, lin, part):
            step, tile = schedule_unit(lin, step_tiles, head, region)
            # whose rows this step multiplies
            source = lax.rem(here + size - step, jnp.int32(size))
            at = mt.tile_slices(tiles, tile, m_iters, n_iters)
            band_rows = pl.ds(at.m_idx * tiles.cta_m, tiles.cta_m)
            # the band's first num_senders visits push its rows: K block kk from visit
            # kk mod num_senders (a narrowed tail sends nothing: `narrow_tail`)
            rank = _visit_rank(tiles, at.m_idx, at.n_idx, n_iters)
            sends = step < size - 1 if ring else step == 0
            sender = None if part is not None else sends & (rank < num_senders) & (wg == 0)
            if part is not None:
                at = mt.narrowed_slices(tiles, at, part)

            def finish(read):
                if sender is not None:

                    @pl.when(sender)
                    def _band_sent():
                        plgpu.wait_smem_to_gmem(0, wait_read_only=False)  # it has landed
                        for peer, slot in destinations(step):
                            signals.landed(arrived.at[slot, at.m_idx], device_id=peer)

                acc = mt.scaled(read(), scale_ref, out_dtype)
                out_rows = pl.ds(source * m + at.m_idx * tiles.cta_m, tiles.cta_m)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                for epi_m, epi_n, slot in mt.epilogue_blocks(tiling, num_slots):
                    plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                    out_smem[wg, slot] = acc[epi_m, epi_n]
                    plgpu.commit_smem()
                    dest = out_ref.at[out_rows, at.cta_n].at[at.wg_m, at.wg_n]
                    plgpu.copy_smem_to_gmem(out_smem.at[wg, slot], dest.at[epi_m, epi_n])

            def compute_context(eval_pipeline):
                mt.accumulated(tiling, eval_pipeline, finish, split=split_accumulator)

            def mma_body(idxs, a_smem, b_smem, acc):
                rhs = mt.rhs_operand(b_smem, at.wg_n, w_nk=w_nk)
                acc = mt.accumulate(
                    tiling, acc, a_smem.at[at.wg_m], rhs, split=split_accumulator, in_flight=None
                )
                if sender is not None:
                    send_block(idxs, a_smem)
                if not split_accumulator:
                    plgpu.wgmma_wait(1)
                    mt.await_last_step(idxs[0] == k_iters - 1)
                return acc

            def send_block(idxs, a_smem):
                (kk,) = idxs
                now = sender & (lax.rem(kk, jnp.int32(num_senders)) == rank)
                before = sender & (kk > 0) & (lax.rem(kk - 1, jnp.int32(num_senders)) == rank)

                @pl.when(now)
                def _send():
                    block = pl.ds(kk * tiles.tile_k, tiles.tile_k)
                    targets = destinations(step)
                    for j, (peer, slot) in enumerate(targets):
                        plgpu.copy_smem_to_gmem(
                            a_smem,
                            plgpu.remote_ref(inbox_ref, peer).at[slot, band_rows, block],
                            commit_group=j == len(targets) - 1,  # one group per K-step
                        )

                # a block's slot is released at the end of the next K-step (release 1), or
                # reused by the next tile's first loads after the last: its send must have
                # read it by then
                @pl.when(before & now)
                def _previous_read():
                    plgpu.wait_smem_to_gmem(1, wait_read_only=True)

                @pl.when((before & ~now) | (now & (kk == k_iters - 1)))
                def _all_read():
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

            def run(rows_ref):
                # release 1: a block stays in smem a step longer, while it is being sent
                mt.tile_pipeline(
                    tiling, dtype, k_iters, mma_body, compute_context, release=1, w_nk=w_nk
                )(
                    rows_ref.at[band_rows, :],
                    mt.w_columns(w_ref, at.cta_n, w_nk=w_nk),
                    allocations=pipeline_allocs,
                )

            @pl.when(step == 0)
            def _own_rows():
                run(x_ref)

            if size > 1:

                @pl.when(step > 0)
                def _peer_rows():
                    slot = step - 1
                    pl.semaphore_wait(
                        arrived.at[slot, at.m_idx], value=num_senders, decrement=False
                    )
                    run(inbox_ref.at[slot])

        if main_units:
            walk(tiles, main_units, lambda i: (i, None))
        if tail:  # a new scope: every warpgroup has left the main loop's shared memory
            walk(
                mt.narrowed(tiles),
                2 * tail,
                lambda i: (main_units + i // 2, lax.rem(i, jnp.int32(2))),
            )

    with jax.named_scope("fused_ag_gemm_push"):
        out, inbox = plgpu.kernel(
            body,
            out_type=[
                jax.ShapeDtypeStruct((size * m, n), out_dtype),
                jax.ShapeDtypeStruct((max(size - 1, 1), m, k), dtype),  # the peers' rows
            ],
            **mt.kernel_params(sms, tiles.cluster_size, compiler_params),
        )(x, w, *([] if scale is None else [scale]))
    if return_gathered:
        return out, gathered_rows(x, inbox, axis_name)
    return out


def gathered_rows(x: jax.Array, inbox: jax.Array, axis_name: str | None) -> jax.Array:
    """all_gather(x) [P*m, K] in device order, from this device's rows x [m, K] and its
    inbox [P - 1, m, K] (slot j: the rows of device (d - j - 1) mod P, direct and ring alike)."""
    size, here = mt.axis_position(axis_name)
    if size == 1:
        return x
    stack = jnp.concatenate([x[None], inbox])  # entry t: the rows of device (d - t) mod P
    order = lax.rem(here - jnp.arange(size, dtype=jnp.int32) + size, jnp.int32(size))
    return jnp.take(stack, order, axis=0).reshape(size * x.shape[0], x.shape[1])
