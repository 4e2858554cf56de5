"""The capabilities beyond the bf16 ops, timed overlapped on all devices of one host (the
2-GPU issue's list; the same script serves 4 and 8 GPUs): FP8 ops against bf16, the grouped
GEMMs overlapped against their serial composition, the layers' training step against XLA's
own sharding of the same model, the backward pass alone, and a fused op's forward and backward.
One process drives every device; times are device periods (interleaved rounds, medians) on
GPUs, host-timed medians elsewhere (`--quick` on 8 virtual CPU devices is a smoke run of the
script, not a measurement).

    PYTHONPATH=. python benchmarks/capabilities.py --out DIR [--quick]

Writes DIR/capabilities.json (every section's rows, as they finish).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import pathlib
import re
import sys
import time

from commgemm.devices import setup_devices

setup_devices()  # before jax starts

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import commgemm as cg  # noqa: E402
from commgemm.bench.problems import PRESETS, make_problem  # noqa: E402
from commgemm.cli.specs import parse_method  # noqa: E402

FULL = {
    "presets": ["llama70b_mlp", "llama8b_mlp", "comm_heavy", "llama13b_mlp"],
    "grouped": dict(tokens=8192, hidden=4096, ffn=14336, experts=8),
    "decoder": dict(hidden=2048, heads=16, ffn=8192, layers=4, batch=4, seq=2048, vocab=8192),
}
QUICK = {
    "presets": ["quick"],
    "grouped": dict(tokens=256, hidden=64, ffn=128, experts=4),
    "decoder": dict(hidden=64, heads=8, ffn=128, layers=1, batch=2, seq=64, vocab=128),
}
SHAPES = dict(PRESETS, quick=(256, 128, 256))
METHODS = {
    "none": cg.OverlapConfig(),
    "pipeline:4": cg.OverlapConfig(method="pipeline", num_splits=4),
    "ring": cg.OverlapConfig(method="ring_exchange"),
    "auto": cg.OverlapConfig(method="auto"),
}


def time_variants(variants: dict) -> dict[str, float | str]:
    """{name: median ms, "timing": how}: device periods on GPUs, host-timed interleaved
    medians elsewhere or where a trace's activity does not split into the calls."""
    if jax.default_backend() == "gpu":
        from commgemm.bench.spans import device_periods_interleaved

        for gap_s in (2e-3, 2e-2):  # a longer gap between batches where host stalls split them
            try:
                found = device_periods_interleaved(variants, rounds=6, gap_s=gap_s)
            except RuntimeError as err:
                found = {"": {"error": str(err)}}
            errors = {name: f["error"] for name, f in found.items() if "error" in f}
            if not errors:
                ms = {name: f["median"] for name, f in found.items()}
                return {**ms, "timing": f"device periods, medians of 6 rounds ({gap_s}s gaps)"}
            print(f"device periods failed with {gap_s}s gaps: {errors}", flush=True)
        print("host-timed medians instead", flush=True)
    from commgemm.bench.timing import benchmark_interleaved

    iters = 20 if jax.default_backend() == "gpu" else 3
    found = benchmark_interleaved(variants, iters=iters, warmup=1)
    return {**{n: r.median for n, r in found.items()}, "timing": f"host medians of {iters}"}


