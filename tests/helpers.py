"""Meshes, shard_map wrappers, float64 references and tolerances shared by the tests."""

from __future__ import annotations

import functools
import importlib.util
import os
import pathlib
import sys

import jax
import ml_dtypes
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import commgemm as cg

#: (rtol, atol per sqrt(K)) against a float64 reference of the same (rounded) inputs.
#: float32: accumulation error grows ~ eps * sqrt(K). bfloat16: the output (and, for RS/AR, the
#: partial sums on the wire) are rounded to 8 bits of mantissa.
TOLERANCES = {np.float32: (1e-5, 1e-5), ml_dtypes.bfloat16: (2e-2, 2e-2)}


def dequantized(a, mode, axis: int = -1, dtype=None) -> np.ndarray:
    """a quantized whole in `mode` (blocks along `axis`; float8 `dtype` where given) and back,
    float64, in one jitted program (eagerly each op compiles on its own)."""
    return np.asarray(_dequantized(jax.numpy.asarray(a), mode, axis, dtype))


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _dequantized(a, mode, axis, dtype):
    kw = {} if dtype is None else {"dtype": dtype}
    return cg.dequantize(cg.quantize(a, mode, axis=axis, **kw), np.float64)


def mesh1d(size: int, name: str = "x") -> Mesh:
    return Mesh(np.array(jax.devices()[:size]), (name,))


def mesh2d(rows: int, cols: int) -> Mesh:
    return Mesh(np.array(jax.devices()[: rows * cols]).reshape(rows, cols), ("x", "y"))


def shard(fn, mesh: Mesh, in_specs, out_specs, check_vma: bool = True):
    return jax.jit(
        jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma)
    )


def ragged_layouts(sizes: np.ndarray, rows: int, most: int):
    """Layouts of a ragged all-to-all (`commgemm.grouped.exchange`) from sizes [src, dst], the
    rows each device has for each device (each source's sum at most `rows`): per device its
    send bounds [P + 1] (regions of those sizes tiling `rows`), send counts (capped at `most`),
    receive bounds (regions of `most` rows) and receive counts."""
    size = sizes.shape[0]
    counts = np.minimum(sizes, most).astype(np.int32)
    send = np.zeros((size, size + 1), np.int32)
    send[:, 1:size] = np.cumsum(sizes, 1)[:, :-1]
    send[:, size] = rows
    recv = np.tile(np.arange(size + 1, dtype=np.int32) * most, (size, 1))
    return send, counts, recv, counts.T.copy()


def region_index(peer: int, group: int, size: int, groups: int, by_group: bool) -> int:
    """The region of (peer, group) in a `grouped.exchange.Layout` of size x groups regions."""
    return group * size + peer if by_group else peer * groups + group


def grouped_layouts(rng: np.random.Generator, size: int, groups: int, most: int, orders):
    """Random layouts of a grouped ragged all-to-all: counts [src, dst, group] (each source's
    per peer summing to at most `most`), regions of those counts plus 0 or 1 rows of slack in
    the orders (send by_group, recv by_group) tiling `size * (most + groups)` rows on both
    sides: (counts, send bounds [P, R + 1], send counts [P, R], recv bounds, recv counts)."""
    rows, regions = size * (most + groups), size * groups
    totals = rng.integers(0, most + 1, size=(size, size))
    counts = np.stack([rng.multinomial(t, np.full(groups, 1 / groups)) for t in totals.flat])
    counts = counts.reshape(size, size, groups).astype(np.int32)
    sides = []
    for by_group, pairs in zip(orders, ("send", "recv"), strict=True):
        sizes, live = np.zeros((size, regions), np.int32), np.zeros((size, regions), np.int32)
        for me in range(size):
            for other in range(size):
                for j in range(groups):
                    c = counts[me, other, j] if pairs == "send" else counts[other, me, j]
                    r = region_index(other, j, size, groups, by_group)
                    live[me, r], sizes[me, r] = c, c + rng.integers(0, 2)
        bounds = np.zeros((size, regions + 1), np.int32)
        bounds[:, 1:regions] = np.cumsum(sizes, axis=1)[:, :-1]
        bounds[:, regions] = rows
        sides += [bounds, live]
    return counts, *sides


