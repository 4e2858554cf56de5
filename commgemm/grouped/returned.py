"""The expert-parallel block's grouped GEMMs with the exchanges that bring rows back to their
owners inside them, differentiable.

`matmul_returned` (the second GEMM) is `blocks.whole_block_matmul` then
`exchange.ragged_all_to_all` from the experts' layout to the tokens'. On Hopper GPUs, where the
GEMM runs on the ping-pong kernel (16-bit, or float8 with current tensor scaling and fast
accumulation) and the exchange on NVLink, both run as one kernel (`mosaic_gpu.grouped_return`):
each output tile goes from the epilogue straight into its owners' results while the next tile
multiplies, so the exchange runs under the GEMM instead of after it, and the GEMM's own
[P*C, N] result is never written. Its backward is the unfused one: the exchange's transpose
(dY's rows to the experts) and the GEMM's gradients.

`matmul_dispatched` (the first GEMM) is the dispatch (`to_experts`) then the GEMM; in 16 bits,
where the same kernel takes dX's product, its backward runs dX that way: dX's rows go back to
the tokens' owners from its epilogue, the dispatch's transpose inside dX's GEMM.

In 16 bits, where no reader takes the receive buffer's padding (fill=False) and
`arrive_reason` allows, the rows a GEMM reads arrive inside it too
(`mosaic_gpu.grouped_dispatch`): the dispatch inside the first GEMM's forward and dY's exchange
inside the second GEMM's dX, each kernel also returning the rows received (for dW)."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from commgemm.grouped import exchange
from commgemm.grouped.blocks import own_dy_block_matmul, reads_cotangent_padding, whole_block_matmul
from commgemm.grouped.exchange import Layout, destinations, ragged_all_to_all, unwritten
from commgemm.grouped.local import grouped_matmul
from commgemm.grouped.scaling import Float8Experts, Rows, carry
from commgemm.operands import axis_size
from commgemm.vma import varying_like

#: With several processes a kernel with remote references gets every operand in the
#: collective (symmetric) memory, and XLA copies there each operand that comes from outside
#: it (`memcpy128`): in 16 bits the experts' weights, where they are the program's inputs. The
#: fused kernels run there where the weights are at most this many times the rows a shard
#: returns (bytes), so that the copy stays below the exchange it hides.
WEIGHT_COPY_RATIO = 2
#: The most columns of a GEMM whose rows arrive inside it (`arrive_reason`): beyond, a row's
#: exchange is short beside its products, and the senders' SMs cost the GEMM more than the
#: exchange they hide.
ARRIVE_MAX_N = 4096


class _How(NamedTuple):
    """The fused ops' static arguments (`matmul_returned`'s; for `_dispatched` out_rows are
    x's rows and fill the dispatch's), and float8's: the experts' split flags and dY's format
    (None: 16-bit)."""

    axis_name: str
    capacity: int
    out_rows: int
    padded: bool
    fill: bool
    fill_grad: bool
    split: tuple[bool, bool, bool] | None
    grad_dtype: str | None
    arrive: bool = False  # the rows this GEMM reads arrive inside its kernel (`arrive_reason`)


def to_experts(axis_name: str, capacity: int, fill: bool = True):
    """The exchange of a shard's tokens (x or its quantized payload) into its experts' rows
    [P*C, .], by `expert_parallel._layouts`' pair (`fill=False`: their padding left
    unwritten)."""
    return functools.partial(ragged_all_to_all, axis_name=axis_name, most=capacity,
                             out_rows=axis_size(axis_name) * capacity, fill=fill)  # fmt: skip


def fused_reason(values, w, rows: Rows | None, experts: Float8Experts | None, recipe,
                 axis_name: str) -> str | None:  # fmt: skip
    """Why `matmul_returned` runs the GEMM values [M, K] @ w [e, K, N] and the exchange apart
    here, or None (`values` and `w` may be shapes: jax.ShapeDtypeStruct). With one process
    per GPU, in 16 bits, also where the weights outweigh the rows (`WEIGHT_COPY_RATIO`)."""
    from commgemm.mosaic_gpu import grouped as hopper
    from commgemm.mosaic_gpu.configs import PingPongTiles

    if axis_size(axis_name) == 1:
        return "one shard: the exchange is a select"
    (m, k), (groups, _, n) = values.shape, w.shape
    if (reason := exchange.kernel_reason(values.dtype, n)) is not None:
        return reason
    if jax.process_count() > 1 and recipe is None:
        weights = groups * k * n * jnp.dtype(w.dtype).itemsize
        rows = m // axis_size(axis_name) * n * jnp.dtype(values.dtype).itemsize  # C rows of N
        if weights > WEIGHT_COPY_RATIO * rows:
            return (
                f"one process per GPU: the weights' copy into collective memory ({weights} "
                f"bytes) would outweigh the {rows} bytes of rows a shard returns"
            )
    if recipe is None:
        if (reason := hopper.unsupported_reason(values, w)) is not None:
            return reason
        if not isinstance(hopper.pick_tiles(m, k, n, groups, values.dtype), PingPongTiles):
            return "the ping-pong kernel does not take the shape"
        return None
    if reads_cotangent_padding(values, rows, experts, recipe):
        return "dY goes to an amax over every row (delayed scaling, or no float8 kernel)"
    kernel = hopper.float8_kernel(m, k, n, groups, rows.payload.dtype, split=experts.split[0])
    if not isinstance(kernel, PingPongTiles):
        return "split accumulation runs on the row-aligned kernel"
    return None


def arrive_reason(m: int, k: int, n: int, groups: int, dtype, axis_name: str, *,
                  w_nk: bool = False) -> str | None:  # fmt: skip
    """Why the 16-bit GEMM x [m, k] @ w [groups, k, n] ([groups, n, k] with w_nk) takes x's
    rows after their exchange instead of while they arrive (`mosaic_gpu.grouped_dispatch`),
    or None; the caller has checked the NVLink kernels (`fused_reason`). The senders take
    SMs from the GEMM: they pay where a row's exchange is long beside its products, n at most
    ARRIVE_MAX_N."""
    from commgemm.mosaic_gpu import grouped as hopper
    from commgemm.mosaic_gpu import grouped_dispatch, grouped_pingpong
    from commgemm.mosaic_gpu import tiles as mt
    from commgemm.mosaic_gpu.configs import PingPongTiles

    if n > ARRIVE_MAX_N:
        return f"N={n} > {ARRIVE_MAX_N}: the exchange is short beside the GEMM"
    if grouped_dispatch.staging_cols(k, dtype) is None:
        return f"rows of {k} x {jnp.dtype(dtype).name} are no whole pairs of staged blocks"
    if not w_nk and not isinstance(hopper.pick_tiles(m, k, n, groups, dtype), PingPongTiles):
        return "the ping-pong kernel does not take the shape"
    if reason := grouped_pingpong.shape_reason(PingPongTiles(), m, k, n, dtype, w_nk=w_nk):
        return reason
    if mt.num_sms() <= 2 * grouped_dispatch.SENDERS:
        return f"{mt.num_sms()} SMs leave too few to multiply beside the senders"
    return None


def arrival_plan(x, send: Layout, recv: Layout, axis_name: str, m: int):
    """The `mosaic_gpu.grouped_dispatch.Dispatched` of the exchange `ragged_all_to_all(x, send,
    recv, ...)` into m rows: each of send's regions an item, taken group-major (the order in
    which the receivers' GEMMs read them)."""
    from commgemm.mosaic_gpu import grouped_dispatch

    size, regions = axis_size(axis_name), send.counts.shape[0]
    order = lambda a: send.grid(a, size).T.reshape(-1)  # noqa: E731  (group-major)
    peers = send.pair(jnp.arange(regions, dtype=jnp.int32), size)[0]
    sends = (send.bounds[:-1], send.counts, destinations(send, recv, axis_name), peers)
    return grouped_dispatch.plan(x, *map(order, sends), recv.bounds[:-1], recv.counts, m,
                                 axis_name)  # fmt: skip


