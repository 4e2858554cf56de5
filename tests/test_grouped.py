"""Grouped GEMMs (mixture-of-experts) against a float64 masked reference: the local op with
bias, the all-gather and reduce-scatter forms for every method and both shard_map settings,
values and gradients, random group sizes (empty groups, one group taking every row, sums
short of the rows), and bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import P, balance_reference, load_script, mesh1d, shard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import commgemm as cg

METHODS = {
    "none": cg.OverlapConfig(),
    "pipeline2": cg.OverlapConfig(method="pipeline", num_splits=2),
    "ring": cg.OverlapConfig(method="ring_exchange"),
    "auto": cg.OverlapConfig(method="auto"),  # GROUPED_AUTO_RING_SIZES' choice per op and size
}


def reference(x, w, sizes):
    """float64 sum over groups of the group's rows times its weight (zero past the sum); in
    numpy where x and w are numpy arrays (no jax op to compile), else in jnp (traceable)."""
    xp = np if isinstance(x, np.ndarray) and isinstance(w, np.ndarray) else jnp
    if xp is np:
        x, w = x.astype(np.float64), w.astype(np.float64)
    ends = np.cumsum(sizes)
    rows = np.arange(x.shape[0])
    out = 0.0
    for g in range(w.shape[0]):
        mask = ((rows >= ends[g] - sizes[g]) & (rows < ends[g]))[:, None]
        out = out + xp.where(mask, x @ w[g], 0.0)
    return out


def random_sizes(rng, groups: int, rows: int) -> np.ndarray:
    """Counts summing to at most `rows`, with empty groups and sometimes one group taking all."""
    kind = rng.integers(3)
    if kind == 0:
        sizes = np.zeros(groups, np.int32)
        sizes[rng.integers(groups)] = rows
        return sizes
    cuts = np.sort(rng.integers(0, rows + 1, size=groups))
    sizes = np.diff(np.concatenate([[0], cuts])).astype(np.int32)
    if kind == 2:
        sizes[rng.integers(groups)] = 0  # an empty group, the sum short of the rows
    return sizes


def _grads(f, *args):
    """f(*args) and the gradient of sum(sin(f)) in x and w, in one jitted program (the float64
    references run eagerly op by op otherwise: a compile each)."""
    loss = lambda *a: jnp.sum(jnp.sin(f(*a)))  # noqa: E731
    return jax.jit(lambda *a: (f(*a), jax.grad(loss, argnums=(0, 1))(*a)))(*args)


def _close(got, want, tol=1e-9):
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=tol, atol=tol)


def test_grouped_matmul_and_bias(rng):
    x, w = rng.standard_normal((24, 16)), rng.standard_normal((3, 16, 8))
    sizes, bias = np.array([5, 0, 10], np.int32), rng.standard_normal((3, 8))
    out = cg.grouped_matmul(x, w, sizes, bias=bias)
    want = reference(x, w, sizes) + np.concatenate(
        [np.repeat(bias, sizes, axis=0), np.zeros((9, 8))]
    )
    _close(out, want)
    _close(_grads(lambda a, b: cg.grouped_matmul(a, b, sizes), x, w),
           _grads(lambda a, b: reference(a, b, sizes), x, w))  # fmt: skip
    assert cg.grouped_matmul(x.astype(np.float32), w.astype(np.float32), sizes).dtype == np.float32


@settings(max_examples=6, deadline=None)
@given(groups=st.integers(1, 6), rows=st.integers(1, 40), seed=st.integers(0, 2**31 - 1))
def test_hopper_weight_grad_fallback(groups, rows, seed):
    """The Hopper path's dW where K and N are not whole tiles (here: off the GPU too) is XLA's
    ragged dot: x_g^T dy_g per group, zero for empty groups, rows past the sum left out."""
    from commgemm.mosaic_gpu import grouped

    rng = np.random.default_rng(seed)
    x, dy = rng.standard_normal((rows, 12)), rng.standard_normal((rows, 20))
    sizes = random_sizes(rng, groups, rows)
    got = grouped.weight_grad(jnp.asarray(x), jnp.asarray(dy), jnp.asarray(sizes))
    ends = np.cumsum(sizes)
    want = [x[e - s : e].T @ dy[e - s : e] for s, e in zip(sizes, ends, strict=True)]
    _close(got, np.stack(want))


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    check_vma=st.booleans(),
    size=st.sampled_from([2, 4, 8]),
    method=st.sampled_from(sorted(METHODS)),
    groups=st.integers(1, 5),
    m=st.sampled_from([2, 4, 6]),
    seed=st.integers(0, 2**31 - 1),
)
def test_all_gather_grouped_matmul(check_vma, size, method, groups, m, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((size * m, 6))
    w = rng.standard_normal((groups, 6, size * 3))
    sizes = np.stack([random_sizes(rng, groups, m) for _ in range(size)])
    f = shard(
        lambda a, b, c: cg.all_gather_grouped_matmul(a, b, c[0], "x", config=METHODS[method]),
        mesh1d(size),
        (P("x"), P(None, None, "x"), P("x")),
        P(None, "x"),
        check_vma=check_vma,
    )

    def plain(a, b):
        return jnp.concatenate(
            [reference(a[s * m : (s + 1) * m], b, sizes[s]) for s in range(size)]
        )

    _close(_grads(lambda a, b: f(a, b, sizes), x, w), _grads(plain, x, w))


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    check_vma=st.booleans(),
    size=st.sampled_from([2, 4, 8]),
    method=st.sampled_from(sorted(METHODS)),
    groups=st.integers(1, 5),
    r=st.sampled_from([2, 4]),
    seed=st.integers(0, 2**31 - 1),
)
def test_grouped_matmul_reduce_scatter(check_vma, size, method, groups, r, seed):
    rng = np.random.default_rng(seed)
    rows = size * r
    x = rng.standard_normal((rows, size * 3))
    w = rng.standard_normal((groups, size * 3, 5))
    sizes = random_sizes(rng, groups, rows)
    f = shard(
        lambda a, b: cg.grouped_matmul_reduce_scatter(
            a, b, jnp.asarray(sizes), "x", config=METHODS[method]
        ),
        mesh1d(size),
        (P(None, "x"), P(None, "x", None)),
        P("x"),
        check_vma=check_vma,
    )
    _close(_grads(f, x, w), _grads(lambda a, b: reference(a, b, sizes), x, w))


def test_auto_resolves_per_op():
    """AUTO runs each grouped op's measured method for the axis size (one device: the serial
    one), one-way and unsplit whatever else the config says; an explicit method stays as it
    is. As measured on 2 and 4 GPUs: the all-gather's ring on two, NONE elsewhere and with
    float8 blocks."""
    from commgemm.plan import make_grouped_plan

    def resolve_grouped(config, op, size, float8=False):
        return make_grouped_plan(config, op, size, float8=float8).config

    auto = cg.OverlapConfig(method="auto", num_splits=4, bidirectional=True)
    ops = ("all_gather_grouped_matmul", "grouped_matmul_reduce_scatter",
           "all_to_all_grouped_matmul", "grouped_matmul_all_to_all")  # fmt: skip
    for op in ops:
        for size in (1, 2, 4, 8):
            cfg = resolve_grouped(auto, op, size)
            ring = size == 2 and op == "all_gather_grouped_matmul"
            method = cg.Method.RING_EXCHANGE if ring else cg.Method.NONE
            assert (cfg.method, cfg.num_splits, cfg.bidirectional) == (method, 1, False)
            # blocks on the float8 kernel: NONE at every size (measured on 2 GPUs)
            assert resolve_grouped(auto, op, size, float8=True).method is cg.Method.NONE
        if "all_to_all" in op:  # the expert-parallel ops take NONE and the ring only
            with pytest.raises(ValueError, match="NONE and RING_EXCHANGE"):
                resolve_grouped(METHODS["pipeline2"], op, 4)
            continue
        assert resolve_grouped(METHODS["pipeline2"], op, 4) == METHODS["pipeline2"]
        assert resolve_grouped(METHODS["pipeline2"], op, 4, float8=True) == METHODS["pipeline2"]


@pytest.mark.parametrize(
    "args,error,match",
    [
        (((4, 8), (2, 8, 3), (2,)), None, None),
        (((4, 8), (2, 7, 3), (2,)), ValueError, "contracting dimensions differ"),
        (((4, 8), (2, 8, 3), (3,)), ValueError, r"group_sizes must have shape \(2,\)"),
        (((8,), (2, 8, 3), (2,)), ValueError, r"x must be \[rows, K\]"),
    ],
)
def test_bad_input(args, error, match):
    (xs, ws, gs) = args
    x, w, sizes = np.ones(xs), np.ones(ws), np.ones(gs, np.int32)
    if error is None:
        assert cg.grouped_matmul(x, w, sizes).shape == (4, 3)
        with pytest.raises(TypeError, match="group_sizes must be integers"):
            cg.grouped_matmul(x, w, sizes.astype(np.float32))
        with pytest.raises(ValueError, match="not a valid ScalingMode"):
            cg.grouped_matmul(x, w, sizes, scaling="fp8")
        with pytest.raises(ValueError, match="multiples of 32"):
            cg.grouped_matmul(x, w, sizes, scaling="mxfp8_1d_scaling")
        with pytest.raises(ValueError, match=r"must be >= 0, got \[-1, 2\]"):
            cg.grouped_matmul(x, w, np.array([-1, 2], np.int32))
        with pytest.raises(ValueError, match="sum to 5, more than x's 4 rows"):
            cg.grouped_matmul(x, w, np.array([3, 2], np.int32))
        # traced counts are not checked: a sum past M cuts the groups at row M, as ragged_dot
        cut = jax.jit(cg.grouped_matmul)(x, w, np.array([3, 2], np.int32))
        np.testing.assert_array_equal(cut, jax.lax.ragged_dot(x, w, np.array([3, 1], np.int32)))
        with pytest.raises(ValueError, match="one way"):
            shard(
                lambda a, b: cg.all_gather_grouped_matmul(
                    a, b, jnp.ones(2, jnp.int32), "x",
                    config=cg.OverlapConfig(method="ring", bidirectional=True),
                ),
                mesh1d(2), (P("x"), P(None, None, "x")), P(None, "x"),
            )(np.ones((8, 8)), np.ones((2, 8, 6)))  # fmt: skip
        return
    with pytest.raises(error, match=match):
        cg.grouped_matmul(x, w, sizes)


def _expert_sizes(rng, experts: int, m: int) -> np.ndarray:
    """One shard's counts per global expert: at most m tokens, some experts empty."""
    tokens = rng.integers(0, experts, size=rng.integers(0, m + 1))
    return np.bincount(tokens, minlength=experts).astype(np.int32)


