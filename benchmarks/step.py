"""One transformer layer's training step on all devices of the host, against its bound and XLA's
own partitioning: layernorms, the QKV and output projections, causal attention in plain jax
(`jax.nn.dot_product_attention`), the MLP (GELU in its tanh form, jax.nn.gelu's default, in
every variant), sequence-parallel tensor parallelism over every device, forward, backward and
an optax AdamW update, bf16 and FP8 (current tensor scaling on the four GEMMs).

Variants, timed interleaved on the devices (`bench.spans.batch_spans_interleaved`):
  auto, none: the layer with commgemm's ops inside shard_map (AUTO, and NONE: serial)
  SPEC or AG_SPEC/RS_SPEC: the layer with the methods `commgemm bench --methods` names (both
              ops, or the all-gathers' and the reduce-scatters'), e.g. fused/fused-direct: not
              in the default list
  auto-fast-dgrad: FP8 rows only: AUTO with split_accumulator=(False, False, True), so that a
              fused forward's dX runs the fused kernels too (the default recipe's promoted dX
              runs the split ring)
  xla:        the same layer in jnp on global arrays with NamedShardings (XLA's partitioning;
              FP8: `commgemm.scaled.matmul` on the global arrays)
  comm:       the step's collectives alone, back to back (4 all-gathers and 4 reduce-scatters
              of [tokens, H]; FP8: the gathers in float8) -> t_comm
  local:      the per-device layer (heads/P, F/P, every token) on one device, no
              communication -> t_local; timed right after the others
  nnx, flax:  the layer a user writes with commgemm's Flax layers (`commgemm.nnx`, AUTO), and
              as `local` in plain Flax modules (bf16 rows): P = 1's baseline
              (`flax_layer.py`); float32 parameters, so not comparable with the others'
              (their AdamW updates bf16 ones)
  NAME+lhs:   the variant NAME jitted with XLA's latency-hiding scheduler on
              (compiler_options xla_gpu_enable_latency_hiding_scheduler)
  xla-flags:  `xla` in a child process with XLA's windowed-einsum collective matmul on
              (threshold 0, multi-streamed), reported as failing where it does not compile
t_bound = max(t_local, t_comm). Each variant: ms per step, step / t_bound, speedup over xla,
the devices' busy fraction and the exposed collective time (collective kernels with no other
kernel beside them, GPU 0). A step under 90% busy is host-bound: no ratio is given from it.
Before timing, every variant's loss is checked against xla's (rtol 5e-2 bf16, 1e-1 FP8).

Both launch modes: one process for all devices, or one process per GPU under
`commgemm launch -n P` (each process times its own GPUs, process 0 writes the results; `local`
runs on each process's first device; `xla-flags` only in one process).

    PYTHONPATH=. python benchmarks/step.py --out DIR [--sizes 8b,70b,13b] [--dtypes bf16,fp8] \
        [--profile]   # GPUs: each variant's kernel time by kind too (`bench.kernels`)
    PYTHONPATH=. python benchmarks/step.py --out DIR --quick     # tiny shapes, any backend
    PYTHONPATH=. python -m commgemm launch -n 4 --gpus-per-process 1 -- \
        python benchmarks/step.py --out DIR

Writes DIR/step.json and prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys

from commgemm.devices import environment, setup_devices
from commgemm.distributed import agreed, initialize

setup_devices()
initialize()  # under `commgemm launch`: join the other processes (a no-op otherwise)

import flax_layer  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import commgemm as cg  # noqa: E402
from commgemm import scaled  # noqa: E402
from commgemm.bench import kernels, spans  # noqa: E402
from commgemm.cli.specs import parse_method  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Size:
    hidden: int
    ffn: int
    heads: int
    batch: int
    seq: int

    @property
    def tokens(self) -> int:
        return self.batch * self.seq


SIZES = {
    "8b": Size(4096, 14336, 32, 4, 4096),  # Llama-3-8B-like, 16384 tokens
    "70b": Size(8192, 28672, 64, 4, 4096),  # Llama-3-70B-like, 16384 tokens
    "13b": Size(5120, 13824, 40, 4, 2048),  # Llama-2-13B-like, 8192 tokens
}
QUICK = Size(64, 128, 8, 2, 32)
FP8 = "current_tensor_scaling"
#: The rows' dtypes (--dtypes): bf16 operands, or FP8 (current tensor scaling, default recipe).
DTYPES = ("bf16", "fp8")
#: AUTO on FP8 with fast accumulation in dX too: the recipe's default promotes dX's partial sums,
#: which the fused kernels' dX does not take (a fused forward's dX then runs the split ring)
FAST_DGRAD = "auto-fast-dgrad"
FAST_DGRAD_RECIPE = cg.ScalingRecipe(FP8, split_accumulator=(False, False, True))
WINDOWED = (
    "--xla_gpu_threshold_for_windowed_einsum_mib=0 --xla_gpu_multi_streamed_windowed_einsum=true"
)
BUSY = 0.9
#: a variant's suffix -> the compiler options its step is jitted with ("auto+lhs": AUTO's step
#: with XLA's latency-hiding scheduler on)
OPTIONS = {"lhs": {"xla_gpu_enable_latency_hiding_scheduler": True}}


def layernorm(x, scale):
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    return ((x32 - mean) * jax.lax.rsqrt(var + 1e-5) * scale).astype(x.dtype)


def layer(p, x, ag, rs, size: Size, heads: int, place=lambda a: a):
    """The layer on x [rows, H]: ag(h, w, activation) gathers rows before its GEMM, rs(a, w)
    reduces (and scatters) after; `heads` the heads this device holds; place(a) lays out the
    per-head activations [batch, seq, heads, ...] (XLA's variant: sharded by head)."""
    d = size.hidden // size.heads
    qkv = ag(layernorm(x, p["ln1"]), p["w_qkv"], None)  # [T, heads * 3 * d]
    t = qkv.shape[0]
    qkv = place(qkv.reshape(t // size.seq, size.seq, heads, 3, d))
    q, k, v = (place(qkv[..., i, :]) for i in range(3))
    a = place(jax.nn.dot_product_attention(q, k, v, is_causal=True))
    x = x + rs(a.reshape(t, heads * d), p["w_o"])
    u = ag(layernorm(x, p["ln2"]), p["w1"], "gelu_tanh")
    return x + rs(u, p["w2"])


def init(size: Size, heads: int, ffn: int, dtype, seed: int = 0):
    """Parameters of a layer holding `heads` heads and `ffn` columns of the MLP."""
    rng = np.random.default_rng(seed)
    h, d = size.hidden, size.hidden // size.heads

    def w(rows, cols):
        return jnp.asarray(rng.standard_normal((rows, cols)) / np.sqrt(rows), dtype)

    return {"ln1": jnp.ones((h,), jnp.float32), "ln2": jnp.ones((h,), jnp.float32),
            "w_qkv": w(h, heads * 3 * d), "w_o": w(heads * d, h), "w1": w(h, ffn),
            "w2": w(ffn, h)}  # fmt: skip


SPECS = {"ln1": P(), "ln2": P(), "w_qkv": P(None, "tp"), "w_o": P("tp", None),
         "w1": P(None, "tp"), "w2": P("tp", None)}  # fmt: skip


def train_step(forward, optimizer, options: dict | None = None):
    """jit(loss, grad, AdamW update) of forward(params, x) -> the layer's output, compiled with
    XLA's `options` (jax.jit's compiler_options)."""

    def step(params, opt_state, x):
        def loss_fn(p):
            return jnp.mean(jnp.square(forward(p, x).astype(jnp.float32)))

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, compiler_options=options)


def epilogue(y, activation):
    """The XLA and local variants' GELU: the ops' `activation` in jnp."""
    return jax.nn.gelu(y, approximate=activation == "gelu_tanh") if activation else y


def shard(a, mesh: Mesh, spec) -> jax.Array:
    """The same host value `a` on every process laid out by `spec` on `mesh` (one process for
    all devices or one per device)."""
    a = np.asarray(a)
    return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec), lambda i: a[i])


