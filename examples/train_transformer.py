"""Train a small decoder-only transformer with commgemm's tensor-parallel Flax NNX layers.

Embedding, N blocks (attention and MLP, each pre-norm with a residual), a final norm and the
vocabulary head, trained with optax (AdamW) on synthetic token sequences that follow a rule
(each token is the previous one plus a per-sequence stride, mod the vocabulary), so the loss
falls. Activations are sequence-parallel over the tensor axis and every GEMM is overlapped by
`--method`. An unsharded twin (the same parameters on one device) takes the same steps, and its
losses are printed beside ours. A sharded checkpoint is saved and restored (orbax), and its
values and shardings checked. `--scaling` runs the blocks' GEMMs in float8 (current or delayed
scaling; delayed scaling's dY states come back as gradients, `train_step`). Needs
`pip install commgemm[flax]`.

    python examples/train_transformer.py                       # 8 virtual CPU devices, or all GPUs
                                                               # (--size gpu there: 8B-like blocks)
    python examples/train_transformer.py --method pipeline --steps 40
    python examples/train_transformer.py --scaling delayed
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import tempfile
import time

from commgemm.devices import setup_devices

setup_devices()  # before jax starts: 8 virtual CPU devices where there is no accelerator

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import commgemm as cg  # noqa: E402
from commgemm import nnx as cgnnx  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Shape:
    vocab: int = 256
    hidden: int = 128
    heads: int = 8
    ffn: int = 512
    layers: int = 2
    batch: int = 8
    seq: int = 64
    dtype: str | None = None  # compute dtype (e.g. "bfloat16"); None: the float32 parameters'


#: --size: "cpu" is small enough for 8 virtual CPU devices; "gpu" has Llama-3-8B-like blocks
#: (16384 tokens a step), large enough that a GPU's step is its kernels, not Python's dispatch.
SIZES = {
    "cpu": Shape(),
    "gpu": Shape(vocab=32768, hidden=4096, heads=32, ffn=14336, batch=8, seq=2048,
                 dtype="bfloat16"),
}  # fmt: skip


def size_for(backend: str) -> str:
    """The default --size on `backend`: "gpu" on GPUs, "cpu" elsewhere."""
    return "gpu" if backend == "gpu" else "cpu"


class Block(nnx.Module):
    def __init__(self, shape: Shape, *, rngs: nnx.Rngs, **kw):
        self.norm = nnx.LayerNorm(shape.hidden, rngs=rngs, dtype=shape.dtype)
        self.attention = cgnnx.ParallelAttentionProjections(
            shape.hidden, shape.heads, rngs=rngs, **kw
        )
        self.mlp = cgnnx.ParallelMLP(shape.hidden, shape.ffn, rngs=rngs, **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attention(self.norm(x))
        return x + self.mlp(x)


class Decoder(nnx.Module):
    """tokens [B, S] -> logits [B, S, vocab] (vocabulary sharded over the tensor axis); the
    blocks' GEMMs quantized by `scaling` (the head's stay unquantized)."""

    def __init__(self, shape: Shape, *, mesh, config, rngs: nnx.Rngs, scaling=None):
        kw = dict(mesh=mesh, axis_name="tp", data_axis="data", config=config, dtype=shape.dtype)
        self.embed = nnx.Embed(shape.vocab, shape.hidden, rngs=rngs, dtype=shape.dtype)
        self.blocks = nnx.List([Block(shape, rngs=rngs, scaling=scaling, **kw)
                                for _ in range(shape.layers)])  # fmt: skip
        self.norm = nnx.LayerNorm(shape.hidden, rngs=rngs, dtype=shape.dtype)
        self.head = cgnnx.ColumnParallelLinear(shape.hidden, shape.vocab, rngs=rngs,
                                               use_bias=False, **kw)  # fmt: skip
        self.sequence_parallel = NamedSharding(mesh, P("data", "tp", None))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = jax.lax.with_sharding_constraint(self.embed(tokens), self.sequence_parallel)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def batches(shape: Shape, seed: int = 0):
    """Endless [B, S + 1] int32 token sequences: a random start and stride per sequence."""
    rng = np.random.default_rng(seed)
    positions = np.arange(shape.seq + 1)
    while True:
        start = rng.integers(0, shape.vocab, (shape.batch, 1))
        stride = rng.integers(1, 8, (shape.batch, 1))
        yield ((start + stride * positions) % shape.vocab).astype(np.int32)


def loss_fn(model: Decoder, tokens: jax.Array) -> jax.Array:
    logits = model(tokens[:, :-1]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


@nnx.jit
def train_step(model: Decoder, optimizer: nnx.Optimizer, tokens: jax.Array) -> jax.Array:
    # delayed scaling's dY states come back as their gradients: written into the model, the
    # parameters' gradients to the optimizer (no Float8GradState without them: a no-op)
    wrt = nnx.DiffState(0, (nnx.Param, cgnnx.Float8GradState))
    loss, grads = nnx.value_and_grad(loss_fn, argnums=wrt)(model, tokens)
    optimizer.update(model, cgnnx.apply_float8_grads(model, grads))
    return loss


#: --scaling: the blocks' GEMMs unquantized, in float8 scaled by the current amax, or by delayed
#: scaling's states (x's, w's and dY's, each a history of 16 amaxes).
SCALINGS = {
    "none": None,
    "current": "current_tensor_scaling",
    "delayed": cg.ScalingRecipe(
        "delayed_tensor_scaling",
        x_state=cg.ScalingState.create(),
        w_state=cg.ScalingState.create(),
        dy_state=cg.ScalingState.create(),
    ),  # fmt: skip
}


def make_mesh(devices) -> Mesh:
    """(data, tp): 2 x 4 on 8 devices, else all devices on the tensor axis."""
    n = len(devices)
    data = 2 if n == 8 else 1
    return Mesh(np.array(devices).reshape(data, n // data), ("data", "tp"))


def build(shape: Shape, mesh: Mesh, config, scaling=None) -> tuple[Decoder, nnx.Optimizer]:
    model = cgnnx.create_sharded(
        lambda: Decoder(shape, mesh=mesh, config=config, rngs=nnx.Rngs(0), scaling=scaling), mesh
    )
    optimizer = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)
    # the optimizer's scalars (its step count) made on one device would come back from the
    # first step replicated on the mesh, and the step would compile again: place them there
    on_mesh = NamedSharding(mesh, P())
    state = nnx.state(optimizer)
    nnx.update(optimizer, jax.tree.map(
        lambda a: a if isinstance(a.sharding, NamedSharding) else jax.device_put(a, on_mesh),
        state))  # fmt: skip
    return model, optimizer


def check_checkpoint(model: Decoder, shape: Shape, mesh: Mesh, config) -> None:
    """Save the sharded parameters with orbax, restore them into an abstract model carrying the
    same shardings, and compare values and shardings."""
    state = nnx.state(model, nnx.Param)
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "params"
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(path, state)
        checkpointer.wait_until_finished()
        abstract = nnx.eval_shape(lambda: Decoder(shape, mesh=mesh, config=config,
                                                  rngs=nnx.Rngs(1)))  # fmt: skip
        target = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            nnx.state(abstract, nnx.Param),
            nnx.get_named_sharding(nnx.state(abstract, nnx.Param), mesh),
        )
        restored = checkpointer.restore(path, target)
    for saved, back in zip(jax.tree.leaves(state), jax.tree.leaves(restored), strict=True):
        assert back.sharding.is_equivalent_to(saved.sharding, saved.ndim), (back, saved)
        np.testing.assert_array_equal(np.asarray(back), np.asarray(saved))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", default="auto",
                        choices=("auto", "none", "pipeline", "ring_exchange", "xla"),
                        help="overlap method: auto, none, pipeline, ring_exchange; or xla (no "
                             "commgemm: XLA's own partitioning of plain dots)")  # fmt: skip
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--size", choices=SIZES, default=None,
                        help="model and batch: cpu (small) or gpu (8B-like blocks); default: "
                             "gpu on GPUs, cpu elsewhere")  # fmt: skip
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--no-checkpoint", action="store_true",
                        help="skip the checkpoint's save and restore")  # fmt: skip
    parser.add_argument("--scaling", choices=SCALINGS, default="none",
                        help="the blocks' GEMMs in float8: current or delayed scaling")  # fmt: skip
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps={args.steps} must be >= 1")
    size = args.size or size_for(jax.default_backend())
    shape = dataclasses.replace(SIZES[size], layers=args.layers)
    config = None if args.method == "xla" else cg.OverlapConfig(method=args.method)
    mesh = make_mesh(jax.devices())
    scaling = SCALINGS[args.scaling]
    if scaling is not None and config is None:
        parser.error("--scaling needs commgemm's GEMMs, not --method xla")
    model, optimizer = build(shape, mesh, config, scaling)
    twin_mesh = make_mesh(jax.devices()[:1])
    twin, twin_optimizer = build(shape, twin_mesh, cg.OverlapConfig(), scaling)
    nnx.update(twin, jax.device_put(nnx.state(model, nnx.Param), jax.devices()[0]))
    losses, twin_losses, times = [], [], []
    data = batches(shape)
    from rich.progress import Progress, TextColumn, TimeElapsedColumn

    columns = (*Progress.get_default_columns()[:3], TextColumn("{task.fields[info]}"),
               TimeElapsedColumn())  # fmt: skip
    with Progress(*columns, disable=args.quiet) as progress:
        axes = " x ".join(f"{n} {k}" for n, k in mesh.shape.items())
        task = progress.add_task(f"{axes}, {args.method}", total=args.steps, info="")
        for _ in range(args.steps):
            tokens = next(data)
            start = time.perf_counter()
            loss = float(train_step(model, optimizer, tokens))
            times.append(time.perf_counter() - start)
            losses.append(loss)
            twin_losses.append(float(train_step(twin, twin_optimizer, tokens)))
            info = f"loss {loss:.4f} (twin {twin_losses[-1]:.4f})  step {times[-1] * 1e3:.1f} ms"
            progress.update(task, advance=1, info=info)
    if not args.no_checkpoint:
        print("saving and restoring a checkpoint (orbax; 10 to 20 s on a CPU) ...", flush=True)
        check_checkpoint(model, shape, mesh, config)
    gap = max(abs(a - b) for a, b in zip(losses, twin_losses, strict=True))
    summary = {
        "mesh": dict(mesh.shape), "size": size, "method": args.method, "scaling": args.scaling,
        "first_loss": losses[0],
        "last_loss": losses[-1], "max_gap_to_twin": gap,
        "median_step_ms": float(np.median(times[1:] or times) * 1e3),
    }  # fmt: skip
    from rich.console import Console
    from rich.table import Table

    table = Table("", "", title="train_transformer")
    for key, value in summary.items():
        table.add_row(key.replace("_", " "), f"{value:.4g}" if isinstance(value, float) else
                      str(value))  # fmt: skip
    Console().print(table)
    return summary


if __name__ == "__main__":
    main()
