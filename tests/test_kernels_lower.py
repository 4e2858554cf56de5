"""The direct fused kernels (Mosaic GPU) lower for a CUDA target on the CPU: their Pallas code
traces and compiles to Mosaic GPU's MLIR, for several meshes and tilings. They only run on
Hopper GPUs (benchmarks/fused_check.py checks their outputs there); this catches what breaks
before a kernel is ever launched."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import P, mesh1d
from hypothesis import given, settings
from hypothesis import strategies as st

import commgemm as cg
from commgemm.algorithms import mosaic_tiles, push_gather_gemm, scatter_add_gemm
from commgemm.bench.problems import parse_method

pytest.importorskip("jax.experimental.pallas.mosaic_gpu")


@pytest.fixture(autouse=True)
def _h100_sms(monkeypatch):
    monkeypatch.setattr(mosaic_tiles, "num_sms", lambda: 132)  # CPU devices have no SM count


def lower(fn, x_spec, w_spec, out_spec, size: int, x_shape, w_shape) -> str:
    f = jax.shard_map(
        fn, mesh=mesh1d(size), in_specs=(x_spec, w_spec), out_specs=out_spec, check_vma=False
    )
    args = (
        jax.ShapeDtypeStruct(x_shape, jnp.bfloat16),
        jax.ShapeDtypeStruct(w_shape, jnp.bfloat16),
    )
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize(
    "spec", ["fused-direct", "fused-direct-gm-w2", "fused-direct-cm", "fused-direct-p1"]
)
def test_push_gather_gemm_lowers(size, spec):
    cfg = parse_method(spec)
    text = lower(
        lambda x, w: push_gather_gemm.all_gather_matmul(x, w, "x", cfg),
        P("x", None),
        P(None, "x"),
        P(None, "x"),
        size,
        (512 * size, 256),
        (256, 512 * size),
    )
    assert "mosaic_gpu" in text and "custom_call" in text


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("spec", ["fused-direct-cm", "fused-direct-d1", "fused-direct-cm-ct"])
def test_scatter_add_gemm_lowers(size, spec):
    cfg = parse_method(spec)
    text = lower(
        lambda x, w: scatter_add_gemm.matmul_reduce_scatter(x, w, "x", cfg),
        P(None, "x"),
        P("x", None),
        P("x", None),
        size,
        (2048 * size, 256 * size),
        (256 * size, 4096),
    )
    assert "mosaic_gpu" in text and "custom_call" in text


def test_chain_tiles_needs_two_tiles_per_cta():
    cfg = cg.OverlapConfig(
        method="pipeline", atomic_gemm=True, fused_tiles=cg.FusedTiles(chain_tiles=True)
    )
    with pytest.raises(ValueError, match="chain_tiles needs two tiles per CTA, got 16 tiles"):
        lower(
            lambda x, w: scatter_add_gemm.matmul_reduce_scatter(x, w, "x", cfg),
            P(None, "x"),
            P("x", None),
            P("x", None),
            2,
            (512, 512),
            (512, 1024),
        )


@settings(max_examples=25, deadline=None)
@given(
    m_iters=st.integers(1, 12),
    n_iters=st.integers(1, 12),
    width=st.sampled_from([1, 2, 3, 4, 8]),
    minor_m=st.booleans(),
    cluster=st.sampled_from([None, "m"]),
)
def test_senders_are_each_bands_first_visits(m_iters, n_iters, width, minor_m, cluster):
    """ATOMIC_GEMM_AG: the tiles that push a band's rows (visit rank < senders) are the band's
    first visits in the kernel's tile order (`planar_snake`), one for each rank."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    from jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu import MatmulDimension

    tiles = cg.FusedTiles(grid_tile_width=width, grid_minor_m=minor_m, cluster=cluster)
    minor = MatmulDimension.M if minor_m else MatmulDimension.N
    order = jnp.arange(m_iters * n_iters, dtype=jnp.int32)  # the kernel's tile order
    snake = jax.vmap(lambda t: plgpu.planar_snake(t, (m_iters, n_iters), minor, width))
    ms, ns = (np.asarray(v) for v in jax.jit(snake)(order))
    visits: dict[int, list[int]] = {}
    for cta in (0, 1) if cluster == "m" else (None,):
        bands = ms if cta is None else 2 * ms + cta
        ranks = np.asarray(push_gather_gemm._visit_rank(tiles, bands, ns, n_iters))
        for band, rank in zip(bands.tolist(), ranks.tolist(), strict=True):
            visits.setdefault(band, []).append(rank)
    count = push_gather_gemm.senders(tiles, n_iters, k_iters=64)
    assert 1 <= count <= min(8, n_iters)
    for ranks in visits.values():
        assert sorted(ranks) == list(range(n_iters))
        assert ranks[:count] == list(range(count))