def variants(size: Size, mesh: Mesh, dtype, scaling, names) -> dict:
    """{name: (step fn, args)} of the variants in `names` (all but xla-flags)."""
    for name in names:
        if (suffix := name.partition("+")[2]) and suffix not in OPTIONS:
            raise ValueError(f"variant {name!r}: unknown suffix +{suffix} (known: "
                             f"{', '.join('+' + s for s in OPTIONS)})")  # fmt: skip
    n = mesh.devices.size
    opt = optax.adamw(1e-4)
    params = init(size, size.heads, size.ffn, dtype)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((size.tokens, size.hidden)), dtype)
    placed = {k: shard(v, mesh, SPECS[k]) for k, v in params.items()}
    x_placed = shard(x, mesh, P("tp", None))
    out = {}
    for name in names:
        base, _, suffix = name.partition("+")
        options = OPTIONS[suffix] if suffix else None
        if base == "nnx":
            fn, args = flax_layer.nnx_variant(size, mesh, params, x, dtype, scaling)
            out[name] = (jax.jit(fn, compiler_options=options), args)
        elif base == "flax":
            if scaling is None:  # plain Flax has no FP8 layer
                local = init(size, size.heads // n, size.ffn // n, dtype)
                fn, args = flax_layer.flax_variant(size, local, x, dtype, jax.local_devices()[0])
                out[name] = (jax.jit(fn, compiler_options=options), args)
        elif base not in ("xla", "local", "comm"):
            if base == FAST_DGRAD and scaling is None:
                continue  # an FP8 recipe's variant
            specs = ("auto", "auto") if base == FAST_DGRAD else (base.split("/") * 2)[:2]
            ag_cfg, rs_cfg = (parse_method(spec, op) for spec, op in zip(specs, ("ag", "rs"),
                                                                         strict=True))  # fmt: skip
            recipe = FAST_DGRAD_RECIPE if base == FAST_DGRAD else scaling

            def ag(h, w, act, cfg=ag_cfg, recipe=recipe):
                return cg.all_gather_matmul(h, w, "tp", config=cfg, activation=act,
                                            scaling=recipe)  # fmt: skip

            def rs(a, w, cfg=rs_cfg, recipe=recipe):
                return cg.matmul_reduce_scatter(a, w, "tp", config=cfg, scaling=recipe)

            body = jax.shard_map(
                lambda p, x, ag=ag, rs=rs: layer(p, x, ag, rs, size, size.heads // n),
                mesh=mesh, in_specs=(SPECS, P("tp", None)), out_specs=P("tp", None),
            )  # fmt: skip
            out[name] = (train_step(body, opt, options), (placed, opt.init(placed), x_placed))
        elif base == "xla":

            def xla_mm(a, w, spec, act=None):
                y = jnp.dot(a, w) if scaling is None else scaled.matmul(a, w, scaling)
                return jax.lax.with_sharding_constraint(epilogue(y, act),
                                                        NamedSharding(mesh, spec))  # fmt: skip

            def forward(p, x):
                ag = lambda h, w, act: xla_mm(h, w, P(None, "tp"), act)  # noqa: E731
                rs = lambda a, w: xla_mm(a, w, P("tp", None))  # noqa: E731
                by_head = NamedSharding(mesh, P(None, None, "tp"))
                place = lambda a: jax.lax.with_sharding_constraint(a, by_head)  # noqa: E731
                return layer(p, x, ag, rs, size, size.heads, place)

            out[name] = (train_step(forward, opt, options), (placed, opt.init(placed), x_placed))
        elif base == "local":
            local = init(size, size.heads // n, size.ffn // n, dtype)
            dev = jax.local_devices()[0]  # each process's own, under one process per GPU
            local = jax.device_put(local, dev)

            def local_mm(a, w, act=None):
                y = jnp.dot(a, w) if scaling is None else scaled.matmul(a, w, scaling)
                return epilogue(y, act)

            def local_forward(p, x):
                return layer(p, x, local_mm, local_mm, size, size.heads // n)

            args = (local, opt.init(local), jax.device_put(x, dev))
            out[name] = (train_step(local_forward, opt, options), args)
        elif base == "comm":

            def chain(x, gather_dtype=jnp.float8_e4m3fn if scaling else dtype):
                for _ in range(4):
                    g = jax.lax.all_gather(x.astype(gather_dtype), "tp", axis=0, tiled=True)
                    x = jax.lax.psum_scatter(g.astype(dtype), "tp", scatter_dimension=0,
                                             tiled=True)  # fmt: skip
                return x

            mapped = jax.shard_map(chain, mesh=mesh, in_specs=P("tp", None),
                                   out_specs=P("tp", None))  # fmt: skip
            fn = jax.jit(mapped, compiler_options=options)
            out[name] = (fn, (x_placed,))
    return out


def cannot_run(fn, args) -> str | None:
    """Why a jitted step cannot run on these devices (it does not compile, or its compiled
    buffers exceed what a local device has free: the one with the least), or None (also where
    the backend gives no memory figures). A step that ran out of memory on one GPU left the
    others waiting in NCCL for good."""
    try:
        compiled = fn.lower(*args).compile()
    except Exception as err:  # noqa: BLE001 - a variant that cannot compile here is reported
        return f"{type(err).__name__}: {err}"[:600]
    memory = compiled.memory_analysis()
    stats = {d.id: d.memory_stats() for d in jax.local_devices()}
    if memory is None or not all(s and "bytes_limit" in s for s in stats.values()):
        return None
    need = sum(
        getattr(memory, f, 0) or 0
        for f in ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes")
    )
    free = {d: s["bytes_limit"] - s.get("bytes_in_use", 0) for d, s in stats.items()}
    least = min(free, key=free.get)
    if need <= free[least]:
        return None
    return (f"needs {need / 2**30:.1f} GiB a device, {free[least] / 2**30:.1f} GiB free on "
            f"device {least}")  # fmt: skip


def first_losses(found: dict, row: dict, skip: tuple[str, ...] = ()) -> None:
    """Each variant's first step (its loss into row["loss"]; not for `skip`), where it compiles
    and fits in memory; a variant that does not is reported in row["errors"] and dropped from
    `found`. With several processes the processes agree first on which variants every one of
    them can run, so that all run the same steps. With one process a variant whose first step
    fails (an error raised when it runs) is reported and dropped too; with several, such an
    error ends the process (the others would wait for it in their collectives)."""
    errors = {name: why for name, (fn, args) in found.items() if (why := cannot_run(fn, args))}
    runnable = agreed(list(found), set(found) - set(errors), every=True)
    for name in list(found):
        if name not in runnable:
            why = errors.get(name, "it cannot run on another process")
            row.setdefault("errors", {})[name] = why
            del found[name]
        elif name not in skip:
            try:
                row["loss"][name] = float(found[name][0](*found[name][1])[2])
            except Exception as err:  # noqa: BLE001 - one process: report it, run the others
                if jax.process_count() > 1:
                    raise
                row.setdefault("errors", {})[name] = f"{type(err).__name__}: {err}"[:600]
                del found[name]


def run(size_name: str, size: Size, dtype_name: str, names: list[str], calls: int,
        profile: bool = False) -> dict:  # fmt: skip
    mesh = Mesh(np.array(jax.devices()), ("tp",))
    dtype = jnp.bfloat16
    scaling = FP8 if dtype_name == "fp8" else None
    found = variants(size, mesh, dtype, scaling, names)
    row = {"size": size_name, "dtype": dtype_name, "devices": mesh.devices.size,
           "shape": dataclasses.asdict(size), "loss": {}, "ms": {}, "busy": {},
           "exposed_ms": {}, "rounds": {}}  # fmt: skip
    first_losses(found, row, skip=("comm",))
    # local (and flax at P > 1): other (per-device) parameters, on one device, timed apart
    single = ("local", "flax") if mesh.devices.size > 1 else ("local",)
    if "xla" in row["loss"]:
        tol = 1e-1 if scaling else 5e-2
        ref = row["loss"]["xla"]
        row["loss_ok"] = {
            n: abs(v - ref) <= tol * abs(ref) for n, v in row["loss"].items() if n not in single
        }
    if jax.default_backend() != "gpu":
        return row
    timed = spans.batch_spans_interleaved({n: v for n, v in found.items() if n not in single},
                                          calls=calls)  # fmt: skip
    if alone := {n: v for n, v in found.items() if n in single}:
        timed |= spans.batch_spans_interleaved(alone, calls=calls)
    for name, t in timed.items():
        row["ms"][name] = round(t["median"], 4)
        row["rounds"][name] = [round(r, 4) for r in t["rounds"]]
        row["busy"][name] = round(t["busy"], 3)
        row["exposed_ms"][name] = round(kernels.exposed_ms(t["events"], calls), 4)
    if profile:
        row["profile"] = profiles(found, calls)
    return row


def profiles(found: dict, calls: int) -> dict:
    """Each variant's kernel time by kind (`bench.kernels.profile`: `calls` steps traced on the
    process's first GPU)."""
    return {name: kernels.profile(fn, args, calls) for name, (fn, args) in found.items()}


def ratios(row: dict) -> dict:
    """step / t_bound and the speedup over xla for every device-bound variant."""
    ms, busy = row["ms"], row["busy"]
    if "local" not in ms or "comm" not in ms:
        return {}
    bound = max(ms["local"], ms["comm"])
    out = {"t_bound_ms": bound}
    for name, t in ms.items():
        if name in ("local", "comm"):
            continue
        if busy.get(name, 1.0) < BUSY:
            out[name] = "host-bound"
            continue
        xla_ok = "xla" in ms and busy.get("xla", 0.0) >= BUSY
        out[name] = {"vs_bound": round(t / bound, 3),
                     "speedup_vs_xla": round(ms["xla"] / t, 3) if xla_ok else None}  # fmt: skip
    return out


def arguments(
    doc: str, sizes: str, variants: str, microbatches: bool = False, input_grad: bool = False
) -> argparse.Namespace:
    """The step benchmarks' command line (this script's and moe_step.py's; `microbatches`,
    `input_grad`: with --microbatches and --input-grad, moe_step.py's)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--sizes", default=sizes)
    parser.add_argument("--dtypes", default="bf16,fp8", help="bf16, fp8 (comma-separated)")
    parser.add_argument("--variants", default=variants)
    parser.add_argument("--calls", type=int, default=4, help="steps per timed batch")
    parser.add_argument("--quick", action="store_true", help="tiny shapes: a smoke run")
    parser.add_argument("--profile", action="store_true",
                        help="GPUs: each variant's kernel time by kind too")  # fmt: skip
    if microbatches:
        parser.add_argument("--microbatches", type=int, default=1,
                            help="micro-batches a step (a scan, one update)")  # fmt: skip
    if input_grad:
        parser.add_argument("--input-grad", action="store_true",
                            help="the step takes the block input's gradient too")  # fmt: skip
    args = parser.parse_args()
    if unknown := set(args.dtypes.split(",")) - set(DTYPES):
        parser.error(f"--dtypes: {', '.join(sorted(unknown))} not among {', '.join(DTYPES)}")
    return args


def main() -> None:
    args = arguments(__doc__, "8b,70b,13b", "auto,none,auto-fast-dgrad,xla,comm,local,xla-flags")
    names = args.variants.split(",")
    processes, writer = jax.process_count(), jax.process_index() == 0
    if processes > 1 and "xla-flags" in names:  # its child would start outside the run
        names.remove("xla-flags")
    if writer:
        args.out.mkdir(parents=True, exist_ok=True)
    result = {"devices": jax.device_count(), "processes": processes,
              "backend": jax.default_backend(), "kind": jax.devices()[0].device_kind,
              "jax": jax.__version__, "xla_flags": os.environ.get("XLA_FLAGS", ""),
              "nccl": environment()["nccl_library"],
              "rows": []}  # fmt: skip
    path = args.out / "step.json"
    for size_name in args.sizes.split(","):
        size = QUICK if args.quick else SIZES[size_name]
        for dtype_name in args.dtypes.split(","):
            row = run(size_name, size, dtype_name, [n for n in names if n != "xla-flags"],
                      args.calls, args.profile)  # fmt: skip
            if "xla-flags" in names:
                row["xla-flags"] = flags_variant(args, size_name, dtype_name)
            row["ratios"] = ratios(row)
            result["rows"].append(row)
            if writer:  # process 0's GPUs' figures
                path.write_text(json.dumps(result, indent=1))  # a run cut short keeps its rows
                print(json.dumps({k: row[k] for k in ("size", "dtype", "ms", "busy", "ratios")}),
                      flush=True)  # fmt: skip


def flags_variant(args, size_name: str, dtype_name: str) -> dict:
    """`xla` in a child process with XLA's windowed einsum on: its ms and busy, or the error."""
    out = args.out / f"flags-{size_name}-{dtype_name}"
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {WINDOWED}".strip())
    cmd = [sys.executable, __file__, "--out", str(out), "--sizes", size_name, "--dtypes",
           dtype_name, "--variants", "xla", "--calls", str(args.calls)]  # fmt: skip
    if args.quick:
        cmd.append("--quick")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or ["failed"]
        errors = [ln for ln in lines if re.match(r"^[\w.]*(Error|Exception)\b", ln)]
        return {"error": (errors or lines)[-1][:600]}
    row = json.loads((out / "step.json").read_text())["rows"][0]
    return {"ms": row["ms"].get("xla"), "busy": row["busy"].get("xla"),
            "loss": row["loss"].get("xla")}  # fmt: skip


if __name__ == "__main__":
    main()
