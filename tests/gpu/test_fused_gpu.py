"""The fused kernels and the XLA methods on Hopper GPUs: outputs and gradients against a
float32 reference (HIGHEST precision) on fresh random data, back-to-back calls, plan errors.

bf16 outputs: |error| <= REL * max|reference| (8 mantissa bits; RS partial sums also rounded).
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import commgemm as cg
from commgemm.cli.specs import parse_method
from commgemm.config import Collective
from commgemm.mosaic_gpu import fused

REL = 1.5e-2
#: (M, K, N) global shapes; the fused kernels need M/P % 128, N/P % 256, K/P % 64.
SHAPES = {"small": (1024, 512, 768), "big": (8192, 4096, 14336)}


def _shape(name: str, size: int | None = None) -> tuple[int, int, int]:
    """SHAPES[name] on `size` devices (default all): "small" grows with P (the same shard on
    every device count: 2048 x 1024 x 1536 on 2), "big" is the same problem on every count."""
    size = size or jax.device_count()
    return tuple(d * size for d in SHAPES["small"]) if name == "small" else SHAPES["big"]


SPECS = {
    "ag": [
        "fused",
        "fused-gm",
        "fused-direct",
        "fused-direct-gm",
        "fused-direct-cm-r50",
        "fused-direct-pp-gm-cm",  # the ping-pong kernel; "big": a partial last tile column
        "fused-direct-pp-gm-cm-nt",  # "big": its last wave (28 of 66 clusters) run as halves
    ],
    "rs": [
        "fused",
        "fused-wgm-cm-m64-n256",  # the ring in the direct plan's tiling: 2-CTA clusters
        "fused-direct",
        "fused-direct-cm-ct",
        "fused-direct-wgm-cm-ct-m64-n256-k128-s2-t0-a2",
        "fused-direct-wgm-cm-ct-m64-n256-sk-a2",  # "big": the last 10 tiles streamed
        "fused-direct-pp-gm-cm",  # the ping-pong kernel; "big": a partial last tile column
        "fused-direct-pp-gm-cm-nt",  # the RS plan on 2 GPUs; "big": 24 of 66 clusters halved
    ],
}


def _mesh(n: int | None = None) -> Mesh:
    devices = jax.devices()[: n or jax.device_count()]
    return Mesh(np.array(devices), ("x",))


def _sharded(op: str, mesh: Mesh, cfg, w_transposed: bool = False):
    if op == "ag":
        specs = (P("x", None), P("x", None) if w_transposed else P(None, "x"))
        out, fn = P(None, "x"), cg.all_gather_matmul
    else:
        specs = (P(None, "x"), P(None, "x") if w_transposed else P("x", None))
        out, fn = P("x", None), cg.matmul_reduce_scatter
    body = lambda a, b: fn(a, b, "x", config=cfg, w_transposed=w_transposed)  # noqa: E731
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=out))


def _relative_error(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def _operands(shape, seed):
    m, k, n = shape
    kx, kw, kg = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w = (jax.random.normal(kw, (k, n), jnp.float32) / k**0.5).astype(jnp.bfloat16)
    return x, w, jax.random.normal(kg, (m, n), jnp.bfloat16)


def _reference(a, b):
    return jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32), precision="highest")


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("w_transposed", [False, True], ids=["w", "wT"])
@pytest.mark.parametrize(("op", "spec"), [(op, s) for op in SPECS for s in SPECS[op]])
def test_fused_outputs_and_gradients(two_gpus, op, spec, shape, w_transposed):
    """Values and gradients; the backward runs the other collective's fused kernel (two
    Mosaic GPU kernels in the compiled gradient)."""
    shape = _shape(shape)
    x, w, g = _operands(shape, hash((op, spec, shape)) % 2**31)
    stored = w.T if w_transposed else w
    cfg = parse_method(spec, op)
    f = _sharded(op, _mesh(), cfg, w_transposed)
    reason = fused.reason_for_shape(Collective.REDUCE_SCATTER, shape, jax.device_count(),
                                    "bfloat16", cfg) if op == "rs" else None  # fmt: skip
    # small: on 2 GPUs fewer than 2 tiles per CTA pair; on 4 a last wave of more than one block
    if reason and ("chain_tiles" in reason or "needs the tail" in reason):
        with pytest.raises(ValueError, match=re.escape(reason)):
            f(x, stored)
        return
    assert _relative_error(f(x, stored), _reference(x, w)) <= REL

    def loss(fn):
        return lambda a, b: jnp.sum(fn(a, b).astype(jnp.float32) * g.astype(jnp.float32))

    step = jax.jit(jax.value_and_grad(loss(f), argnums=(0, 1))).lower(x, stored).compile()
    # (a gradient alone drops an RS forward's kernel: the loss is linear in its result)
    assert len(re.findall(r'custom_call_target="[^"]*mosaic[^"]*"', step.as_text())) == 2
    _, got = step(x, stored)
    ref_fn = lambda a, b: _reference(a, b.T if w_transposed else b)  # noqa: E731
    want = jax.jit(jax.grad(loss(ref_fn), argnums=(0, 1)))(x, stored)
    for a, b in zip(got, want, strict=True):
        assert _relative_error(a, b) <= REL


@pytest.mark.parametrize(
    "spec",
    [
        "fused-direct-nt",  # a narrowed last wave: N/P = 1792, 224 tiles a block
        "fused-direct-cm-nt",
        "fused-direct-cm-r50-nt",
        "fused-direct-wgm-m64-n192",  # 128 x 192 tiles: N/P = 1728
        "fused-direct-wgm-gm-cm-m64-n192",
    ],
)
def test_direct_ag_tilings_checked_on_one_gpu(two_gpus, spec):
    """The direct AG kernel's tilings that one GPU checked as a GEMM core (a narrowed last
    wave, 192-column tiles), now sending rows to peers: values and gradients on every GPU
    (on 2: 448 units of 132 CTAs, the last 52 narrowed). Not yet run on two GPUs when written."""
    size = jax.device_count()
    n = size * (1728 if "n192" in spec else 1792)
    x, w, g = _operands((size * 4096, 512, n), 9)
    f = _sharded("ag", _mesh(), parse_method(spec, "ag"))
    assert _relative_error(f(x, w), _reference(x, w)) <= REL
    got = jax.grad(lambda a, b: jnp.sum(f(a, b).astype(jnp.float32) * g), argnums=(0, 1))(x, w)
    want = jax.grad(lambda a, b: jnp.sum(_reference(a, b) * g), argnums=(0, 1))(x, w)
    for a, b in zip(got, want, strict=True):
        assert _relative_error(a, b) <= REL


@pytest.mark.parametrize(
    ("op", "spec"),
    [("ag", "fused-s3"), ("ag", "fused-direct-s3"), ("rs", "fused-s3"),
     ("rs", "fused-direct-wgm-cm-m64-n256-s3")],
)  # fmt: skip
def test_three_stages_alternating_inputs(two_gpus, op, spec):
    """3 stages and 16 K-steps a device, many tiles a CTA, calls alternating x and -x: with
    one wgmma in flight the last K-step's smem slot is the next tile's first load; the kernels
    await it (`tiles.await_last_step`, wrong tiles on one H200 before)."""
    size = jax.device_count()
    shape = (8192, 1024, 7168) if op == "ag" else (8192, 1024 * size, 7168)
    x, w, _ = _operands(shape, 13)
    f = _sharded(op, _mesh(), parse_method(spec, op))
    for sign in (-1, 1, -1, 1):
        assert _relative_error(f(sign * x, w), _reference(sign * x, w)) <= REL


@pytest.mark.parametrize(
    ("op", "spec"),
    [("ag", "fused-direct-gm"), ("rs", "fused-direct-cm"), ("rs", "fused-direct-pp-gm-cm"),
     ("ag", "fused-direct-pp-gm-cm"), ("rs", "fused-direct-pp-gm-cm-nt"),
     ("ag", "fused-direct-pp-gm-cm-nt")],
)  # fmt: skip
def test_back_to_back_calls_are_bit_identical(two_gpus, op, spec):
    """24 calls enqueued back to back, two inputs alternating: each equals that input's call
    run alone, bit for bit (no state leaks between calls; on 2 GPUs the adds have one order)."""
    if jax.device_count() != 2:
        pytest.skip("a fixed add order holds on 2 GPUs")
    f = _sharded(op, _mesh(), parse_method(spec, op))
    inputs = [_operands(_shape("big"), seed)[:2] for seed in (1, 2)]
    alone = [np.asarray(jax.block_until_ready(f(*i)), np.float32) for i in inputs]
    outs = [f(*inputs[c % 2]) for c in range(24)]
    for c, out in enumerate(outs):
        assert np.array_equal(np.asarray(out, np.float32), alone[c % 2]), c


@pytest.mark.parametrize(
    ("op", "spec"),
    [("ag", "fused-direct"), ("ag", "fused"), ("rs", "fused-direct-cm"), ("rs", "fused"),
     ("rs", "fused-direct-pp-gm-cm"), ("ag", "fused-direct-pp-gm-cm")],
)  # fmt: skip
def test_fused_kernels_on_a_mesh_with_another_axis(two_gpus, op, spec):
    """A ("data", "x") mesh of 1 x P (the layers' and the example's): the kernels address
    peers by their coordinate on "x"."""
    mesh = Mesh(np.array(jax.devices()).reshape(1, -1), ("data", "x"))
    x, w, _ = _operands(_shape("small"), 5)
    f = _sharded(op, mesh, parse_method(spec, op))
    assert _relative_error(f(x, w), _reference(x, w)) <= REL


def test_fused_plan_errors(two_gpus):
    """Shapes and dtypes the fused kernels cannot take raise at plan time, never hang."""
    mesh = _mesh()
    cases = [
        ((2 * 64, 256, 512), jnp.bfloat16, "must be divisible by the tile"),
        ((512, 256, 512), jnp.float32, "bfloat16 or float16"),
    ]
    for (m, k, n), dtype, why in cases:
        x, w = jnp.zeros((m, k), dtype), jnp.zeros((k, n), dtype)
        with pytest.raises(ValueError, match=why):
            _sharded("ag", mesh, parse_method("fused", "ag"))(x, w)


@pytest.mark.parametrize("spec", ["none", "pipeline:2", "ring", "ring-bidi:2", "auto"])
@pytest.mark.parametrize("op", ["ag", "rs"])
def test_xla_methods_on_every_gpu(op, spec):
    """The XLA-scheduled methods on all GPUs of this machine (one GPU included)."""
    x, w, _ = _operands(_shape("small"), 7)
    f = _sharded(op, _mesh(), parse_method(spec, op))
    assert _relative_error(f(x, w), _reference(x, w)) <= REL


@pytest.mark.parametrize("spec", ["fused", "fused-direct"])
@pytest.mark.parametrize("op", ["ag", "rs"])
def test_fused_config_on_one_gpu_runs_the_local_gemm(op, spec):
    """A mesh axis of one GPU plans the local GEMM for a fused config (no peers to send to)."""
    x, w, _ = _operands(_shape("small"), 11)
    f = _sharded(op, _mesh(1), parse_method(spec, op))
    assert _relative_error(f(x, w), _reference(x, w)) <= REL


def _grouped_kernel(name: str):
    """The grouped forward's kernel by name (None: the one `pick_tiles` picks)."""
    from commgemm.mosaic_gpu import grouped

    kernels = {"commgemm": grouped.GroupedConfig(), "jax": grouped.GroupedTiles(),
               "pingpong": grouped.PingPongTiles()}  # fmt: skip
    return kernels.get(name)


