"""Probe: a dense ping-pong Hopper GEMM in cuBLASLt's 128 x 160 tile, against XLA's dot and our
fused kernels' GEMM cores, bf16, on one GPU.

The question (docs/performance.md, "Open leads"; the GEMM-core issue): on every RS preset's
local shape XLA's autotuner runs cuBLASLt's `nvjet_sm90_tst_128x160_64x5_2x1_v_bz_NNT`
(128 x 160 tiles, 64-element K-steps, 5 stages, 2-CTA clusters, each warpgroup a tile of its
own), and our cooperative cores trail it by 3 to 9%. The earlier ping-pong probes held 128 x 128
tiles (1.06 to 1.13x XLA) or two whole result tiles in shared memory (3 stages at 160 or 192
columns). Here: each compute warpgroup owns a 128 x tile_n tile; one ring of `stages` smem
slots shared by both and filled in tile order by the load warpgroup; the K loops alternate
(ordered barrier pair); w read [N, K] (K-major, so any tile_n that is whole 8s swizzles);
N need not be whole tiles (the last column of tiles is partial: TMA zero-fills the loads past
N and clips the stores); the epilogue stores the tile in blocks of `epi_rows` full-width rows
through `epi_bufs` buffers a warpgroup (64 x 160 bf16: 20 KiB, so 5 stages still fit).

    PYTHONPATH=. python benchmarks/pingpong_wide_probe.py --out DIR [--lower-only]

Writes DIR/pingpong_wide.json: per shape, device periods (medians of 6 interleaved rounds) of
every variant and each variant's largest error against a float32 dot.
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
from jax import lax

from commgemm.mosaic_gpu import tiles as mosaic_tiles


def pingpong(
    a,
    b,
    *,
    tile_m: int = 128,
    tile_n: int = 160,
    tile_k: int = 64,
    stages: int = 5,
    band: int = 8,
    minor_m: bool = True,
    epi_rows: int = 64,
    epi_bufs: int = 1,
    cluster: bool = False,
    ordered: bool = True,
    shared_epi: bool = False,
):
    """a [M, K] @ b [N, K]^T -> [M, N] bf16 (float32 accumulation), ping-pong schedule.

    `shared_epi`: one epilogue buffer for both warpgroups (their epilogues alternate as their
    tiles do; each awaits the other's stores' reads), which leaves room for a fifth stage at
    tile_n = 192."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu
    from jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu import MatmulDimension

    (m, k), n = a.shape, b.shape[0]
    pair = 2 if cluster else 1  # with cluster, CTA pairs along M share w's blocks (multicast)
    if m % (tile_m * pair) or k % tile_k or tile_n % 8 or tile_m % epi_rows:
        raise ValueError(f"{m}x{k}x{n} does not tile as {tile_m}x{tile_k}x{tile_n}")
    m_iters, n_iters, k_iters = m // tile_m, -(-n // tile_n), k // tile_k
    sms = (mosaic_tiles.num_sms() if jax.devices()[0].platform == "gpu" else 132) // pair
    total = m_iters // pair * n_iters
    minor = MatmulDimension.M if minor_m else MatmulDimension.N
    transforms = mosaic_tiles.smem_transforms(a.dtype, tile_k)
    out_dtype = jnp.bfloat16
    out_transforms = mosaic_tiles.smem_transforms(out_dtype, tile_n)

    def body(a_gmem, b_gmem, out_gmem):
        cta = lax.axis_index("sm")
        mine = (total - cta + sms - 1) // sms

        def where(i):
            m_idx, n_idx = plgpu.planar_snake(
                cta + i * sms, (m_iters // pair, n_iters), minor, band
            )
            if cluster:
                m_idx = m_idx * 2 + lax.axis_index("cluster")
            return m_idx * tile_m, n_idx * tile_n

        def scoped(a_smem, b_smem, full0, full1, empty, out_smem, order0, order1, free0, free1):
            wg, fulls, order = lax.axis_index("wg"), (full0, full1), (order0, order1)
            free = (free0, free1)

            def issue(c, s):  # step s's loads, for consumer c
                i, kk, slot = s // k_iters, s % k_iters, s % stages
                row0, col0 = where(i)
                ks = pl.ds(kk * tile_k, tile_k)
                plgpu.copy_gmem_to_smem(
                    a_gmem.at[pl.ds(row0, tile_m), ks], a_smem.at[slot], fulls[c].at[slot]
                )
                shared = dict(collective_axes="cluster") if cluster else {}
                plgpu.copy_gmem_to_smem(
                    b_gmem.at[pl.ds(col0, tile_n), ks], b_smem.at[slot], fulls[c].at[slot], **shared
                )

            def load():
                plgpu.set_max_registers(40, action="decrease")

                @pl.loop(0, mine * k_iters)
                def _step(s):
                    @pl.when(s >= stages)
                    def _():
                        plgpu.barrier_wait(empty.at[s % stages])

                    for c in (0, 1):
                        pl.when((s // k_iters) % 2 == c)(functools.partial(issue, c, s))

            def epilogue(c, i, acc_ref, row0, col0):
                if shared_epi:  # the other warpgroup's stores have read the buffer

                    @pl.when(i > 0)
                    def _():
                        plgpu.barrier_wait(free[c])

                for r in range(tile_m // epi_rows):
                    buf = r % epi_bufs
                    plgpu.wait_smem_to_gmem(epi_bufs - 1, wait_read_only=True)
                    rows = slice(r * epi_rows, (r + 1) * epi_rows)
                    out_smem[0 if shared_epi else c, buf] = acc_ref[rows, :].astype(out_dtype)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(
                        out_smem.at[0 if shared_epi else c, buf],
                        out_gmem.at[pl.ds(row0 + r * epi_rows, epi_rows), pl.ds(col0, tile_n)],
                    )
                if shared_epi:
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    plgpu.barrier_arrive(free[1 - c])

            def tile(c, i):
                row0, col0 = where(i)

                def kstep(kk, acc):
                    s = i * k_iters + kk
                    plgpu.barrier_wait(fulls[c].at[s % stages])
                    plgpu.wgmma(acc, a_smem.at[s % stages], b_smem.at[s % stages].T)
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
                    epilogue(c, i, acc_ref, row0, col0)

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
            plgpu.SMEM((stages, tile_n, tile_k), b.dtype, transforms=transforms),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            plgpu.ClusterBarrier(collective_axes=("cluster",), num_barriers=stages)
            if cluster
            else plgpu.Barrier(num_arrivals=1, num_barriers=stages),
            plgpu.SMEM(
                (1 if shared_epi else 2, epi_bufs, epi_rows, tile_n),
                out_dtype,
                transforms=out_transforms,
            ),
            *[plgpu.Barrier(num_arrivals=1) for _ in range(4)],
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


#: (name, op, P, M, K, N): every RS preset's local GEMM at P = 2, 4, 8, and the two AG rows where
#: XLA also picks the 128 x 160 kernel (BENCHMARKS.md, "Which GEMM kernels XLA and torch run").
SHAPES = [
    ("llama8b rs P2", "rs", 2, 8192, 2048, 14336),
    ("llama8b rs P4", "rs", 4, 8192, 1024, 14336),
    ("llama8b rs P8", "rs", 8, 8192, 512, 14336),
    ("llama13b rs P2", "rs", 2, 8192, 2560, 13824),
    ("llama13b rs P8", "rs", 8, 8192, 640, 13824),
    ("comm_heavy rs P2", "rs", 2, 16384, 4096, 4096),
    ("comm_heavy rs P8", "rs", 8, 16384, 1024, 4096),
    ("llama70b rs P2", "rs", 2, 8192, 4096, 28672),
    ("llama70b rs P8", "rs", 8, 8192, 1024, 28672),
    ("llama13b ag P2", "ag", 2, 8192, 5120, 6912),
    ("llama8b ag P8", "ag", 8, 8192, 4096, 1792),
]

VARIANTS = {
    "pp160-s5-cm": dict(cluster=True),
    "pp192-s4": dict(tile_n=192, stages=4),
    "pp192-s4-cm": dict(tile_n=192, stages=4, cluster=True),
    "pp192-s5-sh": dict(tile_n=192, stages=5, shared_epi=True),
    "pp192-s5-sh-cm": dict(tile_n=192, stages=5, shared_epi=True, cluster=True),
    "pp160-s5-sh": dict(shared_epi=True),
    "pp192-s4-b16": dict(tile_n=192, stages=4, band=16),
}


def xla_nk(x, y):
    """XLA's dot of x [M, K] and y [N, K], bf16 out."""
    return lax.dot_general(x, y, (((1,), (1,)), ((), ())), preferred_element_type=jnp.bfloat16)


def xla_kn(x, y):
    """XLA's dot of x [M, K] and y [K, N], bf16 out."""
    return jnp.dot(x, y, preferred_element_type=jnp.bfloat16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--lower-only", action="store_true", help="lower for CUDA (CPU check)")
    parser.add_argument("--shapes", default="", help="comma-separated indices into SHAPES")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    from fused_core import core, core_tilings

    shapes = [SHAPES[int(i)] for i in args.shapes.split(",")] if args.shapes else SHAPES
    rows = []
    for name, op, size, m, k, n in shapes:
        ka, kb = jax.random.split(jax.random.key(m + k + n))
        a = jax.random.normal(ka, (m, k), jnp.float32).astype(jnp.bfloat16)
        b_nk = (jax.random.normal(kb, (n, k), jnp.float32) / k**0.5).astype(jnp.bfloat16)
        b_kn = b_nk.T.copy()
        variants = {"xla": (jax.jit(xla_kn), (a, b_kn)), "xla nk": (jax.jit(xla_nk), (a, b_nk))}
        variants["core plan"] = (core(op, core_tilings(op, size, (m, k, n))["plan"], float8=False),
                                 (a, b_kn))  # fmt: skip
        for label, kw in VARIANTS.items():
            variants[label] = (jax.jit(functools.partial(pingpong, **kw)), (a, b_nk))
        row = {"name": name, "m": m, "k": k, "n": n, "error": {}, "failed": {}}
        if args.lower_only:
            for label, (fn, fargs) in variants.items():
                if label.startswith("pp"):
                    try:
                        fn.trace(*fargs).lower(lowering_platforms=("cuda",))
                    except Exception as e:  # noqa: BLE001
                        row["failed"][label] = repr(e)[:600]
            print(json.dumps(row), flush=True)
            continue
        from commgemm.bench.spans import device_periods_interleaved

        ref = jnp.dot(a.astype(jnp.float32), b_kn.astype(jnp.float32))
        good = {}
        for label, (fn, fargs) in variants.items():
            try:
                out = fn(*fargs).astype(jnp.float32)
                err = jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref))
                row["error"][label] = float(err)
                good[label] = (fn, fargs)
            except Exception as e:  # noqa: BLE001
                row["failed"][label] = repr(e)[:600]
        periods = device_periods_interleaved(good)
        row["ms"] = {label: p.get("median") for label, p in periods.items()}
        best = min(v for v in row["ms"].values() if v)
        row["vs_best"] = {label: round(v / best, 3) for label, v in row["ms"].items() if v}
        rows.append(row)
        print(json.dumps(row), flush=True)
        name = f"pingpong_wide{args.shapes.replace(',', '_')}.json"
        (args.out / name).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
