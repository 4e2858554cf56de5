"""The compiled program does what the method promises."""

import re

import jax
import numpy as np
import pytest
from helpers import P, mesh1d, shard

import commgemm as cg


def _hlo(op, cfg, size=4, k_sharded=False):
    x = np.zeros((size * 16, size * 16) if k_sharded else (size * 16, 32), np.float32)
    w = np.zeros((size * 16, 8) if k_sharded else (32, size * 8), np.float32)
    if k_sharded:
        specs, out = (P(None, "x"), P("x", None)), P("x", None)
        if op is cg.matmul_all_reduce:
            out = P(None, None)
    else:
        specs, out = (P("x", None), P(None, "x")), P(None, "x")
    f = shard(lambda a, b: op(a, b, "x", config=cfg), mesh1d(size), specs, out)
    return f.lower(x, w).compile().as_text()


def _count(text, name):
    return len(re.findall(rf"= \S+ {name}(-start)?\(", text))


@pytest.mark.parametrize(
    "op,k_sharded",
    [(cg.all_gather_matmul, False), (cg.matmul_reduce_scatter, True), (cg.matmul_all_reduce, True)],
)
@pytest.mark.parametrize("bidirectional", [False, True])
def test_ring_exchange_uses_collective_permutes_only(op, k_sharded, bidirectional):
    text = _hlo(
        op,
        cg.OverlapConfig(method="ring_exchange", bidirectional=bidirectional),
        k_sharded=k_sharded,
    )
    assert _count(text, "collective-permute") >= 2
    assert _count(text, "reduce-scatter") == 0
    if op is not cg.matmul_all_reduce:  # AR ends with the all-gather of the reduced blocks
        assert _count(text, "all-gather") == 0
    assert _count(text, "all-reduce") == 0


@pytest.mark.parametrize(
    "op,k_sharded,collective",
    [
        (cg.all_gather_matmul, False, "all-gather"),
        (cg.matmul_reduce_scatter, True, "reduce-scatter"),
        (cg.matmul_all_reduce, True, "all-reduce"),
    ],
)
def test_pipeline_has_one_dot_and_collective_per_split(op, k_sharded, collective):
    text = _hlo(op, cg.OverlapConfig(method="pipeline", num_splits=4), k_sharded=k_sharded)
    assert _count(text, "dot") == 4
    # The CPU compiler's all-reduce combiner merges the four chunk all-reduces into one with four
    # operands (our ordering barriers are expanded before it runs), so count operands.
    assert _operands(text, collective) == 4


def _operands(text, name):
    calls = re.findall(rf"= (\([^=]*?\)|\S+) {name}(?:-start)?\(", text)
    return sum(shape.count("[") for shape in calls)


def test_serial_baseline_is_one_collective_one_dot():
    text = _hlo(cg.all_gather_matmul, cg.OverlapConfig())
    assert _count(text, "dot") == 1 and _count(text, "all-gather") == 1
    assert _count(text, "collective-permute") == 0


def test_ring_dot_count():
    """Unidirectional: one dot per step (P); num_splits=2: two per step."""
    assert _count(_hlo(cg.all_gather_matmul, cg.OverlapConfig(method="ring_exchange")), "dot") == 4
    text = _hlo(cg.all_gather_matmul, cg.OverlapConfig(method="ring_exchange", num_splits=2))
    assert _count(text, "dot") == 8


def test_compiles_for_jax_version():
    assert jax.__version__


def test_ring_steps_are_named_for_profiles():
    text = _hlo(cg.all_gather_matmul, cg.OverlapConfig(method="ring_exchange"))
    assert all(f"ring_ag_step{t}" in text for t in range(4))
    text = _hlo(cg.matmul_reduce_scatter, cg.OverlapConfig(method="ring_exchange"), k_sharded=True)
    assert all(f"ring_rs_step{t}" in text for t in range(4))


@pytest.mark.parametrize(
    "op,k_sharded", [(cg.all_gather_matmul, False), (cg.matmul_reduce_scatter, True)]
)
def test_ring_pieces_carry_schedule_hints(op, k_sharded):
    """With num_splits > 1, each piece's transfer is tied to the previous GEMM (an optimization
    barrier in the lowered program) so the GPU scheduler interleaves transfers and GEMMs."""
    x = np.zeros((64, 64), np.float32)
    w = np.zeros((64, 32), np.float32)
    specs = (
        ((P(None, "x"), P("x", None)), P("x", None))
        if k_sharded
        else ((P("x", None), P(None, "x")), P(None, "x"))
    )
    cfg = cg.OverlapConfig(method="ring_exchange", num_splits=2)
    f = shard(lambda a, b: op(a, b, "x", config=cfg), mesh1d(4), *specs)
    assert "optimization_barrier" in f.lower(x, w).as_text()


def test_chain_gemms_orders_the_pieces_gemms():
    """chain_gemms adds a barrier before every GEMM but the first; off, only transfers wait."""
    x, w = np.zeros((64, 64), np.float32), np.zeros((64, 32), np.float32)

    def barriers(chain):
        cfg = cg.OverlapConfig(method="ring_exchange", num_splits=2, chain_gemms=chain)
        f = shard(
            lambda a, b: cg.all_gather_matmul(a, b, "x", config=cfg),
            mesh1d(2),
            (P("x", None), P(None, "x")),
            P(None, "x"),
        )
        return f.lower(x, w).as_text().count("optimization_barrier")

    assert barriers(True) > barriers(False) >= 1
