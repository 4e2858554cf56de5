"""`grouped.exchange.ragged_all_to_all` (here its all-to-all form; the NVLink kernel is checked
against it bit for bit in tests/gpu/test_exchange_gpu.py): results against a numpy reference
on random layouts (regions of any size, empty and capped ones, counts up to `most`; one region
per peer, and several per peer in either order), float64, 1 (a select or a gather), 2, 4 and 8
devices, both shard_map settings; the gradient is the exchange the other way."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import grouped_layouts, ragged_layouts, region_index
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

from commgemm.grouped.exchange import Layout, kernel_reason, ragged_all_to_all

ROWS, MOST, K = 12, 5, 3


def _reference(x: np.ndarray, send, counts, recv, rows_out: int) -> np.ndarray:
    """The exchange in numpy: x [P, R, K] -> [P, rows_out, K]."""
    size = x.shape[0]
    out = np.zeros((size, rows_out, x.shape[2]), x.dtype)
    for s in range(size):
        for d in range(size):
            c = counts[s, d]
            out[d, recv[d, s] : recv[d, s] + c] = x[s, send[s, d] : send[s, d] + c]
    return out


@functools.cache
def _exchange(size: int, check_vma: bool):
    mesh = Mesh(np.array(jax.devices()[:size]), ("x",))

    def body(x, sb, sc, rb, rc):
        send, recv = Layout(sb[0], sc[0]), Layout(rb[0], rc[0])
        return ragged_all_to_all(x, send, recv, "x", MOST, size * MOST)

    specs = (P("x"),) * 5
    fn = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P("x"), check_vma=check_vma)
    return jax.jit(fn)


def _sizes(draw_rows, size: int) -> np.ndarray:
    """Pair sizes whose rows per source sum to at most ROWS."""
    sizes = np.zeros((size, size), np.int64)
    for s in range(size):
        left = ROWS
        for d in range(size):
            sizes[s, d] = draw_rows(left)
            left -= sizes[s, d]
    return sizes


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "no-vma"])
@pytest.mark.parametrize("size", [1, 2, 4, 8])
@settings(max_examples=8, deadline=None)
@given(data=st.data())
def test_exchange_against_numpy(size, check_vma, data):
    sizes = _sizes(lambda left: data.draw(st.integers(0, left)), size)
    send, counts, recv, recv_counts = ragged_layouts(sizes, ROWS, MOST)
    seed = data.draw(st.integers(0, 2**31 - 1))
    x = np.random.default_rng(seed).standard_normal((size, ROWS, K))
    fn = _exchange(size, check_vma)
    args = (send, counts, recv, recv_counts)
    got = np.asarray(fn(x.reshape(size * ROWS, K), *args)).reshape(size, size * MOST, K)
    np.testing.assert_array_equal(got, _reference(x, send, counts, recv, size * MOST))
    # the gradient: the same rows moved back, zeros for the rows that did not travel
    ct = np.random.default_rng(seed + 1).standard_normal(got.shape)
    pullback = jax.vjp(lambda v: fn(v, *args), x.reshape(size * ROWS, K))[1]
    grad = np.asarray(pullback(ct.reshape(size * size * MOST, K))[0]).reshape(x.shape)
    want = np.zeros_like(x)
    for s in range(size):
        for d in range(size):
            c = counts[s, d]
            want[s, send[s, d] : send[s, d] + c] = ct[d, recv[d, s] : recv[d, s] + c]
    np.testing.assert_array_equal(grad, want)


@functools.cache
def _grouped_exchange(size: int, check_vma: bool, orders: tuple[bool, bool], most: int, rows: int):
    mesh = Mesh(np.array(jax.devices()[:size]), ("x",))

    def body(x, sb, sc, rb, rc):
        send = Layout(sb[0], sc[0], by_group=orders[0])
        recv = Layout(rb[0], rc[0], by_group=orders[1])
        return ragged_all_to_all(x, send, recv, "x", most, rows)

    specs = (P("x"),) * 5
    fn = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P("x"), check_vma=check_vma)
    return jax.jit(fn)


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "no-vma"])
@pytest.mark.parametrize("size", [1, 2, 4, 8])
@settings(max_examples=6, deadline=None)
@given(groups=st.integers(1, 4), orders=st.tuples(st.booleans(), st.booleans()),
       seed=st.integers(0, 2**31 - 1))  # fmt: skip
def test_grouped_exchange_against_numpy(size, check_vma, groups, orders, seed):
    """Regions per (peer, group) in either order on either side (the expert-parallel block's
    tokens: peer-major out, group-major in): each region's live rows land in the receiver's
    region of (source, group), and the gradient moves them back."""
    rng, most = np.random.default_rng(seed), 6
    counts, sb, sc, rb, rc = grouped_layouts(rng, size, groups, most, orders)
    rows = size * (most + groups)
    x = rng.standard_normal((size, rows, K))
    fn = _grouped_exchange(size, check_vma, orders, most, rows)
    args = (sb, sc, rb, rc)
    got = np.asarray(fn(x.reshape(size * rows, K), *args)).reshape(size, rows, K)
    ct = rng.standard_normal(got.shape)
    pullback = jax.vjp(lambda v: fn(v, *args), x.reshape(size * rows, K))[1]
    grad = np.asarray(pullback(ct.reshape(size * rows, K))[0]).reshape(x.shape)
    want, want_grad = np.zeros_like(x), np.zeros_like(x)
    for s, d, j in np.ndindex(counts.shape):
        c = counts[s, d, j]
        out = rb[d, region_index(s, j, size, groups, orders[1])]
        src = sb[s, region_index(d, j, size, groups, orders[0])]
        want[d, out : out + c] = x[s, src : src + c]
        want_grad[s, src : src + c] = ct[d, out : out + c]
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(grad, want_grad)


def test_exchange_every_row_to_one_shard(rng):
    """Every shard's rows all for shard 0, capped at MOST: the rest are dropped (zeros)."""
    size = 4
    sizes = np.zeros((size, size), np.int64)
    sizes[:, 0] = ROWS
    send, counts, recv, recv_counts = ragged_layouts(sizes, ROWS, MOST)
    x = rng.standard_normal((size, ROWS, K))
    got = _exchange(size, True)(x.reshape(-1, K), send, counts, recv, recv_counts)
    got = np.asarray(got).reshape(size, size * MOST, K)
    np.testing.assert_array_equal(got, _reference(x, send, counts, recv, size * MOST))
    assert not got[1:].any()
    np.testing.assert_array_equal(got[0].reshape(size, MOST, K), x[:, :MOST])