def _check_expert_mlp(f, x, w1, w2, sizes, capacity=None) -> None:
    """f(x, w1, w2, sizes), the experts' MLP (tanh between) on every shard's rows dispatched and
    returned, and its gradients, against the float64 reference on one device; with `capacity`
    each shard's tokens for a shard past their first `capacity` give zeros."""
    size = sizes.shape[0]
    m = x.shape[0] // size
    kept = np.ones((size * m, 1))
    if capacity is not None:  # each source's rows for each destination, past the capacity
        for s, per_dest in enumerate(sizes.reshape(size, size, -1).sum(axis=2)):
            start = s * m + np.cumsum(per_dest) - per_dest
            for a, n in zip(start, per_dest, strict=True):
                kept[a + min(n, capacity) : a + n] = 0

    def plain(a, b, c):
        return kept * jnp.concatenate(
            [reference(jnp.tanh(reference(a[s * m : (s + 1) * m], b, sizes[s])), c, sizes[s])
             for s in range(size)]
        )  # fmt: skip

    def both(g):  # values and gradients in one jitted program
        loss = lambda *a: jnp.sum(jnp.sin(g(*a)))  # noqa: E731
        return jax.jit(lambda *a: (g(*a), jax.grad(loss, (0, 1, 2))(*a)))(x, w1, w2)

    _close(both(lambda *a: f(*a, sizes)), both(plain))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    check_vma=st.booleans(),
    size=st.sampled_from([1, 2, 4, 8]),
    method=st.sampled_from(["none", "ring", "auto"]),
    per_shard=st.integers(1, 3),
    m=st.sampled_from([3, 8]),
    capacity=st.one_of(st.none(), st.integers(1, 10)),
    seed=st.integers(0, 2**31 - 1),
    mlp=st.booleans(),
)
def test_expert_parallel_dispatch_and_return(
    check_vma, size, method, per_shard, m, capacity, seed, mlp
):
    """Tokens to their experts' shards and back: each shard's result equals ragged_dot with every
    expert's weights on one device, activation between, values and gradients; shards with no
    tokens and experts with none included; the two ops, or `expert_mlp`. With a capacity C each
    shard sends each shard only its first C tokens for it: the rest come back as zeros (the
    reference's rows zeroed; C past the m rows: nothing dropped)."""
    from commgemm.grouped.expert_parallel import expert_mlp

    rng = np.random.default_rng(seed)
    experts = size * per_shard
    x = rng.standard_normal((size * m, 5))
    w1, w2 = rng.standard_normal((experts, 5, 4)), rng.standard_normal((experts, 4, 3))
    sizes = np.stack([_expert_sizes(rng, experts, m) for _ in range(size)])
    cfg = cg.OverlapConfig(method=method)

    def body(a, b, c, g):
        if mlp:  # the same as one function (NONE: regrouped once for both GEMMs)
            return expert_mlp(a, b, c, g[0], "x", activation=jnp.tanh, config=cfg,
                              capacity=capacity)[0]  # fmt: skip
        y, received = cg.all_to_all_grouped_matmul(a, b, g[0], "x", config=cfg,
                                                   capacity=capacity)  # fmt: skip
        assert y.shape[:2] == (size, m if capacity is None else min(capacity, m))
        return cg.grouped_matmul_all_to_all(jnp.tanh(y), c, received, g[0], "x", config=cfg,
                                            tokens=m)  # fmt: skip

    f = shard(body, mesh1d(size), (P("x"),) * 4, P("x"), check_vma=check_vma)
    _check_expert_mlp(f, x, w1, w2, sizes, capacity)