@pytest.mark.parametrize("kernel", ["commgemm", "pingpong", "jax", "picked"])
@pytest.mark.parametrize("empty", [False, True], ids=["all", "empty"])
@pytest.mark.parametrize("groups", [8, 64])
def test_grouped_matmul_hopper_path(groups, empty, kernel):
    """cg.grouped_matmul on Hopper runs the Mosaic GPU kernels (the forward on commgemm's
    row-aligned or ping-pong kernel, on jax's or on the one `pick_tiles` picks; dX on its pick;
    dW commgemm's dW kernel): values and gradients against the float32 XLA ragged dot,
    uneven groups summing short of the rows, and with every other group empty."""
    from commgemm.mosaic_gpu import grouped

    tiles = _grouped_kernel(kernel)

    m, k, n = 2048, 512, 768
    kx, kw, kg = jax.random.split(jax.random.key(groups), 3)
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w = (jax.random.normal(kw, (groups, k, n), jnp.float32) / k**0.5).astype(jnp.bfloat16)
    probs = np.ones(groups)
    if empty:
        probs[::2] = 0
    sizes = np.random.default_rng(groups).multinomial(m - 100, probs / probs.sum())
    sizes = jnp.asarray(sizes, jnp.int32)
    assert grouped.unsupported_reason(x, w, tiles) is None
    g = jax.random.normal(kg, (m, n), jnp.float32)

    def loss(fn):
        return lambda a, b: jnp.sum(fn(a, b).astype(jnp.float32) * g)

    def ref(a, b):
        a32, b32 = a.astype(jnp.float32), b.astype(jnp.float32)
        return jax.lax.ragged_dot(a32, b32, sizes, precision="highest")

    ours = lambda a, b: cg.grouped_matmul(a, b, sizes, hopper_tiles=tiles)  # noqa: E731
    assert _relative_error(ours(x, w), ref(x, w)) <= REL
    assert not np.asarray(ours(x, w)[m - 100 :], np.float32).any()  # rows past the sum
    got = jax.grad(loss(ours), (0, 1))(x, w)
    want = jax.grad(loss(ref), (0, 1))(x, w)
    for a, b in zip(got, want, strict=True):
        assert _relative_error(a, b) <= REL


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("kernel", ["commgemm", "pingpong", "jax"])
def test_grouped_matmul_hopper_path_in_shard_map(kernel, check_vma):
    """Inside shard_map (x's rows over a mesh axis of this GPU, w replicated), as the grouped
    collective ops call it: the kernels' results, which Pallas types as varying over nothing,
    are typed as the values they come from, and dW summed over the axis w is replicated over;
    values and gradients as the float32 ragged dot's."""

    tiles = _grouped_kernel(kernel)
    m, k, n, groups = 1024, 256, 512, 4
    kx, kw, kg = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w = (jax.random.normal(kw, (groups, k, n), jnp.float32) / k**0.5).astype(jnp.bfloat16)
    sizes = jnp.asarray([300, 0, 500, 100], jnp.int32)
    g = jax.random.normal(kg, (m, n), jnp.float32)
    body = lambda a, b: cg.grouped_matmul(a, b, sizes, hopper_tiles=tiles)  # noqa: E731
    ours = jax.shard_map(body, mesh=_mesh(1), in_specs=(P("x"), P()), out_specs=P("x"),
                         check_vma=check_vma)  # fmt: skip

    def ref(a, b):
        a32, b32 = a.astype(jnp.float32), b.astype(jnp.float32)
        return jax.lax.ragged_dot(a32, b32, sizes, precision="highest")

    assert _relative_error(jax.jit(ours)(x, w), ref(x, w)) <= REL
    loss = lambda fn: lambda a, b: jnp.sum(fn(a, b).astype(jnp.float32) * g)  # noqa: E731
    got = jax.jit(jax.grad(loss(ours), (0, 1)))(x, w)
    want = jax.grad(loss(ref), (0, 1))(x, w)
    for a, b in zip(got, want, strict=True):
        assert _relative_error(a, b) <= REL