def returned_layouts(rng, size: int, groups: int, most: int, drop: bool):
    """Random counts [src, dst, group] and per device: the experts' side (regions (group,
    source) packed from row 0, group-major, over size * most rows), the tokens' side
    (regions (peer, group) peer-major with up to 3 rows of slack each where `drop`: rows no
    one returns, tiling `out_rows`), as int32 arrays [P, ...], and out_rows."""
    totals = rng.integers(0, most + 1, size=(size, size))
    totals[0, 1] = 0  # an empty pair
    counts = np.stack([rng.multinomial(t, rng.dirichlet(np.ones(groups))) for t in totals.flat])
    counts = counts.reshape(size, size, groups).astype(np.int32)
    regions = size * groups
    eb, ec = np.zeros((size, regions + 1), np.int32), np.zeros((size, regions), np.int32)
    for d in range(size):  # the experts' device
        ec[d] = counts[:, d, :].T.reshape(-1)  # region g * P + s
        eb[d, 1:] = np.cumsum(ec[d])
        eb[d, regions] = size * most
    slack = rng.integers(0, 4 if drop else 1, size=(size, regions)).astype(np.int32)
    tc = counts.reshape(size, regions)  # region d * groups + g on owner s
    out_rows = int((tc + slack).sum(axis=1).max()) + 5
    tb = np.zeros((size, regions + 1), np.int32)
    tb[:, 1:] = np.cumsum(tc + slack, axis=1)
    tb[:, regions] = out_rows
    return counts, (eb, ec, tb, tc), out_rows


def random(rng: np.random.Generator, shape, dtype=np.float32) -> np.ndarray:
    return rng.standard_normal(shape).astype(dtype)


def reference(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """float64 x @ w over the last axis of x."""
    return np.asarray(x, np.float64) @ np.asarray(w, np.float64)


def assert_close(out, ref: np.ndarray, dtype, k: int) -> None:
    rtol, atol = TOLERANCES[dtype]
    out = np.asarray(out, np.float64)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, rtol=rtol, atol=atol * np.sqrt(k))


def configs(collective: cg.Collective):
    """Every method x bidirectional x num_splits in {1, 2, 4} the collective supports."""
    yield cg.OverlapConfig(method=cg.Method.NONE)
    for s in (1, 2, 4):
        yield cg.OverlapConfig(method=cg.Method.PIPELINE, num_splits=s)
        for bidi in (False, True):
            yield cg.OverlapConfig(method=cg.Method.RING_EXCHANGE, num_splits=s, bidirectional=bidi)
        if collective is cg.Collective.ALL_GATHER:
            yield cg.OverlapConfig(method=cg.Method.RING_EXCHANGE, num_splits=s, aggregate=True)


def config_id(cfg: cg.OverlapConfig) -> str:
    extra = ("-bidi" if cfg.bidirectional else "") + ("-agg" if cfg.aggregate else "")
    return f"{cfg.method.name}-s{cfg.num_splits}{extra}"


__all__ = ["P"]


def fake_periods(rng):
    """A stand-in for `device_periods_interleaved` on a CPU: every variant's rounds drawn at
    random around its own level."""

    def fake(variants, rounds):
        out = {}
        for name in variants:
            level = rng.uniform(0.5, 2.0)
            found = [level * rng.uniform(0.9, 1.1) for _ in range(rounds)]
            out[name] = {"median": float(np.median(found)), "rounds": found}
        fake.found = out
        return out

    return fake