def fp8_rows(devices, cfg) -> list[dict]:
    """Each preset's AG and RS: bf16 serial and AUTO, FP8 (current scaling) serial, ring and
    AUTO, XLA's bf16 dot, and on GPUs the direct fused kernels where they take the shape (else
    the row's `skipped` says why); FP8 errors against the bf16 serial result."""
    rows = []
    for preset in cfg["presets"]:
        for op in ("ag", "rs"):
            problem = make_problem(op, SHAPES[preset], "bfloat16", devices)
            x, w = problem.operands()
            variants = {"xla bf16": (problem.xla(), (x, w))}
            for name in ("none", "auto"):
                variants[f"bf16 {name}"] = (problem.overlapped(METHODS[name]), (x, w))
            for name in ("none", "ring", "auto"):
                fn = problem.overlapped(METHODS[name], scaling="current_tensor_scaling")
                variants[f"fp8 {name}"] = (fn, (x, w))
            skipped = {}
            if jax.default_backend() == "gpu":  # the direct fused kernels, bf16 and float8
                fused, fast = parse_method("fused-direct", op), cg.ScalingRecipe(
                    split_accumulator=(False, True, True))  # fmt: skip
                candidates = {"bf16 fused-direct": problem.overlapped(fused)}
                for name, method in (("none", METHODS["none"]), ("fused-direct", fused)):
                    candidates[f"fp8 fast {name}"] = problem.overlapped(method, scaling=fast)
                for name, fn in candidates.items():
                    try:  # the plan refuses, at trace time, a shape the kernel cannot take
                        jax.block_until_ready(fn(x, w))
                    except ValueError as err:
                        skipped[name] = str(err)
                        continue
                    variants[name] = (fn, (x, w))
            ref = variants["bf16 none"][0](x, w).astype(jnp.float32)
            scale = float(jnp.abs(ref).max())
            errors = {n: float(jnp.abs(f(*a).astype(jnp.float32) - ref).max()) / scale
                      for n, (f, a) in variants.items() if n.startswith("fp8")}  # fmt: skip
            rows.append({"preset": preset, "op": op, "ms": time_variants(variants),
                         "rel_error_vs_bf16": errors, "skipped": skipped})  # fmt: skip
    return rows


def _grouped_setup(devices, cfg):
    """(mesh, rng, put, (P, m, K, N, E), (x, w_col, sizes)) of the grouped sections: x's rows
    and the experts' columns sharded over "tp", each shard's uneven counts per expert."""
    size, g = len(devices), cfg["grouped"]
    mesh = Mesh(np.array(devices), ("tp",))
    rng = np.random.default_rng(0)
    m, k, n, e = g["tokens"] // size, g["hidden"], g["ffn"], g["experts"]
    put = lambda a, spec: jax.device_put(jnp.asarray(a, jnp.bfloat16), NamedSharding(mesh, spec))  # noqa: E731
    sizes = np.stack([np.bincount(rng.integers(0, e, m), minlength=e) for _ in range(size)])
    sizes_d = jax.device_put(sizes.astype(np.int32), NamedSharding(mesh, P("tp")))
    x = put(rng.standard_normal((size * m, k)), P("tp"))
    w_col = put(rng.standard_normal((e, k, n)) / k**0.5, P(None, None, "tp"))
    return mesh, rng, put, (size, m, k, n, e), (x, w_col, sizes_d)