@pytest.mark.parametrize("capacity", [None, 3], ids=["all", "capped"])
@pytest.mark.parametrize("size", [1, 2, 4])
def test_expert_mlp_rows_arrive_by_expert(size, capacity):
    """`expert_mlp` with NONE (the tokens exchanged straight into expert order and back; one
    shard: a select) on fresh counts, some experts empty, against the float64 reference."""
    from commgemm.grouped.expert_parallel import expert_mlp

    rng, m, per_shard = np.random.default_rng(), 8, 3
    experts = size * per_shard
    x = rng.standard_normal((size * m, 5))
    w1, w2 = rng.standard_normal((experts, 5, 4)), rng.standard_normal((experts, 4, 3))
    sizes = np.stack([_expert_sizes(rng, experts, m) for _ in range(size)])
    cfg = cg.OverlapConfig(method="none")

    def body(a, b, c, g):
        return expert_mlp(a, b, c, g[0], "x", activation=jnp.tanh, config=cfg,
                          capacity=capacity)[0]  # fmt: skip

    f = shard(body, mesh1d(size), (P("x"),) * 4, P("x"))
    _check_expert_mlp(f, x, w1, w2, sizes, capacity)


@pytest.mark.parametrize("method", ["none", "ring"])
def test_capacity_caps_the_counts_that_travel(method):
    """The counts a shard receives with a capacity C are the sender's first C tokens for it, by
    expert (the kernels' row counts must match the rows sent): sender s's counts for shard d's
    experts cut where their running sum passes C."""
    size, e, m, capacity = 2, 2, 8, 3
    sizes = np.array([[3, 2, 1, 2], [0, 4, 3, 1]], np.int32)  # [source, global expert]
    x, w = np.ones((size * m, 4)), np.ones((size * e, 4, 2))
    cfg = cg.OverlapConfig(method=method)
    body = lambda a, b, g: cg.all_to_all_grouped_matmul(a, b, g[0], "x", config=cfg,  # noqa: E731
                                                        capacity=capacity)[1]  # fmt: skip
    got = np.asarray(shard(body, mesh1d(size), (P("x"),) * 3, P("x"))(x, w, sizes))
    want = np.zeros((size, size, e), np.int32)  # [dest, source, its expert]
    for s, row in enumerate(sizes):
        for d in range(size):
            left = capacity
            for j, n in enumerate(row[d * e : (d + 1) * e]):
                want[d, s, j], left = min(n, left), left - min(n, left)
    np.testing.assert_array_equal(got, want.reshape(size * size, e))


