"""The expert-parallel MoE block's training step on all devices of the host, against its serial
form and the same block written with XLA's own ops: router, top-k, the tokens dispatched to
their experts' shards, two grouped GEMMs with GELU between, back, the gated combine; tokens
sequence-parallel, experts split over every device; forward, backward and an optax AdamW update.

Variants, timed interleaved on the devices (`bench.spans.batch_spans_interleaved`):
  auto, none: `commgemm.nnx.moe_per_shard` with AUTO, and NONE (serial: every exchange, then
              one grouped GEMM), bf16 and FP8 (current tensor scaling on both grouped GEMMs)
  SPEC:       another method in `commgemm bench --methods`' spelling, e.g. ring
  NAME@CF:    the variant with capacity factor CF (`moe_per_shard`'s capacity_factor: each
              expert takes at most ceil(CF * m*k / E) copies from a shard, the rest dropped),
              e.g. auto@1.25; its loss is not checked (dropped tokens change it)
  NAME-fast:  FP8 rows: the variant with fast accumulation in the forward, dX and dW
              (`ScalingRecipe(split_accumulator=(False, False, False))`; the default recipe
              promotes dX and dW), e.g. auto-fast
  NAME+qw:    FP8 rows: the variant with its experts quantized once a step (`cg.quantize_weight`,
              both float8 layouts kept, gradients pulled back to the weights) rather than in
              every call: with --microbatches, once for all micro-batches (XLA on a GPU
              quantizes them again in each micro-batch of the scan otherwise)
  xla:        the same block with `jax.lax.ragged_all_to_all` (only the routed rows travel) and
              `jax.lax.ragged_dot` on a receive buffer of the worst case (every token of every
              shard routed here), bf16 only. On a CPU, where XLA has no ragged all-to-all, an
              all-to-all of padded chunks with the same offsets stands in for it (checked, not
              timed).
  ragged-a2a: xla's block with commgemm's grouped GEMM (`cg.grouped_matmul`) in place of the
              ragged dots: XLA's ragged exchange against commgemm's (`grouped.exchange`), the
              GEMMs alike (bf16 only)
With --input-grad every step also takes the gradient of the block's input (as a block inside a
model does: dX of the first GEMM and the dispatch's transpose), returned beside the loss.
With --microbatches N every variant's step accumulates gradients over N micro-batches of the
tokens (`accumulated`: a `lax.scan` of forward and backward, float32 sums, one AdamW update).
Before timing, every variant's first loss is checked against xla's (rtol 5e-2 bf16, 1e-1 FP8);
a variant that fails to compile or run is reported with its error and left out of the timing.
A step under 90% busy is host-bound: no ratio is given from it.

    PYTHONPATH=. python benchmarks/moe_step.py --out DIR [--sizes mixtral,fine] \
        [--dtypes bf16,fp8] [--microbatches 4] [--input-grad]
    PYTHONPATH=. python benchmarks/moe_step.py --out DIR --quick     # tiny shapes, any backend
    PYTHONPATH=. python -m commgemm launch -n 4 --gpus-per-process 1 -- \
        python benchmarks/moe_step.py --out DIR

Under `commgemm launch` (one process per GPU) each process times its own GPUs and process 0
writes the results; on GPUs the xla and ragged-a2a variants are left out there (reported in
the row's errors: XLA's ragged all-to-all does not run across processes).

Writes DIR/moe_step.json and prints a line per row.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

# step's import sets the devices up and joins the run
from step import BUSY, arguments, first_losses, profiles, shard

import commgemm as cg
from commgemm.bench import spans
from commgemm.cli.specs import parse_method
from commgemm.nnx import moe_per_shard, top_k_routing

FP8 = "current_tensor_scaling"
FAST = "-fast"  # a variant's suffix: FP8 rows with fast accumulation everywhere
FAST_RECIPE = cg.ScalingRecipe(FP8, split_accumulator=(False, False, False))
#: XLA's ragged all-to-all with commgemm's grouped GEMMs: what the exchange alone costs
RAGGED = "ragged-a2a"
QW = "+qw"  # a variant's suffix: its experts quantized once a step (FP8 rows)
#: Why the XLA ragged all-to-all variants are left out with one process per GPU: jax 0.11.2's
#: XLA refuses the exchange across processes (it would fall back to NCCL send/recv); with
#: xla_gpu_allow_ragged_all_to_all_nccl_send_recv_fallback set, a two-process run of auto and
#: xla finished no row in 320 s where auto alone took under a minute (2 x H200).
RAGGED_ACROSS_PROCESSES = (
    "XLA's ragged all-to-all across processes: refused (NCCL send/recv fallback) or stalled"
)


def leave_out_ragged(found: dict, row: dict, processes: int, backend: str) -> None:
    """With several processes on GPUs, drop the variants on XLA's ragged all-to-all (xla,
    ragged-a2a) from `found` before any process runs them, each reported in row["errors"]."""
    if processes > 1 and backend == "gpu":
        for name in sorted({"xla", RAGGED} & set(found)):
            row.setdefault("errors", {})[name] = RAGGED_ACROSS_PROCESSES
            del found[name]


@dataclasses.dataclass(frozen=True)
class Moe:
    hidden: int
    ffn: int  # per expert
    experts: int
    top_k: int
    tokens: int  # per step, all devices


SIZES = {
    "mixtral": Moe(4096, 14336, 8, 2, 16384),  # Mixtral-8x7B-like
    "fine": Moe(2048, 1408, 64, 6, 16384),  # DeepSeek-V2-Lite-like: many small experts
}
QUICK = Moe(64, 128, 8, 2, 256)


def emulated_ragged_all_to_all(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name
):
    """`jax.lax.ragged_all_to_all`'s result from an all-to-all of chunks padded to operand's
    rows (for backends without it): chunk j (rows input_offsets[j] + [0, send_sizes[j])) lands
    in device j's output at output_offsets[j]."""
    del recv_sizes  # implied by the senders' sizes, as in the real collective
    rows = operand.shape[0]
    idx = jnp.arange(rows)
    take = jnp.clip(input_offsets[:, None] + idx, 0, rows - 1)  # [P, rows]
    chunks = operand[take]
    a2a = functools.partial(
        jax.lax.all_to_all, axis_name=axis_name, split_axis=0, concat_axis=0, tiled=True
    )
    got, counts, offsets = a2a(chunks), a2a(send_sizes), a2a(output_offsets)
    where = jnp.where(idx < counts[:, None], offsets[:, None] + idx, output.shape[0])
    return output.at[where.reshape(-1)].set(got.reshape(-1, operand.shape[1]), mode="drop")


