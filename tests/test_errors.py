"""Bad inputs raise clear errors at trace time, before any collective is issued."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import P, mesh1d, mesh2d, random, reference, shard

import commgemm as cg
from commgemm import mosaic_gpu


def call(op, x, w, size=4, x_spec=P("x", None), w_spec=P(None, "x"), out=P(None, "x"), **kw):
    f = shard(
        lambda a, b: op(a, b, kw.pop("axis_name", "x"), **kw), mesh1d(size), (x_spec, w_spec), out
    )
    return f(x, w)


def test_k_mismatch(rng):
    with pytest.raises(ValueError, match="contracting dimensions differ"):
        call(cg.all_gather_matmul, random(rng, (32, 16)), random(rng, (12, 8)))


def test_not_divisible_by_num_splits(rng):
    cfg = cg.OverlapConfig(method="pipeline", num_splits=3)
    with pytest.raises(ValueError, match="must be divisible by num_splits=3"):
        call(cg.all_gather_matmul, random(rng, (32, 16)), random(rng, (16, 8)), config=cfg)


def test_not_divisible_by_axis_size(rng):
    with pytest.raises(ValueError, match=r"x's split dimension=6 must be divisible by P"):
        call(
            cg.matmul_reduce_scatter,
            random(rng, (6, 16)),
            random(rng, (16, 8)),
            x_spec=P(None, "x"),
            w_spec=P("x", None),
            out=P("x", None),
        )


def test_unknown_axis_name(rng):
    with pytest.raises(ValueError, match="axis_name='tp' is not a mesh axis"):
        call(cg.all_gather_matmul, random(rng, (32, 16)), random(rng, (16, 8)), axis_name="tp")


@pytest.mark.parametrize("method", ["bulk"])
def test_unsupported_pairing(rng, method):
    with pytest.raises(ValueError, match="method=BULK is not supported"):
        call(
            cg.all_gather_matmul,
            random(rng, (32, 16)),
            random(rng, (16, 8)),
            config=cg.OverlapConfig(method=method),
        )


def test_fused_kernel_needs_a_hopper_gpu(rng):
    """On the CPU the fused kernel cannot run: a plan-time error that says why, no fallback."""
    cfg = cg.OverlapConfig(method="ring_exchange", atomic_gemm=True)
    x, w = random(rng, (512, 64), ml_dtypes.bfloat16), random(rng, (64, 1024), ml_dtypes.bfloat16)
    with pytest.raises(ValueError, match="ATOMIC_GEMM_AG_P2P .* it runs on GPUs; this backend"):
        call(cg.all_gather_matmul, x, w, config=cfg)


@pytest.mark.parametrize(
    "dtype,cfg,why",
    [
        (np.float32, {}, "bfloat16 or float16 operands, got float32"),
        (ml_dtypes.bfloat16, {"out_dtype": "float32"}, "out_dtype=float32 differs"),
        (ml_dtypes.bfloat16, {"num_splits": 2}, "num_splits, bidirectional and aggregate"),
    ],
)
def test_fused_kernel_rejects_what_it_cannot_do(rng, dtype, cfg, why):
    config = cg.OverlapConfig(method="ring_exchange", atomic_gemm=True, **cfg)
    x, w = random(rng, (512, 64), dtype), random(rng, (64, 1024), dtype)
    with pytest.raises(ValueError, match=why):
        call(cg.all_gather_matmul, x, w, config=config)


def test_fused_kernel_tile_divisibility(rng):
    cfg = cg.OverlapConfig(method="ring_exchange", atomic_gemm=True)
    x, w = random(rng, (256, 64), ml_dtypes.bfloat16), random(rng, (64, 1024), ml_dtypes.bfloat16)
    with pytest.raises(ValueError, match="rows per device=.* must be divisible by the tile 128"):
        call(cg.all_gather_matmul, x, w, config=cfg)


def test_fused_clusters(rng):
    """2-CTA clusters: the tile divisibility counts the cluster's two tiles; the ring
    all-gather kernel's config has no clusters and the direct one pairs along M only."""
    clustered = cg.OverlapConfig(
        method="pipeline", atomic_gemm=True, kernel=mosaic_gpu.DirectRSConfig(cluster="m")
    )
    # RS on 4 devices, K sharded: 128 rows each, one 128-row tile but not a cluster's two
    specs = dict(x_spec=P(None, "x"), w_spec=P("x", None), out=P("x", None))
    x, w = random(rng, (512, 256), ml_dtypes.bfloat16), random(rng, (256, 256), ml_dtypes.bfloat16)
    with pytest.raises(ValueError, match="rows per device=128 must be divisible by the tile 256"):
        call(cg.matmul_reduce_scatter, x, w, config=clustered, **specs)
    wide = clustered.replace(kernel=mosaic_gpu.DirectRSConfig(cluster="n"))
    with pytest.raises(ValueError, match="N=256 must be divisible by the tile 512"):
        call(cg.matmul_reduce_scatter, x, w, config=wide, **specs)
    with pytest.raises(ValueError, match=r"DirectRSConfig.cluster='k' must be one of \(None"):
        mosaic_gpu.DirectRSConfig(cluster="k")
    with pytest.raises(
        ValueError, match=r"DirectAGConfig.cluster='n' must be one of \(None, 'm'\)"
    ):
        mosaic_gpu.DirectAGConfig(cluster="n")
    with pytest.raises(TypeError):
        mosaic_gpu.RingAGConfig(cluster="m")  # the ring AG's config has no clusters