def test_expert_parallel_refuses_bad_capacity_and_pipeline():
    """A capacity that is no positive int, a `tokens` below the blocks' rows, and PIPELINE
    (the expert-parallel ops and `expert_mlp` run NONE or the ring) are refused."""
    from commgemm.grouped.expert_parallel import expert_mlp

    size, m = 2, 8
    x, w = np.ones((size * m, 5)), np.ones((size * 2, 5, 5))
    sizes = np.full((size, size * 2), 2, np.int32)
    run = lambda body: shard(body, mesh1d(size), (P("x"),) * 3, P("x"))(x, w, sizes)  # noqa: E731
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="capacity must be a positive number of rows"):
            run(lambda a, b, g, c=bad: cg.all_to_all_grouped_matmul(a, b, g[0], "x", capacity=c)[0])
    with pytest.raises(ValueError, match="tokens=4 must be an int of at least y's 8 rows"):
        run(lambda a, b, g: cg.grouped_matmul_all_to_all(
            cg.all_to_all_grouped_matmul(a, b, g[0], "x")[0], b, g[0].reshape(size, 2), g[0],
            "x", tokens=4))  # fmt: skip
    pipeline = cg.OverlapConfig(method="pipeline", num_splits=2)
    with pytest.raises(ValueError, match="supports methods NONE and RING_EXCHANGE"):
        run(lambda a, b, g: expert_mlp(a, b, b, g[0], "x", config=pipeline)[0])