def xla_moe_per_shard(x, router, w1, w2, *, k: int, axis_name: str, dot=jax.lax.ragged_dot):
    """The block on one shard's tokens x [m, H] with its experts w1 [e, H, F], w2 [e, F, H],
    in XLA's ops: ragged all-to-all there and back, `dot` (x [M, K], w [e, K, N], sizes [e]:
    XLA's ragged dot, or commgemm's grouped GEMM) on the received rows grouped by expert."""
    ragged = jax.lax.ragged_all_to_all
    if jax.default_backend() == "cpu":
        ragged = emulated_ragged_all_to_all
    size, e, (m, h) = jax.lax.axis_size(axis_name), w1.shape[0], x.shape
    me = jax.lax.axis_index(axis_name)
    expert, gate, token = top_k_routing(x @ router.astype(x.dtype), k)
    order = jnp.argsort(expert, stable=True)
    counts = jnp.bincount(expert, length=size * e).astype(jnp.int32)  # [E]
    every = jax.lax.all_gather(counts, axis_name)  # [src, E]
    per_pair = every.reshape(size, size, e).sum(-1)  # [src, dst] rows
    exclusive = lambda a, axis: jnp.cumsum(a, axis) - a  # noqa: E731
    send = per_pair[me]
    recv = per_pair[:, me]
    cap = m * k * size  # every token of every shard routed here
    got = ragged(
        x[token[order]],
        jnp.zeros((cap, h), x.dtype),
        exclusive(send, 0),
        send,
        exclusive(per_pair, 0)[me],
        recv,
        axis_name=axis_name,
    )
    # received rows come by source, each source's by expert: regroup them by expert
    mine = jax.lax.dynamic_slice_in_dim(every, me * e, e, axis=1)  # [src, e]
    segment = jnp.searchsorted(jnp.cumsum(mine.reshape(-1)), jnp.arange(cap), side="right")
    key = jnp.where(segment < size * e, (segment % e) * size + segment // e, size * e)
    perm = jnp.argsort(key, stable=True)
    sizes = mine.sum(0)
    y = jax.nn.gelu(dot(got[perm], w1, sizes), approximate=False)
    y = dot(y, w2, sizes)
    back = jnp.zeros_like(y).at[perm].set(y)
    out = ragged(
        back,
        jnp.zeros((m * k, h), x.dtype),
        exclusive(recv, 0),
        recv,
        exclusive(per_pair, 1)[:, me],
        send,
        axis_name=axis_name,
    )
    weighted = out * gate[order][:, None].astype(out.dtype)
    return jnp.zeros_like(x).at[token[order]].add(weighted.astype(x.dtype))


def init(size: Moe, dtype, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)

    def w(*shape):
        return jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[-2]), dtype)

    return {
        "router": w(size.hidden, size.experts),
        "w1": w(size.experts, size.hidden, size.ffn),
        "w2": w(size.experts, size.ffn, size.hidden),
    }