def test_kernel_config_of_another_family_is_refused(rng):
    """Each kernel takes its own family's config: the family follows the op and the method."""
    bf16 = ml_dtypes.bfloat16
    x, w = random(rng, (512, 64), bf16), random(rng, (64, 1024), bf16)
    direct = cg.OverlapConfig(method="pipeline", atomic_gemm=True)
    cases = [
        (
            direct.replace(kernel=mosaic_gpu.DirectRSConfig()),
            "DirectAGConfig or PingPongAGConfig's kernel",
        ),
        (direct, "ATOMIC_GEMM_AG .* cannot run this call: it runs on GPUs"),
    ]
    for config, why in cases:
        with pytest.raises(ValueError, match=why):
            call(cg.all_gather_matmul, x, w, config=config)
    with pytest.raises(ValueError, match="RingRSConfig.* is for method RING_EXCHANGE"):
        direct.replace(kernel=mosaic_gpu.RingRSConfig())
    with pytest.raises(ValueError, match="kernel needs atomic_gemm=True"):
        cg.OverlapConfig(method="pipeline", kernel=mosaic_gpu.DirectRSConfig())
    for bad in (-1, 101, True, 0.5):
        with pytest.raises(ValueError, match="spread="):
            mosaic_gpu.DirectAGConfig(spread=bad)
    for bad in (-1, True, 2.0):
        with pytest.raises(ValueError, match="zero_ahead=.* must be an int >= 0"):
            mosaic_gpu.DirectRSConfig(zero_ahead=bad)
    specs = dict(x_spec=P(None, "x"), w_spec=P("x", None), out=P("x", None))
    x, w = random(rng, (1024, 3 * 4 * 64), bf16), random(rng, (3 * 4 * 64, 256), bf16)
    chained = direct.replace(kernel=mosaic_gpu.DirectRSConfig(chain_tiles=True))
    with pytest.raises(ValueError, match="chain_tiles needs K/tile_k=3 divisible by 4 stages"):
        call(cg.matmul_reduce_scatter, x, w, config=chained, **specs)


@pytest.mark.parametrize(
    ("size", "tiles", "why"),
    [
        (
            2,
            mosaic_gpu.DirectRSConfig(split_tail=0),
            "split_tail and stream_tail add a tile's K-ranges in arrival order",
        ),
        (
            2,
            mosaic_gpu.DirectRSConfig(stream_tail=True),
            "split_tail and stream_tail add a tile's K-ranges in arrival order",
        ),
        (4, None, "on 4 devices a tile's partial sums are added in arrival order"),
    ],
)
def test_deterministic_refuses_arrival_order_adds(rng, size, tiles, why):
    """deterministic=True: the direct reduce-add kernel raises at plan time where its adds
    happen in arrival order (split tails, more than 2 devices); without it the same call gets
    as far as the GPU check."""
    bf16 = ml_dtypes.bfloat16
    x, w = random(rng, (128 * size, 64 * size), bf16), random(rng, (64 * size, 256), bf16)
    specs = dict(size=size, x_spec=P(None, "x"), w_spec=P("x", None), out=P("x", None))
    cfg = cg.OverlapConfig(method="pipeline", atomic_gemm=True, kernel=tiles)
    with pytest.raises(ValueError, match=f"deterministic=True, and {why}"):
        call(cg.matmul_reduce_scatter, x, w, config=cfg.replace(deterministic=True), **specs)
    with pytest.raises(ValueError, match="it runs on GPUs"):
        call(cg.matmul_reduce_scatter, x, w, config=cfg, **specs)
    with pytest.raises(ValueError, match="deterministic=1 must be True or False"):
        cfg.replace(deterministic=1)