@pytest.mark.parametrize("narrow", [True, False], ids=["narrowed", "whole"])
@pytest.mark.parametrize("w_nk", [False, True], ids=["forward", "dX"])
@pytest.mark.parametrize(
    "sizes",
    [[1024], [100, 0, 300, 1, 500], [0, 0, 0], [7] * 40 + [400], [60, 70, 80, 90]],
    ids=["one", "uneven", "none", "tiny", "short"],
)
def test_grouped_kernel_against_ragged_dot(sizes, w_nk, narrow):
    """commgemm's grouped kernel alone, in the forward and dX's form (w read [G, N, K]): one
    group, empty groups, no rows at all, 40 tiles' worth of 7-row groups in one row tile, and
    sums short of the rows by whole tiles (zero there); against the float32 ragged dot. Its 16
    tiles fill less than half a wave: narrowed, each runs as two half-width tiles."""
    from commgemm.mosaic_gpu import grouped_kernel
    from commgemm.mosaic_gpu.configs import GroupedConfig

    m, k, n = 1024, 320, 512
    sizes = jnp.asarray(sizes, jnp.int32)
    kx, kw = jax.random.split(jax.random.key(sizes.shape[0]), 2)
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    shape = (sizes.shape[0], n, k) if w_nk else (sizes.shape[0], k, n)
    w = (jax.random.normal(kw, shape, jnp.float32) / k**0.5).astype(jnp.bfloat16)
    tiles = GroupedConfig(narrow_tail=narrow)
    got = jax.jit(lambda a, b, s: grouped_kernel.grouped_matmul(a, b, s, tiles, w_nk=w_nk))(
        x, w, sizes
    )
    rhs = jnp.swapaxes(w, 1, 2) if w_nk else w
    want = jax.lax.ragged_dot(x.astype(jnp.float32), rhs.astype(jnp.float32), sizes,
                              precision="highest")  # fmt: skip
    scale = max(float(jnp.abs(want).max()), 1.0)
    assert float(jnp.abs(got.astype(jnp.float32) - want).max()) <= REL * scale


