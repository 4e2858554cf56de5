"""The expert-parallel block's second GEMM with its return exchange in one kernel
(`grouped.returned.matmul_returned`, `mosaic_gpu.grouped_return`) on 2 or more Hopper GPUs: the
op against a float32 reference (`lax.ragged_dot` then the all-to-all fallback) on fresh random
layouts (uneven, empty and dropped segments; the dropped rows zeroed over freed NaNs), its
gradients bit for bit the unfused op's; the first GEMM's dX returned the same way
(`matmul_dispatched`) against dX then the exchange; the dispatch and dY's exchange inside the
GEMMs that read their rows (`grouped_dispatch`) against them apart; the MoE block with all of
them against the block with the GEMMs and the exchanges apart, bf16 and FP8, with and without a
capacity, check_vma on and off."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import garbage_freed, moe_block_step, returned_layouts
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import commgemm as cg
import commgemm.grouped.exchange as ex
from commgemm.grouped import returned
from commgemm.grouped.local import grouped_matmul
from commgemm.mosaic_gpu import grouped_return


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "no-vma"])
@pytest.mark.parametrize(
    "groups, most, k, n, drop",
    [(4, 700, 512, 256, True), (16, 1500, 1408, 2048, False), (3, 40, 256, 128, True)],
    ids=["4", "16-wide", "tiny"],
)
def test_op_against_reference(two_gpus, monkeypatch, groups, most, k, n, drop, check_vma):
    """Each owner's rows of the experts' product (float32 reference: `lax.ragged_dot`, then
    the fallback exchange), rows no one returns exactly zero over freed NaNs, twice; the
    gradients bit for bit those of the GEMM and the exchange apart."""
    size, rng = jax.device_count(), np.random.default_rng()
    counts, layouts, out_rows = returned_layouts(rng, size, groups, most, drop)
    x = jnp.asarray(rng.standard_normal((size * size * most, k))).astype(jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((size * groups, k, n)) / k**0.5).astype(jnp.bfloat16)
    sizes = jnp.asarray(counts.sum(axis=0), jnp.int32)  # [dst, group]
    mesh = Mesh(np.array(jax.devices()[:size]), ("x",))

    def body(fn, a, b, g, eb, ec, tb, tc):
        by_expert, tokens = ex.Layout(eb[0], ec[0], by_group=True), ex.Layout(tb[0], tc[0])
        return fn(a, b, g[0], by_expert, tokens)

    def fused(a, b, g, by_expert, tokens):
        return returned.matmul_returned(a, b, g, None, None, None, "x", by_expert, tokens,
                                        size * most, out_rows)  # fmt: skip

    def reference(a, b, g, by_expert, tokens):
        z = lax.ragged_dot(a, b, g, preferred_element_type=jnp.float32)
        return ex._blocks(z, by_expert, tokens, "x", size * most, out_rows)

    def unfused(a, b, g, by_expert, tokens):
        z = grouped_matmul(a, b, g)  # the kernel the fused op's backward runs
        return ex.ragged_all_to_all(z, by_expert, tokens, "x", size * most, out_rows)

    def jitted(fn):
        return jax.jit(jax.shard_map(functools.partial(body, fn), mesh=mesh,
                                     in_specs=(P("x"),) * 7, out_specs=P("x"),
                                     check_vma=check_vma))  # fmt: skip

    run = {fn.__name__: jitted(fn) for fn in (fused, reference, unfused)}
    args = (x, w, sizes, *layouts)
    want = np.asarray(run["reference"](*args))
    traced = _spy(monkeypatch)
    for _ in range(2):
        garbage_freed(1 << 28)
        got = np.asarray(run["fused"](*args).astype(jnp.float32))
        np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2 * np.abs(want).max())
        np.testing.assert_array_equal(got[want == 0], 0)  # the dropped rows: zeros
    assert traced  # the fused kernel ran
    ct = jnp.asarray(rng.standard_normal(want.shape)).astype(jnp.bfloat16)
    grads = [jax.vjp(lambda a, b, f=run[f]: f(a, b, *args[2:]), x, w)[1](ct)
             for f in ("fused", "unfused")]  # fmt: skip
    for a, b in zip(*grads, strict=True):
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)),
                                      np.asarray(b.astype(jnp.float32)))  # fmt: skip


@pytest.mark.parametrize("groups, most, k, f", [(4, 700, 512, 256), (3, 40, 256, 128)],
                         ids=["4", "tiny"])  # fmt: skip
def test_dispatched_dx_returned(two_gpus, monkeypatch, groups, most, k, f):
    """The dispatch and the first GEMM (16-bit) with dX's rows returned from its epilogue:
    result and gradients bit for bit those of dX then the dispatch's transpose, the gradient's
    rows of tokens no expert took exactly zero over freed NaNs."""
    size, rng = jax.device_count(), np.random.default_rng()
    counts, layouts, rows = returned_layouts(rng, size, groups, most, True)
    x = jnp.asarray(rng.standard_normal((size * rows, k))).astype(jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((size * groups, k, f)) / k**0.5).astype(jnp.bfloat16)
    sizes = jnp.asarray(counts.sum(axis=0), jnp.int32)
    mesh = Mesh(np.array(jax.devices()[:size]), ("x",))

    def body(a, b, g, eb, ec, tb, tc):
        by_expert, tokens = ex.Layout(eb[0], ec[0], by_group=True), ex.Layout(tb[0], tc[0])
        return returned.matmul_dispatched(a, b, g[0], None, None, None, "x", tokens, by_expert,
                                          most)[0]  # fmt: skip

    args, traced = (sizes, *layouts), _spy(monkeypatch)
    ct = jnp.asarray(rng.standard_normal((size * size * most, f))).astype(jnp.bfloat16)

    def run():  # traced anew each time: the patched reasons take effect
        fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"),) * 7, out_specs=P("x")))
        garbage_freed(1 << 28)
        y, pullback = jax.vjp(lambda a, b: fn(a, b, *args), x, w)
        return [np.asarray(v.astype(jnp.float32)) for v in (y, *pullback(ct))]

    got = run()
    assert traced
    monkeypatch.setattr(returned, "fused_reason", lambda *a: "turned off")
    want = run()
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)
    live = np.zeros((size, rows), bool)
    for d in range(size):
        for first, count in zip(layouts[2][d, :-1], layouts[3][d], strict=True):
            live[d, first : first + count] = True
    np.testing.assert_array_equal(got[1][~live.reshape(-1)], 0)


@pytest.mark.parametrize("groups, most, k, f", [(4, 700, 512, 256), (3, 40, 256, 512)],
                         ids=["4", "tiny"])  # fmt: skip
def test_rows_arrive_inside_the_gemms(two_gpus, monkeypatch, groups, most, k, f):
    """The dispatch inside the first GEMM and dY's exchange inside the second GEMM's dX
    (`grouped_dispatch`, padding unread: fill=False) against the same ops with the exchanges
    apart (`arrive_reason` turned off): both traced, result and gradients bit for bit."""
    size, rng = jax.device_count(), np.random.default_rng()
    counts, layouts, rows = returned_layouts(rng, size, groups, most, True)
    x = jnp.asarray(rng.standard_normal((size * rows, k))).astype(jnp.bfloat16)
    w1 = jnp.asarray(rng.standard_normal((size * groups, k, f)) / k**0.5).astype(jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((size * groups, f, k)) / f**0.5).astype(jnp.bfloat16)
    sizes = jnp.asarray(counts.sum(axis=0), jnp.int32)
    mesh = Mesh(np.array(jax.devices()[:size]), ("x",))

    def body(a, b, c, g, eb, ec, tb, tc):
        by_expert, tokens = ex.Layout(eb[0], ec[0], by_group=True), ex.Layout(tb[0], tc[0])
        y = returned.matmul_dispatched(a, b, g[0], None, None, None, "x", tokens, by_expert,
                                       most, fill=False)[0]  # fmt: skip
        return returned.matmul_returned(jax.nn.gelu(y), c, g[0], None, None, None, "x",
                                        by_expert, tokens, most, rows, padded=True,
                                        fill=False)  # fmt: skip

    args, traced, arriving = (sizes, *layouts), set(), returned._arriving
    spy = lambda *a, **kw: traced.add(kw.get("w_nk", False)) or arriving(*a, **kw)  # noqa: E731
    monkeypatch.setattr(returned, "_arriving", spy)
    ct = jnp.asarray(rng.standard_normal((size * rows, k))).astype(jnp.bfloat16)

    def run():  # traced anew each time: the patched reasons take effect
        fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"),) * 8, out_specs=P("x")))
        garbage_freed(1 << 28)
        out, pullback = jax.vjp(lambda *a: fn(*a, *args), x, w1, w2)
        return [np.asarray(v.astype(jnp.float32)) for v in (out, *pullback(ct))]

    got = run()
    assert traced == {False, True}  # the dispatch (x @ w1) and dY's exchange (dY @ w2^T)
    monkeypatch.setattr(returned, "arrive_reason", lambda *a, **k: "turned off")
    want = run()
    for a, b in zip(got, want, strict=True):
        assert np.isfinite(a).all()
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("capacity_factor", [None, 0.75], ids=["all", "capped"])
@pytest.mark.parametrize("scaling", [None, "current_tensor_scaling"], ids=["bf16", "fp8"])
def test_moe_block_returned_from_its_gemm(two_gpus, monkeypatch, scaling, capacity_factor):
    """The MoE block (AUTO, all GPUs) with its second GEMM returning the rows itself against
    the same block with the GEMM and the exchange apart (`fused_reason` turned off): the fused
    kernel traced, equal losses and gradients bit for bit, finite over freed NaNs."""
    step, (x, w1, w2) = moe_block_step("gelu", scaling, capacity_factor=capacity_factor)
    traced = _spy(monkeypatch)
    garbage_freed(1 << 30)
    got = step(x, w1, w2)
    assert traced
    monkeypatch.setattr(returned, "fused_reason", lambda *a: "turned off")
    want = step(x, w1, w2)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    for a, b in zip(got[1], want[1], strict=True):
        a, b = (np.asarray(v.astype(jnp.float32)) for v in (a, b))
        assert np.isfinite(a).all()
        np.testing.assert_array_equal(a, b)


def _spy(monkeypatch) -> list:
    """A list that gets an item each time the fused kernel is traced."""
    traced, init = [], grouped_return.Epilogue.__init__
    monkeypatch.setattr(grouped_return.Epilogue, "__init__",
                        lambda self, *a: traced.append(1) or init(self, *a))  # fmt: skip
    return traced


@pytest.mark.parametrize("capacity", [None, 160], ids=["all", "capped"])
def test_two_ops_returned_from_their_gemms(two_gpus, monkeypatch, capacity):
    """`cg.all_to_all_grouped_matmul`, GELU, `cg.grouped_matmul_all_to_all` in 16 bits (NONE):
    the result's rows and dX's returned from their GEMMs against the ops with the GEMMs and the
    exchanges apart: the fused kernels traced, results and gradients equal bit for bit, finite
    over freed NaNs."""
    size, rng = jax.device_count(), np.random.default_rng()
    m, k, f, n, e = 256, 256, 512, 256, 4
    counts = rng.multinomial(m - 8, rng.dirichlet(np.ones(size * e)), size=size)  # [P, E]
    x = jnp.asarray(rng.standard_normal((size * m, k))).astype(jnp.bfloat16)
    w1 = jnp.asarray(rng.standard_normal((size * e, k, f)) / k**0.5).astype(jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((size * e, f, n)) / f**0.5).astype(jnp.bfloat16)
    ct = jnp.asarray(rng.standard_normal((size * m, n)), jnp.float32)
    cfg = cg.OverlapConfig(method="none")
    mesh = Mesh(np.array(jax.devices()[:size]), ("x",))

    def body(a, b, c, g, d):
        y, recv = cg.all_to_all_grouped_matmul(a, b, g[0], "x", config=cfg, capacity=capacity)
        out = cg.grouped_matmul_all_to_all(jax.nn.gelu(y), c, recv, g[0], "x", config=cfg,
                                           tokens=m)  # fmt: skip
        return jnp.sum(out.astype(jnp.float32) * d)[None]

    fn = jax.shard_map(body, mesh=mesh, in_specs=(P("x"),) * 5, out_specs=P("x"))

    def step(*a):  # traced anew each call: the patched reasons take effect
        return jax.jit(jax.value_and_grad(lambda *b: jnp.sum(fn(*b)), (0, 1, 2)))(*a)

    args = (x, w1, w2, jnp.asarray(counts, jnp.int32), ct)
    traced = _spy(monkeypatch)
    garbage_freed(1 << 30)
    got = step(*args)
    assert len(traced) >= 2  # the return and dX's
    monkeypatch.setattr(returned, "fused_reason", lambda *a: "turned off")
    want = step(*args)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    for a, b in zip(got[1], want[1], strict=True):
        a, b = (np.asarray(v.astype(jnp.float32)) for v in (a, b))
        assert np.isfinite(a).all()
        np.testing.assert_array_equal(a, b)