def spreads_of(found: dict) -> dict[str, float]:
    """{name: (largest - smallest) / median} of each variant's rounds in a `fake_periods`
    result: the reference for `overlap.round_spread`."""
    return {n: (max(f["rounds"]) - min(f["rounds"])) / float(np.median(f["rounds"]))
            for n, f in found.items()}  # fmt: skip


ROOT = pathlib.Path(__file__).parent.parent


def cpu_env(devices: int | None = None) -> dict[str, str]:
    """The environment for a test's child process on the CPU: this process's, with its XLA_FLAGS
    (conftest's unoptimized CPU code, which the child compiles in half the time) and, where
    given, `devices` virtual devices (a flag the child's jax reads at start)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if devices is not None:
        flags += f" --xla_force_host_platform_device_count={devices}"
    return os.environ | {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags.strip()}


def load_script(relative: str, name: str):
    """The repository's script at `relative` (benchmarks/..., examples/...) as module `name`,
    registered in sys.modules (its dataclasses look their module up there), with its folder
    on sys.path (benchmarks import each other)."""
    path = ROOT / relative
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def balance_reference(logits: np.ndarray, k: int) -> float:
    """Switch Transformer's load-balancing loss in float64 numpy: E * sum_e f_e * p_e."""
    logits = np.asarray(logits, np.float64).reshape(-1, logits.shape[-1])
    tokens, experts = logits.shape
    chosen = np.argsort(-logits, axis=1, kind="stable")[:, :k]
    f = np.bincount(chosen.ravel(), minlength=experts) / (tokens * k)
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    return experts * float(np.sum(f * p.mean(axis=0)))


def moe_block_step(activation, scaling, capacity_factor=None):
    """(step, args): jit(value_and_grad) of the mean square of the MoE block (`moe_per_shard`,
    AUTO, 4 experts a device over every device, top 2, 512 tokens a device, H 256, F 512,
    `capacity_factor`) in x, w1, w2 (fresh random bf16), the router fixed;
    `step(*args, scaling=...)` overrides the block's scaling."""
    import jax.numpy as jnp

    from commgemm.nnx import moe_per_shard

    size, tokens, hidden, ffn, k = jax.device_count(), 512, 256, 512, 2
    experts = 4 * size
    keys = jax.random.split(jax.random.key(np.random.default_rng().integers(1 << 30)), 4)
    x = jax.random.normal(keys[0], (tokens * size, hidden), jnp.bfloat16)
    router = jax.random.normal(keys[1], (hidden, experts), jnp.float32)
    w1 = (jax.random.normal(keys[2], (experts, hidden, ffn)) / hidden**0.5).astype(jnp.bfloat16)
    w2 = (jax.random.normal(keys[3], (experts, ffn, hidden)) / ffn**0.5).astype(jnp.bfloat16)
    mesh = Mesh(np.array(jax.devices()), ("tp",))

    def loss(x, w1, w2, scaling=scaling):
        block = lambda a, b, c: moe_per_shard(a, router, b, c, k=k, axis_name="tp", config=None,  # noqa: E731
                                              scaling=scaling, activation=activation,
                                              capacity_factor=capacity_factor)  # fmt: skip
        out = jax.shard_map(block, mesh=mesh, in_specs=(P("tp"),) * 3, out_specs=P("tp"))
        return jnp.mean(jnp.square(out(x, w1, w2).astype(jnp.float32)))

    def step(*args, **kw):
        return jax.jit(jax.value_and_grad(functools.partial(loss, **kw), (0, 1, 2)))(*args)

    return step, (x, w1, w2)


def garbage_freed(nbytes: int) -> None:
    """Fills and frees `nbytes` of NaNs on every device, so that buffers allocated next are
    likely to start out as NaNs (a kernel's unwritten rows then show it if anyone reads them)."""
    import jax.numpy as jnp

    for device in jax.devices():
        filled = jnp.full((nbytes // 2,), jnp.nan, jnp.bfloat16, device=device)
        jax.block_until_ready(filled).delete()
