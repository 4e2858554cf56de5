"""OverlapConfig validation, the algorithm table and the overlap-buffer registry."""

import pytest

import commgemm as cg
from commgemm import Algorithm as A
from commgemm import Collective as C
from commgemm import Method as M
from commgemm import mosaic_gpu
from commgemm.config import config_from_fields, config_to_fields, select_algorithm
from commgemm.flags import xla_flags


@pytest.mark.parametrize(
    "collective,method,atomic,expected",
    [
        (C.ALL_GATHER, M.NONE, False, A.NO_OVERLAP),
        (C.NONE, M.RING_EXCHANGE, False, A.NO_OVERLAP),
        (C.ALL_GATHER, M.BULK, False, A.BULK_OVERLAP_AG),
        (C.REDUCE_SCATTER, M.BULK, False, A.BULK_OVERLAP_RS),
        (C.ALL_GATHER, M.PIPELINE, False, A.SPLIT_PIPELINED_AG),
        (C.ALL_GATHER, M.RING_EXCHANGE, False, A.SPLIT_PIPELINED_AG_P2P),
        (C.REDUCE_SCATTER, M.PIPELINE, False, A.SPLIT_PIPELINED_RS),
        (C.REDUCE_SCATTER, M.RING_EXCHANGE, False, A.SPLIT_PIPELINED_RS_P2P),
        (C.ALL_REDUCE, M.RING_EXCHANGE, False, A.SPLIT_PIPELINED_AR_P2P),
        (C.REDUCE_SCATTER, M.PIPELINE, True, A.ATOMIC_GEMM_RS),
        (C.ALL_GATHER, M.PIPELINE, True, A.ATOMIC_GEMM_AG),
        (C.ALL_GATHER, M.RING_EXCHANGE, True, A.ATOMIC_GEMM_AG_P2P),
        (C.REDUCE_SCATTER, M.RING_EXCHANGE, True, A.ATOMIC_GEMM_RS_P2P),
    ],
)
def test_select_algorithm(collective, method, atomic, expected):
    assert select_algorithm(collective, method, atomic_gemm=atomic) is expected


@pytest.mark.parametrize(
    "collective,method,atomic",
    [
        (C.ALL_REDUCE, M.PIPELINE, True),
        (C.ALL_REDUCE, M.RING_EXCHANGE, True),
        (C.ALL_GATHER, M.BULK, True),
        (C.NONE, M.NONE, True),
    ],
)
def test_select_algorithm_rejects(collective, method, atomic):
    with pytest.raises(ValueError, match="atomic|unsupported pairing"):
        select_algorithm(collective, method, atomic_gemm=atomic)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(num_splits=0), "num_splits=0 must be from 1 to 64"),
        (dict(num_splits=2.0), "num_splits=2.0 must be an int"),
        (dict(method="warp"), "method='warp' is not a Method"),
        (dict(collective="scatter"), "collective='scatter' is not a Collective"),
        (dict(method="bulk", bidirectional=True), "bidirectional=True needs method=RING_EXCHANGE"),
        (dict(method="pipeline", aggregate=True), "aggregate=True needs method=RING_EXCHANGE"),
        (
            dict(method="ring_exchange", aggregate=True, collective="reduce_scatter"),
            "aggregate=True is for ALL_GATHER",
        ),
        (dict(accumulate_dtype="int32"), "accumulate_dtype=int32 must be a floating"),
        (dict(out_dtype="no-such-dtype"), "out_dtype='no-such-dtype' is not a dtype"),
        (
            dict(collective="all_reduce", method="ring_exchange", atomic_gemm=True),
            "unsupported pairing",
        ),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        cg.OverlapConfig(**kwargs)


def test_config_is_hashable_and_normalised():
    a = cg.OverlapConfig(method="ring_exchange", accumulate_dtype="float32", out_dtype="bfloat16")
    b = cg.OverlapConfig(method=M.RING_EXCHANGE, out_dtype=__import__("ml_dtypes").bfloat16)
    assert a == b and hash(a) == hash(b)
    assert a.method is M.RING_EXCHANGE and a.out_dtype == "bfloat16"
    assert a.replace(num_splits=2).num_splits == 2
    assert cg.OverlapConfig(accumulate_dtype="bfloat16").accumulate_dtype == "bfloat16"


def test_registry_ids():
    cfg = cg.OverlapConfig(method="pipeline", num_splits=2)
    a = cg.create_overlap_buffer(cfg)
    assert cg.create_overlap_buffer(cg.OverlapConfig(method="pipeline", num_splits=2)) == a
    b = cg.create_overlap_buffer(cfg.replace(num_splits=4))
    c = cg.create_overlap_buffer(cfg, tp_size=4)
    assert len({a, b, c}) == 3
    assert cg.get_overlap_buffer(a).config == cfg
    cg.destroy_overlap_buffer(a)
    with pytest.raises(KeyError, match=str(a)):
        cg.get_overlap_buffer(a)
    with pytest.raises(KeyError, match=str(a)):
        cg.destroy_overlap_buffer(a)
    cg.destroy_all_overlap_buffers()
    with pytest.raises(KeyError, match=str(b)):
        cg.get_overlap_buffer(b)


