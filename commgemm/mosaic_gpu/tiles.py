"""Pieces shared by the fused Mosaic GPU kernels that walk output tiles themselves
(`direct_rs`, `direct_ag`): launch parameters, the K-loop pipeline of one tile and
where a tile lies. They follow jax's Hopper matmul kernel (`hopper_matmul_mgpu.kernel`): one
persistent CTA per SM (2-CTA clusters optional), two compute warpgroups that own a tile_m x
tile_n block each of the CTA's tile, one warpgroup that issues the TMA loads."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jax import lax

from commgemm.mosaic_gpu.configs import KernelConfig

#: Streaming multiprocessors of an H100 / H200 SXM: the grid where the GPU is not at hand.
HOPPER_SMS = 132


def num_sms() -> int:
    """Streaming multiprocessors of this process's first device (the kernels' grid); an H100's
    where the device is no GPU (a plan checked on a CPU or a TPU host)."""
    return getattr(jax.devices()[0], "core_count", None) or HOPPER_SMS


def hopper_reason() -> str | None:
    """Why this process's devices cannot run the Mosaic GPU kernels here, or None: they need a
    Hopper GPU (compute capability 9.x) and jax >= 0.11."""
    device = jax.devices()[0]
    if device.platform != "gpu":
        return f"it runs on GPUs; this backend is {device.platform}"
    capability = str(getattr(device, "compute_capability", ""))
    if not capability.startswith("9"):
        return f"it needs a Hopper GPU (compute capability 9.x), got {capability or 'unknown'}"
    if jax.__version_info__ < (0, 11):
        return f"it needs jax >= 0.11 (tested on 0.11.2), this is {jax.__version__}"
    return None


def kernel_params(sms: int, cluster: int, compiler_params: Mapping | None = None) -> dict:
    """plgpu.kernel's launch parameters for the fused kernels: one persistent CTA per SM (in
    clusters of `cluster`), two compute warpgroups and one that issues the loads.
    `compiler_params`: extra `plgpu.CompilerParams` fields (e.g. benchmarks/kernel_profile.py's
    profiler); None in normal use."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    semantics = plgpu.LoweringSemantics.Warpgroup
    params = plgpu.CompilerParams(lowering_semantics=semantics, **(compiler_params or {}))
    return dict(grid=(sms // cluster,), grid_names=("cluster_grid",), cluster=(cluster,),
                cluster_names=("cluster",), num_threads=3, thread_name="wg",
                compiler_params=params)  # fmt: skip


def axis_position(axis_name: str | None) -> tuple[int, jax.Array]:
    """(size, this device's index) of the kernels' mesh axis; axis_name None: one device, the
    kernel on its own (its GEMM core: nothing to send, no NVSHMEM)."""
    if axis_name is None:
        return 1, jnp.int32(0)
    return lax.axis_size(axis_name), lax.axis_index(axis_name)


def peer_id(axis_name: str, index: jax.Array) -> dict:
    """The device id of the device at `index` along `axis_name`, the others of this device's
    mesh coordinates kept: Mosaic GPU reads a bare index as a position in a 1-D mesh only."""
    return {axis_name: index}


def shape_reason(tiles: KernelConfig, m: int, k: int, n: int) -> str | None:
    """Why rows `m`, K `k` and columns `n` (per device) are not whole tiles of `tiles`, or None:
    a kernel walks whole tiles only, so a remainder would be left unwritten."""
    for what, value, by in (("rows", m, tiles.cluster_m), ("N", n, tiles.cluster_n),
                            ("K", k, tiles.tile_k)):  # fmt: skip
        if value % by:
            return f"{what}={value} must be divisible by the tile {by}"
    return None


def checked_shape(tiles: KernelConfig, x, w, *, w_nk: bool, split: bool, owners: int = 1):
    """(rows, K, n) of each owner's block of x [owners * rows, K] @ w [K, n] ([n, K] with w_nk;
    an RS kernel's rows have `owners`, AG's one); ValueError where the rows do not split, or
    `shape_reason` or (with `split` accumulation) `split_reason` gives a reason."""
    if x.shape[0] % owners:
        raise ValueError(f"rows={x.shape[0]} must be divisible by the {owners} devices")
    rows, k, n = x.shape[0] // owners, x.shape[1], w.shape[0 if w_nk else 1]
    for reason in (shape_reason(tiles, rows, k, n), split_reason(tiles) if split else None):
        if reason is not None:
            raise ValueError(f"{type(tiles).__name__}: {reason}")
    return rows, k, n


def scaled(acc: jax.Array, scale_ref, dtype) -> jax.Array:
    """A tile's float32 accumulator times the scalar in `scale_ref` [1] (None: 1), in `dtype`."""
    return (acc if scale_ref is None else acc * scale_ref[0]).astype(dtype)


#: Most accumulator elements a compute warpgroup's tile may hold with split accumulation (a
#: float32 total beside each K-step's wgmma accumulator: 64 registers a thread for each).
SPLIT_TILE_ELEMENTS = 64 * 128


def split_reason(tiles: KernelConfig) -> str | None:
    """Why `tiles` cannot run with split accumulation, or None."""
    if tiles.tile_m * tiles.tile_n <= SPLIT_TILE_ELEMENTS:
        return None
    return (f"split accumulation keeps two accumulators a warpgroup: its tile {tiles.tile_m} "
            f"x {tiles.tile_n} must hold at most {SPLIT_TILE_ELEMENTS} elements")  # fmt: skip


def accumulated(tiles: KernelConfig, eval_pipeline, finish, *, split: bool) -> None:
    """Run one tile's K loop (`eval_pipeline`, whose body folds each K-step in with
    `accumulate`), then `finish(read)`, where `read()` gives the accumulator's float32 value
    (reading a wgmma accumulator awaits its last wgmma, so work before it overlaps that).
    Fast (split False): one wgmma accumulator across all K-steps, which float8 wgmma keeps in
    the tensor cores' narrower accumulator. Split: each K-step multiplies into a fresh
    accumulator, awaited and added into a float32 total in registers (partial sums promoted
    every K-step, as Transformer Engine's split accumulator and DeepSeek-V3's FP8 GEMMs do),
    at the cost of the wgmma in flight across K-steps (`split_reason`)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    shape = (tiles.tile_m, tiles.tile_n)
    if split:
        zeros = plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)
        total = eval_pipeline(zeros)
        finish(lambda: total)
        return

    @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC(shape, jnp.float32))
    def _scope(acc_ref):
        eval_pipeline(acc_ref)
        finish(lambda: acc_ref[...])


def accumulate(
    tiles: KernelConfig, acc, lhs, rhs, *, split: bool, in_flight: int | None = 1, last=None
):
    """Fold one K-step, lhs @ rhs (smem refs), into the pipeline carry `acc` of `accumulated`
    and return the next carry: fast, a wgmma into the accumulator ref, awaited down to
    `in_flight` running (None: the caller waits), all of it on the tile's `last` step
    (`await_last_step`; needed where in_flight > 0); split, the K-step's awaited product added
    into the float32 total."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if not split:
        plgpu.wgmma(acc, lhs, rhs)
        if in_flight is not None:
            plgpu.wgmma_wait(in_flight)
        if in_flight and last is not None:
            await_last_step(last)
        return acc

    def step(part_ref):
        plgpu.wgmma(part_ref, lhs, rhs)
        return part_ref[...]

    return acc + pl.run_scoped(step, plgpu.ACC((tiles.tile_m, tiles.tile_n), jnp.float32))


def await_last_step(last) -> None:
    """On a tile's last K-step (`last`, traced bool), await every wgmma. With delay_release=1
    the next tile's pipeline reloads the last step's smem slot once the step before it is
    released (right after this body): a wgmma still in flight would read the next tile's block
    (wrong tiles on a Hopper GPU with 3 stages, where that slot is the first one reloaded)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    @pl.when(last)
    def _all_done():
        plgpu.wgmma_wait(0)


def smem_transforms(dtype, minor: int) -> tuple:
    """Tiling and swizzle of an smem block whose minor dimension holds `minor` elements."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    itemsize = jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(minor * itemsize * 8)
    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def tile_pipeline(
    tiles: KernelConfig,
    dtype,
    k_iters: int,
    body,
    compute_context,
    *,
    release=0,
    state=None,
    w_nk: bool = False,
    k_first=0,
):
    """The warp-specialized K loop of one CTA tile: x blocks [cta_m, tile_k] and w blocks
    [tile_k, cta_n] (with `w_nk`, of w laid out [n, K]: [cta_n, tile_k], K-major as float8
    wgmma needs), `tiles.stages` loaded ahead (multicast to a 2-CTA cluster), `k_iters` K-steps
    (traced: a dynamic grid) from the `k_first`-th. `release`: a K-step's smem slot is released
    that many steps late (its wgmma may still run, or a transfer read its block). `state`:
    `chain_state` where a CTA's tiles run as one pipeline."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    transforms, cluster = smem_transforms(dtype, tiles.tile_k), getattr(tiles, "cluster", None)
    at = (lambda kk: kk) if isinstance(k_first, int) and not k_first else (lambda kk: kk + k_first)
    if w_nk:
        w_block, w_index = (tiles.cta_n, tiles.tile_k), lambda kk: (0, at(kk))
    else:
        w_block, w_index = (tiles.tile_k, tiles.cta_n), lambda kk: (at(kk), 0)
    return plgpu.emit_pipeline_warp_specialized(
        body,
        grid=(k_iters,),
        memory_registers=40,
        in_specs=[
            plgpu.BlockSpec(
                (tiles.cta_m, tiles.tile_k),
                lambda kk: (0, at(kk)),
                transforms=transforms,
                memory_space=plgpu.SMEM,
                delay_release=release,
                collective_axes=("cluster",) if cluster == "n" else (),  # shared x
            ),
            plgpu.BlockSpec(
                w_block,
                w_index,
                transforms=transforms,
                memory_space=plgpu.SMEM,
                delay_release=release,
                collective_axes=("cluster",) if cluster == "m" else (),  # shared w
            ),
        ],
        wg_axis="wg",
        num_compute_wgs=2,
        max_concurrent_steps=tiles.stages,
        compute_context=compute_context,
        pipeline_state=state,
    )


def w_columns(w_ref, columns, ks=slice(None), *, w_nk: bool = False):
    """w's K-range `ks` of output columns `columns`, from w [K, n] (or [n, K] with w_nk)."""
    return w_ref.at[columns, ks] if w_nk else w_ref.at[ks, columns]


def rhs_operand(b_smem, wg_n, *, w_nk: bool = False):
    """The wgmma right operand [tile_k, n] of a compute warpgroup's columns `wg_n`, from a
    pipeline's w block (`tile_pipeline`)."""
    if not w_nk:
        return b_smem.at[:, wg_n]
    return b_smem.at[wg_n, :].transpose((1, 0))


def chain_state(info) -> jax.Array:
    """The pipeline state of a CTA's tile in an nd_loop that chains its tiles' pipelines
    (DirectRSConfig.chain_tiles): the loads of the next tile start while this one's last K-steps
    run, instead of after its pipeline drains. The CTA must have at least two tiles."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    states = plgpu.PipelinePipeline
    last = info.local_index == info.num_local_steps - 1
    state = jnp.where(last, jnp.int32(states.STOP), jnp.int32(states.STEADY))
    return jnp.where(info.local_index == 0, jnp.int32(states.START), state)


def tile_smem(
    tiles: KernelConfig,
    dtype,
    k_iters: int,
    x_ref,
    w_ref,
    *,
    release=0,
    out_dtype=None,
    w_nk: bool = False,
):
    """Decorator running fn(pipeline_allocs, out_smem) in the shared memory of `tile_pipeline`
    (allocated once, for every tile) and of the epilogue (`out_smem`, in `out_dtype`, default
    `dtype`), for all warpgroups."""
    from jax.experimental import pallas as pl

    ignore = lambda *_, **__: None  # noqa: E731
    pipeline = tile_pipeline(tiles, dtype, k_iters, ignore, ignore, release=release, w_nk=w_nk)
    return functools.partial(
        pl.run_scoped,
        pipeline_allocs=pipeline.get_allocations(x_ref, w_ref),
        out_smem=out_smem(tiles, out_dtype or dtype),
        collective_axes="wg",
    )


def cluster_tile(tiles: KernelConfig, tile: jax.Array, m_iters: int, n_iters: int):
    """(m_idx, n_idx) of the `tile`-th cluster tile of an [m_iters, n_iters] grid, walked in
    bands `grid_tile_width` wide (`plgpu.planar_snake`)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    from jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu import MatmulDimension

    minor = MatmulDimension.M if tiles.grid_minor_m else MatmulDimension.N
    return plgpu.planar_snake(tile, (m_iters, n_iters), minor, tiles.grid_tile_width)


@dataclasses.dataclass(frozen=True)
class TileSlices:
    """Where one CTA tile lies: its band and column (in CTA tiles), the CTA's slices of the
    output and the compute warpgroup's slices within them."""

    m_idx: jax.Array
    n_idx: jax.Array
    cta_m: object
    cta_n: object
    wg_m: object
    wg_n: object


def tile_slices(tiles: KernelConfig, tile: jax.Array, m_iters: int, n_iters: int) -> TileSlices:
    """The `tile`-th cluster tile of an [m_iters, n_iters] grid (of cluster tiles), walked in
    bands `grid_tile_width` wide (`plgpu.planar_snake`), as this CTA and warpgroup see it."""
    from jax.experimental import pallas as pl

    m_idx, n_idx = cluster_tile(tiles, tile, m_iters, n_iters)
    cluster = getattr(tiles, "cluster", None)
    if cluster == "m":
        m_idx = m_idx * 2 + lax.axis_index("cluster")
    elif cluster == "n":
        n_idx = n_idx * 2 + lax.axis_index("cluster")
    wg = lax.axis_index("wg")
    if tiles.wg_along_m:
        wg_m, wg_n = pl.ds(wg * tiles.tile_m, tiles.tile_m), slice(None)
    else:
        wg_m, wg_n = slice(None), pl.ds(wg * tiles.tile_n, tiles.tile_n)
    return TileSlices(
        m_idx=m_idx,
        n_idx=n_idx,
        cta_m=pl.ds(m_idx * tiles.cta_m, tiles.cta_m),
        cta_n=pl.ds(n_idx * tiles.cta_n, tiles.cta_n),
        wg_m=wg_m,
        wg_n=wg_n,
    )


def narrow_tail_units(tiles: KernelConfig, units: int, ctas: int) -> int:
    """How many of `units` tiles (unit u on CTA u mod ctas), the last wave's, run `narrowed`:
    where the tiling asks (`narrow_tail`) and their halves fit in one wave; else 0."""
    tail = units % ctas
    return tail if getattr(tiles, "narrow_tail", False) and 2 * tail <= ctas else 0


def narrowed(tiles: KernelConfig) -> KernelConfig:
    """The tiling of half a CTA tile's columns, cta_m x cta_n / 2, its two compute warpgroups
    stacked along M (the better of the two halvings on Hopper: docs/performance.md)."""
    half = dict(tile_m=tiles.cta_m // 2, tile_n=tiles.cta_n // 2, wg_along_m=True)
    if hasattr(tiles, "narrow_tail"):
        half["narrow_tail"] = False
    return dataclasses.replace(tiles, **half)


def narrowed_slices(tiles: KernelConfig, at: TileSlices, part) -> TileSlices:
    """Half `part` (0 or 1) of the columns of the CTA tile `at` of `tiles`, in the `narrowed`
    tiling (n_idx counts half tiles)."""
    from jax.experimental import pallas as pl

    half, n_idx, wg = narrowed(tiles), at.n_idx * 2 + part, lax.axis_index("wg")
    cta_n, wg_m = pl.ds(n_idx * half.cta_n, half.cta_n), pl.ds(wg * half.tile_m, half.tile_m)
    return dataclasses.replace(at, n_idx=n_idx, cta_n=cta_n, wg_m=wg_m, wg_n=slice(None))


def epilogue_slots(tiles: KernelConfig) -> int:
    """How many epi x epi smem blocks each compute warpgroup's epilogue cycles through."""
    return min(2, (tiles.tile_m * tiles.tile_n) // (tiles.epi * tiles.epi))


def out_smem(tiles: KernelConfig, dtype):
    """The epilogue's smem: (warpgroup, slot) blocks of epi x epi."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    shape = (2, epilogue_slots(tiles), tiles.epi, tiles.epi)
    return plgpu.SMEM(shape, dtype, transforms=smem_transforms(dtype, tiles.epi))


def epilogue_blocks(tiles: KernelConfig, slots: int) -> list[tuple[slice, slice, int]]:
    """The epi x epi blocks of a warpgroup's tile_m x tile_n tile, in store order, each with
    the smem slot it goes through."""
    per_row = tiles.tile_n // tiles.epi
    return [
        (
            slice(mi * tiles.epi, (mi + 1) * tiles.epi),
            slice(ni * tiles.epi, (ni + 1) * tiles.epi),
            (mi * per_row + ni) % slots,
        )
        for mi in range(tiles.tile_m // tiles.epi)
        for ni in range(per_row)
    ]
