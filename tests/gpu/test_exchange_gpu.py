"""The ragged all-to-all kernel (`mosaic_gpu.ragged_a2a`) on 2 or more Hopper GPUs: results and
gradients equal, bit for bit, to the all-to-all fallback's (`grouped.exchange._blocks`) on
fresh random layouts (skewed, empty and capped regions, rows not whole tiles; one region per
peer or several in either order), repeated calls, read by the next op of the same program,
several dtypes and row widths, under shard_map with and without check_vma; and the
expert-parallel block through it against the block with the fallback."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import garbage_freed, grouped_layouts, ragged_layouts
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import commgemm.grouped.exchange as ex
from commgemm.nnx import moe_per_shard


def _layouts(rng, size: int, rows: int, most: int, skew: bool):
    """Random pair sizes (skewed: every source's rows all for shard 0, none from shard 0 to
    the others) as `helpers.ragged_layouts`."""
    sizes = rng.integers(0, rows // size + 1, size=(size, size))
    if skew:
        sizes[:, 0] = rows // size
        sizes[0, 1:] = 0
    return ragged_layouts(sizes, rows, most)


def _pair(size: int, most: int, check_vma: bool, orders=(False, False), out_rows=None,
          **fills):  # fmt: skip
    out_rows = size * most if out_rows is None else out_rows

    def body(exchange):
        def fn(x, sb, sc, rb, rc):
            send = ex.Layout(sb[0], sc[0], by_group=orders[0])
            recv = ex.Layout(rb[0], rc[0], by_group=orders[1])
            return exchange(x, send, recv, "x", most, out_rows)

        mesh = Mesh(np.array(jax.devices()[:size]), ("x",))
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P("x"),) * 5, out_specs=P("x"),
                                     check_vma=check_vma))  # fmt: skip

    return body(functools.partial(ex.ragged_all_to_all, **fills)), body(ex._blocks)


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "no-vma"])
@pytest.mark.parametrize(
    "rows, most, k, dtype, skew",
    [
        (1000, 700, 256, jnp.bfloat16, False),
        (4096, 3000, 2048, jnp.bfloat16, True),
        (777, 777, 512, jnp.float8_e4m3fn, False),
        (300, 250, 2112, jnp.uint8, True),
        (129, 129, 128, jnp.float32, False),
        (5, 3, 256, jnp.bfloat16, False),
    ],
    ids=["bf16", "wide-skewed", "float8", "bytes", "float32", "tiny"],
)
def test_kernel_equals_fallback(two_gpus, rows, most, k, dtype, skew, check_vma):
    size = jax.device_count()
    rng = np.random.default_rng()
    sb, sc, rb, rc = _layouts(rng, size, rows, most, skew)
    x = jnp.asarray(rng.standard_normal((size * rows, k)) * 4).astype(dtype)
    assert ex.kernel_reason(dtype, k) is None
    kernel, fallback = _pair(size, most, check_vma)
    want = np.asarray(fallback(x, sb, sc, rb, rc).astype(jnp.float32))
    for _ in range(2):  # back-to-back calls: the semaphores start over
        got = np.asarray(kernel(x, sb, sc, rb, rc).astype(jnp.float32))
        np.testing.assert_array_equal(got, want)
    if jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize >= 2:
        ct = jnp.asarray(rng.standard_normal(want.shape)).astype(dtype)
        grads = [jax.vjp(lambda v, f=f: f(v, sb, sc, rb, rc), x)[1](ct)[0]
                 for f in (kernel, fallback)]  # fmt: skip
        np.testing.assert_array_equal(np.asarray(grads[0]), np.asarray(grads[1]))


@pytest.mark.parametrize("orders", [(False, True), (True, False), (True, True)],
                         ids=["to-groups", "from-groups", "groups"])  # fmt: skip
@pytest.mark.parametrize("groups, most", [(4, 300), (32, 1500), (3, 5)], ids=["4", "32", "tiny"])
def test_grouped_kernel_equals_fallback(two_gpus, groups, most, orders):
    """Several regions per peer (the MoE block's (shard, expert) regions): the kernel's result
    and gradient equal the fallback's, bit for bit, on random counts and slack."""
    size, k, dtype = jax.device_count(), 512, jnp.bfloat16
    rng = np.random.default_rng()
    _, sb, sc, rb, rc = grouped_layouts(rng, size, groups, most, orders)
    rows = size * (most + groups)
    x = jnp.asarray(rng.standard_normal((size * rows, k))).astype(dtype)
    kernel, fallback = _pair(size, most, True, orders, rows)
    want = np.asarray(fallback(x, sb, sc, rb, rc).astype(jnp.float32))
    for _ in range(2):
        np.testing.assert_array_equal(np.asarray(kernel(x, sb, sc, rb, rc).astype(jnp.float32)),
                                      want)  # fmt: skip
    ct = jnp.asarray(rng.standard_normal(want.shape)).astype(dtype)
    grads = [jax.vjp(lambda v, f=f: f(v, sb, sc, rb, rc), x)[1](ct)[0] for f in (kernel, fallback)]
    np.testing.assert_array_equal(np.asarray(grads[0]), np.asarray(grads[1]))


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "no-vma"])
@pytest.mark.parametrize("groups, most", [(4, 700), (16, 1500)], ids=["4", "16"])
def test_rows_read_right_after_the_exchange(two_gpus, groups, most, check_vma):
    """An op that reads the kernel's result right after it, in the same program, sees every
    row (the kernel ends only when every peer's rows have landed): the first run and two more,
    each after the allocations moved (freed NaNs of another size), against the fallback."""
    size, k = jax.device_count(), 512
    rng = np.random.default_rng()
    orders = (False, True)
    _, sb, sc, rb, rc = grouped_layouts(rng, size, groups, most, orders)
    rows = size * (most + groups)
    x = jnp.asarray(rng.standard_normal((size * rows, k))).astype(jnp.bfloat16)
    mesh = Mesh(np.array(jax.devices()[:size]), ("x",))

    def read_after(exchange):
        def fn(v, sb, sc, rb, rc):
            send = ex.Layout(sb[0], sc[0], by_group=orders[0])
            recv = ex.Layout(rb[0], rc[0], by_group=orders[1])
            return exchange(v, send, recv, "x", most, rows).astype(jnp.float32)

        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P("x"),) * 5, out_specs=P("x"),
                                     check_vma=check_vma))  # fmt: skip

    kernel, fallback = read_after(ex.ragged_all_to_all), read_after(ex._blocks)
    want = np.asarray(fallback(x, sb, sc, rb, rc))
    for nbytes in (1 << 28, 1 << 27, 1 << 29):
        garbage_freed(nbytes)
        np.testing.assert_array_equal(np.asarray(kernel(x, sb, sc, rb, rc)), want)