def _arriving(x, w, sizes, send: Layout, recv: Layout, axis_name: str, m: int, w_nk=False):
    """x [R, K] in `send`'s regions -> (recv's rows [m, K] times w per group (`sizes` [G]),
    those rows): the exchange `ragged_all_to_all(x, send, recv, ...)` (recv's padding left
    unwritten) inside the GEMM's kernel."""
    from commgemm.mosaic_gpu import grouped_pingpong
    from commgemm.mosaic_gpu.configs import PingPongTiles

    plan = arrival_plan(x, send, recv, axis_name, m)
    rows = jax.ShapeDtypeStruct((m, x.shape[1]), x.dtype)
    y, flat = grouped_pingpong.grouped_matmul(rows, w, sizes.astype(jnp.int32), PingPongTiles(),
                                              w_nk=w_nk, dispatched=plan)  # fmt: skip
    return varying_like(y, x, w, plan.items), varying_like(flat, x, plan.items)


def matmul_returned(
    values: jax.Array,
    w: jax.Array,
    sizes: jax.Array,
    rows: Rows | None,
    experts: Float8Experts | None,
    recipe,
    axis_name: str,
    by_expert: Layout,
    tokens: Layout,
    capacity: int,
    out_rows: int,
    *,
    padded: bool = False,
    fill: bool = True,
) -> jax.Array:
    """values [P*C, K] (the rows this shard's experts received, in `by_expert`'s regions,
    sorted by expert with counts `sizes` [e]), w [e, K, N] -> [out_rows, N]: each owner's rows
    of `whole_block_matmul(values, w, sizes, rows, experts, recipe, axis_name, padded, fill)`
    back in `tokens`' regions (`ragged_all_to_all(..., by_expert, tokens, axis_name, capacity,
    out_rows)`), zeros in the rows no shard returns. Inside shard_map over `axis_name`; one
    kernel where `fused_reason` is None. `fill=False` (values' rows past the groups are left
    unwritten upstream, no one reads them): so are the GEMM's gradient's, and dZ's where the
    GEMM's backward reads the groups' rows of it only (`blocks.reads_cotangent_padding`)."""
    fill_grad = fill or reads_cotangent_padding(values, rows, experts, recipe)
    if fused_reason(values, w, rows, experts, recipe, axis_name) is not None:
        z = whole_block_matmul(values, w, sizes, rows, experts, recipe, axis_name, padded, fill)
        return ragged_all_to_all(z, by_expert, tokens, axis_name, capacity, out_rows,
                                 fill_grad=fill_grad)  # fmt: skip
    f8, split, grad_dtype = None, None, None
    if recipe is not None:
        f8 = (experts.nk, experts.kn, experts.scale_inv)
        split, grad_dtype = experts.split, experts.grad_dtype
    (m, k), (groups, _, n) = values.shape, w.shape
    arrive = (
        recipe is None
        and not fill_grad
        and arrive_reason(m, n, k, groups, values.dtype, axis_name, w_nk=True) is None
    )
    how = _How(axis_name, capacity, out_rows, padded, fill, fill_grad, split, grad_dtype, arrive)
    return _returned(values, w, sizes, rows, f8, by_expert, tokens, how)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _returned(values, w, sizes, rows, f8, by_expert: Layout, tokens: Layout, how: _How):
    """The fused kernel; f8: the experts' (nk, kn, scale_inv) for float8 rows, else None."""
    from commgemm.mosaic_gpu import grouped_pingpong
    from commgemm.mosaic_gpu.configs import PingPongTiles

    returned = _returned_to(by_expert, tokens, how.axis_name, how.out_rows)
    sizes = sizes.astype(jnp.int32)
    if f8 is None:
        out = grouped_pingpong.grouped_matmul(values, w, sizes, PingPongTiles(), returned=returned)
    else:
        nk, _, scale_inv = f8
        scale = (rows.scale * scale_inv).astype(jnp.float32).reshape(1)
        out = grouped_pingpong.grouped_matmul(rows.payload, nk, sizes, PingPongTiles(), w_nk=True,
                                              scale=scale, out_dtype=values.dtype,
                                              returned=returned)  # fmt: skip
    return varying_like(out, values, w, returned.segments)  # a Pallas result: no varying axes


