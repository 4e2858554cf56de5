"""One training step of a decoder built from commgemm.nnx's layers against the same decoder in
plain Flax NNX (nnx.Linear), on one GPU: both in bf16 compute with float32 parameters, AdamW,
timed interleaved by device periods (medians of 6 rounds, host-timed steps beside them). On one
device our layers' GEMMs are local (a mesh axis of size 1), so this measures what the layers
cost beside plain Flax; and the same layers with every GEMM in float8, current tensor scaling
and delayed scaling (x's and w's scales from the layers' states, dY's current), from the same
parameters (their first losses recorded beside bf16's).
Writes OUT/layers_step.json.

    PYTHONPATH=. python benchmarks/layers_step.py --out DIR [--kernels]
"""

from __future__ import annotations

import argparse
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

import commgemm as cg
from commgemm import nnx as cgnnx
from commgemm.bench import kernels
from commgemm.bench.spans import device_periods_interleaved

VOCAB, HIDDEN, HEADS, FFN, LAYERS, BATCH, SEQ = 8192, 2048, 16, 8192, 4, 4, 2048
BF16 = jnp.bfloat16
FP8 = "current_tensor_scaling"
DELAYED = "delayed_tensor_scaling"


class OursBlock(nnx.Module):
    def __init__(self, mesh, rngs, scaling=None):
        kw = dict(mesh=mesh, axis_name="tp", config=cg.OverlapConfig(), dtype=BF16,
                  scaling=scaling)  # fmt: skip
        self.norm = nnx.LayerNorm(HIDDEN, rngs=rngs, dtype=BF16)
        self.attention = cgnnx.ParallelAttentionProjections(HIDDEN, HEADS, rngs=rngs, **kw)
        self.mlp = cgnnx.ParallelMLP(HIDDEN, FFN, rngs=rngs, **kw)

    def __call__(self, x):
        x = x + self.attention(self.norm(x))
        return x + self.mlp(x)


class PlainBlock(nnx.Module):
    def __init__(self, rngs):
        self.norm = nnx.LayerNorm(HIDDEN, rngs=rngs, dtype=BF16)
        self.qkv = nnx.Linear(HIDDEN, 3 * HIDDEN, rngs=rngs, dtype=BF16)
        self.proj = nnx.Linear(HIDDEN, HIDDEN, rngs=rngs, dtype=BF16)
        self.mlp_norm = nnx.LayerNorm(HIDDEN, rngs=rngs, dtype=BF16)
        self.up = nnx.Linear(HIDDEN, FFN, rngs=rngs, dtype=BF16)
        self.down = nnx.Linear(FFN, HIDDEN, rngs=rngs, dtype=BF16)

    def __call__(self, x):
        b, s, h = x.shape
        qkv = self.qkv(self.norm(x)).reshape(b, s, HEADS, 3, h // HEADS)
        att = cgnnx.causal_attention(qkv[:, :, :, 0], qkv[:, :, :, 1], qkv[:, :, :, 2])
        x = x + self.proj(att.reshape(b, s, h))
        return x + self.down(jax.nn.gelu(self.up(self.mlp_norm(x)), approximate=False))


class Decoder(nnx.Module):
    def __init__(self, blocks, rngs):
        self.embed = nnx.Embed(VOCAB, HIDDEN, rngs=rngs, dtype=BF16)
        self.blocks = nnx.List(blocks)
        self.norm = nnx.LayerNorm(HIDDEN, rngs=rngs, dtype=BF16)
        self.head = nnx.Linear(HIDDEN, VOCAB, use_bias=False, rngs=rngs, dtype=BF16)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def loss_fn(model, tokens):
    logits = model(tokens[:, :-1]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


@nnx.jit
def train_step(model, optimizer, tokens):
    loss, grads = nnx.value_and_grad(loss_fn)(model, tokens)
    optimizer.update(model, grads)
    return loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--kernels", action="store_true", help="kernel time by kind (a trace)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    mesh = Mesh(np.array(jax.devices()[:1]), ("tp",))
    rngs = nnx.Rngs(0)
    ours = Decoder([OursBlock(mesh, rngs) for _ in range(LAYERS)], rngs)
    plain = Decoder([PlainBlock(rngs) for _ in range(LAYERS)], rngs)
    rngs = nnx.Rngs(0)  # the same parameters as `ours`, every GEMM in float8
    fp8 = Decoder([OursBlock(mesh, rngs, FP8) for _ in range(LAYERS)], rngs)
    rngs = nnx.Rngs(0)
    delayed = Decoder([OursBlock(mesh, rngs, DELAYED) for _ in range(LAYERS)], rngs)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (BATCH, SEQ + 1)), jnp.int32)
    first_loss = {
        name: float(nnx.jit(loss_fn)(m, tokens))
        for name, m in (("bf16", ours), ("fp8", fp8), ("fp8 delayed", delayed))
    }
    variants = {}
    for name, model in (("commgemm.nnx", ours), ("plain flax", plain),
                        ("commgemm.nnx fp8", fp8),
                        ("commgemm.nnx fp8 delayed", delayed)):  # fmt: skip
        optimizer = nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.Param)
        variants[name] = (train_step, (model, optimizer, tokens))
    # 50 ms between batches: a step's host work may outlast its GPU work, and the periods'
    # batches must stay apart (spans.batches_from_trace); host-timed steps beside them
    from layers_profile import wall_periods

    found = device_periods_interleaved(variants, rounds=6, calls=4, gap_s=0.05)
    wall = wall_periods(variants)
    periods = {name: f.get("median") for name, f in found.items()}
    ms = periods if None not in periods.values() else wall
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "shape": dict(vocab=VOCAB, hidden=HIDDEN, heads=HEADS, ffn=FFN, layers=LAYERS,
                            batch=BATCH, seq=SEQ),
              "timing": "device periods" if ms is periods else "host (the periods failed)",
              "ms": ms, "device_periods_ms": periods, "wall_ms": wall,
              "ours_vs_plain": ms["commgemm.nnx"] / ms["plain flax"],
              "fp8_vs_bf16": ms["commgemm.nnx fp8"] / ms["commgemm.nnx"],
              "fp8_delayed_vs_bf16": ms["commgemm.nnx fp8 delayed"] / ms["commgemm.nnx"],
              "first_loss": first_loss,
              "errors": {n: f["error"] for n, f in found.items() if "error" in f}}  # fmt: skip
    if args.kernels:
        result["kernels"] = {name: kernels.profile(*v) for name, v in variants.items()}
    print(json.dumps(result), flush=True)
    (args.out / "layers_step.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