def _moe_step_text(method: str, size: int = 4) -> str:
    """The lowered StableHLO of the MoE block's gradient (m 16, H 8, F 12, 8 experts, top 2)."""
    from commgemm.grouped.moe import moe_per_shard

    m, h, f, experts = 16, 8, 12, 8
    rng = np.random.default_rng(0)
    args = [rng.standard_normal(s) for s in ((size * m, h), (h, experts), (experts, h, f),
                                              (experts, f, h))]  # fmt: skip
    cfg = cg.OverlapConfig(method=method)
    block = shard(lambda a, r, b, c: moe_per_shard(a, r, b, c, k=2, axis_name="x", config=cfg,
                                                   scaling=None),
                  mesh1d(size), (P("x"), P(), P("x"), P("x")), P("x"))  # fmt: skip
    grad = jax.jit(jax.grad(lambda *a: jnp.sum(block(*a) ** 2), argnums=(0, 1, 2, 3)))
    return grad.lower(*args).as_text()


@pytest.mark.parametrize("method", ["none", "ring"])
def test_moe_block_moves_rows_by_gathers(method):
    """The MoE block's training step sorts, dispatches, returns and combines the token rows by
    gathers, forward and backward: no scatter of rows (the transpose of a gather, a scatter-add,
    ran atomics far below the memory's bandwidth on GPUs); scatters of indices only."""
    text = _moe_step_text(method)
    scatters = [ln for ln in text.splitlines() if "stablehlo.scatter" in ln]
    assert scatters and not [ln for ln in scatters if "update_window_dims = [" in ln], scatters


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("method", ["none", "ring"])
def test_moe_block_exchanges(method, size):
    """NONE moves the MoE block's token rows ([P, C, H] blocks) in four all-to-alls, the
    dispatch and the return, forward and backward (on 4 H100s one NCCL all-to-all moved them in
    0.6x the time of P ppermutes), and no collective-permute; the ring by collective-permutes
    alone, P - 1 real shifts per exchange and direction."""
    from test_scaled import _operand_types

    text = _moe_step_text(method, size)
    blocks = lambda op: [t for t in _operand_types(text, op) if t.count("x") == 3]  # noqa: E731
    if method == "none":
        assert len(blocks("all_to_all")) == 4 and not _operand_types(text, "collective_permute")
    else:
        assert not _operand_types(text, "all_to_all")
        assert len(_operand_types(text, "collective_permute")) >= 4 * (size - 1)


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("method", ["none", "ring"])
def test_moe_block_keeps_lean_residuals(method, check_vma):
    """What autodiff keeps of the MoE block for its backward (what a scan over layers or
    micro-batches stores per step; bf16 operands): the dispatch's and return's row selections
    keep [rows] flags, not masks of the rows' shape, the combine keeps the experts' outputs
    in bf16, not their [m, k, H] float32 copy, and the GELU between the GEMMs its input and
    output alone."""
    import contextlib
    import io
    import re

    from jax.ad_checkpoint import print_saved_residuals

    from commgemm.grouped.moe import moe_per_shard

    size, m, h, f, experts, k = 2, 16, 8, 12, 8, 2
    rng = np.random.default_rng(0)
    shapes = ((size * m, h), (h, experts), (experts, h, f), (experts, f, h))
    args = [jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in shapes]
    cfg = cg.OverlapConfig(method=method)
    printed = io.StringIO()

    def loss(*p):
        out = moe_per_shard(*p, k=k, axis_name="x", config=cfg, scaling=None)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    def body(*p):
        with contextlib.redirect_stdout(printed):
            print_saved_residuals(loss, *p)
        return loss(*p)[None]

    shard(body, mesh1d(size), (P("x"), P(), P("x"), P("x")), P("x"), check_vma=check_vma)(*args)
    lines = printed.getvalue().splitlines()
    kept = [re.match(r"(\w+)\[([\d,]*)\]", line).groups() for line in lines]
    assert ("bf16", f"{m},{k},{h}") in kept or ("bf16", f"{m * k},{h}") in kept, kept
    assert not [s for d, s in kept if d == "bool" and "," in s], kept
    assert ("f32", f"{m},{k},{h}") not in kept, kept
    # the activations between the GEMMs (P*m*k rows of F): the GELU's input and output, not
    # the intermediates of jax.nn.gelu's autodiff (four arrays of their size)
    between = [np.prod([int(d) for d in s.split(",")]) for d, s in kept
               if s.endswith(f",{f}") and s != f"{experts // size},{h},{f}"]  # fmt: skip
    assert 0 < sum(between) <= 2 * size * m * k * f, kept


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("method", ["none", "ring"])
def test_moe_block_in_a_scan(method, check_vma):
    """The MoE block over 3 micro-batches in a `lax.scan` inside shard_map (gradient
    accumulation; a scan over layers stacks the same residuals): the loss and the gradients of
    the router and both experts' weights equal those of the 3 blocks unrolled (float64
    operands; the gates are float32, the block's softmax, so within float32's rounding)."""
    from commgemm.grouped.moe import moe_per_shard

    steps, size, m, h, f, experts = 3, 2, 8, 8, 6, 4
    rng = np.random.default_rng(7)
    xs, router, w1, w2 = (rng.standard_normal(s) for s in ((steps, size * m, h), (h, experts),
                          (experts, h, f), (experts, f, h)))  # fmt: skip
    cfg = cg.OverlapConfig(method=method)

    def block(x, r, a, b):
        out = moe_per_shard(x, r, a, b, k=2, axis_name="x", config=cfg, scaling=None)
        return jnp.sum(jnp.sin(out))

    def scanned(xs, r, a, b):
        zero = jax.lax.pcast(jnp.zeros(()), ("x",), to="varying") if check_vma else 0.0
        return jax.lax.scan(lambda c, x: (c + block(x, r, a, b), None), zero, xs)[0][None]

    def unrolled(xs, r, a, b):
        return sum(block(xs[i], r, a, b) for i in range(steps))[None]

    specs = (P(None, "x"), P(), P("x"), P("x"))
    losses = {}
    for name, body in (("scan", scanned), ("unrolled", unrolled)):
        f_ = shard(body, mesh1d(size), specs, P("x"), check_vma=check_vma)
        loss = lambda *a, f_=f_: jnp.sum(f_(*a))  # noqa: E731
        losses[name] = (loss(xs, router, w1, w2),
                        jax.grad(loss, argnums=(1, 2, 3))(xs, router, w1, w2))  # fmt: skip
    np.testing.assert_allclose(losses["scan"][0], losses["unrolled"][0], rtol=1e-6)
    for name, g, r in zip(("router", "w1", "w2"), losses["scan"][1], losses["unrolled"][1],
                          strict=True):  # fmt: skip
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6 * np.abs(r).max(), err_msg=name)


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("method", ["none", "ring"])
def test_moe_block_capacity_on_balanced_routing(check_vma, method):
    """Routing that gives every expert the same copies from every shard (token i of a shard
    prefers experts i and i + 1, of 8): with capacity factor 1 each shard sends each shard
    4 rows, not 16, and nothing is dropped, so the capped block equals the uncapped one
    (float64, values and gradients); at factor 0.5 it differs."""
    from commgemm.grouped.moe import moe_per_shard

    size, m, h, f, experts = 4, 8, 8, 6, 8
    rng = np.random.default_rng(1)
    x = np.tile(np.eye(m) * 4 + np.roll(np.eye(m), 1, axis=1) * 3, (size, 1))  # [size*m, 8]
    x = x + 0.01 * rng.standard_normal(x.shape)
    args = [x, np.eye(h), rng.standard_normal((experts, h, f)),
            rng.standard_normal((experts, f, h))]  # fmt: skip
    cfg = cg.OverlapConfig(method=method)

    def block(**kw):
        body = lambda a, r, b, c: moe_per_shard(a, r, b, c, k=2, axis_name="x", config=cfg,  # noqa: E731
                                                scaling=None, **kw)  # fmt: skip
        f = shard(body, mesh1d(size), (P("x"), P(), P("x"), P("x")), P("x"), check_vma=check_vma)
        loss = lambda *a: jnp.sum(jnp.sin(f(*a)))  # noqa: E731
        return f(*args), jax.grad(loss, argnums=(0, 1, 2, 3))(*args)

    full = block()
    _close(block(capacity_factor=1.0), full)
    with pytest.raises(AssertionError):
        _close(block(capacity_factor=0.5), full)