def test_chain_tiles_needs_two_tiles_per_cta_at_plan_time(monkeypatch):
    """On a GPU (faked here: 132 SMs) the plan-time check refuses chained pipelines when the
    CTAs would not get two tiles each, so AUTO and the tuner leave such tilings out."""
    from commgemm.mosaic_gpu import fused
    from commgemm.mosaic_gpu import tiles as mosaic_tiles

    monkeypatch.setattr(fused, "_gpu_reason", lambda: None)
    monkeypatch.setattr(mosaic_tiles, "num_sms", lambda: 132)
    rs = cg.Collective.REDUCE_SCATTER
    chained = cg.OverlapConfig(
        method="pipeline", atomic_gemm=True, kernel=mosaic_gpu.DirectRSConfig(chain_tiles=True)
    )
    size = jax.device_count()
    small = (128 * size * 16, 256 * size, 256)  # 16 tiles per device
    reason = fused.reason_for_shape(rs, small, size, "bfloat16", chained)
    assert reason == f"chain_tiles needs two tiles per CTA, got {16 * size} tiles for 132 CTAs"
    large = (128 * size * 264, 256 * size, 256)  # 264 tiles per device: two per CTA
    assert fused.reason_for_shape(rs, large, size, "bfloat16", chained) is None


@pytest.mark.parametrize("stream", [True, False], ids=["stream_tail", "split_tail"])
def test_explicit_tail_needs_it_within_one_block_at_plan_time(monkeypatch, stream):
    """An explicit tail (stream_tail, or split_tail > 1) must be this device's own tiles: the
    plan (GPU faked: 132 SMs) refuses it where the last wave is more than one block, with the
    kernel's reason; the automatic tail (split_tail=0) then runs whole."""
    from commgemm.mosaic_gpu import fused
    from commgemm.mosaic_gpu import tiles as mosaic_tiles

    monkeypatch.setattr(fused, "_gpu_reason", lambda: None)
    monkeypatch.setattr(mosaic_tiles, "num_sms", lambda: 132)
    rs, size = cg.Collective.REDUCE_SCATTER, jax.device_count()
    tiles = mosaic_gpu.DirectRSConfig(cluster="m", stream_tail=stream, split_tail=1 + (not stream))
    config = cg.OverlapConfig(method="pipeline", atomic_gemm=True, kernel=tiles)
    per_block = 2  # 256 x 256 cluster tiles a device: all of them in the tail on 66 clusters
    shape = (256 * size * per_block, 256 * size, 256)
    tail = size * per_block
    reason = fused.reason_for_shape(rs, shape, size, "bfloat16", config)
    what = "stream_tail" if stream else "split_tail"
    assert reason == (f"DirectRSConfig.{what} needs the tail ({tail} tiles) within one block "
                      f"({per_block} tiles)")  # fmt: skip
    whole = (256 * size * 66, 256 * size, 256)  # whole waves: no tail
    assert fused.reason_for_shape(rs, whole, size, "bfloat16", config) is None
    auto = config.replace(kernel=mosaic_gpu.DirectRSConfig(cluster="m", split_tail=0))
    assert fused.reason_for_shape(rs, shape, size, "bfloat16", auto) is None


