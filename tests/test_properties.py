"""Hypothesis: any valid (mesh size, shape, config) gives the float64 reference's answer."""

import numpy as np
from helpers import P, assert_close, mesh1d, reference, shard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import commgemm as cg
from commgemm.plan import split_requirement

OPS = {
    "ag": (cg.all_gather_matmul, cg.Collective.ALL_GATHER),
    "rs": (cg.matmul_reduce_scatter, cg.Collective.REDUCE_SCATTER),
    "ar": (cg.matmul_all_reduce, cg.Collective.ALL_REDUCE),
}


@st.composite
def problems(draw):
    op = draw(st.sampled_from(sorted(OPS)))
    size = draw(st.sampled_from([1, 2, 3, 4, 8]))
    method = draw(st.sampled_from([cg.Method.NONE, cg.Method.PIPELINE, cg.Method.RING_EXCHANGE]))
    splits = draw(st.sampled_from([1, 2, 3])) if method is not cg.Method.NONE else 1
    ring = method is cg.Method.RING_EXCHANGE
    bidi = ring and draw(st.booleans())
    aggregate = ring and op == "ag" and draw(st.booleans())
    # Rows of the split dimension: a multiple of what the method needs.
    unit = split_requirement(OPS[op][1], method, size, splits)
    rows = unit * draw(st.integers(1, 3))
    k, n = draw(st.integers(1, 12)), draw(st.integers(1, 12))
    cfg = cg.OverlapConfig(
        method=method, num_splits=splits, bidirectional=bidi, aggregate=aggregate
    )
    return op, size, rows, k, n, cfg, draw(st.integers(0, 2**32 - 1))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_any_valid_problem_matches_reference(problem):
    op, size, rows, k, n, cfg, seed = problem
    rng = np.random.default_rng(seed)
    fn = OPS[op][0]
    if op == "ag":
        x, w = rng.standard_normal((size * rows, k)), rng.standard_normal((k, size * n))
        specs, out = (P("x", None), P(None, "x")), P(None, "x")
        kk = k
    else:
        x, w = rng.standard_normal((rows, size * k)), rng.standard_normal((size * k, n))
        specs, out = (P(None, "x"), P("x", None)), P("x" if op == "rs" else None, None)
        kk = size * k
    x, w = x.astype(np.float32), w.astype(np.float32)
    f = shard(lambda a, b: fn(a, b, "x", config=cfg), mesh1d(size), specs, out)
    assert_close(f(x, w), reference(x, w), np.float32, kk)