def test_moe_example_matches_its_unsharded_twin():
    module = load_script("examples/moe_block.py", "moe_block")
    assert module.check(jax.devices()[:4], tokens=16, hidden=8, ffn=12) < 1e-4


@settings(max_examples=4, deadline=None)
@given(
    blocks=st.integers(1, 4), groups=st.integers(1, 5), rows=st.integers(1, 24),
    seed=st.integers(0, 2**31 - 1),
)  # fmt: skip
def test_merged_blocks(blocks, groups, rows, seed):
    """P blocks' grouped GEMMs in one (`grouped.blocks.merged_matmul`): the rows regrouped by a
    permutation (each group's rows contiguous, in block order, the rows in no group last), the
    result every block's own grouped GEMM (zero past its sum), values and gradients."""
    from commgemm.grouped.blocks import merged_matmul, merged_rows

    rng = np.random.default_rng(seed)
    sizes = np.stack([random_sizes(rng, groups, rows) for _ in range(blocks)])
    dest, merged = merged_rows(jnp.asarray(sizes), rows)
    assert sorted(np.asarray(dest).tolist()) == list(range(blocks * rows))
    np.testing.assert_array_equal(merged, sizes.sum(0))
    x = rng.standard_normal((blocks, rows, 8))
    w = rng.standard_normal((groups, 8, 5))
    merged = jax.jit(lambda a, b: merged_matmul(a, b, jnp.asarray(sizes), None, None))
    want = jax.jit(lambda a: jnp.stack([reference(a[p], w, sizes[p]) for p in range(blocks)]))
    _close(merged(x, w), want(x))

    def each(a, b):
        return jnp.stack([cg.grouped_matmul(a[p], b, sizes[p]) for p in range(blocks)])

    def loss(f):
        return jax.jit(jax.grad(lambda a, b: jnp.sum(f(a, b) * jnp.arange(5.0)), (0, 1)))(x, w)

    got_g = loss(merged)
    want_g = loss(each)
    for g, e in zip(got_g, want_g, strict=True):
        _close(g, e)