@pytest.mark.parametrize("stages", [3, 4])
def test_ring_all_gather_takes_partial_rounds_of_stages(monkeypatch, stages):
    """The ring AG kernel awaits every wgmma on a tile's last K-step (`tiles.await_last_step`),
    so K-steps need not be whole rounds of stages: the plan (GPU faked) takes 17 K-steps of 64
    as it takes whole rounds."""
    from commgemm.mosaic_gpu import fused

    monkeypatch.setattr(fused, "_gpu_reason", lambda: None)
    ag, size = cg.Collective.ALL_GATHER, jax.device_count()
    ring = cg.OverlapConfig(method="ring_exchange", atomic_gemm=True,
                            kernel=mosaic_gpu.RingAGConfig(stages=stages))  # fmt: skip
    for k_steps in (17, 4 * stages):
        shape = (128 * size, 64 * k_steps, 256 * size)
        assert fused.reason_for_shape(ag, shape, size, "bfloat16", ring) is None


def test_pipelined_atomic_rs_says_why_it_cannot_run(rng):
    """ATOMIC_GEMM_RS (the direct reduce-add kernel) checks its needs like the ring kernels."""
    cfg = cg.OverlapConfig(method="pipeline", atomic_gemm=True)
    with pytest.raises(ValueError, match="ATOMIC_GEMM_RS .* runs on GPUs.*needs bf"):
        call(cg.matmul_reduce_scatter, random(rng, (32, 16)), random(rng, (16, 8)), config=cfg)
    x = random(rng, (4096, 1024), ml_dtypes.bfloat16)
    w = random(rng, (1024, 2048), ml_dtypes.bfloat16)
    with pytest.raises(ValueError, match="ATOMIC_GEMM_RS .* runs on GPUs"):
        call(cg.matmul_reduce_scatter, x, w, config=cfg)


def test_integer_dtype(rng):
    x = np.ones((32, 16), np.int32)
    with pytest.raises(TypeError, match="dtype int32; commgemm GEMMs need floating"):
        call(cg.all_gather_matmul, x, x.T.copy())


def test_mismatched_dtypes(rng):
    with pytest.raises(TypeError, match="x has dtype float32 but w has dtype bfloat16"):
        call(cg.all_gather_matmul, random(rng, (32, 16)), jnp.ones((16, 8), jnp.bfloat16))


def test_unknown_buffer_id(rng):
    with pytest.raises(KeyError, match="no overlap buffer with id 987654"):
        call(cg.all_gather_matmul, random(rng, (32, 16)), random(rng, (16, 8)), config=987654)


def test_buffer_tp_size_mismatch(rng):
    buf = cg.create_overlap_buffer(cg.OverlapConfig(), tp_size=8)
    with pytest.raises(ValueError, match="tp_size=8"):
        call(cg.all_gather_matmul, random(rng, (32, 16)), random(rng, (16, 8)), config=buf)


def test_bad_axis(rng):
    with pytest.raises(ValueError, match="axis=1 must name a row dimension"):
        call(cg.all_gather_matmul, random(rng, (32, 16)), random(rng, (16, 8)), axis=1)


def test_config_collective_contradicts_op(rng):
    cfg = cg.OverlapConfig(collective="reduce_scatter")
    with pytest.raises(ValueError, match="this op performs ALL_GATHER"):
        call(cg.all_gather_matmul, random(rng, (32, 16)), random(rng, (16, 8)), config=cfg)


def test_bad_epilogue(rng):
    x, w = random(rng, (32, 16)), random(rng, (16, 8))
    with pytest.raises(ValueError, match="activation='relu' is not one of"):
        call(cg.all_gather_matmul, x, w, activation="relu")
    with pytest.raises(ValueError, match=r"bias must have shape \(2,\)"):
        f = shard(
            lambda a, b, c: cg.all_gather_matmul(a, b, "x", bias=c),
            mesh1d(4),
            (P("x", None), P(None, "x"), P("x")),
            P(None, "x"),
        )
        f(x, w, np.ones(16, np.float32))