@pytest.mark.parametrize("m", [1024, 1000], ids=["whole", "ragged-rows"])
@pytest.mark.parametrize("w_nk", [False, True], ids=["forward", "dX"])
@pytest.mark.parametrize(
    "sizes",
    [[1024], [100, 0, 300, 1, 500], [0, 0, 0], [7] * 40 + [400], [60, 70, 80, 90], [900, 900]],
    ids=["one", "uneven", "none", "tiny", "short", "past-the-rows"],
)
def test_pingpong_kernel_against_ragged_dot(sizes, w_nk, m):
    """commgemm's ping-pong grouped kernel alone, in the forward and dX's form (w read
    [G, N, K]): one group, empty groups, no rows at all, forty 7-row groups (tiles starting at
    rows that are not whole 8s), sums short of the rows (zero there) and past them (cut), rows
    not whole tiles; against the float32 ragged dot. With a float32 scale and result too."""
    from commgemm.mosaic_gpu import grouped_pingpong

    k, n = 320, 512
    sizes = jnp.asarray(sizes, jnp.int32)
    kx, kw = jax.random.split(jax.random.key(sizes.shape[0] + m), 2)
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    shape = (sizes.shape[0], n, k) if w_nk else (sizes.shape[0], k, n)
    w = (jax.random.normal(kw, shape, jnp.float32) / k**0.5).astype(jnp.bfloat16)
    rhs = jnp.swapaxes(w, 1, 2) if w_nk else w
    cut = jnp.minimum(jnp.cumsum(sizes), m)  # ragged_dot's rows of a sum past m
    want = jax.lax.ragged_dot(x.astype(jnp.float32), rhs.astype(jnp.float32),
                              jnp.diff(cut, prepend=0), precision="highest")  # fmt: skip
    scale = max(float(jnp.abs(want).max()), 1.0)
    kernel = jax.jit(functools.partial(grouped_pingpong.grouped_matmul, w_nk=w_nk))
    got = kernel(x, w, sizes)
    assert got.dtype == jnp.bfloat16
    assert float(jnp.abs(got.astype(jnp.float32) - want).max()) <= REL * scale
    two = jnp.full((1,), 2.0, jnp.float32)
    got = jax.jit(functools.partial(grouped_pingpong.grouped_matmul, w_nk=w_nk, scale=two,
                                    out_dtype=jnp.float32))(x, w, sizes)  # fmt: skip
    assert got.dtype == jnp.float32
    assert float(jnp.abs(got - 2 * want).max()) <= 2 * REL * scale


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("w_nk", [False, True], ids=["forward", "dX"])
@pytest.mark.parametrize(
    "sizes",
    [[839, 480, 2531, 604, 534, 1454, 1051, 699], [839, 480, 2531, 604, 534, 1454, 1051, 560]],
    ids=["all-rows", "short-sum"],
)
def test_pingpong_kernel_halved_last_wave(sizes, w_nk, dtype):
    """commgemm's ping-pong grouped kernel where the groups' tiles leave a last wave at most
    half full (8 uneven groups over 8192 rows, 14 column tiles: 952 tiles, 28 past 7 waves of
    132; or 938, a sum 139 rows short), which run as half tiles of 64 rows: every row of every
    group against the float32 ragged dot (bf16 operands; float8 ones as dX's K-major w), rows
    past the sum zero."""
    from commgemm.mosaic_gpu import grouped_pingpong
    from commgemm.mosaic_gpu import tiles as mosaic_tiles

    m, k, n = 8192, 256, 1792
    sizes = jnp.asarray(sizes, jnp.int32)
    units = int(grouped_pingpong.row_tiles(sizes, m, 128).counts[0]) * (n // 128)
    ctas = mosaic_tiles.num_sms()
    assert units > ctas and 0 < units % ctas <= ctas // 2, (units, ctas)  # a halved last wave
    kx, kw = jax.random.split(jax.random.key(len(dtype) + w_nk), 2)
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(dtype)
    w_nk = w_nk or dtype != "bfloat16"  # float8 w is K-major
    shape = (sizes.shape[0], n, k) if w_nk else (sizes.shape[0], k, n)
    w = (jax.random.normal(kw, shape, jnp.float32) / k**0.25).astype(dtype)
    rhs = jnp.swapaxes(w, 1, 2) if w_nk else w
    want = jax.lax.ragged_dot(x.astype(jnp.float32), rhs.astype(jnp.float32), sizes,
                              precision="highest")  # fmt: skip
    kernel = functools.partial(grouped_pingpong.grouped_matmul, w_nk=w_nk)
    got = jax.jit(kernel)(x, w, sizes).astype(jnp.float32)
    assert float(jnp.abs(got - want).max()) <= REL * float(jnp.abs(want).max())
    total = int(sizes.sum())
    assert float(jnp.abs(got[total:]).max(initial=0.0)) == 0.0


@pytest.mark.parametrize("w_nk", [False, True], ids=["forward", "dX"])
@pytest.mark.parametrize("tile_m, tile_n", [(192, 128), (256, 64), (64, 128), (128, 192)])
def test_pingpong_kernel_tilings(tile_m, tile_n, w_nk):
    """The ping-pong kernel in tilings other than its default (192-row tiles, whose store
    ladder is not a power of two; 256 and 64 rows; 192 columns), uneven groups and rows not
    whole tiles, against the float32 ragged dot."""
    from commgemm.mosaic_gpu import grouped_pingpong
    from commgemm.mosaic_gpu.configs import PingPongTiles

    m, k, n, sizes = 1000, 320, 3 * tile_n, jnp.asarray([100, 0, 300, 1, 500], jnp.int32)
    kx, kw = jax.random.split(jax.random.key(tile_m + tile_n), 2)
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    shape = (sizes.shape[0], n, k) if w_nk else (sizes.shape[0], k, n)
    w = (jax.random.normal(kw, shape, jnp.float32) / k**0.5).astype(jnp.bfloat16)
    rhs = jnp.swapaxes(w, 1, 2) if w_nk else w
    want = jax.lax.ragged_dot(x.astype(jnp.float32), rhs.astype(jnp.float32),
                              sizes, precision="highest")  # fmt: skip
    tiles = PingPongTiles(tile_m=tile_m, tile_n=tile_n)
    got = jax.jit(functools.partial(grouped_pingpong.grouped_matmul, tiles=tiles, w_nk=w_nk))(
        x, w, sizes
    )
    scale = max(float(jnp.abs(want).max()), 1.0)
    assert float(jnp.abs(got.astype(jnp.float32) - want).max()) <= REL * scale


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("form", ["quantizing", "prequantized"])
def test_grouped_matmul_float8_in_shard_map(form, check_vma):
    """The float8 grouped paths inside shard_map (x's rows over a mesh axis of this GPU, w
    replicated): `scaling=` with current tensor scaling (values within fast float8
    accumulation of the dequantized operands' float32 ragged dot, gradients the emulated
    path's outside shard_map) and ScaledTensor operands quantized before (forward); each
    compiled program runs commgemm's float8 kernel."""
    from commgemm.mosaic_gpu.grouped import GroupedTiles

    m, k, n, groups = 1024, 512, 512, 4
    kx, kw, kg = jax.random.split(jax.random.key(5), 3)
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w = (jax.random.normal(kw, (groups, k, n), jnp.float32) / k**0.5).astype(jnp.bfloat16)
    sizes = jnp.asarray([300, 0, 500, 100], jnp.int32)  # 900 rows: the rest zero
    mode = "current_tensor_scaling"
    qx, qw = cg.quantize(x, mode), cg.quantize(w, mode, axis=1)
    want = jax.lax.ragged_dot(cg.dequantize(qx, jnp.float32), cg.dequantize(qw, jnp.float32),
                              sizes, precision="highest")  # fmt: skip
    shard = functools.partial(jax.shard_map, mesh=_mesh(1), out_specs=P("x"),
                              check_vma=check_vma)  # fmt: skip
    if form == "prequantized":
        qwt = cg.quantize(jnp.swapaxes(w, 1, 2), mode, axis=2)

        def body(xd, xs, wd, ws):
            a, b = cg.ScaledTensor(xd, xs), cg.ScaledTensor(wd, ws, axis=2)
            return cg.grouped_matmul(a, b, sizes)

        f = jax.jit(shard(body, in_specs=(P("x"), P(), P(), P())))
        args = (qx.data, qx.scale_inv, qwt.data, qwt.scale_inv)
        assert "mosaic" in f.lower(*args).compile().as_text().lower()
        got = f(*args).astype(jnp.float32)
        assert float(jnp.abs(got - want).max()) <= REL * float(jnp.abs(want).max())
        assert float(jnp.abs(got[900:]).max()) == 0.0
        return
    ours = shard(lambda a, b: cg.grouped_matmul(a, b, sizes, scaling=mode),
                 in_specs=(P("x"), P()))  # fmt: skip
    compiled = jax.jit(ours).lower(x, w).compile().as_text().lower()
    assert "f8e4m3fn" in compiled and "mosaic" in compiled
    got = jax.jit(ours)(x, w).astype(jnp.float32)
    assert float(jnp.abs(got - want).max()) <= REL * float(jnp.abs(want).max())
    emulated = lambda a, b: cg.grouped_matmul(a, b, sizes, scaling=mode,  # noqa: E731
                                              hopper_tiles=GroupedTiles())  # fmt: skip
    g = jax.random.normal(kg, (m, n), jnp.float32)
    loss = lambda f: lambda a, b: jnp.sum(f(a, b).astype(jnp.float32) * g)  # noqa: E731
    for a, b in zip(jax.jit(jax.grad(loss(ours), (0, 1)))(x, w),
                    jax.jit(jax.grad(loss(emulated), (0, 1)))(x, w), strict=True):  # fmt: skip
        assert _relative_error(a, b) <= REL


@pytest.mark.parametrize(
    "split",
    [(False, True, True), (False, False, False), (True, True, True)],
    ids=["default", "fast", "split"],
)
@pytest.mark.parametrize("groups", [8, 64])
def test_grouped_matmul_float8_kernel(groups, split):
    """cg.grouped_matmul with current tensor scaling on Hopper multiplies float8 operands in
    the forward and dX (the compiled programs' kernels take f8; dX e5m2 dY against e4m3 w):
    within float8 accumulation and bf16 rounding of the float32 ragged dot of the dequantized
    operands, rows past the groups' sum zero; the gradients the emulated path's (jax's tiles
    requested: emulated), whichever accumulation the recipe asks; dW on float8 operands where
    the recipe lets it accumulate fast and the groups are large enough (8 groups of these 2048
    rows take the float8 dW, 64 do not)."""
    _check_float8_grouped(2048, 1024, 512, groups, split)


@pytest.mark.parametrize("split", [(False, True, True), (False, False, False)],
                         ids=["default", "fast"])  # fmt: skip
def test_grouped_matmul_float8_columns_not_whole_256s(split):
    """N = 640 (five 128-column tiles) with 2048 rows a group, where the row-aligned kernel's
    256-column tiles do not fit: the forward on the ping-pong kernel (`float8_kernel`), dX on
    the row-aligned kernel (split) or the ping-pong one (fast), as test_grouped_matmul_float8_
    kernel checks them."""
    from commgemm.mosaic_gpu import grouped

    assert isinstance(grouped.float8_kernel(8192, 1024, 640, 4, jnp.float8_e4m3fn),
                      grouped.PingPongTiles)  # fmt: skip
    _check_float8_grouped(8192, 1024, 640, 4, split)


def _mosaic_operand_types(hlo: str) -> set[str]:
    """The element types of the operands of the Mosaic GPU kernels in compiled HLO text."""
    import re

    calls = [line for line in hlo.splitlines() if 'custom_call_target="mosaic_gpu' in line]
    found = (re.search(r"operand_layout_constraints=\{(.*?)\}\}", c) for c in calls)
    return {t for f in found if f for t in re.findall(r"([a-z]+[0-9a-z]*)\[", f.group(1))}


def _check_float8_grouped(m: int, k: int, n: int, groups: int, split) -> None:
    from commgemm.mosaic_gpu.grouped import GroupedTiles

    total = m - 148
    sizes = np.random.default_rng(groups).multinomial(total, np.ones(groups) / groups)
    sizes[1] = 0
    sizes = jnp.asarray(sizes, jnp.int32)
    kx, kw, kg = jax.random.split(jax.random.key(groups), 3)
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w = (jax.random.normal(kw, (groups, k, n), jnp.float32) / k**0.5).astype(jnp.bfloat16)
    g = jax.random.normal(kg, (m, n), jnp.float32)
    mode = "current_tensor_scaling"
    recipe = cg.ScalingRecipe(mode, split_accumulator=split)

    def run(tiles):
        return lambda a, b: cg.grouped_matmul(a, b, sizes, scaling=recipe, hopper_tiles=tiles)

    float8, emulated = run(None), run(GroupedTiles())
    compiled = jax.jit(float8).lower(x, w).compile().as_text()
    assert "f8e4m3fn" in _mosaic_operand_types(compiled)  # the forward on float8 operands
    loss = lambda f: lambda a, b: jnp.sum(f(a, b).astype(jnp.float32) * g)  # noqa: E731
    grads = jax.jit(jax.grad(loss(float8), (0, 1))).lower(x, w).compile().as_text()
    assert "f8e5m2" in _mosaic_operand_types(grads)  # dX on dY's float8 values
    dw_calls = [c for c in grads.splitlines() if 'custom_call_target="mosaic_gpu' in c
                and f"bf16[{groups},{k},{n}]" in c.split("custom-call(")[0]]  # fmt: skip
    assert len(dw_calls) == 1, dw_calls  # dW on a kernel: float8 where it may accumulate fast
    from commgemm.mosaic_gpu import grouped_dw

    float8_dw = not split[2] and grouped_dw.float8_reason(m, k, n, groups) is None
    types = _mosaic_operand_types(dw_calls[0])
    assert any(t.startswith("f8e") for t in types) == float8_dw, (types, dw_calls)
    qx, qw = cg.quantize(x, mode), cg.quantize(w, mode, axis=1)
    want = jax.lax.ragged_dot(cg.dequantize(qx, jnp.float32), cg.dequantize(qw, jnp.float32),
                              sizes, precision="highest")  # fmt: skip
    got = jax.jit(float8)(x, w).astype(jnp.float32)
    assert float(jnp.abs(got - want).max()) <= REL * float(jnp.abs(want).max())
    assert float(jnp.abs(got[total:]).max()) == 0.0
    for a, b in zip(jax.jit(jax.grad(loss(float8), (0, 1)))(x, w),
                    jax.jit(jax.grad(loss(emulated), (0, 1)))(x, w), strict=True):  # fmt: skip
        assert _relative_error(a, b) <= REL


@pytest.mark.parametrize("n", [1024, 1408, 320], ids=["k256-steps", "k128-steps", "k64-steps"])
@pytest.mark.parametrize("sizes", [[300, 0, 500, 100, 200, 400, 250, 150], [2048]])
def test_grouped_kernel_mixed_float8(sizes, n):
    """commgemm's grouped kernel on e5m2 x [M, N] times e4m3 w [G, K, N] read as [G, out, in]
    (dX's form and formats), accumulating fast or split, against the float32 ragged dot of the
    same float8 values; split accumulation at most as far from it as fast. The contraction N
    makes split K-steps of 256, 128 and 64."""
    from commgemm.mosaic_gpu import grouped_kernel

    m, k = 2048, 768
    sizes = jnp.asarray(sizes, jnp.int32)
    kx, kw = jax.random.split(jax.random.key(len(sizes)), 2)
    dy = jax.random.normal(kx, (m, n), jnp.float32).astype(jnp.float8_e5m2)
    w = (4 * jax.random.normal(kw, (sizes.shape[0], k, n), jnp.float32)).astype(jnp.float8_e4m3fn)
    scale = jnp.full((1,), 0.03, jnp.float32)
    want = 0.03 * jax.lax.ragged_dot(dy.astype(jnp.float32),
                                     jnp.swapaxes(w, 1, 2).astype(jnp.float32), sizes,
                                     precision="highest")  # fmt: skip
    errors = {}
    for s in (False, True):
        got = jax.jit(lambda a, b, c, s=s: grouped_kernel.grouped_matmul(
            a, b, sizes, w_nk=True, scale=c, out_dtype=jnp.bfloat16, split_accumulator=s))(
            dy, w, scale).astype(jnp.float32)  # fmt: skip
        errors[s] = float(jnp.abs(got - want).max()) / float(jnp.abs(want).max())
        assert float(jnp.abs(got[int(sizes.sum()) :]).max(initial=0.0)) == 0.0
    assert max(errors.values()) <= REL, errors
    assert errors[True] <= errors[False] * 1.05, errors


@pytest.mark.parametrize("n", [768, 320], ids=["k128-steps", "k64-steps"])
@pytest.mark.parametrize("x_dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_pingpong_kernel_on_float8(x_dtype, n):
    """commgemm's ping-pong grouped kernel on float8 x [M, N] (e4m3, or dX's e5m2) times e4m3
    w [G, K, N] read as [G, out, in] (dX's form), the scale in its epilogue, rows not whole
    tiles and a sum short of them, the contraction in 128-element steps and (N = 320) in 64:
    against the float32 ragged dot of the same float8 values, within fast float8 accumulation
    and bf16 rounding."""
    from commgemm.mosaic_gpu import grouped_pingpong

    m, k = 2000, 1024
    sizes = jnp.asarray([300, 0, 500, 100, 200, 400, 250, 150], jnp.int32)  # 1900 rows
    kx, kw = jax.random.split(jax.random.key(n), 2)
    x = jax.random.normal(kx, (m, n), jnp.float32).astype(x_dtype)
    w = (4 * jax.random.normal(kw, (sizes.shape[0], k, n), jnp.float32)).astype(jnp.float8_e4m3fn)
    scale = jnp.full((1,), 0.03, jnp.float32)
    want = 0.03 * jax.lax.ragged_dot(x.astype(jnp.float32),
                                     jnp.swapaxes(w, 1, 2).astype(jnp.float32), sizes,
                                     precision="highest")  # fmt: skip
    got = jax.jit(lambda a, b, c: grouped_pingpong.grouped_matmul(
        a, b, sizes, w_nk=True, scale=c))(x, w, scale)  # fmt: skip
    assert got.dtype == jnp.bfloat16
    got = got.astype(jnp.float32)
    assert float(jnp.abs(got - want).max()) <= REL * float(jnp.abs(want).max())
    assert float(jnp.abs(got[1900:]).max()) == 0.0


@pytest.mark.parametrize("w_nk", [False, True], ids=["w_gkn", "w_gnk"])
def test_grouped_matmul_prequantized(w_nk):
    """`ScaledTensor`s the caller quantized (w [G, K, N] along axis 1 or [G, N, K] along axis 2)
    run commgemm's float8 kernel (in the compiled program), within fast float8 accumulation and
    bf16 rounding of the float32 ragged dot of their dequantized values; rows past the sum 0."""
    m, k, n, groups = 2048, 1024, 512, 8
    sizes = jnp.asarray([300, 0, 500, 100, 200, 400, 250, 150], jnp.int32)  # 1900 rows
    kx, kw = jax.random.split(jax.random.key(3), 2)
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w = (jax.random.normal(kw, (groups, k, n), jnp.float32) / k**0.5).astype(jnp.bfloat16)
    mode = "current_tensor_scaling"
    qx = cg.quantize(x, mode)
    qw = cg.quantize(jnp.swapaxes(w, 1, 2), mode, axis=2) if w_nk else cg.quantize(w, mode, axis=1)
    f = jax.jit(lambda a, b: cg.grouped_matmul(a, b, sizes))
    assert "mosaic" in f.lower(qx, qw).compile().as_text().lower()
    ws = cg.dequantize(qw, jnp.float32)
    want = jax.lax.ragged_dot(cg.dequantize(qx, jnp.float32),
                              jnp.swapaxes(ws, 1, 2) if w_nk else ws, sizes,
                              precision="highest")  # fmt: skip
    got = f(qx, qw).astype(jnp.float32)
    assert float(jnp.abs(got - want).max()) <= REL * float(jnp.abs(want).max())
    assert float(jnp.abs(got[1900:]).max()) == 0.0


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("narrow", [True, False], ids=["narrowed", "whole"])
@pytest.mark.parametrize("stages", [3, 4])
def test_grouped_kernel_tiles_in_sequence(stages, narrow, dtype):
    """Many tiles a CTA (M 8192, N 1792, 8 uneven groups, 16 K-steps; 448 tiles, 52 in the last
    wave, run narrowed or whole): each tile's last wgmma is done before the next tile reloads
    its smem slot (`tiles.await_last_step`; with 3 stages that slot is the first one reloaded),
    on calls that alternate x and -x; bf16, and float8 (w [G, N, K]) against the float32
    ragged dot of its float8 values."""
    from commgemm.mosaic_gpu import grouped_kernel
    from commgemm.mosaic_gpu.configs import GroupedConfig

    m, k, n = 8192, 1024, 1792
    sizes = jnp.asarray([900, 1500, 300, 1100, 2000, 700, 1000, 692], jnp.int32)
    kx, kw = jax.random.split(jax.random.key(stages), 2)
    x = jax.random.normal(kx, (m, k), jnp.bfloat16).astype(dtype)
    w = (jax.random.normal(kw, (8, k, n), jnp.float32) / k**0.5).astype(dtype)
    w_nk = dtype != "bfloat16"
    tiles = GroupedConfig(stages=stages, narrow_tail=narrow)
    rhs = jnp.swapaxes(w, 1, 2) if w_nk else w
    f = jax.jit(lambda a, b, s: grouped_kernel.grouped_matmul(
        a, b, s, tiles, w_nk=w_nk, out_dtype=jnp.bfloat16))  # fmt: skip
    for sign in (-1, 1, -1, 1):
        a = (sign * x.astype(jnp.float32)).astype(dtype)
        want = jax.lax.ragged_dot(a.astype(jnp.float32), w.astype(jnp.float32), sizes,
                                  precision="highest")  # fmt: skip
        got = f(a, rhs, sizes).astype(jnp.float32)
        assert float(jnp.abs(got - want).max()) <= REL * float(jnp.abs(want).max())


@pytest.mark.parametrize(
    ("spec", "check_vma", "dgrad_split", "forward_split"),
    [("fused-direct", True, True, False), ("fused-direct", False, False, False),
     ("fused", True, True, False), ("fused", True, False, False),
     ("fused-direct", True, False, True), ("fused", True, True, True)],
)  # fmt: skip
@pytest.mark.parametrize("op", ["ag", "rs"])
def test_fused_float8_against_the_split_method(
    two_gpus, op, spec, check_vma, dgrad_split, forward_split
):
    """scaling= with the direct and ring kernels (float8 wgmma, float8 rows on the wire) gives
    the split method's values and gradients under the same recipe, to bf16 rounding; with
    fast dgrad dX runs the other collective's fused kernel on e5m2 dY and e4m3 W (two Mosaic
    GPU kernels in the compiled value and gradient), with promoted dgrad the ring (one); a
    promoted forward runs the kernels' split form (`fused.split_tiling`)."""
    recipe = cg.ScalingRecipe(split_accumulator=(forward_split, dgrad_split, True))
    _float8_against_split(op, spec, check_vma, recipe, (2048, 2048, 2048))


@pytest.mark.parametrize(("op", "spec"), [("rs", "fused-direct-pp-gm-cm"), ("ag", "fused-direct")])
def test_fused_float8_pingpong_against_the_split_method(two_gpus, op, spec):
    """The ping-pong RS kernel on float8: as an RS forward, and (K = 1536: eight 192-wide
    columns, the RS plan's kernel on 2 GPUs) as an AG forward's fast dX on e5m2 dY and e4m3 W;
    against the split method, as `test_fused_float8_against_the_split_method`."""
    if jax.device_count() != 2:
        pytest.skip("the RS plan runs the ping-pong kernel on 2 GPUs")
    recipe = cg.ScalingRecipe(split_accumulator=(False, False, True))
    _float8_against_split(op, spec, True, recipe, (2048, 1536, 2048))


def _float8_against_split(op, spec, check_vma, recipe, shape):
    dgrad_split = recipe.split_accumulator[1]
    x, w, g = _operands(shape, 7)
    mesh = _mesh()
    results = []
    split_method = "pipeline" if "direct" in spec else "ring_exchange"
    for cfg in (parse_method(spec, op), cg.OverlapConfig(method=split_method)):
        fn = cg.all_gather_matmul if op == "ag" else cg.matmul_reduce_scatter
        specs = (P("x", None), P(None, "x")) if op == "ag" else (P(None, "x"), P("x", None))
        out_spec = P(None, "x") if op == "ag" else P("x", None)
        body = lambda a, b, c=cfg, fn=fn: fn(a, b, "x", config=c, scaling=recipe)  # noqa: E731
        f = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=out_spec, check_vma=check_vma)
        loss = lambda a, b, f=f: jnp.sum(f(a, b).astype(jnp.float32) * g.astype(jnp.float32))  # noqa: E501, E731
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(x, w).compile()
        if cfg.atomic_gemm:
            text = step.as_text()
            kernels = len(re.findall(r'custom_call_target="[^"]*mosaic[^"]*"', text))
            assert kernels == (1 if dgrad_split else 2) and "f8e5m2" in text
        results.append((jax.jit(f)(x, w), *step(x, w)[1]))
    for a, b in zip(*results, strict=True):
        assert _relative_error(a, b) <= REL


def _float8_grouped_operands(seed: int):
    """(sizes, x [2048, 1024], w [8, 1024, 512], a cotangent g [2048, 512]): 8 uneven groups,
    one empty, 1900 rows in all; bf16 operands, float32 g."""
    m, k, n, groups = 2048, 1024, 512, 8
    sizes = jnp.asarray([300, 0, 500, 100, 200, 400, 250, 150], jnp.int32)
    kx, kw, kg = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w = (jax.random.normal(kw, (groups, k, n), jnp.float32) / k**0.5).astype(jnp.bfloat16)
    return sizes, x, w, jax.random.normal(kg, (m, n), jnp.float32)


def test_grouped_matmul_float8_kernel_delayed():
    """Delayed scaling with a dy_state on the float8 grouped kernel: the forward and dX on
    float8 (in the compiled programs), values and gradients the emulated path's under the same
    states, and dy_state's gradient (the advanced state) the emulated path's."""
    from commgemm.mosaic_gpu.grouped import GroupedTiles

    sizes, x, w, g = _float8_grouped_operands(11)
    state = lambda a: cg.ScalingState.create(history=4).update(jnp.float32(a))  # noqa: E731
    xs, ws, dys = state(4.0), state(0.2), state(3.0)

    def loss(tiles):
        def f(a, b, d):
            recipe = cg.ScalingRecipe("delayed_tensor_scaling", x_state=xs, w_state=ws,
                                      dy_state=d)  # fmt: skip
            out = cg.grouped_matmul(a, b, sizes, scaling=recipe, hopper_tiles=tiles)
            return jnp.sum(out.astype(jnp.float32) * g)

        return jax.jit(jax.value_and_grad(f, (0, 1, 2)))

    float8, emulated = loss(None), loss(GroupedTiles())
    compiled = float8.lower(x, w, dys).compile().as_text().lower()
    assert "f8e4m3fn" in compiled and "f8e5m2" in compiled and "mosaic" in compiled
    (v8, g8), (ve, ge) = float8(x, w, dys), emulated(x, w, dys)
    assert abs(float(v8) - float(ve)) <= REL * abs(float(ve))
    for a, b in zip(g8[:2], ge[:2], strict=True):
        assert _relative_error(a, b) <= REL
    np.testing.assert_allclose(g8[2].amax_history, ge[2].amax_history, rtol=1e-6)
    np.testing.assert_allclose(float(g8[2].scale), float(ge[2].scale), rtol=1e-6)
    # dY is g in the result's dtype (bf16)
    np.testing.assert_allclose(float(g8[2].amax_history[0]), float(jnp.abs(g).max()), rtol=1e-2)


def test_grouped_matmul_float8_under_remat():
    """The float8 grouped op (its residuals float8 values) under jax.checkpoint: the same loss
    and gradients as without it (to float32 summation order)."""
    sizes, x, w, g = _float8_grouped_operands(13)

    def loss(a, b):
        out = cg.grouped_matmul(a, b, sizes, scaling="current_tensor_scaling")
        return jnp.sum(jnp.sin(out.astype(jnp.float32)) * g)

    plain = jax.jit(jax.value_and_grad(loss, (0, 1)))(x, w)
    remat = jax.jit(jax.value_and_grad(jax.checkpoint(loss), (0, 1)))(x, w)
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(remat), strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())


