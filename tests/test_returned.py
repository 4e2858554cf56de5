"""The expert-parallel block's second GEMM with its return exchange (`grouped.returned`) off a
GPU and as lowered for one: the fused kernel's plan (`grouped_return.Returned`: each segment's
rows, where they land, the rows no one writes) carried out row by row in numpy equals the
exchange of the GEMM's rows, and covers every result row once; the op off a GPU (GEMM, then the
exchange) equals a float64 reference with its gradient; the MoE step lowered for CUDA as on a
Hopper GPU runs the GEMM and the exchange as one kernel, under check_vma on and off; the
dispatch inside the GEMM (`returned.arrival_plan`) carried out chunk by chunk moves the
exchange's rows, each band expecting the chunks that land there (so too for any regions, by
hypothesis). The kernels' results on GPUs: tests/gpu/test_returned_gpu.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import P, mesh1d, returned_layouts
from hypothesis import given, settings
from hypothesis import strategies as st
from test_kernels_lower import JaxOnAnH100

import commgemm as cg
from commgemm.grouped import exchange as ex
from commgemm.grouped import returned
from commgemm.mosaic_gpu import peers
from commgemm.mosaic_gpu import tiles as mosaic_tiles


def _plans(size: int, layouts):
    """Per device: (segments [3, R], fills [2, R]) as `returned._returned` builds them."""

    def body(eb, ec, tb, tc):
        by_expert, tokens = ex.Layout(eb[0], ec[0], by_group=True), ex.Layout(tb[0], tc[0])
        segments = jnp.stack([by_expert.bounds[:-1], by_expert.counts,
                              ex.destinations(by_expert, tokens, "x")])  # fmt: skip
        return segments[None], jnp.stack(ex.unwritten(tokens))[None]

    f = jax.shard_map(body, mesh=mesh1d(size), in_specs=(P("x"),) * 4, out_specs=P("x"))
    return [np.asarray(a) for a in jax.jit(f)(*layouts)]


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "no-vma"])
@pytest.mark.parametrize(
    "size, groups, most, drop",
    [(2, 4, 60, True), (4, 3, 25, True), (2, 1, 9, False), (8, 2, 10, True)],
)
def test_plan_moves_the_rows_the_exchange_moves(size, groups, most, drop, check_vma):
    """Segment g * P + s of device d's rows lands at its `destinations` row on device s and
    the fills are the rest: every result row written exactly once, the same result as the
    exchange (`ragged_all_to_all`, off a GPU its fallback) of those rows; and the op off a GPU
    (`matmul_returned`) is the float64 product so returned, its gradient too."""
    rng = np.random.default_rng()
    counts, layouts, out_rows = returned_layouts(rng, size, groups, most, drop)
    segments, fills = _plans(size, layouts)
    k, n, rows = 16, 8, size * most
    x = rng.standard_normal((size, rows, k))
    w = rng.standard_normal((size, groups, k, n))
    sizes = counts.sum(axis=0)  # [dst, group]
    z = np.zeros((size, rows, n))  # each device's GEMM rows, float64
    for d in range(size):
        at = np.concatenate([[0], np.cumsum(sizes[d])])
        for g in range(groups):
            z[d, at[g] : at[g + 1]] = x[d, at[g] : at[g + 1]] @ w[d, g]
    out, written = np.zeros((size, out_rows, n)), np.zeros((size, out_rows), int)
    for d in range(size):
        for r in range(size * groups):
            first, count, dest = segments[d, :, r]
            s = r % size
            out[s, dest : dest + count] = z[d, first : first + count]
            written[s, dest : dest + count] += 1
    for s in range(size):
        for first, count in fills[s].T:
            written[s, first : first + count] += 1
    np.testing.assert_array_equal(written, 1)

    def op(a, b, g, eb, ec, tb, tc):
        by_expert, tokens = ex.Layout(eb[0], ec[0], by_group=True), ex.Layout(tb[0], tc[0])
        return returned.matmul_returned(a, b, g[0], None, None, None, "x", by_expert, tokens,
                                        rows, out_rows)  # fmt: skip

    f = jax.shard_map(op, mesh=mesh1d(size), in_specs=(P("x"),) * 7, out_specs=P("x"),
                      check_vma=check_vma)  # fmt: skip
    flat = lambda a: jnp.asarray(a.reshape(-1, *a.shape[2:]), jnp.float32)  # noqa: E731
    args = (flat(x), flat(w), jnp.asarray(sizes, jnp.int32), *layouts)
    got, pullback = jax.vjp(lambda a, b: jax.jit(f)(a, b, *args[2:]), *args[:2])
    np.testing.assert_allclose(np.asarray(got), out.reshape(-1, n), rtol=1e-5, atol=1e-5)
    ct = rng.standard_normal(out.shape)
    dx = np.zeros_like(x)  # the transpose: each segment's rows of ct back, times w[g]^T
    for d in range(size):
        at = np.concatenate([[0], np.cumsum(sizes[d])])
        for r in range(size * groups):
            first, count, dest = segments[d, :, r]
            g = r // size
            dx[d, first : first + count] = ct[r % size, dest : dest + count] @ w[d, g].T
    got_dx = pullback(jnp.asarray(ct.reshape(-1, n), jnp.float32))[0]
    np.testing.assert_allclose(np.asarray(got_dx), dx.reshape(-1, k), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "size, groups, most, drop",
    [(2, 4, 300, True), (4, 3, 200, True), (2, 1, 9, False), (8, 2, 140, True)],
)
def test_arrival_plan_moves_the_rows_the_exchange_moves(size, groups, most, drop):
    """The dispatch inside the GEMM (`returned.arrival_plan`, `mosaic_gpu.grouped_dispatch`)
    carried out chunk by chunk in numpy: every live row of each device's experts' rows written
    exactly once, the rest not at all, the same rows as the exchange (`ragged_all_to_all`, off a
    GPU its fallback); items group-major (each group's items for every peer before the next
    group's); and each band of BAND rows expects exactly the chunks the senders' items land in
    it (a receiver waits for these counts: one fewer would let it read rows not yet there)."""
    from commgemm.mosaic_gpu.grouped_dispatch import BAND

    rng = np.random.default_rng()
    counts, (eb, ec, tb, tc), _ = returned_layouts(rng, size, groups, most, drop)
    rows, src_rows = size * most, int(tb[0, -1])  # the tokens: out_rows on every device
    x = rng.standard_normal((size * src_rows, 8)).astype(np.float32)

    def body(a, eb, ec, tb, tc):
        tokens, by_expert = ex.Layout(tb[0], tc[0]), ex.Layout(eb[0], ec[0], by_group=True)
        plan = returned.arrival_plan(a, tokens, by_expert, "x", rows)
        want = ex.ragged_all_to_all(a, tokens, by_expert, "x", most, rows)
        return plan.items[None], plan.expected[None], want

    f = jax.shard_map(body, mesh=mesh1d(size), in_specs=(P("x"),) * 5, out_specs=P("x"))
    items, expected, want = (np.asarray(v) for v in jax.jit(f)(x, eb, ec, tb, tc))
    got, written = np.zeros((size, rows, 8), np.float32), np.zeros((size, rows), int)
    landed = np.zeros_like(expected)
    for s in range(size):
        first, src, count, dst, peer = items[s]
        assert first[-1] == sum(-(-max(c, 0) // BAND) for c in count[:-1])
        np.testing.assert_array_equal(peer[:-1], np.tile(np.arange(size), groups))  # group-major
        for i in range(first.shape[0] - 1):
            assert first[i + 1] - first[i] == -(-count[i] // BAND)
            for c in range(first[i + 1] - first[i]):
                lo, n = c * BAND, min(BAND, count[i] - c * BAND)
                at = dst[i] + lo
                got[peer[i], at : at + n] = x[s * src_rows + src[i] + lo :][:n]
                written[peer[i], at : at + n] += 1
                for band in {at // BAND, (at + n - 1) // BAND}:
                    landed[peer[i], band] += 1
    live = np.zeros((size, rows), bool)
    for d in range(size):
        for r, c in enumerate(ec[d]):
            live[d, eb[d, r] : eb[d, r] + c] = True
    np.testing.assert_array_equal(written, live.astype(int))
    np.testing.assert_array_equal(got[live], want.reshape(size, rows, 8)[live])
    np.testing.assert_array_equal(landed, expected)


@settings(max_examples=40, deadline=None)
@given(
    regions=st.lists(st.tuples(st.integers(0, 60), st.integers(0, 400)), min_size=1, max_size=8),
    pad=st.integers(0, 300),
)
def test_expected_chunks_count_every_chunk_per_band(regions, pad):
    """`grouped_dispatch.expected_chunks` for regions (a gap before each, rows) of any sizes,
    empty ones and ones that straddle bands included: per band the chunks of BAND rows (from
    each region's first row) that touch it, as counted chunk by chunk."""
    from commgemm.mosaic_gpu.grouped_dispatch import BAND, expected_chunks

    firsts, at = [], 0
    for gap, rows in regions:
        firsts.append(at + gap)
        at += gap + rows
    rows = [r for _, r in regions]
    m = at + pad + 1
    want = np.zeros(-(-m // BAND), np.int32)
    for first, count in zip(firsts, rows, strict=True):
        for lo in range(0, count, BAND):
            start, end = first + lo, first + min(lo + BAND, count) - 1
            for band in {start // BAND, end // BAND}:
                want[band] += 1
    got = jax.jit(expected_chunks, static_argnums=2)(jnp.array(firsts), jnp.array(rows), m)
    np.testing.assert_array_equal(np.asarray(got), want)


def _step_calls(size: int, fp8: bool, check_vma: bool, two_ops: bool = False) -> int:
    """The Mosaic GPU calls of the MoE block's training step (`expert_mlp`, NONE, named GELU;
    `two_ops`: `cg.all_to_all_grouped_matmul`, GELU, `cg.grouped_matmul_all_to_all`) lowered
    for CUDA as on a Hopper GPU."""
    from commgemm.grouped.expert_parallel import expert_mlp

    m, k, f, n, e = 512 // size, 256, 256, 256, 2
    grad = "float8_e5m2" if jax.__version_info__ >= (0, 11) else "float8_e4m3fn"  # mixed: 0.11
    recipe = cg.ScalingRecipe("current_tensor_scaling", grad_dtype=grad) if fp8 else None
    cfg = cg.OverlapConfig(method="none")

    def body(x, w1, w2, g):
        if two_ops:
            y, recv = cg.all_to_all_grouped_matmul(x, w1, g[0], "x", config=cfg, scaling=recipe)
            return cg.grouped_matmul_all_to_all(jax.nn.gelu(y), w2, recv, g[0], "x", config=cfg,
                                                scaling=recipe)  # fmt: skip
        return expert_mlp(x, w1, w2, g[0], "x", activation="gelu", config=cfg,
                          scaling=recipe)[0]  # fmt: skip

    fn = jax.shard_map(body, mesh=mesh1d(size), in_specs=(P("x"),) * 4, out_specs=P("x"),
                       check_vma=check_vma)  # fmt: skip
    loss = lambda *a: jnp.sum(fn(*a).astype(jnp.float32) ** 2)  # noqa: E731
    sds = jax.ShapeDtypeStruct
    args = (sds((size * m, k), jnp.bfloat16), sds((size * e, k, f), jnp.bfloat16),
            sds((size * e, f, n), jnp.bfloat16), sds((size, size * e), jnp.int32))  # fmt: skip
    text = jax.jit(jax.grad(loss, (0, 1, 2))).trace(*args).lower(lowering_platforms=("cuda",))
    return text.as_text().count("custom_call @mosaic_gpu")


@pytest.mark.parametrize(
    "size, fp8, check_vma, two_ops",
    [(2, False, True, False), (4, True, False, False), (4, False, False, True)],
)  # fmt: skip
def test_step_returns_from_the_gemm(size, fp8, check_vma, two_ops, monkeypatch):
    """As on a Hopper GPU the step's second GEMM and return exchange lower as one Mosaic GPU
    kernel, and in 16 bits so do the first GEMM's dX and the dispatch's transpose: a call
    fewer each than with them apart (`fused_reason` turned off); in the block and in the two
    ops users compose (`cg.all_to_all_grouped_matmul`, `cg.grouped_matmul_all_to_all`). In
    the 16-bit block the dispatch and dY's exchange run inside the GEMMs that read their rows
    (`arrive_reason`): a call fewer each again."""
    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu as transposed

    monkeypatch.setattr(mosaic_tiles, "hopper_reason", lambda: None)
    monkeypatch.setattr(mosaic_tiles, "num_sms", lambda: 132)
    monkeypatch.setattr(transposed, "jax", JaxOnAnH100())
    reasons = []
    fused_reason = returned.fused_reason
    monkeypatch.setattr(returned, "fused_reason",
                        lambda *a: reasons.append(fused_reason(*a)) or reasons[-1])  # fmt: skip
    arrivals, arrive_reason = [], returned.arrive_reason

    def spy(*a, **k):
        arrivals.append(arrive_reason(*a, **k))
        return arrivals[-1]

    monkeypatch.setattr(returned, "arrive_reason", spy)
    fused = _step_calls(size, fp8, check_vma, two_ops)
    assert reasons == [None] * (1 if fp8 else 2)  # 16-bit: dX's return from its GEMM too
    # in the 16-bit block (padding unread) the dispatch and dY's exchange run inside GEMMs too
    arrived = arrivals.count(None)
    assert arrived == (0 if fp8 or two_ops else 2), arrivals
    monkeypatch.setattr(returned, "fused_reason", lambda *a: "turned off")
    assert _step_calls(size, fp8, check_vma, two_ops) == fused + len(reasons) + arrived


def test_fused_only_where_the_kernels_run(monkeypatch):
    """Off a GPU and on one shard the GEMM and the exchange stay apart, with the reason; with
    one process per GPU they fuse where the NVLink kernels run there (`peers`: NCCL's peer
    addresses) and stay apart with the peers' reason where not, and in 16 bits where the
    weights' copy into collective memory outweighs the rows returned (WEIGHT_COPY_RATIO)."""
    reasons = []

    def traced(rows=2048, groups=2, size=2):
        x, w = jnp.zeros((rows, 256), jnp.bfloat16), jnp.zeros((groups, 256, 256), jnp.bfloat16)

        def body():
            reasons.append(returned.fused_reason(x, w, None, None, None, "x"))
            return jnp.zeros(())

        jax.eval_shape(jax.shard_map(body, mesh=mesh1d(size), in_specs=(), out_specs=P()))
        return reasons[-1]

    assert "one shard" in traced(size=1), reasons
    assert "GPUs" in traced(), reasons
    monkeypatch.setattr(mosaic_tiles, "hopper_reason", lambda: None)  # as on Hopper GPUs
    monkeypatch.setattr(mosaic_tiles, "num_sms", lambda: 132)
    assert traced() is None and traced(256, 8) is None
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(peers, "multiprocess_reason", lambda: "NCCL too old (stand-in)")
    assert traced() == "NCCL too old (stand-in)"
    monkeypatch.setattr(peers, "multiprocess_reason", lambda: None)
    # weights 2 x 256 x 256, rows a shard returns 1024 x 256: 1/2 of them; 8 groups, 128 rows:
    # 8x, over the ratio
    assert traced() is None
    assert "copy into collective memory" in traced(256, 8)


def test_rows_arrive_only_where_they_pay(monkeypatch):
    """The rows arrive inside the GEMM (`arrive_reason` None) where the ping-pong kernel takes
    the shape, K is whole pairs of the senders' staged blocks, the GEMM's N is at most
    ARRIVE_MAX_N (beyond, the exchange is short beside the GEMM) and SMs are left to multiply;
    a kernel whose ring cannot hold the staged blocks raises, and so does one asked for a
    result of another dtype than the rows'."""
    from commgemm.mosaic_gpu import grouped_dispatch, grouped_pingpong
    from commgemm.mosaic_gpu.configs import PingPongTiles

    monkeypatch.setattr(mosaic_tiles, "num_sms", lambda: 132)
    reason = returned.arrive_reason
    assert reason(4096, 2048, 1408, 32, jnp.bfloat16, "x") is None
    assert reason(4096, 2048, 1408, 32, jnp.bfloat16, "x", w_nk=True) is None  # dY @ w2^T
    assert "N=" in reason(4096, 4096, 14336, 8, jnp.bfloat16, "x")
    assert "staged" in reason(4096, 384, 1408, 32, jnp.bfloat16, "x")
    monkeypatch.setattr(mosaic_tiles, "num_sms", lambda: 2 * grouped_dispatch.SENDERS)
    assert "SMs" in reason(4096, 2048, 1408, 32, jnp.bfloat16, "x")

    size, rows, k = 2, 512, 256
    send = ex.Layout(jnp.array([0, 128, 256]), jnp.array([100, 50]))
    recv = ex.Layout(jnp.array([0, 100, 512]), jnp.array([100, 50]), by_group=True)

    def body(x, w):
        plan = returned.arrival_plan(x, send, recv, "x", rows)
        shape = jax.ShapeDtypeStruct((rows, k), x.dtype)
        tiles, sizes = PingPongTiles(stages=2), jnp.array([150], jnp.int32)
        return grouped_pingpong.grouped_matmul(shape, w, sizes, tiles, dispatched=plan)[0]

    f = jax.shard_map(body, mesh=mesh1d(size), in_specs=(P("x"), P()), out_specs=P("x"),
                      check_vma=False)  # fmt: skip
    args = jnp.zeros((size * rows, k), jnp.bfloat16), jnp.zeros((1, k, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match="no room for the senders' blocks"):
        jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))

    def wide(x, w):  # a float32 result: the senders' rows and the result share no dtype
        plan = returned.arrival_plan(x, send, recv, "x", rows)
        shape, sizes = jax.ShapeDtypeStruct((rows, k), x.dtype), jnp.array([150], jnp.int32)
        return grouped_pingpong.grouped_matmul(shape, w, sizes, dispatched=plan,
                                               out_dtype=jnp.float32)[0]  # fmt: skip

    f = jax.shard_map(wide, mesh=mesh1d(size), in_specs=(P("x"), P()), out_specs=P("x"),
                      check_vma=False)  # fmt: skip
    with pytest.raises(ValueError, match="rows dispatched into it take 16-bit operands"):
        jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