def _returned_to(by_expert: Layout, tokens: Layout, axis_name: str, out_rows: int):
    """The fused kernel's `Returned`: by_expert's regions back into `tokens`' on their owners."""
    from commgemm.mosaic_gpu.grouped_return import Returned

    segments = jnp.stack([by_expert.bounds[:-1], by_expert.counts,
                          destinations(by_expert, tokens, axis_name)])  # fmt: skip
    return Returned(segments, jnp.stack(unwritten(tokens)), out_rows, axis_name)


def _returned_fwd(values, w, sizes, rows, f8, by_expert, tokens, how):
    out = _returned(values, w, sizes, rows, f8, by_expert, tokens, how)
    return out, (values, w, sizes, rows, f8, by_expert, tokens)


def _returned_bwd(how: _How, residuals, ct):
    values, w, sizes, rows, f8, by_expert, tokens = residuals
    if how.arrive:  # dY's rows arrive inside dX's GEMM
        dvalues, dz = _arriving(ct, w, sizes, tokens, by_expert, how.axis_name, values.shape[0],
                                w_nk=True)  # fmt: skip
        dw = jax.vjp(lambda b: grouped_matmul(values, b, sizes), w)[1](dz)[0]
        return dvalues, dw, None, None, None, None, None
    dz = ragged_all_to_all(ct, tokens, by_expert, how.axis_name, how.capacity, values.shape[0],
                           fill=how.fill_grad)  # fmt: skip
    if f8 is None:
        product = functools.partial(grouped_matmul, group_sizes=sizes)
    else:
        experts = Float8Experts(*f8, how.split, how.grad_dtype)
        product = functools.partial(
            own_dy_block_matmul, sizes=sizes, rows=rows, experts=experts,
            axis_name=how.axis_name, padded=how.padded, fill=how.fill,
        )  # fmt: skip
    dvalues, dw = jax.vjp(product, values, w)[1](dz)
    return dvalues, dw, None, None, None, None, None