@pytest.mark.parametrize(
    ("op", "config", "rows", "match"),
    [
        ("all_gather_grouped_matmul", cg.OverlapConfig(method="pipeline", atomic_gemm=True), 8,
         "no fused kernel"),
        ("grouped_matmul_reduce_scatter", cg.OverlapConfig(method="bulk"), 8, "got BULK"),
        ("all_gather_grouped_matmul", cg.OverlapConfig(method="ring_exchange",
                                                       bidirectional=True), 8, "one way"),
        ("grouped_matmul_reduce_scatter", cg.OverlapConfig(method="pipeline", num_splits=4), 12,
         "divisible"),
        ("grouped_matmul_all_to_all", cg.OverlapConfig(method="pipeline"), None,
         "NONE and RING_EXCHANGE"),
    ],
)  # fmt: skip
def test_grouped_plan_refuses_what_the_grouped_ops_cannot_run(op, config, rows, match):
    """The grouped ops' plan (`plan.make_grouped_plan`) refuses at trace time, naming the op:
    fused kernels, BULK, a two-way ring, rows that do not split into the reduce-scatter's
    size x num_splits pieces, column chunks for the expert-parallel ops."""
    from commgemm.plan import make_grouped_plan

    with pytest.raises(ValueError, match=match):
        make_grouped_plan(config, op, 2, rows=rows, per_device=op.endswith("reduce_scatter"))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tokens=st.integers(1, 48), experts=st.integers(2, 12), data=st.data())