def test_registry_rejects_bad_arguments():
    with pytest.raises(TypeError, match="OverlapConfig"):
        cg.create_overlap_buffer({"method": "pipeline"})
    with pytest.raises(ValueError, match="tp_size=0"):
        cg.create_overlap_buffer(cg.OverlapConfig(), tp_size=0)


def test_xla_flags(monkeypatch):
    assert xla_flags() == ""
    flags = xla_flags(cublas_gemm=True, copy_engine_p2p=True)
    assert "--xla_gpu_enable_triton_gemm=false" in flags
    assert "--xla_gpu_use_memcpy_local_p2p=true" in flags
    monkeypatch.setenv("XLA_FLAGS", "")
    with pytest.raises(RuntimeError, match="already started its backends"):
        __import__("jax").devices()
        xla_flags(cublas_gemm=True, apply=True)


@pytest.mark.parametrize("family", ["PingPongRSConfig", "PingPongAGConfig"])
@pytest.mark.parametrize("narrow", [False, True])
def test_pingpong_fields_round_trip_and_old_entries_keep_their_meaning(family, narrow):
    """A ping-pong config's fields round-trip (the tune cache's form); fields written before
    narrow_tail existed (a kernel with its last wave whole) read back with narrow_tail off."""
    cfg = cg.OverlapConfig(method="pipeline", atomic_gemm=True,
                           kernel=getattr(mosaic_gpu, family)(narrow_tail=narrow))  # fmt: skip
    fields = config_to_fields(cfg)
    assert config_from_fields(fields) == cfg
    del fields["kernel"]["narrow_tail"]
    assert config_from_fields(fields).kernel.narrow_tail is False


@pytest.mark.parametrize(
    "family", ["RingAGConfig", "RingRSConfig", "DirectAGConfig", "DirectRSConfig"]
)
def test_kernel_config_validation(family):
    cls = getattr(mosaic_gpu, family)
    method = "pipeline" if family.startswith("Direct") else "ring_exchange"
    cfg = cg.OverlapConfig(method=method, atomic_gemm=True, kernel=cls())
    assert hash(cfg) == hash(cfg.replace())
    assert config_from_fields(config_to_fields(cfg)) == cfg
    with pytest.raises(ValueError, match=f"{family}.stages=1 must be >= 2"):
        cls(stages=1)
    with pytest.raises(ValueError, match=f"{family}.tile_n=0 must be a positive int"):
        cls(tile_n=0)
    with pytest.raises(ValueError, match="must be multiples of the epilogue block 64"):
        cls(tile_m=96)
    with pytest.raises(ValueError, match=f"{family}.wg_along_m='yes' must be a bool"):
        cls(wg_along_m="yes")
    assert (cls().cta_m, cls().cta_n) == (128, 256)
    assert (cls(wg_along_m=True).cta_m, cls(wg_along_m=True).cta_n) == (256, 128)


def test_direct_rs_config_fields():
    for split in (-1, True, 2.0):
        with pytest.raises(ValueError, match="split_tail=.* must be an int >= 0"):
            mosaic_gpu.DirectRSConfig(split_tail=split)
    with pytest.raises(ValueError, match="chain_tiles='no' must be a bool"):
        mosaic_gpu.DirectRSConfig(chain_tiles="no")
    with pytest.raises(ValueError, match="stream_tail=1 must be a bool"):
        mosaic_gpu.DirectRSConfig(stream_tail=1)
    with pytest.raises(ValueError, match="split_tail=4 asks for a split as well"):
        mosaic_gpu.DirectRSConfig(stream_tail=True, split_tail=4)
    for split in (0, 1):  # automatic or none: the stream replaces it
        assert mosaic_gpu.DirectRSConfig(stream_tail=True, split_tail=split).stream_tail
    tiles = mosaic_gpu.DirectRSConfig(cluster="m")
    assert (tiles.cluster_size, tiles.cluster_m, tiles.cluster_n) == (2, 256, 256)


def test_direct_ag_config_narrow_tail():
    """narrow_tail halves a CTA tile's columns into two warpgroups' tiles along M, so it needs
    cta_m and cta_n of whole 128s; the halves' tiling (`tiles.narrowed`) covers the CTA tile's
    rows and half its columns."""
    from commgemm.mosaic_gpu import tiles as mosaic_tiles

    with pytest.raises(ValueError, match="narrow_tail=1 must be a bool"):
        mosaic_gpu.DirectAGConfig(narrow_tail=1)
    with pytest.raises(ValueError, match="cta_m and cta_n must be multiples of 128"):
        mosaic_gpu.DirectAGConfig(wg_along_m=True, tile_n=64, narrow_tail=True)
    for tiles in (
        mosaic_gpu.DirectAGConfig(narrow_tail=True),
        mosaic_gpu.DirectAGConfig(wg_along_m=True, tile_m=64, tile_n=256, narrow_tail=True),
        mosaic_gpu.DirectAGConfig(cluster="m", tile_k=128, narrow_tail=True),
    ):
        half = mosaic_tiles.narrowed(tiles)
        assert (half.cta_m, half.cta_n) == (tiles.cta_m, tiles.cta_n // 2)
        assert half.wg_along_m and not half.narrow_tail
        assert (half.cluster, half.tile_k, half.stages) == (tiles.cluster, tiles.tile_k, 4)