def test_fused_kernel_environment_checks(monkeypatch):
    """What the fused kernels need of the machine, each with its own reason (faked devices:
    the CI has no GPU)."""
    import types
    import warnings

    import jax

    from commgemm.mosaic_gpu import fused, peers

    def machine(capability: str, version: tuple, processes: int = 1) -> str | None:
        gpu = types.SimpleNamespace(platform="gpu", compute_capability=capability)
        monkeypatch.setattr(jax, "devices", lambda *a: [gpu])
        monkeypatch.setattr(jax, "__version_info__", version)
        monkeypatch.setattr(jax, "process_count", lambda: processes)
        return fused._gpu_reason()

    assert "Hopper GPU (compute capability 9.x), got 8.0" in machine("8.0", (0, 11, 2))
    assert "needs jax >= 0.11" in machine("9.0", (0, 10, 2))
    monkeypatch.setattr(peers, "nccl_version", lambda: (2, 28, 9))
    monkeypatch.setattr(peers, "_answer", [])
    with warnings.catch_warnings():  # its one-time warning: tested below
        warnings.simplefilter("ignore")
        assert "NCCL >= 2.29.2" in machine("9.0", (0, 11, 2), processes=2)


def test_fused_kernels_with_several_processes_need_new_nccl_and_one_machine(monkeypatch):
    """With one process per GPU the fused kernels need NCCL's peer addresses (NCCL >= 2.29.2)
    and every process on one machine; each miss is its own reason, none where both hold."""
    import warnings

    from commgemm.mosaic_gpu import peers

    def reason(version, machines=("a/1", "a/1"), fresh=True):
        monkeypatch.setattr(peers, "nccl_version", lambda: version)
        monkeypatch.setattr(peers.distributed, "machines", lambda: machines)
        if fresh:  # a new process: nothing kept yet
            monkeypatch.setattr(peers, "_answer", [])
        return peers.multiprocess_reason()

    with pytest.warns(UserWarning, match="fused kernels are off in this job"):
        old = reason((2, 28, 9))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once a process: no second warning
        assert reason((2, 28, 9), fresh=False) == old
    assert reason((2, 32, 3), fresh=False) == old  # kept for the process's life
    assert "NCCL >= 2.29.2" in old and "calls NCCL 2.28.9" in old
    assert "nvidia-nccl-cu13>=2.29.2" in old
    assert "no NCCL is loaded" in reason(None)
    assert peers._answer == []  # not kept: NCCL may load later
    assert reason((2, 29, 2)) is None and reason((2, 32, 3)) is None
    assert "they run on 2" in reason((2, 29, 7), ("a/1", "b/2"))

    def late():
        raise TimeoutError("process 1 did not say where it runs")

    monkeypatch.setattr(peers, "_answer", [])
    monkeypatch.setattr(peers.distributed, "machines", late)
    assert "process 1 did not say" in peers.multiprocess_reason()
    assert peers._answer == []  # not kept: asked again next time
    monkeypatch.setattr(peers.distributed, "machines", lambda: ("a/1", "a/1"))
    assert peers.multiprocess_reason() is None


def test_nccl_version_read_from_the_library():
    """The version codes NCCL reports, before and after 2.9, and a library's ncclGetVersion
    read through ctypes (a stand-in library: the CI has no NCCL)."""
    import ctypes
    import types

    from commgemm.mosaic_gpu import peers

    assert peers.decode_version(22907) == (2, 29, 7)
    assert peers.decode_version(23203) == (2, 32, 3)
    assert peers.decode_version(2708) == (2, 7, 8)
    assert peers.decode_version(21003) == (2, 10, 3)

    def answer(code: int, status: int = 0):
        def get(out):
            out[0] = code
            return status

        signature = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_int))
        return types.SimpleNamespace(ncclGetVersion=signature(get))

    assert peers._library_version(answer(22809)) == (2, 28, 9)
    assert peers._library_version(answer(22809, status=2)) is None  # an error: no version
    assert peers._library_version(types.SimpleNamespace()) is None  # no such function
    # None exactly where no NCCL is mapped (the CI: jax's CPU backend loads none)
    assert (peers.nccl_version() is None) == (not peers._mapped_libraries())