def grouped_rows(devices, cfg) -> list[dict]:
    """Tensor-parallel experts (AG + grouped GEMM, grouped GEMM + RS) and expert parallelism
    (all-to-all + grouped GEMM and back), each method against the serial one (method none)."""
    mesh, rng, put, (size, m, k, n, e), (x, w_col, sizes_d) = _grouped_setup(devices, cfg)
    w_row = put(rng.standard_normal((e, n, k)) / n**0.5, P(None, "tp", None))
    h = put(rng.standard_normal((size * m, n)), P(None, "tp"))
    one = jnp.asarray(np.bincount(rng.integers(0, e, size * m), minlength=e), jnp.int32)
    rows = []
    for name in ("none", "pipeline:4", "ring"):
        c = METHODS[name]
        ag = jax.jit(
            jax.shard_map(
                lambda a, b, s, c=c: cg.all_gather_grouped_matmul(a, b, s[0], "tp", config=c),
                mesh=mesh,
                in_specs=(P("tp"), P(None, None, "tp"), P("tp")),
                out_specs=P(None, "tp"),
            )
        )
        rs = jax.jit(
            jax.shard_map(
                lambda a, b, c=c: cg.grouped_matmul_reduce_scatter(a, b, one, "tp", config=c),
                mesh=mesh,
                in_specs=(P(None, "tp"), P(None, "tp", None)),
                out_specs=P("tp"),
            )
        )
        timed = {"ag+grouped": (ag, (x, w_col, sizes_d)), "grouped+rs": (rs, (h, w_row))}
        rows.append({"method": name, "ms": time_variants(timed)})
    per = max(e // size, 1)
    w_ep = put(rng.standard_normal((per * size, k, n)) / k**0.5, P("tp"))
    ep_sizes = np.stack([np.bincount(rng.integers(0, per * size, m), minlength=per * size)
                         for _ in range(size)]).astype(np.int32)  # fmt: skip
    ep_sizes_d = jax.device_put(ep_sizes, NamedSharding(mesh, P("tp")))
    variants = {}
    for name in ("none", "ring"):
        c = METHODS[name]
        variants[f"all-to-all+grouped {name}"] = (jax.jit(jax.shard_map(
            lambda a, b, s, c=c: cg.all_to_all_grouped_matmul(a, b, s[0], "tp", config=c)[0],
            mesh=mesh, in_specs=(P("tp"), P("tp"), P("tp")), out_specs=P("tp"))),
            (x, w_ep, ep_sizes_d))  # fmt: skip
    rows.append({"method": "expert parallel", "ms": time_variants(variants)})
    # method none's blocks in one regrouped GEMM or block by block, whatever the defaults (the
    # all-gather's; the expert-parallel dispatch receives its rows by expert, no blocks)
    ag = lambda a, b, s: cg.all_gather_grouped_matmul(a, b, s[0], "tp")  # noqa: E731
    variants = {}
    for merge in (True, False):
        how = "regrouped" if merge else "block by block"
        f = jax.shard_map(ag, mesh=mesh, in_specs=(P("tp"), P(None, None, "tp"), P("tp")),
                          out_specs=P(None, "tp"))  # fmt: skip

        def traced(*a, f=f, merge=merge):
            with _merging(merge):
                return f(*a)

        variants[f"ag+grouped none, {how}"] = (jax.jit(traced), (x, w_col, sizes_d))
    rows.append({"method": "none: regrouped or block by block", "ms": time_variants(variants)})
    return rows


@contextlib.contextmanager
def _merging(merge: bool):
    """Method none of the collective grouped ops with every block in one regrouped GEMM
    (`merge`, the library's way: `grouped.blocks.merged_matmul`) or block by block (as before
    it): a benchmark-side patch of their `merged_matmul`."""
    from commgemm.grouped import blocks, collective

    def block_by_block(stacked, w, block_sizes, rows, experts, out_dtype=None):
        return jnp.stack([blocks.block_matmul(stacked[p], w, block_sizes[p],
                                              blocks.row_block(rows, p), experts, out_dtype)
                          for p in range(stacked.shape[0])])  # fmt: skip

    modules = (collective,)
    saved = [m.merged_matmul for m in modules]
    for m in modules:
        m.merged_matmul = blocks.merged_matmul if merge else block_by_block
    try:
        yield
    finally:
        for m, fn in zip(modules, saved, strict=True):
            m.merged_matmul = fn


@contextlib.contextmanager
def _emulated_blocks():
    """The collective grouped ops' float8 forward emulated (dequantized values on the 16-bit
    kernels), as it ran before `grouped.blocks.block_matmul`: a benchmark-side patch."""
    from commgemm.grouped import scaling

    saved, scaling.float8_experts = scaling.float8_experts, lambda *_: None
    try:
        yield
    finally:
        scaling.float8_experts = saved


@contextlib.contextmanager
def _emulated_dx():
    """The float8 blocks' dX emulated (16-bit kernels on dY's and w's dequantized values) while
    their forward runs on the float8 kernel, as before dX took the kernel: a benchmark-side
    patch of `mosaic_gpu.grouped.float8_dx` (the float8 dX of the local grouped op too, which
    this section does not run)."""
    from commgemm.mosaic_gpu import grouped as hopper

    saved = hopper.float8_dx
    hopper.float8_dx = lambda *_: None
    try:
        yield
    finally:
        hopper.float8_dx = saved


#: (label, scaling, patch) of `grouped_fp8_rows`' variants.
GROUPED_FP8_VARIANTS = (
    ("bf16", None, contextlib.nullcontext),
    ("fp8 kernel", "current_tensor_scaling", contextlib.nullcontext),
    ("fp8 kernel, dX emulated", "current_tensor_scaling", _emulated_dx),
    ("fp8 emulated", "current_tensor_scaling", _emulated_blocks),
)


def _grouped_fp8_ops(devices, cfg):
    """(mesh, {name: (body(x, w, sizes, scaling), in_specs, out_spec, w, sizes, x)}) of the
    grouped float8 sections: the all-gather (ring, none), the dispatch's ring and grouped + RS."""
    mesh, rng, put, (size, m, k, n, e), (x, w_col, sizes_d) = _grouped_setup(devices, cfg)
    experts_ep = max(e // size, 1) * size  # whole experts a device
    w_ep = put(rng.standard_normal((experts_ep, k, n // size)) / k**0.5, P("tp"))
    ep_sizes = np.stack([np.bincount(rng.integers(0, experts_ep, m), minlength=experts_ep)
                         for _ in range(size)])  # fmt: skip
    ep_sizes_d = jax.device_put(ep_sizes.astype(np.int32), NamedSharding(mesh, P("tp")))
    # grouped + RS: K (the FFN's N) sharded, every shard's counts the same
    h = put(rng.standard_normal((size * m, n)), P(None, "tp"))
    w_row = put(rng.standard_normal((e, n, k)) / n**0.5, P(None, "tp", None))
    one = np.bincount(rng.integers(0, e, size * m), minlength=e).astype(np.int32)
    rs_sizes_d = jax.device_put(np.tile(one, (size, 1)), NamedSharding(mesh, P("tp")))
    ops = {
        "ag+grouped ring": (lambda a, b, s, sc: cg.all_gather_grouped_matmul(
            a, b, s[0], "tp", config=METHODS["ring"], scaling=sc),
            (P("tp"), P(None, None, "tp"), P("tp")), P(None, "tp"), w_col, sizes_d, x),
        "ag+grouped none": (lambda a, b, s, sc: cg.all_gather_grouped_matmul(
            a, b, s[0], "tp", config=METHODS["none"], scaling=sc),
            (P("tp"), P(None, None, "tp"), P("tp")), P(None, "tp"), w_col, sizes_d, x),
        "all-to-all+grouped ring": (lambda a, b, s, sc: cg.all_to_all_grouped_matmul(
            a, b, s[0], "tp", config=METHODS["ring"], scaling=sc)[0],
            (P("tp"), P("tp"), P("tp")), P("tp"), w_ep, ep_sizes_d, x),
        "grouped+rs none": (lambda a, b, s, sc: cg.grouped_matmul_reduce_scatter(
            a, b, s[0], "tp", config=METHODS["none"], scaling=sc),
            (P(None, "tp"), P(None, "tp", None), P("tp")), P("tp"), w_row, rs_sizes_d, h),
    }  # fmt: skip
    return mesh, ops


def grouped_fp8_rows(devices, cfg) -> list[dict]:
    """The collective grouped ops under current tensor scaling: the forward and a forward and
    backward, bf16 against float8 with each block's GEMMs on the float8 kernel (forward and
    dX; also with dX emulated, `_emulated_dx`) and float8 emulated (`_emulated_blocks`);
    errors against the bf16 op, and the kernel path's gradients against the emulated one's."""
    mesh, ops = _grouped_fp8_ops(devices, cfg)
    rows = []
    for name, (body, in_specs, out_spec, w, sizes_d, x_op) in ops.items():
        variants, outs, grads = {}, {}, {}
        for label, scaling, patch in GROUPED_FP8_VARIANTS:
            f = jax.shard_map(functools.partial(body, sc=scaling), mesh=mesh,
                              in_specs=in_specs, out_specs=out_spec)  # fmt: skip

            def traced(*args, f=f, patch=patch):
                with patch():
                    return f(*args)

            def step(a, b, s, f=traced, patch=patch):
                with patch():  # the backward is traced here too
                    out, vjp = jax.vjp(lambda a, b: f(a, b, s), a, b)
                    return vjp(out)  # a cotangent that is not a constant

            args = (x_op, w, sizes_d)
            if patch is not _emulated_dx:  # its forward is the kernel's
                variants[f"{label} forward"] = (jax.jit(traced), args)
                outs[label] = jax.jit(traced)(*args).astype(jnp.float32)
            variants[f"{label} forward+backward"] = (jax.jit(step), args)
            grads[label] = jax.jit(step)(*args)
        scale = float(jnp.abs(outs["bf16"]).max())
        errors = {label: float(jnp.abs(o - outs["bf16"]).max()) / scale for label, o in outs.items()
                  if label != "bf16"}  # fmt: skip
        errors["kernel vs emulated"] = float(
            jnp.abs(outs["fp8 kernel"] - outs["fp8 emulated"]).max()) / scale  # fmt: skip
        # the gradients (dX, dW) of the float8 kernel path against the fully emulated one
        errors["gradients, kernel vs emulated"] = [
            _relative(g, e) for g, e in zip(grads["fp8 kernel"], grads["fp8 emulated"], strict=True)
        ]
        rows.append({"op": name, "ms": time_variants(variants), "rel_error_vs_bf16": errors})
        print(name, rows[-1], flush=True)
    return rows


def _transposed_spec(spec: P) -> P:
    """The PartitionSpec of an array whose last two dimensions are swapped."""
    parts = (*spec, *([None] * (3 - len(spec))))
    return P(*parts[:-2], parts[-1], parts[-2])


def grouped_fp8_weights_rows(devices, cfg) -> list[dict]:
    """The collective grouped ops' forward with the experts quantized before the call (a
    `QuantizedWeight` as the forward program's argument, as for serving), with and without the
    float8 values kept transposed (`keep_transposed`), against bf16 and against the op
    quantizing the experts itself (current tensor scaling); the kept copy's result against
    the other's (bit for bit on the same quantized values); the dispatch with method none too,
    and the local grouped op on one device (`_local_fp8_weights_row`)."""
    mesh, ops = _grouped_fp8_ops(devices, cfg)
    _, *rest = ops["all-to-all+grouped ring"]
    ops["all-to-all+grouped none"] = (lambda a, b, s, sc: cg.all_to_all_grouped_matmul(
        a, b, s[0], "tp", config=METHODS["none"], scaling=sc)[0], *rest)  # fmt: skip
    mode = cg.ScalingMode.CURRENT_TENSOR_SCALING
    rows = [_local_fp8_weights_row(devices[0], cfg, mode)]
    print(rows[-1], flush=True)
    for name, (body, in_specs, out_spec, w, sizes_d, x_op) in ops.items():
        w_spec = in_specs[1]
        variants, outs = {}, {}
        for label, scaling in (("bf16", None), ("fp8 quantizing w", mode)):
            f = jax.shard_map(functools.partial(body, sc=scaling), mesh=mesh, in_specs=in_specs,
                              out_specs=out_spec)  # fmt: skip
            variants[label] = (jax.jit(f), (x_op, w, sizes_d))
        for keep in (False, True):
            quantized = cg.ScaledTensor(w_spec, P(), mode=mode, axis=1)
            kept = _transposed_spec(w_spec) if keep else None
            specs = cg.QuantizedWeight(w_spec, quantized, kept)
            quantize = jax.shard_map(
                lambda b, keep=keep: cg.quantize_weight(b, mode, axis=1, axis_name="tp",
                                                        keep_transposed=keep),
                mesh=mesh, in_specs=w_spec, out_specs=specs)  # fmt: skip
            qw = jax.jit(quantize)(w)
            f = jax.shard_map(
                functools.partial(body, sc=mode),
                mesh=mesh,
                in_specs=(in_specs[0], specs, in_specs[2]),
                out_specs=out_spec,
            )
            label = "fp8 quantized before, kept transposed" if keep else "fp8 quantized before"
            variants[label] = (jax.jit(f), (x_op, qw, sizes_d))
            outs[label] = np.float32(jax.jit(f)(x_op, qw, sizes_d))
        kept, plain = outs.values()
        errors = {"kept vs not, max abs": float(np.abs(kept - plain).max())}
        rows.append({"op": name, "ms": time_variants(variants), "errors": errors})
        print(name, rows[-1], flush=True)
    return rows


def _local_fp8_weights_row(device, cfg, mode) -> dict:
    """`grouped_fp8_weights_rows`' local row: `cg.grouped_matmul` on one device, tokens x hidden
    times experts of hidden x ffn / experts (the grouped GEMM issue's shape: 8192 x 4096 times
    8 experts of 4096 x 1792), uneven counts, in bf16 and in float8 as the section's variants."""
    g = cfg["grouped"]
    m, k, e = g["tokens"], g["hidden"], g["experts"]
    rng = np.random.default_rng(1)
    put = lambda a: jax.device_put(jnp.asarray(a, jnp.bfloat16), device)  # noqa: E731
    x, w = (
        put(rng.standard_normal((m, k))),
        put(rng.standard_normal((e, k, g["ffn"] // e)) / k**0.5),
    )
    sizes = jax.device_put(np.bincount(rng.integers(0, e, m), minlength=e).astype(np.int32), device)
    call = lambda sc: jax.jit(lambda a, b, s: cg.grouped_matmul(a, b, s, scaling=sc))  # noqa: E731
    variants = {
        "bf16": (call(None), (x, w, sizes)),
        "fp8 quantizing w": (call(mode), (x, w, sizes)),
    }
    outs = {}
    for keep in (False, True):
        qw = jax.jit(
            lambda b, keep=keep: cg.quantize_weight(b, mode, axis=1, keep_transposed=keep)
        )(w)
        label = "fp8 quantized before, kept transposed" if keep else "fp8 quantized before"
        variants[label] = (call(mode), (x, qw, sizes))
        outs[label] = np.float32(call(mode)(x, qw, sizes))
    kept, plain = outs.values()
    errors = {"kept vs not, max abs": float(np.abs(kept - plain).max())}
    return {"op": "grouped (local, one device)", "ms": time_variants(variants), "errors": errors}


def _with_cotangent(preset: str, op: str, devices):
    """(problem, x, w, dy) of a preset's bf16 op: random operands and a random cotangent dY (a
    constant one would let XLA fold the collective away)."""
    problem = make_problem(op, SHAPES[preset], "bfloat16", devices)
    x, w = problem.operands()
    m, _, n = problem.shape
    return problem, x, w, problem._random((m, n), problem.out_spec, 7)


def backward_rows(devices, cfg) -> list[dict]:
    """The backward pass alone, dX of AG + GEMM (the RS of dY @ W^T) and of GEMM + RS (the AG of
    dY), by cg.gemm's methods against XLA's gradient of its own dot, dY random, the forward
    pruned (dX does not need it)."""
    rows = []
    for preset in cfg["presets"]:
        for op in ("ag", "rs"):
            problem, x, w, dy = _with_cotangent(preset, op, devices)
            variants = {}
            for name in ("xla", "none", "ring", "auto"):
                f = problem.xla() if name == "xla" else problem.overlapped(METHODS[name])
                loss = lambda a, b, g, f=f: jnp.sum(f(a, b) * g, dtype=jnp.float32)  # noqa: E731
                grad = jax.jit(jax.grad(loss))
                variants[f"dX {name}"] = (grad, (x, w, dy))
            rows.append({"preset": preset, "op": op, "ms": time_variants(variants)})
    return rows


def _fused_plans(problem, op: str, size: int):
    """(the direct fused config in the cost model's tiling, the ring kernels' config) of a
    problem."""
    from commgemm.mosaic_gpu import heuristics

    m, k, n = problem.shape
    if op == "ag":
        tiles = heuristics.direct_ag_config(m // size, n=n // size)
    else:
        tiles = heuristics.direct_rs_config(m, size, (m, k, n))
    direct = cg.OverlapConfig(method="pipeline", atomic_gemm=True, kernel=tiles)
    return direct, cg.OverlapConfig(method="ring_exchange", atomic_gemm=True)


def _bf16_backward_variants(problem, op: str, size: int) -> dict:
    """The bf16 rows: the split ring throughout, the direct and the ring kernels with the
    library's backward and with dX on the split ring."""
    direct, ring_kernels = _fused_plans(problem, op, size)
    return {
        "split ring": (METHODS["ring"], None),
        "direct": (direct, None),
        "direct, dX ring": (direct, None),
        "ring kernels": (ring_kernels, None),
        "ring kernels, dX ring": (ring_kernels, None),
    }


def _fp8_backward_variants(problem, op: str, size: int) -> dict:
    """The float8 rows (current tensor scaling): the split ring throughout, the direct kernels
    with the default recipe (promoted dgrad: the library runs dX on the split ring; "dX fused"
    forces it onto the fused kernel's split form) and with fast dgrad, each with the library's
    backward and with dX on the split ring; bf16 direct."""
    direct, _ = _fused_plans(problem, op, size)
    default, fast = cg.ScalingRecipe(), cg.ScalingRecipe(split_accumulator=(False, False, True))
    return {
        "bf16 direct": (direct, None),
        "fp8 split ring": (METHODS["ring"], default),
        "fp8 direct": (direct, default),
        "fp8 direct, dX fused": (direct, default),
        "fp8 direct fast dgrad": (direct, fast),
        "fp8 direct fast dgrad, dX ring": (direct, fast),
    }


def _patched_backward(name: str):
    """The benchmark-side patch of a variant named "..., dX ring" (dX on the split ring, the
    backward before 2026-11-26) or "..., dX fused" (a float8 op's dX on the fused kernel
    whatever the dgrad flag), else none."""
    import unittest.mock

    from commgemm import autodiff

    if name.endswith("dX ring"):

        def ring(collective, cfg, x, dy, w, axis_name, w_transposed):
            back = autodiff.backward_config(cfg, x)
            return back.replace(method=cg.Method.RING_EXCHANGE, num_splits=1)

        return unittest.mock.patch.object(autodiff, "fused_backward_config", ring)
    if name.endswith("dX fused"):

        def fused(collective, cfg, quantizer, like_x, dy, w, axis_name, w_transposed):
            return autodiff.fused_backward_config(collective, cfg, like_x, dy, w, axis_name,
                                                  w_transposed)  # fmt: skip

        return unittest.mock.patch.object(autodiff, "_dgrad_config", fused)
    return contextlib.nullcontext()


def _relative(a: jax.Array, b: jax.Array) -> float:
    """max |a - b| / max |b|, in float32."""
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return float(jnp.abs(a - b).max() / jnp.abs(b).max())


def _backward_step_rows(devices, cfg, variants_of) -> list[dict]:
    """A fused op's forward and backward (the gradients of x and w) per preset and op, in the
    configs `variants_of(problem, op, size)` gives ({name: (config, scaling)}; a name ending
    in "dX ring" or "dX fused" is patched: `_patched_backward`), and XLA's gradient of its own
    dot; each compiled program's Mosaic GPU kernels counted; float8 rows' gradients against
    the first float8 row's."""
    rows = []
    for preset in cfg["presets"]:
        for op in ("ag", "rs"):
            problem, x, w, dy = _with_cotangent(preset, op, devices)
            variants, kernels, grads = {}, {}, {}
            configs = variants_of(problem, op, len(devices))
            for name, (config, scaling) in [("xla", (None, None)), *configs.items()]:
                if config is None:
                    f = problem.xla()
                else:
                    f = problem.overlapped(config, scaling=scaling)
                loss = lambda a, b, g, f=f: jnp.sum(f(a, b) * g, dtype=jnp.float32)  # noqa: E731
                step = jax.jit(jax.value_and_grad(loss, (0, 1)))
                jax.clear_caches()  # or the patched variant reuses the other's backward
                try:
                    with _patched_backward(name):
                        compiled = step.lower(x, w, dy).compile()
                        if scaling is not None:
                            grads[name] = compiled(x, w, dy)[1]
                except Exception as err:  # noqa: BLE001 - a row says what did not run
                    print(f"{preset} {op} {name}: {type(err).__name__}: {err}"[:400], flush=True)
                    continue
                variants[name] = (compiled, (x, w, dy))
                text = compiled.as_text()
                kernels[name] = len(re.findall(r'custom_call_target="[^"]*mosaic[^"]*"', text))
            row = {"preset": preset, "op": op, "ms": time_variants(variants),
                   "mosaic_kernels": kernels}  # fmt: skip
            if grads:
                first = next(iter(grads.values()))
                row["grad_error_vs_first_fp8"] = {
                    name: [_relative(a, b) for a, b in zip(g, first, strict=True)]
                    for name, g in grads.items()
                }
            print(json.dumps(row), flush=True)  # the rows so far, should a timeout stop the run
            rows.append(row)
    return rows


def fused_backward_rows(devices, cfg) -> list[dict]:
    """bf16: the direct kernels (cost model's tiling) and the ring kernels, each with its dX on
    the other collective's fused kernel (the library's backward) and on the split ring."""
    return _backward_step_rows(devices, cfg, _bf16_backward_variants)


def fused_backward_fp8_rows(devices, cfg) -> list[dict]:
    """float8 (current tensor scaling): the direct kernels with dX on the fused kernel (e5m2 dY
    x e4m3 W) and on the split ring, dgrad promoted (the default) and fast."""
    return _backward_step_rows(devices, cfg, _fp8_backward_variants)


def layers_rows(devices, cfg) -> list[dict]:
    """One AdamW step of examples/train_transformer.py's decoder at `cfg["decoder"]`'s size,
    commgemm.nnx with each method, against `--method xla`: the same model whose GEMMs XLA's
    partitioner shards from the parameters' and activations' shardings."""
    sys.path.insert(0, str(pathlib.Path(__file__).parent.parent / "examples"))
    import train_transformer as example

    shape = example.Shape(**cfg["decoder"])
    mesh = Mesh(np.array(devices).reshape(1, -1), ("data", "tp"))
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, shape.vocab, (shape.batch, shape.seq + 1)), jnp.int32)
    variants = {}
    for name in ("xla", "none", "ring", "auto"):
        config = None if name == "xla" else METHODS[name]
        model, optimizer = example.build(shape, mesh, config)
        variants[name] = (example.train_step, (model, optimizer, tokens))
    return [{"decoder": cfg["decoder"], "ms": time_variants(variants)}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--quick", action="store_true", help="tiny shapes: a smoke run")
    parser.add_argument("--sections", default="fp8,grouped,backward,layers")
    parser.add_argument("--presets", help="comma-separated presets (default: all of the size)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cfg, devices = (QUICK if args.quick else FULL), jax.devices()
    if args.presets:
        cfg = dict(cfg, presets=args.presets.split(","))
    result = {"devices": [str(d) for d in devices], "backend": jax.default_backend(),
              "jax": jax.__version__, "quick": args.quick}  # fmt: skip
    sections = {"fp8": fp8_rows, "grouped": grouped_rows, "grouped_fp8": grouped_fp8_rows,
                "grouped_fp8_weights": grouped_fp8_weights_rows,
                "backward": backward_rows,
                "fused_backward": fused_backward_rows,
                "fused_backward_fp8": fused_backward_fp8_rows, "layers": layers_rows}  # fmt: skip
    for name in args.sections.split(","):
        start = time.time()
        result[name] = sections[name](devices, cfg)
        print(f"{name}: {time.time() - start:.0f}s", json.dumps(result[name])[:2000], flush=True)
        (args.out / "capabilities.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