SPECS = {"router": P(), "w1": P("tp"), "w2": P("tp")}


def accumulated(loss_fn):
    """value_and_grad of loss_fn(params, batch) over a stack of micro-batches [N, ...]: a
    `lax.scan` whose body takes one micro-batch's loss and gradients (so only one micro-batch's
    residuals live at a time) and adds them to sums of float32 or wider; their means, the
    gradients in the parameters' dtypes."""

    def run(params, batches):
        def wide(dtype):  # float32, or float64 for float64 (float8 leaves: float32)
            return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32

        def body(sums, batch):
            loss, grads = jax.value_and_grad(loss_fn)(params, batch)
            return jax.tree.map(lambda s, x: s + x.astype(s.dtype), sums, (loss, grads)), None

        first = jax.eval_shape(loss_fn, params, batches[0])
        zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, wide(x.dtype)), (first, params))
        loss, grads = jax.lax.scan(body, zeros, batches)[0]
        n = batches.shape[0]
        return loss / n, jax.tree.map(lambda g, p: (g / n).astype(p.dtype), grads, params)

    return run


def variants(size: Moe, mesh: Mesh, dtype, scaling, names, microbatches: int = 1,
             input_grad: bool = False) -> dict:  # fmt: skip
    """{name: (step fn, args)}: jit(loss, grad, AdamW) of each variant's block, its gradients
    accumulated over `microbatches` batches of the tokens where more than one (`accumulated`);
    with `input_grad` (one batch) the step also returns the gradient of the block's input."""
    if microbatches < 1:
        raise ValueError(f"microbatches={microbatches} must be 1 or more")
    if input_grad and microbatches > 1:
        raise ValueError("input_grad takes one batch a step, not micro-batches")
    opt = optax.adamw(1e-4)
    rng = np.random.default_rng(1)
    batches = (microbatches,) if microbatches > 1 else ()
    x = jnp.asarray(rng.standard_normal((*batches, size.tokens, size.hidden)), dtype)
    params = {k: shard(v, mesh, SPECS[k]) for k, v in init(size, dtype).items()}
    x = shard(x, mesh, P(*(None,) * len(batches), "tp", None))
    out = {}
    for label in names:
        name, once = label.removesuffix(QW), label.endswith(QW)
        name, fast = name.removesuffix(FAST), name.endswith(FAST)
        if fast and scaling is None:
            continue  # an FP8 recipe's variant
        recipe = FAST_RECIPE if fast else scaling
        if once and name in ("xla", RAGGED):
            raise ValueError(f"{name + QW}: the {name} block runs in bf16, nothing to quantize")
        if once and scaling is None:
            continue  # nothing to quantize in bf16
        if name in ("xla", RAGGED) and scaling is not None:
            continue  # the ragged all-to-all forms run in bf16
        if name in ("xla", RAGGED):
            dot = cg.grouped_matmul if name == RAGGED else jax.lax.ragged_dot
            block = functools.partial(xla_moe_per_shard, k=size.top_k, axis_name="tp", dot=dot)
        else:
            method, _, factor = name.partition("@")
            block = functools.partial(
                moe_per_shard,
                k=size.top_k,
                axis_name="tp",
                config=parse_method(method),
                scaling=recipe,
                capacity_factor=float(factor) if factor else None,
            )
        quantized = functools.partial(quantized_experts, scaling=recipe if once else None)
        shapes = jax.eval_shape(quantized, params)  # experts split, their scales everywhere
        specs = jax.tree.map(lambda a: P("tp") if a.ndim else P(), shapes) | {"router": P()}
        forward = jax.shard_map(
            lambda p, a, block=block: block(a, p["router"], p["w1"], p["w2"]),
            mesh=mesh,
            in_specs=(specs, P("tp", None)),
            out_specs=P("tp", None),
        )

        def step(p, opt_state, a, forward=forward, quantized=quantized):
            def one(q, b):
                return jnp.mean(jnp.square(forward(q, b).astype(jnp.float32)))

            q, pullback = jax.vjp(quantized, p)  # the experts quantized once a step (+qw)
            if input_grad:
                loss, (grads, dx) = jax.value_and_grad(one, (0, 1))(q, a)
            else:
                loss, grads = (accumulated if batches else jax.value_and_grad)(one)(q, a)
            (grads,) = pullback(grads)
            updates, opt_state = opt.update(grads, opt_state, p)
            if input_grad:
                return optax.apply_updates(p, updates), opt_state, loss, dx
            return optax.apply_updates(p, updates), opt_state, loss

        out[label] = (jax.jit(step), (params, opt.init(params), x))
    return out