@pytest.mark.parametrize("scaling", [None, "current_tensor_scaling"], ids=["bf16", "fp8"])
@pytest.mark.parametrize(("op", "spec"), [("ag", "fused"), ("rs", "fused-direct-cm")])
def test_fused_kernels_under_remat(two_gpus, op, spec, scaling):
    """A fused op (ring AG, direct RS; bf16 and float8) under jax.checkpoint inside shard_map
    with the default check_vma: the forward recomputed in the backward gives the same loss and
    gradients as without remat (the kernels are deterministic on 2 GPUs)."""
    x, w, g = _operands((2048, 2048, 2048), 17)
    specs = (P("x", None), P(None, "x")) if op == "ag" else (P(None, "x"), P("x", None))
    out_spec = P(None, "x") if op == "ag" else P("x", None)
    fn = cg.all_gather_matmul if op == "ag" else cg.matmul_reduce_scatter
    cfg = parse_method(spec, op)
    body = lambda a, b: jnp.sin(fn(a, b, "x", config=cfg, scaling=scaling).astype(jnp.float32))  # noqa: E731
    f = jax.shard_map(body, mesh=_mesh(), in_specs=specs, out_specs=out_spec)

    def loss(a, b):
        return jnp.sum(f(a, b) * g.astype(jnp.float32))

    plain = jax.jit(jax.value_and_grad(loss, (0, 1)))(x, w)
    remat = jax.jit(jax.value_and_grad(jax.checkpoint(loss), (0, 1)))(x, w)
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(remat), strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())
