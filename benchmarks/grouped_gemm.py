"""The local grouped GEMM on one GPU: `cg.grouped_matmul` (the kernel `pick_tiles` picks), each
of its Hopper kernels (commgemm's `grouped_pingpong` and `grouped_kernel`, jax's
`ragged_dot_mgpu`) in the forward
and in dX's form (w transposed), against `jax.lax.ragged_dot`, XLA's dense GEMM of the same
FLOPs and the dense kernels' GEMM core, for G experts with uneven groups (M tokens, K, N per
expert shard), timed interleaved in one run (device periods where the GPU's timestamps can be
read, else host medians); reading w once, the memory bound of many experts; then the weight
gradient dW = x_g^T dy_g alone, against XLA's (the transpose of `lax.ragged_dot`) and a dense
GEMM of the same FLOPs; the float8 forward (`cg.grouped_matmul` with current tensor
scaling, quantizing in each call; on weights quantized before, quantizing x; emulated; and
commgemm's two kernels alone on float8 operands), float8 dX (e5m2 dY, fast and promoted) and
float8 dW (the float8 kernel where it runs, and the default recipe's 16-bit kernel on the
dequantized values). Each against the roofline of the same run:
t_roof = max(FLOPs / R, bytes / B), R the rate of the dense GEMM of the same total shape, B
the HBM bandwidth of a device-to-device copy, bytes what the kernel must move at least (x, the
experts that receive tokens, the output; for dW: x, dY and dW); the float8 variants also
against their own (R of cuBLASLt's tensor-scaled FP8 GEMM, 1-byte operands, a bf16 output;
dX's bytes with N and K swapped, dW's those of x, dY and the experts' dW).
Group sizes: uneven (every group non-empty), Zipf-skewed (some empty) or equal; each row also
records the ping-pong kernel's tiles and waves against a dense GEMM's (`pingpong_waves`).
Writes OUT/grouped_gemm.json.

    PYTHONPATH=. python benchmarks/grouped_gemm.py --out DIR [--groups 8,16,64,128]
        [--skews uneven,zipf,equal] [--quick]
"""

from __future__ import annotations

import argparse
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

import commgemm as cg
from commgemm import quantized_gemm
from commgemm.bench.record import record
from commgemm.bench.spans import device_periods_interleaved
from commgemm.bench.timing import benchmark_interleaved
from commgemm.mosaic_gpu import gemm_core, grouped_dw, grouped_kernel, grouped_pingpong
from commgemm.mosaic_gpu import grouped as hopper
from commgemm.mosaic_gpu import tiles as mosaic_tiles
from commgemm.mosaic_gpu.configs import GroupedConfig

#: The three Hopper kernels of the forward and dX, in their default tilings (commgemm's
#: row-aligned one choosing whether to narrow its last wave: `grouped_kernel.narrowing_pays`),
#: and the row-aligned one with that choice made (`GroupedConfig.narrow_tail`).
KERNELS = {
    "commgemm ping-pong kernel": hopper.PingPongTiles(),
    "commgemm kernel": GroupedConfig(),
    "commgemm kernel, last wave narrowed": GroupedConfig(narrow_tail=True),
    "commgemm kernel, last wave whole": GroupedConfig(narrow_tail=False),
    "jax kernel": hopper.default_tiles(2 * 128),
}


#: `--quick`'s variants: the library's op and kernels (bf16, FP8 forward, dX and dW) and the
#: references its rooflines need; not jax's kernel, XLA's ragged dot (its compile takes
#: minutes at 64 groups and more), the row-aligned tilings or the emulated FP8 path.
QUICK = (
    "commgemm.grouped_matmul", "commgemm ping-pong kernel", "dX commgemm ping-pong kernel",
    "fp8 ping-pong kernel", "fp8 commgemm kernel", "fp8 dX, fast", "fp8 dX, promoted",
    "dense GEMM core (commgemm)", "dense GEMM, same FLOPs", "fp8 dense GEMM, same FLOPs",
)  # fmt: skip