def test_exchange_under_jit_grad_check():
    """Linear in x: jax's numerical gradient check (float64) passes through the custom VJP."""
    size = 2
    sizes = np.array([[3, 4], [0, 5]])
    send, counts, recv, recv_counts = ragged_layouts(sizes, ROWS, MOST)
    fn = _exchange(size, True)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((size * ROWS, K)))
    check_grads(lambda v: fn(v, send, counts, recv, recv_counts), (x,), order=1, modes=("rev",))


def test_kernel_reason_off_gpu():
    """Off a Hopper GPU the exchange takes its all-to-all form, and says why."""
    assert "GPU" in kernel_reason(jnp.bfloat16, 256)


def test_kernel_with_processes_needs_nccl_peers(monkeypatch):
    """With several processes on Hopper GPUs the kernel needs what the fused kernels need there
    (NCCL's peer addresses); an older NCCL gives the all-to-all form, and says why."""
    from commgemm.mosaic_gpu import fused, peers
    from commgemm.mosaic_gpu import tiles as mosaic_tiles

    monkeypatch.setattr(mosaic_tiles, "hopper_reason", lambda: None)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(peers, "_answer", [])
    monkeypatch.setattr(peers, "nccl_version", lambda: (2, 28, 9))
    assert fused.mosaic_tiles is mosaic_tiles
    with pytest.warns(UserWarning, match="NCCL"):
        assert "NCCL >= 2.29.2" in kernel_reason(jnp.bfloat16, 256)


@pytest.mark.parametrize(
    "shape, bounds, counts, most, out_rows, match",
    [
        ((ROWS,), 3, 2, MOST, 2 * MOST, "src must be"),
        ((0, K), 3, 2, MOST, 2 * MOST, "src must be"),
        ((ROWS, K), 4, 2, MOST, 2 * MOST, "send layout bounds"),
        ((ROWS, K), 3, 3, MOST, 2 * MOST, "send layout bounds"),
        ((ROWS, K), 3, 2, 0, 2 * MOST, "most=0"),
        ((ROWS, K), 3, 2, MOST, 2.5, "out_rows=2.5"),
    ],
    ids=["1-d", "empty", "bounds", "counts", "most", "out-rows"],
)
def test_exchange_refuses_bad_input(shape, bounds, counts, most, out_rows, match):
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    send = Layout(jnp.zeros((bounds,), jnp.int32), jnp.zeros((counts,), jnp.int32))
    recv = Layout(jnp.zeros((3,), jnp.int32), jnp.zeros((2,), jnp.int32))

    def body(x):
        return ragged_all_to_all(x, send, recv, "x", most, out_rows)

    fn = jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(fn, jax.ShapeDtypeStruct((2 * shape[0], *shape[1:]), jnp.float32))


def test_exchange_refuses_float_layouts():
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    send = Layout(jnp.zeros((3,), jnp.float32), jnp.zeros((2,), jnp.int32))
    recv = Layout(jnp.zeros((3,), jnp.int32), jnp.zeros((2,), jnp.int32))
    fn = jax.shard_map(lambda x: ragged_all_to_all(x, send, recv, "x", MOST, 2 * MOST),
                       mesh=mesh, in_specs=P("x"), out_specs=P("x"))  # fmt: skip
    with pytest.raises(ValueError, match="integers"):
        jax.eval_shape(fn, jax.ShapeDtypeStruct((2 * ROWS, K), jnp.float32))


@pytest.mark.parametrize("send_regions, recv_regions", [(3, 3), (4, 6)],
                         ids=["not-a-multiple", "sides-differ"])  # fmt: skip
def test_exchange_refuses_regions_that_do_not_pair(send_regions, recv_regions):
    """Regions must come P to a group on both sides, as many on each: 3 on an axis of 2, or 4
    sent against 6 received, is refused with the rule."""
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    layout = lambda r: Layout(jnp.zeros((r + 1,), jnp.int32), jnp.zeros((r,), jnp.int32))  # noqa: E731
    send, recv = layout(send_regions), layout(recv_regions)
    fn = jax.shard_map(lambda x: ragged_all_to_all(x, send, recv, "x", MOST, 2 * MOST),
                       mesh=mesh, in_specs=P("x"), out_specs=P("x"))  # fmt: skip
    with pytest.raises(ValueError, match="R a multiple of 2"):
        jax.eval_shape(fn, jax.ShapeDtypeStruct((2 * ROWS, K), jnp.float32))
