"""Probe: a ping-pong Hopper GEMM (CUTLASS's KernelTmaWarpSpecializedPingpong schedule) against
XLA's dot, cuBLAS and our fused kernels' GEMM cores, bf16 and FP8, on one GPU.

The question (docs/performance.md, "Open leads"; issues 21, 24, 25): our cores run two compute
warpgroups on one 128 x 256 CTA tile (the cooperative schedule), so both run their epilogue at
the same time and the tensor cores idle then; on short-K shapes (the RS shapes at P = 4, 8) that
is 5 to 14% of the time. In a ping-pong schedule each compute warpgroup owns a whole 128 x 128
tile, and the warpgroups take the CTA's tiles in turn from ONE ring of smem stages, filled in
tile order by the load warpgroup: warpgroup 1's K loop starts as warpgroup 0's ends, so each
epilogue runs under the other's K loop. (Stage 23 tried a ring per warpgroup, 3 stages each:
the loads were exposed. Here the ring is shared and 5 to 6 stages deep.) A consumer waits on
the "full" barrier of its own tiles' steps only (one barrier array per consumer, so each
array's phases are awaited in order), and releases each slot to the load warpgroup on one
"empty" barrier array.

    PYTHONPATH=. python benchmarks/pingpong_probe.py --out DIR [--quick]

Writes DIR/pingpong_probe.json: for each shape, device periods (medians of 6 interleaved
rounds) of every variant, and each variant's largest error against XLA's float32 dot.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")  # room for torch beside jax

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

from commgemm.mosaic_gpu import tiles as mosaic_tiles  # noqa: E402


def pingpong(
    a,
    b,
    *,
    tile_m: int = 128,
    tile_n: int = 128,
    tile_k: int = 64,
    stages: int = 5,
    band: int = 8,
    minor_m: bool = True,
    w_nk: bool = False,
    epi: int = 64,
    ordered: bool = False,
    cluster: bool = False,
):
    """a [M, K] @ b ([K, N], or [N, K] with w_nk, as float8 needs) in bf16, ping-pong schedule."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu
    from jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu import MatmulDimension

    (m, k), n = a.shape, b.shape[0 if w_nk else 1]
    pair = 2 if cluster else 1  # with cluster, CTA pairs along M share w's blocks (multicast)
    if m % (tile_m * pair) or n % tile_n or k % tile_k:
        raise ValueError(f"{m}x{k}x{n} is not whole {tile_m}x{tile_k}x{tile_n} tiles")
    m_iters, n_iters, k_iters = m // tile_m, n // tile_n, k // tile_k
    gpu = jax.devices()[0].platform == "gpu"
    sms = (mosaic_tiles.num_sms() if gpu else mosaic_tiles.HOPPER_SMS) // pair
    total = m_iters // pair * n_iters
    minor = MatmulDimension.M if minor_m else MatmulDimension.N
    transforms = mosaic_tiles.smem_transforms(a.dtype, tile_k)
    out_dtype = jnp.bfloat16
    out_transforms = mosaic_tiles.smem_transforms(out_dtype, epi)
    b_block = (tile_n, tile_k) if w_nk else (tile_k, tile_n)

    def body(a_gmem, b_gmem, out_gmem):
        cta = lax.axis_index("sm")
        mine = (total - cta + sms - 1) // sms  # (cluster) tiles cta, cta + sms, ...

        def where(i):
            grid = (m_iters // pair, n_iters)
            m_idx, n_idx = plgpu.planar_snake(cta + i * sms, grid, minor, band)
            if cluster:
                m_idx = m_idx * 2 + lax.axis_index("cluster")
            return pl.ds(m_idx * tile_m, tile_m), pl.ds(n_idx * tile_n, tile_n)

        def scoped(a_smem, b_smem, full0, full1, empty, out_smem, order0, order1):
            wg, fulls, order = lax.axis_index("wg"), (full0, full1), (order0, order1)

            def issue(c, s):  # step s's loads, for consumer c
                i, kk, slot = s // k_iters, s % k_iters, s % stages
                rows, cols = where(i)
                ks = pl.ds(kk * tile_k, tile_k)
                plgpu.copy_gmem_to_smem(a_gmem.at[rows, ks], a_smem.at[slot], fulls[c].at[slot])
                src = b_gmem.at[cols, ks] if w_nk else b_gmem.at[ks, cols]
                shared = dict(collective_axes="cluster") if cluster else {}
                plgpu.copy_gmem_to_smem(src, b_smem.at[slot], fulls[c].at[slot], **shared)

            def load():
                plgpu.set_max_registers(40, action="decrease")

                @pl.loop(0, mine * k_iters)
                def _step(s):
                    @pl.when(s >= stages)
                    def _():
                        plgpu.barrier_wait(empty.at[s % stages])

                    for c in (0, 1):
                        pl.when((s // k_iters) % 2 == c)(functools.partial(issue, c, s))

            def epilogue(c, value, rows, cols):
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                blocks = [(r, q) for r in range(tile_m // epi) for q in range(tile_n // epi)]
                for j, (r, q) in enumerate(blocks):
                    plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                    out_smem[c, j % 2] = value[r * epi : (r + 1) * epi, q * epi : (q + 1) * epi]
                    plgpu.commit_smem()
                    block = out_gmem.at[rows, cols].at[pl.ds(r * epi, epi), pl.ds(q * epi, epi)]
                    plgpu.copy_smem_to_gmem(out_smem.at[c, j % 2], block)

            def tile(c, i):
                rows, cols = where(i)

                def kstep(kk, acc):
                    s = i * k_iters + kk
                    plgpu.barrier_wait(fulls[c].at[s % stages])
                    rhs = b_smem.at[s % stages]
                    if w_nk:
                        rhs = rhs.transpose((1, 0))
                    plgpu.wgmma(acc, a_smem.at[s % stages], rhs)
                    plgpu.wgmma_wait(1)

                    @pl.when(kk > 0)
                    def _():
                        plgpu.barrier_arrive(empty.at[(s - 1) % stages])

                    return acc

                def acc_scope(acc_ref):
                    if ordered:  # the K loops alternate: wait for the other's to be issued

                        @pl.when(i > 0)
                        def _():
                            plgpu.barrier_wait(order[c])

                    lax.fori_loop(0, k_iters, kstep, acc_ref)
                    if ordered:
                        plgpu.barrier_arrive(order[1 - c])
                    plgpu.wgmma_wait(0)
                    plgpu.barrier_arrive(empty.at[(i * k_iters + k_iters - 1) % stages])
                    epilogue(c, acc_ref[...].astype(out_dtype), rows, cols)

                pl.run_scoped(acc_scope, plgpu.ACC((tile_m, tile_n), jnp.float32))

            def compute(c):
                plgpu.set_max_registers(232, action="increase")
                pl.loop(c, mine, step=2)(functools.partial(tile, c))
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

            pl.when(wg == 2)(load)
            for c in (0, 1):
                pl.when(wg == c)(functools.partial(compute, c))

        pl.run_scoped(
            scoped,
            plgpu.SMEM((stages, tile_m, tile_k), a.dtype, transforms=transforms),
            plgpu.SMEM((stages, *b_block), b.dtype, transforms=transforms),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            plgpu.ClusterBarrier(collective_axes=("cluster",), num_barriers=stages)
            if cluster
            else plgpu.Barrier(num_arrivals=1, num_barriers=stages),
            plgpu.SMEM((2, 2, epi, epi), out_dtype, transforms=out_transforms),
            plgpu.Barrier(num_arrivals=1),
            plgpu.Barrier(num_arrivals=1),
            collective_axes="wg",
        )

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(sms,),
        grid_names=("sm",),
        cluster=(pair,),
        cluster_names=("cluster",),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )
    return kernel(a, b)


def row_tiles(sizes, m: int, tile_m: int):
    """Group-aligned row tiles of groups `sizes` [G] over m rows: (start, skip, rows, group)
    [m / tile_m + G] int32 each, and how many are used [1]. Group g's rows [off_g, end_g) run in
    tiles of tile_m rows from off_g rounded down to 8 (Mosaic GPU loads tiled smem from rows
    that are whole 8s): tile j holds rows [start, start + tile_m), of which `rows` from
    start + skip are the group's; unused tiles last (rows 0)."""
    num = m // tile_m + sizes.shape[0]
    ends = jnp.minimum(jnp.cumsum(sizes.astype(jnp.int32)), m)
    offs = jnp.concatenate([jnp.zeros(1, jnp.int32), ends[:-1]])
    base = offs // 8 * 8
    count = jnp.where(ends > offs, (ends - base + tile_m - 1) // tile_m, 0)
    cum = jnp.cumsum(count)
    p = jnp.arange(num, dtype=jnp.int32)
    group = jnp.minimum(jnp.sum(cum[None, :] <= p[:, None], axis=1), sizes.shape[0] - 1)
    start = base[group] + (p - (cum - count)[group]) * tile_m
    first = jnp.maximum(offs[group], start)
    rows = jnp.where(p < cum[-1], jnp.minimum(start + tile_m, ends[group]) - first, 0)
    i32 = lambda v: v.astype(jnp.int32)  # noqa: E731
    return i32(start), i32(first - start), i32(rows), i32(group), i32(cum[-1:])


def grouped_pingpong(
    x,
    w,
    sizes,
    *,
    tile_m: int = 128,
    tile_n: int = 128,
    tile_k: int = 64,
    stages: int = 5,
    band: int = 8,
    minor_m: bool = True,
    ordered: bool = True,
    w_nk: bool = False,
):
    """x [M, K] (rows sorted by group) times w [G, K, N] ([G, N, K] with w_nk) per group,
    sizes [G] summing to M (the probe does not zero rows past the sum): ping-pong schedule
    on group-aligned row tiles, each tile one group's rows (no K loop per boundary); a partial
    tile's rows are stored by a
    ladder of TMA stores of 128, 64, ..., 1 rows (as jax's ragged_dot_mgpu)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu
    from jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu import MatmulDimension

    (m, k), n = x.shape, w.shape[1 if w_nk else 2]
    n_iters, k_iters = n // tile_n, k // tile_k
    gpu = jax.devices()[0].platform == "gpu"
    sms = mosaic_tiles.num_sms() if gpu else mosaic_tiles.HOPPER_SMS
    minor = MatmulDimension.M if minor_m else MatmulDimension.N
    transforms = mosaic_tiles.smem_transforms(x.dtype, tile_k)
    out_dtype = x.dtype

    def body(start_ref, skip_ref, rows_ref, group_ref, used_ref, a_gmem, b_gmem, out_gmem):
        cta = lax.axis_index("sm")
        used = used_ref[0]
        mine = (used * n_iters - cta + sms - 1) // sms

        def where(i):
            p, n_idx = plgpu.planar_snake(cta + i * sms, (used, n_iters), minor, band)
            row0 = pl.multiple_of(start_ref[p], 8)
            return row0, skip_ref[p], rows_ref[p], group_ref[p], pl.ds(n_idx * tile_n, tile_n)

        def scoped(a_smem, b_smem, full0, full1, empty, out_smem, order0, order1):
            wg, fulls, order = lax.axis_index("wg"), (full0, full1), (order0, order1)

            def issue(c, s):
                i, kk, slot = s // k_iters, s % k_iters, s % stages
                row0, _, _, g, cols = where(i)
                ks = pl.ds(kk * tile_k, tile_k)
                rows = pl.ds(row0, tile_m)
                plgpu.copy_gmem_to_smem(a_gmem.at[rows, ks], a_smem.at[slot], fulls[c].at[slot])
                src = b_gmem.at[g, cols, ks] if w_nk else b_gmem.at[g, ks, cols]
                plgpu.copy_gmem_to_smem(src, b_smem.at[slot], fulls[c].at[slot])

            def load():
                plgpu.set_max_registers(40, action="decrease")

                @pl.loop(0, mine * k_iters)
                def _step(s):
                    @pl.when(s >= stages)
                    def _():
                        plgpu.barrier_wait(empty.at[s % stages])

                    for c in (0, 1):
                        pl.when((s // k_iters) % 2 == c)(functools.partial(issue, c, s))

            def epilogue(c, value, row0, skip, valid, cols):
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                out_smem[c] = value
                plgpu.commit_smem()
                at, size = skip, tile_m
                while size >= 1:

                    @pl.when(valid & size != 0)
                    def _(at=at, size=size):
                        plgpu.copy_smem_to_gmem(
                            out_smem.at[c, pl.ds(at, size)],
                            out_gmem.at[pl.ds(row0 + at, size), cols],
                        )

                    at = at + (valid & size)
                    size //= 2

            def tile(c, i):
                row0, skip, valid, _, cols = where(i)

                def kstep(kk, acc):
                    s = i * k_iters + kk
                    plgpu.barrier_wait(fulls[c].at[s % stages])
                    rhs = b_smem.at[s % stages]
                    plgpu.wgmma(acc, a_smem.at[s % stages], rhs.T if w_nk else rhs)
                    plgpu.wgmma_wait(1)

                    @pl.when(kk > 0)
                    def _():
                        plgpu.barrier_arrive(empty.at[(s - 1) % stages])

                    return acc

                def acc_scope(acc_ref):
                    if ordered:

                        @pl.when(i > 0)
                        def _():
                            plgpu.barrier_wait(order[c])

                    lax.fori_loop(0, k_iters, kstep, acc_ref)
                    if ordered:
                        plgpu.barrier_arrive(order[1 - c])
                    plgpu.wgmma_wait(0)
                    plgpu.barrier_arrive(empty.at[(i * k_iters + k_iters - 1) % stages])
                    epilogue(c, acc_ref[...].astype(out_dtype), row0, skip, valid, cols)

                pl.run_scoped(acc_scope, plgpu.ACC((tile_m, tile_n), jnp.float32))

            def compute(c):
                plgpu.set_max_registers(232, action="increase")
                pl.loop(c, mine, step=2)(functools.partial(tile, c))
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

            pl.when(wg == 2)(load)
            for c in (0, 1):
                pl.when(wg == c)(functools.partial(compute, c))

        pl.run_scoped(
            scoped,
            plgpu.SMEM((stages, tile_m, tile_k), x.dtype, transforms=transforms),
            plgpu.SMEM(
                (stages, *((tile_n, tile_k) if w_nk else (tile_k, tile_n))),
                w.dtype,
                transforms=transforms,
            ),  # fmt: skip
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            plgpu.Barrier(num_arrivals=1, num_barriers=stages),
            plgpu.SMEM((2, tile_m, tile_n), out_dtype),
            plgpu.Barrier(num_arrivals=1),
            plgpu.Barrier(num_arrivals=1),
            collective_axes="wg",
        )

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(sms,),
        grid_names=("sm",),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )
    return kernel(*row_tiles(sizes, m, tile_m), x, w)


#: (name, M, K, N): the presets' local GEMMs where our cores are furthest from the best GEMM
#: (BENCHMARKS.md, "The GEMM core"), and the grouped GEMM issue's dense shape.
SHAPES = [
    ("llama8b rs P2", 8192, 2048, 14336),
    ("llama8b rs P8", 8192, 512, 14336),
    ("llama13b rs P8", 8192, 640, 13824),
    ("comm_heavy rs P8", 16384, 1024, 4096),
    ("llama8b ag P8 / grouped dense", 8192, 4096, 1792),
    ("llama70b ag P2", 8192, 8192, 14336),
]
FP8_SHAPES = [("llama70b ag P2", 8192, 8192, 14336), ("llama8b rs P2", 8192, 2048, 14336)]


def xla_nk(x, y):
    """XLA's dot of x [M, K] and y [N, K], bf16 out (its FP8 GEMM for float8 operands)."""
    return lax.dot_general(x, y, (((1,), (1,)), ((), ())), preferred_element_type=jnp.bfloat16)


def xla_kn(x, y):
    """XLA's dot of x [M, K] and y [K, N], bf16 out."""
    return jnp.dot(x, y, preferred_element_type=jnp.bfloat16)


VARIANTS = {
    "ppo-s5-b8m": dict(stages=5, ordered=True),
    "ppo-s6-b8m": dict(stages=6, ordered=True),
    "ppo-s4-b8m-cm": dict(stages=4, ordered=True, cluster=True),
    "ppo-s5-b8m-cm": dict(stages=5, ordered=True, cluster=True),
    "ppo-s6-b8m-cm": dict(stages=6, ordered=True, cluster=True),
    "ppo-s5-b4m-cm": dict(stages=5, ordered=True, cluster=True, band=4),
}


def main() -> None:
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    from fp8_gemm import torch_ms
    from fused_core import core, core_tilings

    from commgemm.bench.spans import device_periods_interleaved

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--quick", action="store_true", help="one shape, two variants")
    parser.add_argument("--grouped", default="", help="group counts: the grouped probe only")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.grouped:
        return grouped_main(args, [int(g) for g in args.grouped.split(",")])
    shapes, fp8_shapes = (SHAPES[:1], FP8_SHAPES[:1]) if args.quick else (SHAPES, FP8_SHAPES)
    rows = []
    for fp8, shape_list in ((False, shapes), (True, fp8_shapes)):
        for name, m, k, n in shape_list:
            ka, kb = jax.random.split(jax.random.key(m + k + n))
            a = jax.random.normal(ka, (m, k), jnp.float32)
            b = jax.random.normal(kb, (n, k), jnp.float32) / k**0.5  # [N, K]
            dtype = jnp.float8_e4m3fn if fp8 else jnp.bfloat16
            a, b_nk = a.astype(dtype), b.astype(dtype)
            b_kn = b_nk.T.copy() if not fp8 else None
            ref = jnp.dot(a.astype(jnp.float32), b_nk.astype(jnp.float32).T)
            row = {"name": name, "m": m, "k": k, "n": n, "fp8": fp8, "ms": {}, "error": {},
                   "failed": {}}  # fmt: skip
            variants = {}
            tile_k = 128 if fp8 else 64
            for label, kw in VARIANTS.items():
                if args.quick and label not in ("ppo-s5-b8m", "ppo-s5-b8m-cm"):
                    continue
                fn = functools.partial(pingpong, tile_k=tile_k, w_nk=fp8, **kw)
                variants[label] = (jax.jit(fn), (a, b_nk if fp8 else b_kn))
            if fp8:
                variants["xla fp8"] = (jax.jit(xla_nk), (a, b_nk))
            else:
                variants["xla"] = (jax.jit(xla_kn), (a, b_kn))
            op = "ag" if " ag " in f" {name} " else "rs"
            try:
                plan = core_tilings(op, 2 if "P2" in name else 8, (m, k, n))["plan"]
                if fp8:
                    import commgemm as cg
                    from commgemm import scaled
                    from commgemm.mosaic_gpu import fused

                    one = jnp.ones((), jnp.float32)
                    rhs = scaled.QuantizedRhs(cg.ScaledTensor(b_nk, one), one, k, "bfloat16", False)
                    plan = fused.float8_tiling(plan, k)
                    variants["core plan"] = (core(op, plan, float8=True), (a, rhs))
                else:
                    variants["core plan"] = (core(op, plan, float8=False), (a, b_kn))
            except Exception as e:  # noqa: BLE001
                row["failed"]["core plan"] = repr(e)[:300]
            good = {}
            for label, (fn, fargs) in variants.items():
                try:
                    out = fn(*fargs)
                    err = jnp.max(jnp.abs(out.astype(jnp.float32) - ref)) / jnp.max(jnp.abs(ref))
                    row["error"][label] = float(err)
                    good[label] = (fn, fargs)
                except Exception as e:  # noqa: BLE001
                    row["failed"][label] = repr(e)[:600]
            periods = device_periods_interleaved(good)
            row["ms"] = {label: p.get("median") for label, p in periods.items()}
            row["torch"] = torch_ms(m, k, n, fp8, fast=True)
            rows.append(row)
            print(json.dumps(row), flush=True)
            (args.out / "pingpong_probe.json").write_text(json.dumps(rows, indent=1))


def grouped_main(args, counts) -> None:
    """The grouped GEMM issue's shape (M 8192, K 4096, N 1792, uneven groups): the group-aligned
    ping-pong kernel against cg.grouped_matmul, the dense ping-pong and XLA's dense dot."""
    from grouped_gemm import uneven_sizes

    import commgemm as cg
    from commgemm.bench.spans import device_periods_interleaved
    from commgemm.mosaic_gpu import grouped as hopper
    from commgemm.mosaic_gpu import grouped_kernel

    m, k, n = 8192, 4096, 1792
    rows = []
    for groups in counts:
        kx, kw = jax.random.split(jax.random.key(groups))
        x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
        w = (jax.random.normal(kw, (groups, k, n), jnp.float32) / k**0.5).astype(jnp.bfloat16)
        sizes = jnp.asarray(uneven_sizes(groups, m, groups))
        ref = lax.ragged_dot(x.astype(jnp.float32), w.astype(jnp.float32), sizes)
        dy = x[:, :n]  # dX's form: [M, N] @ w[g]^T -> [M, K]
        ref_dx = lax.ragged_dot(
            dy.astype(jnp.float32), jnp.swapaxes(w, 1, 2).astype(jnp.float32), sizes
        )
        jax_fwd = functools.partial(
            hopper.product, tiles=hopper.default_tiles(n), transpose_rhs=False
        )
        jax_dx = functools.partial(
            hopper.product, tiles=hopper.default_tiles(n), transpose_rhs=True
        )
        variants = {
            "cg.grouped_matmul": (jax.jit(cg.grouped_matmul), (x, w, sizes)),
            "ours": (jax.jit(grouped_kernel.grouped_matmul), (x, w, sizes)),
            "jax": (jax.jit(jax_fwd), (x, w, sizes)),
            "gpp-s5-b4": (jax.jit(functools.partial(grouped_pingpong, band=4)), (x, w, sizes)),
            "gpp-s5-b8": (jax.jit(grouped_pingpong), (x, w, sizes)),
            "gpp-s5-b4n": (jax.jit(functools.partial(grouped_pingpong, band=4, minor_m=False)),
                           (x, w, sizes)),
            "dX ours": (jax.jit(functools.partial(grouped_kernel.grouped_matmul, w_nk=True)),
                        (dy, w, sizes)),
            "dX jax": (jax.jit(jax_dx), (dy, w, sizes)),
            "dX gpp-s5-b4": (jax.jit(functools.partial(grouped_pingpong, band=4, w_nk=True)),
                             (dy, w, sizes)),
            "dense pp-s6": (jax.jit(functools.partial(pingpong, stages=6, ordered=True)),
                            (x, w[0])),
            "dense xla": (jax.jit(xla_kn), (x, w[0])),
        }  # fmt: skip
        row = {"groups": groups, "sizes": [int(v) for v in sizes], "error": {}, "failed": {}}
        good = {}
        for label, (fn, fargs) in variants.items():
            try:
                out = fn(*fargs).astype(jnp.float32)
                if not label.startswith("dense"):
                    want = ref_dx if label.startswith("dX") else ref
                    err = jnp.max(jnp.abs(out - want)) / jnp.max(jnp.abs(want))
                    row["error"][label] = float(err)
                good[label] = (fn, fargs)
            except Exception as e:  # noqa: BLE001
                row["failed"][label] = repr(e)[:600]
        periods = device_periods_interleaved(good)
        row["ms"] = {label: p.get("median") for label, p in periods.items()}
        rows.append(row)
        print(json.dumps(row), flush=True)
        (args.out / "pingpong_grouped.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