def uneven_sizes(groups: int, tokens: int, seed: int) -> np.ndarray:
    """Uneven group sizes summing to `tokens` (a Zipf-like skew, every group non-empty)."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, groups + 1) ** 0.8
    sizes = np.floor(rng.permutation(weights) / weights.sum() * (tokens - groups)).astype(int) + 1
    sizes[0] += tokens - sizes.sum()
    return sizes.astype(np.int32)


def zipf_sizes(groups: int, tokens: int, seed: int, a: float = 1.2) -> np.ndarray:
    """Group sizes summing to `tokens`, tokens routed to experts with Zipf(a) popularity (a
    random expert order): a few experts take most rows, some may get none."""
    rng = np.random.default_rng(seed)
    popularity = rng.permutation(1.0 / np.arange(1, groups + 1) ** a)
    return rng.multinomial(tokens, popularity / popularity.sum()).astype(np.int32)


def equal_sizes(groups: int, tokens: int, seed: int) -> np.ndarray:
    """Equal group sizes summing to `tokens` (the remainder in the first group; `seed` unused):
    where every group fills whole tiles, the ping-pong kernel runs as many tiles as a dense
    GEMM."""
    sizes = np.full(groups, tokens // groups, np.int32)
    sizes[0] += tokens - sizes.sum()
    return sizes


SIZES = {"uneven": uneven_sizes, "zipf": zipf_sizes, "equal": equal_sizes}


def pingpong_waves(sizes, m: int, n: int, sms: int) -> dict:
    """The ping-pong kernel's output tiles (its default `PingPongTiles()`) for group `sizes`
    over m rows and n columns (its row tiles, `grouped_pingpong.row_tiles`, times the column
    tiles), the most any of `sms` CTAs runs (its waves), and the same for a dense GEMM of m rows
    in the same tiles: the wave quantization the groups' partial last tiles add."""
    tile_m, tile_n = hopper.PingPongTiles().tile_m, hopper.PingPongTiles().tile_n
    used = int(grouped_pingpong.row_tiles(jnp.asarray(sizes), m, tile_m).counts[0])
    tiles, dense = used * (n // tile_n), -(-m // tile_m) * (n // tile_n)
    return {"tiles": tiles, "waves": -(-tiles // sms), "dense_tiles": dense,
            "dense_waves": -(-dense // sms)}  # fmt: skip


def least_bytes(
    sizes, m: int, k: int, n: int, itemsize: int, *, dw: bool = False, out_itemsize: int = 0
) -> int:
    """What a grouped GEMM must move at least: x [m, k], the experts that receive rows (w [k, n]
    each) and the output [m, n]; for dW (x^T dY per group): x, dY [m, n] and those experts'
    dW. Operands of `itemsize` bytes, the output of `out_itemsize` (default the same: float8
    operands give a bf16 output, 2)."""
    active, out_itemsize = int(np.count_nonzero(np.asarray(sizes))), out_itemsize or itemsize
    if dw:  # read x and dY, write dW
        return itemsize * (m * k + m * n) + out_itemsize * active * k * n
    return itemsize * (m * k + active * k * n) + out_itemsize * m * n


def roofline_ms(flops: float, nbytes: int, flops_per_s: float, bytes_per_s: float) -> float:
    """t_roof = max(FLOPs / R, bytes / B), in ms."""
    return max(flops / flops_per_s, nbytes / bytes_per_s) * 1e3


def copy_variant(mib: int = 256):
    """A device-to-device copy of `mib` MiB (read and written once): B = 2 x its bytes / t."""
    buf = jnp.ones((mib * 2**20 // 2,), jnp.bfloat16)
    return (jax.jit(lambda b: b + 1), (buf,)), 2 * buf.nbytes


def emulated_operands(x, w):
    """x and w quantized and dequantized as the emulated float8 path runs them."""
    from commgemm.grouped.scaling import quantized_operands

    return quantized_operands(x, w, "current_tensor_scaling")[:2]


def problem(
    groups: int, m: int, k: int, n: int, dtype=jnp.bfloat16, skew: str = "uneven",
    kernels=None,
):  # fmt: skip
    """The forward's, dX's and FP8's variants, their errors and the group sizes; `kernels`: the
    tilings beside the default op (KERNELS where None)."""
    kernels = KERNELS if kernels is None else kernels
    keys = jax.random.split(jax.random.key(groups), 3)
    x = jax.random.normal(keys[0], (m, k), dtype)
    w = (jax.random.normal(keys[1], (groups, k, n), jnp.float32) / k**0.5).astype(dtype)
    dense_w = w[0]
    sizes = jnp.asarray(SIZES[skew](groups, m, groups))
    dy = x[:, :n]  # dX's form: [M, N] @ w[g]^T -> [M, K], w read as [G, K (out), N]
    variants = {
        "commgemm.grouped_matmul": (jax.jit(cg.grouped_matmul), (x, w, sizes)),
        **{
            name: (
                jax.jit(lambda a, b, s, t=t: cg.grouped_matmul(a, b, s, hopper_tiles=t)),
                (x, w, sizes),
            )  # fmt: skip
            for name, t in kernels.items()
        },
        "dX commgemm ping-pong kernel": (
            jax.jit(lambda a, b, s: hopper.product(a, b, s, hopper.PingPongTiles(), True)),
            (dy, w, sizes),
        ),
        "dX commgemm kernel": (
            jax.jit(lambda a, b, s: grouped_kernel.grouped_matmul(a, b, s, w_nk=True)),
            (dy, w, sizes),
        ),
        "dX jax kernel": (
            jax.jit(lambda a, b, s: hopper.product(a, b, s, KERNELS["jax kernel"], True)),
            (dy, w, sizes),
        ),
        # float8: the op with current scaling (quantizing x and w in each call), and the
        # kernel alone on operands quantized before
        "fp8 grouped_matmul (quantizing)": (
            jax.jit(lambda a, b, s: cg.grouped_matmul(a, b, s, scaling="current_tensor_scaling")),
            (x, w, sizes),
        ),
        "fp8 pre-quantized w, quantizing x": (
            jax.jit(
                lambda a, b, s: cg.grouped_matmul(cg.quantize(a, "current_tensor_scaling"), b, s)
            ),
            (x, cg.quantize(jnp.swapaxes(w, 1, 2), "current_tensor_scaling", axis=2), sizes),
        ),
        "fp8 emulated (quantizing)": (
            jax.jit(lambda a, b, s: cg.grouped_matmul(*emulated_operands(a, b), s)),
            (x, w, sizes),
        ),
        **{
            f"fp8 {name} kernel": (
                jax.jit(
                    lambda a, b, s, c, kernel=kernel: kernel.grouped_matmul(
                        a, b, s, w_nk=True, scale=c, out_dtype=dtype
                    )
                ),
                (
                    x.astype(jnp.float8_e4m3fn),
                    jnp.swapaxes(w, 1, 2).astype(jnp.float8_e4m3fn),
                    sizes,
                    jnp.ones((1,), jnp.float32),
                ),
            )
            for name, kernel in (("commgemm", grouped_kernel), ("ping-pong", grouped_pingpong))
        },  # fmt: skip
        # float8 dX as the op's backward runs it (`hopper.float8_matmul`, the kernel it picks):
        # e5m2 dY times the e4m3 experts read [G, K, N] (K-major for the contraction over N),
        # fast and promoted (split: the default recipe's)
        **{
            f"fp8 dX, {name}": (
                jax.jit(
                    lambda a, b, s, c, split=split: hopper.float8_matmul(
                        a, c, b, c, s, dtype, split=split
                    )
                ),
                (
                    dy.astype(jnp.float8_e5m2),
                    w.astype(jnp.float8_e4m3fn),
                    sizes,
                    jnp.ones((), jnp.float32),
                ),
            )  # fmt: skip
            for name, split in (("fast", False), ("promoted", True))
        },
        "read w once": (jax.jit(lambda b: jnp.sum(b, axis=(0, 1))), (w,)),
        "dense GEMM core (commgemm)": (
            jax.jit(lambda a, b: gemm_core.matmul(a, b, False)),
            (x, dense_w),
        ),
        "lax.ragged_dot": (
            jax.jit(lambda a, b, s: jax.lax.ragged_dot(a, b, s, preferred_element_type=dtype)),
            (x, w, sizes),
        ),
        "dense GEMM, same FLOPs": (jax.jit(lambda a, b: a @ b), (x, dense_w)),
        # the FP8 rows' rate: cuBLASLt's tensor-scaled FP8 GEMM (the library's local one)
        "fp8 dense GEMM, same FLOPs": (
            jax.jit(
                lambda a, b, c: quantized_gemm.scaled_dot(
                    a, b, ((1,), (1,)), c, "float32", dtype, split=False
                )
            ),
            (
                x.astype(jnp.float8_e4m3fn),
                dense_w.T.astype(jnp.float8_e4m3fn),
                jnp.ones((), jnp.float32),
            ),
        ),
    }
    ref = jax.jit(lambda a, b, s: jax.lax.ragged_dot(
        a.astype(jnp.float32), b.astype(jnp.float32), s))(x, w, sizes)  # fmt: skip
    errors = {}
    for name in ("commgemm.grouped_matmul", *kernels):
        fn, args = variants[name]
        err = float(jnp.abs(fn(*args).astype(jnp.float32) - ref).max())
        errors[name] = err / float(jnp.abs(ref).max())
    # the float8 op against the float32 ragged dot of the operands it quantized
    qx = cg.quantize(x, "current_tensor_scaling")
    qw = cg.quantize(w, "current_tensor_scaling", axis=1)
    ref8 = jax.lax.ragged_dot(cg.dequantize(qx, jnp.float32), cg.dequantize(qw, jnp.float32),
                              sizes, precision="highest")  # fmt: skip
    fn, args = variants["fp8 grouped_matmul (quantizing)"]
    err = float(jnp.abs(fn(*args).astype(jnp.float32) - ref8).max())
    errors["fp8 grouped_matmul (quantizing), vs its quantized operands"] = err / float(
        jnp.abs(ref8).max()
    )
    # float8 dX against the float32 ragged dot of the same float8 values
    a8, b8 = variants["fp8 dX, fast"][1][:2]
    ref_dx = jax.lax.ragged_dot(a8.astype(jnp.float32), jnp.swapaxes(b8, 1, 2).astype(jnp.float32),
                                sizes, precision="highest")  # fmt: skip
    for name in ("fp8 dX, fast", "fp8 dX, promoted"):
        fn, args = variants[name]
        err = float(jnp.abs(fn(*args).astype(jnp.float32) - ref_dx).max())
        errors[name] = err / float(jnp.abs(ref_dx).max())
    return variants, errors, sizes


#: dW's kernels beside the default (commgemm's ping-pong dW kernel in `PingPongTiles()`): its
#: other tilings and jax's transposed ragged dot in its fastest measured tiling.
DW_KERNELS = {
    "dW commgemm, steps of 128": hopper.PingPongTiles(tile_k=128, stages=2),
    "dW commgemm, band 1": hopper.PingPongTiles(band=1),
    "dW commgemm, band 8": hopper.PingPongTiles(band=8),
    "dW jax transposed ragged dot": hopper.default_tiles(2 * 128),
}


def weight_grad_problem(
    groups: int, m: int, k: int, n: int, dtype=jnp.bfloat16, skew: str = "uneven",
    quick: bool = False,
):  # fmt: skip
    """dW's variants: ours (default, then `DW_KERNELS` unless `quick`), XLA's (not with
    `quick`), a dense x^T dy of the same FLOPs, float8 dW; and each kernel's largest error
    against the float32 ragged dot, relative to its largest value."""
    keys = jax.random.split(jax.random.key(groups + 1), 2)
    x = jax.random.normal(keys[0], (m, k), dtype)
    dy = jax.random.normal(keys[1], (m, n), dtype)
    sizes = jnp.asarray(SIZES[skew](groups, m, groups))

    def xla(a, d, s):
        zeros = jnp.zeros((groups, k, n), a.dtype)
        _, pullback = jax.vjp(lambda b: jax.lax.ragged_dot(a, b, s), zeros)
        return pullback(d)[0]

    kernels = {"dW commgemm (ping-pong)": None, **({} if quick else DW_KERNELS)}
    variants = {
        name: (jax.jit(lambda a, d, s, t=t: hopper.weight_grad(a, d, s, t)), (x, dy, sizes))
        for name, t in kernels.items()
    }
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    ref = jax.jit(xla)(f32(x), f32(dy), sizes)
    scale = float(jnp.abs(ref).max())
    errors = {name: float(jnp.abs(f32(fn(*args)) - ref).max()) / scale
              for name, (fn, args) in variants.items()}  # fmt: skip
    # float8: e4m3 x and e5m2 dY (unit scales) on the fast recipe's float8 kernel (its
    # transposes included) where it runs (`grouped_dw.float8_reason`), and as the default
    # recipe runs dW (the 16-bit kernel on the dequantized values)
    x8, dy8 = x.astype(jnp.float8_e4m3fn), dy.astype(jnp.float8_e5m2)
    one = jnp.ones((), jnp.float32)
    fp8 = {"dW fp8, dequantized + 16-bit kernel": (
        jax.jit(lambda a, d, s: hopper.weight_grad(a.astype(dtype), d.astype(dtype), s)),
        (x8, dy8, sizes))}  # fmt: skip
    if grouped_dw.float8_reason(m, k, n, groups) is None:
        fp8["dW fp8, float8 kernel"] = (
            jax.jit(lambda a, d, s: grouped_dw.float8_weight_grad(a, one, d, one, s, dtype)),
            (x8, dy8, sizes),
        )
    ref8 = jax.jit(xla)(f32(x8), f32(dy8), sizes)
    for name, (fn, args) in fp8.items():
        errors[name] = float(jnp.abs(f32(fn(*args)) - ref8).max()) / float(jnp.abs(ref8).max())
    variants.update(fp8)
    if not quick:  # XLA's compile takes minutes at 64 groups and more
        variants["dW lax.ragged_dot (XLA)"] = (jax.jit(xla), (x, dy, sizes))
    variants["dense x^T dy, same FLOPs"] = (jax.jit(lambda a, d: a.T @ d), (x, dy))
    # the float8 rows' rate: cuBLASLt's FP8 GEMM of the same FLOPs on K-major copies
    variants["fp8 dense x^T dy, same FLOPs"] = (
        jax.jit(lambda a, d, c: quantized_gemm.scaled_dot(
            a, d, ((1,), (1,)), c, "float32", dtype, split=False)),
        (x8.T, dy8.T, one),
    )  # fmt: skip
    return variants, errors


def timed(variants) -> tuple[dict, str]:
    """{name: ms} by device periods (host medians where they cannot be read), and which."""
    try:
        periods = device_periods_interleaved(variants, rounds=6)
        times = {name: f["median"] for name, f in periods.items() if "median" in f}
        if len(times) >= 3:
            return times, "device periods"
    except RuntimeError:
        pass
    host = benchmark_interleaved(variants, iters=30)
    return {name: r.median for name, r in host.items()}, "host"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--m", type=int, default=8192)
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--n", type=int, default=14336 // 8)
    parser.add_argument("--groups", default="8,16,64,128", help="comma-separated group counts")
    parser.add_argument("--skews", default="uneven,zipf", help="group sizes: uneven, zipf, equal")
    parser.add_argument("--quick", action="store_true", help="the library's kernels only (QUICK)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    m, k, n = args.m, args.k, args.n
    cases = [(int(g), skew) for skew in args.skews.split(",") for g in args.groups.split(",")]
    for groups, skew in cases:
        pingpong = "commgemm ping-pong kernel"
        kernels = {pingpong: KERNELS[pingpong]} if args.quick else None
        variants, rel_errs, sizes = problem(groups, m, k, n, skew=skew, kernels=kernels)
        if args.quick:
            variants = {name: v for name, v in variants.items() if name in QUICK}
        variants["hbm copy"], copy_bytes = copy_variant()
        times, timing = timed(variants)
        dw_variants, dw_err = weight_grad_problem(groups, m, k, n, skew=skew, quick=args.quick)
        dw_variants["hbm copy"], _ = copy_variant()
        dw_times, dw_timing = timed(dw_variants)
        dense_dw = dw_times["dense x^T dy, same FLOPs"]
        flops = 2.0 * m * k * n
        roof = {  # (least bytes, R, B) of the forward and of dW, each from its own run
            "fwd": (least_bytes(sizes, m, k, n, 2), min(times["dense GEMM, same FLOPs"],
                    times.get("dense GEMM core (commgemm)", float("inf"))), times["hbm copy"]),
            "dw": (least_bytes(sizes, m, k, n, 2, dw=True), dense_dw, dw_times["hbm copy"]),
            "fp8": (least_bytes(sizes, m, k, n, 1, out_itemsize=2),
                    times["fp8 dense GEMM, same FLOPs"], times["hbm copy"]),
            "fp8 dX": (least_bytes(sizes, m, n, k, 1, out_itemsize=2),
                       times["fp8 dense GEMM, same FLOPs"], times["hbm copy"]),
            "fp8 dW": (least_bytes(sizes, m, k, n, 1, dw=True, out_itemsize=2),
                       dw_times["fp8 dense x^T dy, same FLOPs"], dw_times["hbm copy"]),
        }  # fmt: skip
        t_roof = {
            key: roofline_ms(flops, nbytes, flops / (t_gemm * 1e-3), copy_bytes / (t_copy * 1e-3))
            for key, (nbytes, t_gemm, t_copy) in roof.items()
        }
        row = {
            "groups": groups,
            "skew": skew,
            "pingpong_waves": pingpong_waves(sizes, m, n, mosaic_tiles.num_sms()),
            "sizes": sizes.tolist(),
            "timing": timing,
            "ms": times,
            "t_roof_ms": t_roof["fwd"],
            "hbm_gb_per_s": copy_bytes / (times["hbm copy"] * 1e-3) / 1e9,
            "vs_roof": {name: t / t_roof["fwd"] for name, t in times.items()},
            # the FP8 variants against the FP8 roofline: 1-byte operands, the FP8 GEMM's rate
            "fp8_t_roof_ms": t_roof["fp8"],
            "fp8_vs_roof": {
                n: t / t_roof["fp8 dX" if n.startswith("fp8 dX") else "fp8"]
                for n, t in times.items()
                if n.startswith("fp8")
            },  # fmt: skip
            "fp8_dx_t_roof_ms": t_roof["fp8 dX"],
            "gb_per_s": {name: roof["fwd"][0] / (t * 1e-3) / 1e9 for name, t in times.items()},
            "tflops": {name: flops / (t * 1e-3) / 1e12 for name, t in times.items()},
            "vs_dense": {name: t / times["dense GEMM, same FLOPs"] for name, t in times.items()},
            "vs_ragged_dot": times["commgemm.grouped_matmul"] / times["lax.ragged_dot"]
            if "lax.ragged_dot" in times
            else None,
            "max_rel_error_vs_float32": rel_errs,
            "dw": {
                "timing": dw_timing,
                "ms": dw_times,
                "tflops": {name: flops / (t * 1e-3) / 1e12 for name, t in dw_times.items()},
                "vs_dense": {name: t / dense_dw for name, t in dw_times.items()},
                "t_roof_ms": t_roof["dw"],
                "vs_roof": {name: t / t_roof["dw"] for name, t in dw_times.items()},
                "fp8_t_roof_ms": t_roof["fp8 dW"],
                "fp8_vs_roof": {
                    name: t / t_roof["fp8 dW"] for name, t in dw_times.items() if "fp8" in name
                },  # fmt: skip
                "max_rel_error_vs_float32": dw_err,
            },
        }
        record(args.out / "grouped_gemm.json", rows, row, m=args.m, k=args.k, n=args.n)


if __name__ == "__main__":
    main()