def _live(bounds: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """[P * rows] bool: the live rows of each device's regions (bounds [P, R + 1], counts
    [P, R]), the devices' rows one after another."""
    size, rows = bounds.shape[0], int(bounds[0, -1])
    live = np.zeros((size, rows), bool)
    for d in range(size):
        for first, count in zip(bounds[d, :-1], counts[d], strict=True):
            live[d, first : first + count] = True
    return live.reshape(-1)


@pytest.mark.parametrize("orders", [(False, True), (True, False)], ids=["to-groups", "back"])
def test_unfilled_kernel_on_live_rows(two_gpus, orders):
    """fill=False and fill_grad=False (the rows outside the live regions not written, here
    after a buffer of NaNs was freed): the live rows of the result and of the gradient equal
    the fallback's bit for bit."""
    size, k, dtype, groups, most = jax.device_count(), 512, jnp.bfloat16, 8, 700
    rng = np.random.default_rng()
    _, sb, sc, rb, rc = grouped_layouts(rng, size, groups, most, orders)
    rows = size * (most + groups)
    x = jnp.asarray(rng.standard_normal((size * rows, k))).astype(dtype)
    kernel, fallback = _pair(size, most, True, orders, rows, fill=False, fill_grad=False)
    garbage_freed(8 * size * rows * k)  # NaNs where the results may go
    got, pullback = jax.vjp(lambda v: kernel(v, sb, sc, rb, rc), x)
    want, want_pullback = jax.vjp(lambda v: fallback(v, sb, sc, rb, rc), x)
    live = _live(rb, rc)
    np.testing.assert_array_equal(np.asarray(got)[live], np.asarray(want)[live])
    ct = jnp.asarray(rng.standard_normal(want.shape)).astype(dtype)
    back = _live(sb, sc)
    np.testing.assert_array_equal(np.asarray(pullback(ct)[0])[back],
                                  np.asarray(want_pullback(ct)[0])[back])  # fmt: skip


@pytest.mark.parametrize("scaling", [None, "current_tensor_scaling"], ids=["bf16", "fp8"])
def test_expert_parallel_block_through_the_kernel(two_gpus, monkeypatch, scaling):
    """The MoE block (AUTO: every exchange one ragged all-to-all) with the kernel against the
    same block with the kernel turned off: equal losses and gradients."""
    size, tokens, hidden, ffn, experts, k = jax.device_count(), 512, 256, 512, 4, 2
    experts *= size
    keys = jax.random.split(jax.random.key(np.random.default_rng().integers(1 << 30)), 4)
    x = jax.random.normal(keys[0], (tokens * size, hidden), jnp.bfloat16)
    router = jax.random.normal(keys[1], (hidden, experts), jnp.float32)
    w1 = (jax.random.normal(keys[2], (experts, hidden, ffn)) / hidden**0.5).astype(jnp.bfloat16)
    w2 = (jax.random.normal(keys[3], (experts, ffn, hidden)) / ffn**0.5).astype(jnp.bfloat16)
    mesh = Mesh(np.array(jax.devices()[:size]), ("tp",))

    def loss(x, w1, w2):
        block = lambda a, b, c: moe_per_shard(a, router, b, c, k=k, axis_name="tp", config=None,  # noqa: E731
                                              scaling=scaling)  # fmt: skip
        out = jax.shard_map(block, mesh=mesh, in_specs=(P("tp"), P("tp"), P("tp")),
                            out_specs=P("tp"))(x, w1, w2)  # fmt: skip
        return jnp.mean(jnp.square(out.astype(jnp.float32)))

    _kernel_equals_fallback(monkeypatch, loss, x, w1, w2)


@pytest.mark.parametrize("capacity", [None, 96], ids=["all", "capped"])
@pytest.mark.parametrize("scaling", [None, "current_tensor_scaling"], ids=["bf16", "fp8"])
def test_expert_parallel_ops_through_the_kernel(two_gpus, monkeypatch, scaling, capacity):
    """The two ops with NONE (tokens into expert order, results out of it) with the kernel
    against the same ops with the kernel turned off: equal results and gradients."""
    import commgemm as cg

    size, m, hidden, ffn, per_shard = jax.device_count(), 256, 256, 512, 4
    experts = per_shard * size
    rng = np.random.default_rng()
    x = jnp.asarray(rng.standard_normal((size * m, hidden))).astype(jnp.bfloat16)
    w1 = jnp.asarray(rng.standard_normal((experts, hidden, ffn)) / 16).astype(jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((experts, ffn, hidden)) / 22).astype(jnp.bfloat16)
    sizes = np.stack([np.bincount(rng.integers(0, experts, m), minlength=experts)
                      for _ in range(size)]).astype(np.int32)  # fmt: skip
    cfg = cg.OverlapConfig(method="none")
    mesh = Mesh(np.array(jax.devices()[:size]), ("x",))

    def body(a, b, c, g):
        y, got = cg.all_to_all_grouped_matmul(a, b, g[0], "x", config=cfg, scaling=scaling,
                                              capacity=capacity)  # fmt: skip
        return cg.grouped_matmul_all_to_all(jax.nn.gelu(y), c, got, g[0], "x", config=cfg,
                                            scaling=scaling, tokens=m)  # fmt: skip

    def loss(a, b, c):
        f = jax.shard_map(body, mesh=mesh, in_specs=(P("x"),) * 4, out_specs=P("x"))
        return jnp.mean(jnp.square(f(a, b, c, sizes).astype(jnp.float32)))

    _kernel_equals_fallback(monkeypatch, loss, x, w1, w2)


def _kernel_equals_fallback(monkeypatch, loss, *args) -> None:
    """loss(*args) and its gradients with the exchange kernel, then with it turned off: equal
    bit for bit."""
    got = jax.jit(jax.value_and_grad(loss, (0, 1, 2)))(*args)
    monkeypatch.setattr(ex, "kernel_reason", lambda dtype, k: "turned off")
    want = jax.jit(jax.value_and_grad(loss, (0, 1, 2)))(*args)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    for a, b in zip(got[1], want[1], strict=True):
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)),
                                      np.asarray(b.astype(jnp.float32)))  # fmt: skip