def quantized_experts(params: dict, scaling) -> dict:
    """params with the experts quantized once by `scaling` (`cg.quantize_weight`, both float8
    layouts kept; the gradient flows to the weights), or as they are where scaling is None."""
    if scaling is None:
        return params
    once = functools.partial(cg.quantize_weight, scaling=scaling, keep_transposed=True)
    return {**params, "w1": once(params["w1"]), "w2": once(params["w2"])}


def run(
    size_name: str,
    size: Moe,
    dtype_name: str,
    names: list[str],
    calls: int,
    reference: dict,
    profile: bool = False,
    microbatches: int = 1,
    input_grad: bool = False,
) -> dict:
    """One row: first losses checked against xla's bf16 loss (`reference`, per size), then
    device time per step where the backend is a GPU."""
    mesh = Mesh(np.array(jax.devices()), ("tp",))
    scaling = FP8 if dtype_name == "fp8" else None
    found = variants(size, mesh, jnp.bfloat16, scaling, names, microbatches, input_grad)
    row = {
        "size": size_name,
        "dtype": dtype_name,
        "devices": mesh.devices.size,
        "shape": dataclasses.asdict(size),
        "microbatches": microbatches,
        "input_grad": input_grad,
        "loss": {},
        "ms": {},
        "busy": {},
        "rounds": {},
    }
    leave_out_ragged(found, row, jax.process_count(), jax.default_backend())
    first_losses(found, row)
    if "xla" in row["loss"]:
        reference[size_name] = row["loss"]["xla"]
    if size_name in reference:
        tol, ref = (1e-1 if scaling else 5e-2), reference[size_name]
        exact = [n for n in row["loss"] if "@" not in n]
        row["loss_ok"] = {n: abs(row["loss"][n] - ref) <= tol * abs(ref) for n in exact}
    if jax.default_backend() != "gpu":
        return row
    for name, t in spans.batch_spans_interleaved(found, calls=calls).items():
        row["ms"][name] = round(t["median"], 4)
        row["rounds"][name] = [round(r, 4) for r in t["rounds"]]
        row["busy"][name] = round(t["busy"], 3)
    if profile:
        row["profile"] = profiles(found, calls)
    return row


def ratios(row: dict) -> dict:
    """AUTO's speedup over serial, xla and ragged-a2a, where both steps are device-bound."""
    ms, busy = row["ms"], row["busy"]
    if "auto" not in ms or busy["auto"] < BUSY:
        return {}
    return {
        f"auto_vs_{n}": round(ms[n] / ms["auto"], 3) if busy[n] >= BUSY else "host-bound"
        for n in ("none", "xla", RAGGED)
        if n in ms
    }


def main() -> None:
    args = arguments(__doc__, "mixtral,fine", "auto,none,auto@1.25,xla,ragged-a2a",
                     microbatches=True, input_grad=True)  # fmt: skip
    writer = jax.process_index() == 0
    if writer:
        args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "devices": jax.device_count(),
        "processes": jax.process_count(),
        "backend": jax.default_backend(),
        "kind": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "rows": [],
    }
    path, reference = args.out / "moe_step.json", {}
    for size_name in args.sizes.split(","):
        size = QUICK if args.quick else SIZES[size_name]
        for dtype_name in args.dtypes.split(","):
            row = run(size_name, size, dtype_name, args.variants.split(","), args.calls,
                      reference, args.profile, args.microbatches, args.input_grad)  # fmt: skip
            row["ratios"] = ratios(row)
            result["rows"].append(row)
            if not writer:
                continue
            path.write_text(json.dumps(result, indent=1))  # a run cut short keeps its rows
            print(
                json.dumps({k: row[k] for k in ("size", "dtype", "loss", "ms", "busy", "ratios")}),
                flush=True,
            )


if __name__ == "__main__":
    main()