def test_nccl_version_of_the_libraries_mapped(monkeypatch):
    """With none in the global scope: the oldest NCCL mapped into the process, a mapped file
    that cannot be opened any more skipped."""
    import ctypes
    import types

    from commgemm.mosaic_gpu import peers

    def library(code):
        def get(out):
            out[0] = code
            return 0

        signature = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_int))
        return types.SimpleNamespace(ncclGetVersion=signature(get))

    files = {"/a/libnccl.so.2": library(22907), "/b/libnccl.so.2": library(22809)}

    def load(path):
        if path is None:
            return types.SimpleNamespace()  # the global scope: no NCCL there
        if path not in files:
            raise OSError(f"{path}: cannot open shared object file")
        return files[path]

    monkeypatch.setattr(peers.ctypes, "CDLL", load)
    monkeypatch.setattr(peers, "_mapped_libraries", lambda: ["/gone/libnccl.so.2", *files])
    assert peers.nccl_version() == (2, 28, 9)
    files["/b/libnccl.so.2"] = library(23203)
    assert peers.nccl_version() == (2, 29, 7)
    files["/global"] = library(23001)
    monkeypatch.setattr(peers.ctypes, "CDLL", lambda p: files["/global"] if p is None else load(p))
    assert peers.nccl_version() == (2, 30, 1)  # the global scope's, where it has one


ZERO_CONFIGS = [
    cg.OverlapConfig(),
    cg.OverlapConfig(method="pipeline", num_splits=2),
    cg.OverlapConfig(method="ring_exchange"),
    cg.OverlapConfig(method="ring_exchange", bidirectional=True, num_splits=2),
    cg.OverlapConfig(method="auto"),
]
ZERO_OPS = {
    "ag": (cg.all_gather_matmul, P("x", None), P(None, "x"), P(None, "x")),
    "rs": (cg.matmul_reduce_scatter, P(None, "x"), P("x", None), P("x", None)),
    "ar": (cg.matmul_all_reduce, P(None, "x"), P("x", None), P(None, None)),
}


@pytest.mark.parametrize("mkn", [(0, 16, 8), (16, 0, 8), (16, 16, 0)], ids=["M0", "K0", "N0"])
@pytest.mark.parametrize("op", list(ZERO_OPS))
@pytest.mark.parametrize("cfg", ZERO_CONFIGS, ids=lambda c: f"{c.method.name}{c.num_splits}")
def test_zero_size_dimensions_give_jnp_dot_result(rng, mkn, op, cfg):
    """M, K or N of zero: the empty or zero result of jnp.dot, and gradients of the right
    (empty or zero) shapes, for every op and method."""
    fn, xs, ws, os = ZERO_OPS[op]
    m, k, n = mkn
    x, w = random(rng, (m, k)), random(rng, (k, n))
    f = shard(lambda a, b: fn(a, b, "x", config=cfg), mesh1d(4), (xs, ws), os)
    out = f(x, w)
    assert out.shape == (m, n) and not np.asarray(out).any()
    dx, dw = jax.grad(lambda a, b: jnp.sum(f(a, b)), (0, 1))(x, w)
    assert dx.shape == x.shape and dw.shape == w.shape
    np.testing.assert_allclose(np.asarray(dx), np.ones((m, n)) @ w.T, atol=1e-6)
    np.testing.assert_allclose(np.asarray(dw), x.T @ np.ones((m, n)), atol=1e-6)


def test_zero_size_2d_and_bulk(rng):
    x, w = random(rng, (8, 0)), random(rng, (0, 6))
    f = shard(
        lambda a, b: cg.matmul_2d(a, b, row_axis="x", k_axis="y"),
        mesh2d(2, 2),
        (P("x", "y"), P("x", None)),
        P("x", None),
    )
    assert f(x, w).shape == (8, 6) and not np.asarray(f(x, w)).any()
    x, w, c = random(rng, (8, 4)), random(rng, (4, 3)), random(rng, (0, 5))
    g = shard(
        lambda a, b, d: cg.bulk_overlap(a, b, d, "x", collective="all_gather"),
        mesh1d(4),
        (P("x", None), P(None, None), P("x", None)),
        (P("x", None), P(None, None)),
    )
    out, comm = g(x, w, c)
    assert comm.shape == (0, 5) and np.allclose(out, x @ w, atol=1e-5)


@pytest.mark.parametrize("field", ["out_dtype", "reduce_dtype", "accumulate_dtype"])
@pytest.mark.parametrize("dtype", ["int32", "int8", "bool", np.uint16])
def test_integer_and_bool_dtypes_refused(field, dtype):
    with pytest.raises(ValueError, match=f"{field}=.* must be a floating dtype"):
        cg.OverlapConfig(**{field: dtype})