def test_load_balancing_loss_against_numpy(tokens, experts, data):
    """The loss of random logits (float64, float32, bf16) against float64 numpy, for every k."""
    from commgemm.grouped.moe import load_balancing_loss

    k = data.draw(st.integers(1, experts))
    dtype = data.draw(st.sampled_from([np.float64, np.float32, jnp.bfloat16]))
    logits = np.random.default_rng(tokens * 31 + experts).standard_normal((tokens, experts))
    logits = np.asarray(logits.astype(dtype), np.float64)  # the values the loss sees
    got = jax.jit(load_balancing_loss, static_argnums=1)(jnp.asarray(logits, dtype), k)
    assert got.dtype == (jnp.float64 if dtype == np.float64 else jnp.float32)
    np.testing.assert_allclose(float(got), balance_reference(logits, k), rtol=1e-5)


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("size", [2, 4])
def test_load_balancing_loss_over_shards(rng, size, check_vma):
    """Tokens split over `size` shards: every shard returns the loss of all tokens, and its
    gradient with respect to the logits is the unsplit loss's (float64)."""
    from commgemm.grouped.moe import load_balancing_loss

    logits = rng.standard_normal((8 * size, 8))
    split = shard(lambda a: load_balancing_loss(a, 2, "x"), mesh1d(size), P("x"), P(),
                  check_vma)  # fmt: skip
    np.testing.assert_allclose(float(split(logits)), balance_reference(logits, 2), rtol=1e-12)
    whole = jax.grad(lambda a: load_balancing_loss(a, 2))(logits)
    assert np.abs(whole).max() > 0
    np.testing.assert_allclose(np.asarray(jax.grad(split)(logits)), whole, rtol=1e-10,
                               atol=1e-14)  # fmt: skip


def test_load_balancing_loss_bounds():
    """1 for routing spread evenly over the experts, E for every token on one expert; a k
    outside 1..E is refused."""
    from commgemm.grouped.moe import load_balancing_loss

    experts = 8
    even = 50.0 * np.eye(experts)[np.arange(64) % experts]  # token t on expert t mod E
    np.testing.assert_allclose(float(load_balancing_loss(jnp.asarray(even), 1)), 1.0, rtol=1e-9)
    one = np.zeros((64, experts))
    one[:, 3] = 50.0
    np.testing.assert_allclose(float(load_balancing_loss(jnp.asarray(one), 1)), experts,
                               rtol=1e-9)  # fmt: skip
    for bad in (0, experts + 1):
        with pytest.raises(ValueError, match="between 1 and the experts' count 8"):
            load_balancing_loss(jnp.asarray(one), bad)
