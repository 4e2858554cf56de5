"""`cg.gemm` on sharded arrays: the collective inferred from the shardings, and the 2-D case."""

import jax
import numpy as np
import pytest
from helpers import P, assert_close, mesh1d, mesh2d, random, reference
from jax.sharding import AxisType, NamedSharding

import commgemm as cg

RING = cg.OverlapConfig(method="ring_exchange", bidirectional=True)
LAYOUTS = {  # name: (x spec, w spec, out spec)
    "ag": (P("x", None), P(None, "x"), P(None, "x")),
    "rs": (P(None, "x"), P("x", None), P("x", None)),
    "ar": (P(None, "x"), P("x", None), P(None, None)),
    "local": (P("x", None), P(None, None), P("x", None)),
    "xla": (P(None, None), P("x", None), P(None, "x")),
}


def _placed(rng, mesh, specs, shape=(32, 24, 16)):
    m, k, n = shape
    x, w = random(rng, (m, k)), random(rng, (k, n))
    xs, ws, _ = specs
    return (
        x,
        w,
        jax.device_put(x, NamedSharding(mesh, xs)),
        jax.device_put(w, NamedSharding(mesh, ws)),
    )


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_inferred_layouts(rng, layout, axis_type):
    mesh = jax.make_mesh((4,), ("x",), axis_types=(axis_type,))
    x, w, xd, wd = _placed(rng, mesh, LAYOUTS[layout])
    out_sharding = NamedSharding(mesh, LAYOUTS[layout][2])
    out = cg.gemm(xd, wd, out_sharding=out_sharding, config=RING)
    assert_close(out, reference(x, w), np.float32, x.shape[1])
    assert out.sharding.is_equivalent_to(out_sharding, 2)


@pytest.mark.parametrize("layout", ["ag", "rs", "ar"])
def test_under_jit_with_specs(rng, layout):
    mesh = mesh1d(4)
    xs, ws, os = LAYOUTS[layout]
    x, w, xd, wd = _placed(rng, mesh, LAYOUTS[layout])
    f = jax.jit(
        lambda a, b: cg.gemm(
            a, b, out_sharding=NamedSharding(mesh, os), config=RING, x_spec=xs, w_spec=ws
        )
    )
    assert_close(f(xd, wd), reference(x, w), np.float32, x.shape[1])


@pytest.mark.parametrize("collective,layout", [("all_gather", "ag"), ("reduce_scatter", "rs")])
def test_under_jit_specs_implied_by_collective(rng, collective, layout):
    mesh = mesh1d(4)
    x, w, xd, wd = _placed(rng, mesh, LAYOUTS[layout])
    cfg = RING.replace(collective=collective)
    f = jax.jit(
        lambda a, b: cg.gemm(a, b, out_sharding=NamedSharding(mesh, LAYOUTS[layout][2]), config=cfg)
    )
    assert_close(f(xd, wd), reference(x, w), np.float32, x.shape[1])


def test_under_jit_explicit_axes_reads_types(rng):
    mesh = jax.make_mesh((4,), ("x",), axis_types=(AxisType.Explicit,))
    x, w, xd, wd = _placed(rng, mesh, LAYOUTS["rs"])
    f = jax.jit(lambda a, b: cg.gemm(a, b, out_sharding=P("x", None), config=RING))
    assert_close(f(xd, wd), reference(x, w), np.float32, x.shape[1])


def test_sequence_parallel_nd_with_data_axis(rng):
    """x [B, S, H] on P('data', 'tp', None): AG over tp along S; the data axis passes through."""
    mesh = mesh2d(2, 4)
    mesh = jax.sharding.Mesh(mesh.devices, ("data", "tp"))
    x, w = random(rng, (4, 16, 8)), random(rng, (8, 12))
    xd = jax.device_put(x, NamedSharding(mesh, P("data", "tp", None)))
    wd = jax.device_put(w, NamedSharding(mesh, P(None, "tp")))
    out = cg.gemm(xd, wd, out_sharding=P("data", None, "tp"), config=RING)
    assert_close(out, reference(x, w), np.float32, 8)


@pytest.mark.parametrize("rows,cols", [(2, 2), (2, 4), (4, 2)])
@pytest.mark.parametrize(
    "cfg",
    [
        cg.OverlapConfig(),
        cg.OverlapConfig(method="pipeline", num_splits=2),
        cg.OverlapConfig(method="ring_exchange", bidirectional=True),
    ],
    ids=["none", "pipeline", "ring"],
)
def test_2d_mesh(rng, rows, cols, cfg):
    """The notebook's layout: x P('x','y'), w P('x', None) -> out P('x', None)."""
    mesh = mesh2d(rows, cols)
    x, w = random(rng, (rows * cols * 8, 64)), random(rng, (64, 16))
    xd = jax.device_put(x, NamedSharding(mesh, P("x", "y")))
    wd = jax.device_put(w, NamedSharding(mesh, P("x", None)))
    out = cg.gemm(xd, wd, out_sharding=P("x", None), config=cfg)
    assert_close(out, reference(x, w), np.float32, 64)
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, P("x", None)), 2)


def test_contradictory_collective(rng):
    mesh = mesh1d(4)
    _, _, xd, wd = _placed(rng, mesh, LAYOUTS["ag"])
    with pytest.raises(ValueError, match="contradicts the shardings"):
        cg.gemm(
            xd, wd, out_sharding=P(None, "x"), config=cg.OverlapConfig(collective="reduce_scatter")
        )


def test_unknown_mesh_axis_in_out_spec(rng):
    mesh = mesh1d(4)
    _, _, xd, wd = _placed(rng, mesh, LAYOUTS["ag"])
    with pytest.raises(ValueError, match="names axis 'tp', not in the mesh"):
        cg.gemm(xd, wd, out_sharding=P(None, "tp"))


def test_eager_calls_reuse_the_compiled_plan(rng, monkeypatch):
    """cg.gemm outside jit traces once per (shapes, shardings, config), as jax.jit would: a
    ring method's second call does not plan (trace) again."""
    import commgemm.ops as ops
    from commgemm.gemm import _sharded_call

    planned = []
    real = ops.make_plan
    monkeypatch.setattr(ops, "make_plan", lambda *a, **k: planned.append(1) or real(*a, **k))
    _sharded_call.cache_clear()
    mesh = mesh1d(4)
    x = jax.device_put(random(rng, (64, 16)), NamedSharding(mesh, P("x", None)))
    w = jax.device_put(random(rng, (16, 32)), NamedSharding(mesh, P(None, "x")))
    ring = cg.OverlapConfig(method="ring_exchange", bidirectional=True)
    for _ in range(3):
        out = cg.gemm(x, w, out_sharding=P(None, "x"), config=ring)
    assert len(planned) == 1
    assert_close(out, reference(np.asarray(x), np.asarray(w)), np.float32, 16)