_returned.defvjp(_returned_fwd, _returned_bwd)


def matmul_dispatched(
    x: jax.Array,
    w: jax.Array,
    sizes: jax.Array,
    rows: Rows | None,
    experts: Float8Experts | None,
    recipe,
    axis_name: str,
    tokens: Layout,
    by_expert: Layout,
    capacity: int,
    *,
    live: jax.Array | None = None,
    fill: bool = True,
) -> tuple[jax.Array, bool]:
    """x [m, K] (this shard's tokens in `tokens`' regions; `rows` their quantized form or
    None) to its experts' rows [P*C, K] (`to_experts(axis_name, capacity, fill)`, carried as
    `scaling.carry` carries them, `live` the rows that hold tokens there) times w [e, K, F]
    (`whole_block_matmul` with `sizes` [e], padded on several shards) -> (y [P*C, F], whether
    y's gradient is read past the groups: `blocks.reads_cotangent_padding`). 16-bit, where
    `fused_reason` takes dX's product: its backward's dX returns its rows to their owners from
    the GEMM's epilogue (the dispatch's transpose)."""
    size = axis_size(axis_name)
    k, f = w.shape[1:]
    shape = jax.ShapeDtypeStruct
    dx = (shape((size * capacity, f), x.dtype), shape((w.shape[0], f, k), x.dtype))
    if recipe is None and fused_reason(*dx, None, None, None, axis_name) is None:
        arrive = not fill and arrive_reason(size * capacity, k, f, w.shape[0], x.dtype,
                                            axis_name) is None  # fmt: skip
        how = _How(axis_name, capacity, x.shape[0], size > 1, fill, True, None, None, arrive)
        return _dispatched(x, w, sizes, tokens, by_expert, how), False
    flat, flat_rows = carry(to_experts(axis_name, capacity, fill), x, rows, None, tokens,
                            by_expert, live=live, fill=fill)  # fmt: skip
    y = whole_block_matmul(flat, w, sizes, flat_rows, experts, recipe, axis_name, size > 1, fill)
    return y, reads_cotangent_padding(flat, flat_rows, experts, recipe)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _dispatched(x, w, sizes, tokens: Layout, by_expert: Layout, how: _How):
    """The dispatch and the 16-bit GEMM (how.out_rows: x's rows)."""
    return _dispatched_fwd(x, w, sizes, tokens, by_expert, how)[0]


def _dispatched_fwd(x, w, sizes, tokens, by_expert, how: _How):
    m = axis_size(how.axis_name) * how.capacity
    if how.arrive:  # the rows arrive inside the GEMM
        y, flat = _arriving(x, w, sizes, tokens, by_expert, how.axis_name, m)
        return y, (flat, w, sizes, tokens, by_expert)
    flat = to_experts(how.axis_name, how.capacity, how.fill)(x, tokens, by_expert)
    return grouped_matmul(flat, w, sizes), (flat, w, sizes, tokens, by_expert)


def _dispatched_bwd(how: _How, residuals, dy):
    from commgemm.mosaic_gpu import grouped_pingpong
    from commgemm.mosaic_gpu.configs import PingPongTiles

    flat, w, sizes, tokens, by_expert = residuals
    returned = _returned_to(by_expert, tokens, how.axis_name, how.out_rows)
    dx = grouped_pingpong.grouped_matmul(dy.astype(flat.dtype), w, sizes.astype(jnp.int32),
                                         PingPongTiles(), w_nk=True, returned=returned)  # fmt: skip
    dx = varying_like(dx, dy, w, returned.segments)  # a Pallas result carries no varying axes
    dw = jax.vjp(lambda b: grouped_matmul(flat, b, sizes), w)[1](dy)[0]
    return dx, dw, None, None, None


_dispatched.defvjp(_dispatched_fwd, _dispatched_bwd)