def test_dtype_aliases_accepted():
    cfg = cg.OverlapConfig(out_dtype="bf16", reduce_dtype="f32")
    assert (cfg.out_dtype, cfg.reduce_dtype) == ("bfloat16", "float32")


@pytest.mark.parametrize("splits", [0, -1, 65, 10**6])
def test_num_splits_range(splits):
    with pytest.raises(ValueError, match="num_splits=.* must be from 1 to 64"):
        cg.OverlapConfig(method="pipeline", num_splits=splits)


def test_more_chunks_than_rows_refused(rng):
    cfg = cg.OverlapConfig(method="pipeline", num_splits=8)
    with pytest.raises(ValueError, match="divisible by num_splits=8"):
        call(cg.all_gather_matmul, random(rng, (16, 16)), random(rng, (16, 8)), config=cfg)


@pytest.mark.parametrize(
    "field",
    ["bidirectional", "aggregate", "atomic_gemm", "save_gathered_input", "chain_gemms",
     "deterministic"],
)  # fmt: skip
@pytest.mark.parametrize("value", ["no", "False", 0, 1, None])
def test_bool_fields_refuse_non_bools(field, value):
    with pytest.raises(ValueError, match=f"{field}=.* must be True or False"):
        cg.OverlapConfig(method="ring_exchange", **{field: value})


@pytest.mark.parametrize(
    "spelling,method",
    [("ring", "RING_EXCHANGE"), ("RING_EXCHANGE", "RING_EXCHANGE"), ("Pipeline", "PIPELINE"),
     ("ring-exchange", "RING_EXCHANGE"), ("auto", "AUTO")],
)  # fmt: skip
def test_method_spellings(spelling, method):
    assert cg.OverlapConfig(method=spelling).method is cg.Method[method]
    assert cg.Collective("ag") is cg.Collective.ALL_GATHER
    with pytest.raises(ValueError, match="not a Method"):
        cg.OverlapConfig(method="teleport")


def test_traced_buffer_id_refused(rng):
    buf = cg.create_overlap_buffer(cg.OverlapConfig(method="ring_exchange"))
    x, w = random(rng, (32, 16)), random(rng, (16, 8))

    def body(a, b, ident):
        return cg.all_gather_matmul(a, b, "x", config=ident)

    f = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh1d(4),
            in_specs=(P("x", None), P(None, "x"), P()),
            out_specs=P(None, "x"),
        )
    )
    with pytest.raises(TypeError, match="traced value.*Python int"):
        f(x, w, jnp.int32(buf % 2**31))


@pytest.mark.parametrize("op", [cg.all_gather_matmul, cg.matmul_reduce_scatter])
def test_one_dimensional_x_says_what_is_expected(rng, op):
    with pytest.raises(ValueError, match=r"x must be \[rows, K\].*got shape \(16,\).*x\[None\]"):
        call(op, random(rng, (64,)), random(rng, (16, 8)), x_spec=P("x"))


@pytest.mark.parametrize(
    "cfg",
    [
        cg.OverlapConfig(method="ring_exchange", atomic_gemm=True),
        cg.OverlapConfig(method="pipeline", atomic_gemm=True),
        cg.OverlapConfig(method="ring_exchange", bidirectional=True, num_splits=2),
        cg.OverlapConfig(method="auto"),
    ],
    ids=["fused-ring", "fused-direct", "ring-bidi", "auto"],
)
@pytest.mark.parametrize("op", list(ZERO_OPS))
def test_axis_of_one_device_is_a_local_gemm(rng, cfg, op):
    """A mesh axis of size 1: any config, fused ones included, plans the local GEMM (there is
    nothing to overlap, and no peer memory to run a fused kernel on)."""
    if op == "ar" and cfg.atomic_gemm:
        pytest.skip("there is no fused all-reduce kernel (refused at plan time, tested above)")
    fn, xs, ws, os = ZERO_OPS[op]
    bf16 = ml_dtypes.bfloat16
    x, w = random(rng, (256, 128), bf16), random(rng, (128, 256), bf16)
    f = shard(lambda a, b: fn(a, b, "x", config=cfg), mesh1d(1), (xs, ws), os)
    np.testing.assert_allclose(
        np.asarray(f(x, w), np.float64), reference(x, w), rtol=2e-2, atol=2e-2 * np.sqrt(128)
    )
