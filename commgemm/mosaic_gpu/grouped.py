"""The grouped GEMM on Hopper.

The forward and dX (w transposed) run commgemm's ping-pong kernel (`grouped_pingpong`: tiles
aligned to the groups, each compute warpgroup a whole 128 x 128 tile, one's epilogue under the
other's K loop) wherever its tiles fit (`pick_tiles`); the row-aligned kernel
(`grouped_kernel`: the dense kernels' 128 x 256 tiles aligned to the rows, a tile that
straddles group boundaries running one K loop per group) and jax's Mosaic GPU ragged dot
(`ragged_dot_mgpu`: one unit per (row block, group)) run where asked for (`GroupedConfig`,
`GroupedTiles`). dW runs commgemm's ping-pong dW kernel (`grouped_dw`: the tokens contracted
group by group; jax's `transposed_ragged_dot_mgpu` where asked for). XLA's own ragged dot runs
far below the tensor cores' rate on a Hopper GPU, which is why this path exists; it stays the
fall-back for shapes no kernel takes. Tensor scaling (current or delayed) runs the forward and
dX on float8 operands in the same two kernels (`float8_kernel`: the ping-pong one where
accumulation is fast, the row-aligned one for split accumulation), and `ragged_dot`'s dW on
the float8 dW kernel where the recipe lets dW accumulate fast (`float8_dw`)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from commgemm.mosaic_gpu import grouped_dw, grouped_kernel, grouped_pingpong
from commgemm.mosaic_gpu import tiles as mosaic_tiles
from commgemm.mosaic_gpu.configs import GroupedConfig, PingPongTiles
from commgemm.mosaic_gpu.transposes import swapped
from commgemm.vma import like_primal, varying_like


@dataclasses.dataclass(frozen=True)
class GroupedTiles:
    """The tiling of jax's ragged-dot kernels: block_m x block_n output tiles, K-steps of
    block_k, `stages` loaded ahead, tiles walked in bands grid_block_n wide."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    stages: int = 4
    grid_block_n: int = 1

    def kernel_kwargs(self) -> dict:
        """The tiling as jax's ragged-dot kernels take it."""
        return dict(
            block_m=self.block_m,
            block_n=self.block_n,
            block_k=self.block_k,
            max_concurrent_steps=self.stages,
            grid_block_n=self.grid_block_n,
        )

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GroupedTiles.{field.name}={value!r} must be a positive int")


#: A grouped kernel and its tiling: the ping-pong kernel's, the row-aligned kernel's, jax's.
Kernel = PingPongTiles | GroupedConfig | GroupedTiles


def default_tiles(n: int) -> GroupedTiles:
    """128 x 128 tiles walked in bands two wide where N allows (on a Hopper GPU the fastest of five
    tilings for 8 and 64 groups, M = 8192, K = 4096, N = 1792)."""
    return GroupedTiles(grid_block_n=2 if n % 256 == 0 else 1)


def unsupported_reason(x, w, tiles: Kernel | None = None) -> str | None:
    """Why the Hopper kernel `tiles` (None: any of them) cannot run x [M, K] @ w [G, K, N],
    or None."""
    if (reason := mosaic_tiles.hopper_reason()) is not None:
        return reason
    if x.dtype not in (jnp.bfloat16, jnp.float16):
        return f"it needs bfloat16 or float16 operands, got {x.dtype}"
    return _shape_reason(x.shape[0], w.shape[1], w.shape[2], x.dtype, tiles)


def padding_reason(m: int, dtype, w) -> str | None:
    """Why the groups' results of x [m, K] @ w [G, K, N] for x of `dtype`
    (`grouped.local.grouped_matmul`, forward and gradients) might depend on what x's and dY's
    rows past the groups' sum hold here (a NaN there reaching dW through XLA's ragged dot), or
    None: where the Hopper path runs (`ragged_dot`: its forward and dX go row by row) and dW
    runs on commgemm's kernel, which zeroes those rows in shared memory (`grouped_dw`)."""
    x = jax.ShapeDtypeStruct((m, w.shape[1]), dtype)
    if (reason := unsupported_reason(x, w)) is not None:
        return reason
    return grouped_dw.shape_reason(PingPongTiles(), m, w.shape[1], w.shape[2], dtype)


def _shape_reason(m: int, k: int, n: int, dtype, tiles) -> str | None:
    if tiles is None:
        kernels = (PingPongTiles(), GroupedConfig(), default_tiles(n))
        reasons = [_shape_reason(m, k, n, dtype, t) for t in kernels]
        return None if None in reasons else " and ".join(reasons)
    if isinstance(tiles, GroupedConfig):
        return grouped_kernel.shape_reason(tiles, m, k, n, dtype)
    if isinstance(tiles, PingPongTiles):
        return grouped_pingpong.shape_reason(tiles, m, k, n, dtype)
    if 0 in (m, k, n):
        return f"an empty operand ({m} x {k} x {n}): XLA's ragged dot"
    if k % tiles.block_k or n % (tiles.block_n * tiles.grid_block_n):
        return f"K={k} and N={n} must divide into the tiles {tiles}"
    return None


def pick_tiles(m: int, k: int, n: int, groups: int, dtype) -> Kernel | None:
    """The kernel for x [m, K] @ w [groups, K, n] (16-bit, on Hopper; the forward and dX's
    product alike): the ping-pong kernel where its tiles fit (it takes every shape the other
    kernels take); else (or with no groups) None (XLA's ragged dot)."""
    if groups < 1:  # no weights: every row is past the groups' sum
        return None
    return PingPongTiles() if _shape_reason(m, k, n, dtype, PingPongTiles()) is None else None


def weight_grad(x, dy, sizes, tiles: PingPongTiles | GroupedTiles | None = None) -> jax.Array:
    """dW [G, K, N] = x_g^T @ dy_g per group (rows past the groups' sum contribute nothing), in
    x's dtype, float32 accumulation: commgemm's ping-pong dW kernel (`grouped_dw`) in `tiles`
    (default `PingPongTiles()`: 128 x 128 tiles of dW, steps of 64 rows) where K and N are
    whole tiles; jax's transposed ragged dot where asked for (`GroupedTiles`) and its tiles fit;
    else XLA's ragged dot."""
    (m, k), n = x.shape, dy.shape[1]
    tiles = tiles or PingPongTiles()
    if isinstance(tiles, PingPongTiles):
        if grouped_dw.shape_reason(tiles, m, k, n, x.dtype) is None:
            return grouped_dw.weight_grad(x, dy.astype(x.dtype), sizes, tiles)
    elif not (k % tiles.block_m or n % (tiles.block_n * tiles.grid_block_n)):
        from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu

        return transposed_ragged_dot_mgpu.transposed_ragged_dot(
            x, dy.astype(x.dtype), group_sizes=sizes, **tiles.kernel_kwargs()
        )
    wide = jnp.promote_types(x.dtype, jnp.float32)
    _, pullback = jax.vjp(
        lambda b: lax.ragged_dot(x, b, sizes, preferred_element_type=wide),
        jnp.zeros((sizes.shape[0], k, n), x.dtype),
    )
    return pullback(dy.astype(wide))[0].astype(x.dtype)


def stored_apart(out: jax.Array) -> jax.Array:
    """A grouped kernel's result behind an optimization barrier (no copy, no work). Where a
    result is both used and saved for the backward inside a scan (an activation's input, which
    the scan stacks with a dynamic update slice), XLA's dynamic-slice fusion would otherwise
    launch the kernel a second time to write that slice; this way the slice is a copy."""
    return lax.optimization_barrier(out)


def product(x, w, sizes, tiles, transpose_rhs: bool) -> jax.Array:
    """x [M, K] @ w[g] per group (w [G, K, N]; with transpose_rhs, dX's dy [M, N] @ w[g]^T),
    forward only, by the kernel `tiles` names (None: `pick_tiles`; XLA's ragged dot where no
    kernel takes the shape)."""
    m, k = x.shape
    n = w.shape[1 if transpose_rhs else 2]
    tiles = tiles or pick_tiles(m, k, n, w.shape[0], x.dtype)
    if (reason := _shape_reason(m, k, n, x.dtype, tiles) if tiles else None) is not None:
        raise ValueError(f"grouped GEMM {(m, k)} x {w.shape}: {reason}")
    if isinstance(tiles, GroupedConfig | PingPongTiles):
        kernel = grouped_kernel if isinstance(tiles, GroupedConfig) else grouped_pingpong
        out = stored_apart(kernel.grouped_matmul(x, w, sizes, tiles, w_nk=transpose_rhs))
        return varying_like(out, x, w)  # a Pallas result carries no varying axes of its own
    if tiles is None:
        rhs = jnp.swapaxes(w, 1, 2) if transpose_rhs else w
        return lax.ragged_dot(x, rhs, sizes, preferred_element_type=x.dtype)
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    out = ragged_dot_mgpu.ragged_dot(
        x, w, group_sizes=sizes, transpose_rhs=transpose_rhs, **tiles.kernel_kwargs()
    )
    # rows past the groups' sum are never stored by the kernel: zero them (ragged_dot's meaning)
    rows = jnp.arange(x.shape[0], dtype=jnp.int32)[:, None]
    return varying_like(jnp.where(rows < jnp.sum(sizes), out, jnp.zeros((), out.dtype)), x, w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def ragged_dot(x: jax.Array, w: jax.Array, sizes: jax.Array, tiles: Kernel | None) -> jax.Array:
    """x [M, K] rows sorted by group, w [G, K, N], sizes [G] int32 -> [M, N] in x's dtype
    (float32 accumulation). `tiles`: the forward's kernel (None: `pick_tiles`); dX picks its
    own for its shape."""
    return product(x, w, sizes, tiles, transpose_rhs=False)


def _fwd(x, w, sizes, tiles):
    return product(x, w, sizes, tiles, transpose_rhs=False), (x, w, sizes)


def _bwd(tiles, residuals, dy):
    x, w, sizes = residuals
    dx = product(dy.astype(x.dtype), w, sizes, None, transpose_rhs=True)
    dw = varying_like(weight_grad(x, dy, sizes).astype(w.dtype), x, dy)
    # inside shard_map: dW summed over the axes the tokens vary over and w does not
    return like_primal(dx, x), like_primal(dw, w), None


ragged_dot.defvjp(_fwd, _bwd)


def float8_reason(x, w, recipe, tiles: GroupedConfig | None = None) -> str | None:
    """Why `float8_ragged_dot` cannot run x [M, K] @ w [G, K, N] under `recipe` in `tiles` here
    (the grouped op then emulates the quantized GEMM), or None: it takes tensor scaling,
    current or delayed, on the shapes commgemm's kernel takes (its forward accumulating as the
    recipe asks)."""
    from commgemm.quant import TENSOR_MODES

    if (reason := mosaic_tiles.hopper_reason()) is not None:
        return reason
    if x.dtype not in (jnp.bfloat16, jnp.float16):
        return f"it quantizes bfloat16 or float16 operands, got {x.dtype}"
    if recipe.mode not in TENSOR_MODES:
        return f"its float8 kernel takes tensor scaling, not {recipe.mode.name}"
    m, k, n = x.shape[0], w.shape[1], w.shape[2]
    split = recipe.split_accumulator[0]
    return float8_shape_reason(m, k, n, w.shape[0], recipe.dtype, split=split, tiles=tiles)


@dataclasses.dataclass(frozen=True)
class Float8Plan:
    """How `float8_ragged_dot` quantizes and accumulates (static): x and w's float8 format,
    the cotangent's (`grad_dtype`), and split accumulation in the forward, dX and dW
    (`ScalingRecipe.split_accumulator`); the forward's kernel tiles."""

    dtype: str
    grad_dtype: str
    split: tuple[bool, bool, bool]
    tiles: GroupedConfig | None = None

    @staticmethod
    def of(recipe, tiles: GroupedConfig | None = None) -> Float8Plan:
        return Float8Plan(recipe.dtype, recipe.grad_dtype, tuple(recipe.split_accumulator), tiles)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def float8_ragged_dot(
    x: jax.Array, w: jax.Array, sizes: jax.Array, qw, nk, states, plan: Float8Plan
) -> jax.Array:
    """`ragged_dot` on float8 operands (`float8_reason` must be None): x [M, K] quantized to
    plan.dtype with one scale (its current amax, or delayed: `states`' x_state), times qw, w
    [G, K, N] quantized along K (a `ScaledTensor`; its values transposed to [G, N, K], K-major,
    in one pass, unless `nk` holds them so already: a `QuantizedWeight`'s `transposed`),
    multiplied on the float8 tensor cores by commgemm's kernel, the scales
    applied in its epilogue -> [M, N] in x's dtype. `states`: (x_state, dy_state), the delayed
    recipe's `ScalingState`s (None: current scaling).

    Backward: straight-through; dY is quantized to plan.grad_dtype by its current amax or by
    dy_state's scale, whose cotangent is then the state advanced by dY's amax (what
    `grouped.scaling.with_quantized_cotangent` does on the emulated path). dX = dY @ w^T runs on
    the float8 tensor cores too, on dY's float8 values and w's float8 values as they are
    ([G, K, N] is K-major for dX's contraction over N), where the kernel takes dX's shape (else
    the 16-bit kernel on the dequantized values); dW = x^T dY too where its accumulation may be
    fast (`float8_dw`), else the 16-bit product of the dequantized x and dY. The residuals are
    the float8 operands, not dequantized copies. qw gets no gradient."""
    return _float8_forward(x, w, sizes, qw, nk, states, plan)[0]


def _float8_forward(x, w, sizes, qw, nk, states, plan: Float8Plan):
    from commgemm.quant import ScalingMode, quantize

    x_state, dy_state = states
    if x_state is None:
        qx = quantize(x, ScalingMode.CURRENT_TENSOR_SCALING, dtype=plan.dtype)
    else:
        qx = quantize(x, ScalingMode.DELAYED_TENSOR_SCALING, dtype=plan.dtype, state=x_state)[0]
    w_nk = swapped(qw.data) if nk is None else nk
    out = float8_matmul(
        qx.data,
        qx.scale_inv,
        w_nk,
        qw.scale_inv,
        sizes,
        x.dtype,
        split=plan.split[0],
        tiles=plan.tiles,
    )
    return varying_like(out, x, w), (qx, qw, sizes, dy_state)


def _float8_bwd(plan: Float8Plan, residuals, dy):
    from commgemm.operand_scaling import dy_quantized
    from commgemm.quant import ScalingMode, dequantize, dequantize_fusible

    qx, qw, sizes, dy_state = residuals  # x, w and the result share dy's dtype
    mode = ScalingMode.DELAYED_TENSOR_SCALING if dy_state is not None else qx.mode
    qdy, new_state = dy_quantized(dy, mode, plan.grad_dtype, (), dy_state)
    dx = float8_dx(qdy, qw.data, qw.scale_inv, sizes, dy.dtype, plan.split[1])
    dw = float8_dw(qx.data, qx.scale_inv, qdy, sizes, dy.dtype, plan.split[2])
    if dx is None or dw is None:
        dy16 = dequantize_fusible(qdy, dy.dtype)  # written by dY's quantizing pass
    if dx is None:
        dx = product(dy16, dequantize(qw, dy.dtype), sizes, None, transpose_rhs=True)
    if dw is None:
        x16 = dequantize(qx, dy.dtype)
        dw = varying_like(weight_grad(x16, dy16, sizes), x16, dy16)
    # inside shard_map: dW summed over the axes the tokens vary over and w does not (the
    # quantized values vary as the operands do)
    return like_primal(dx, qx.data), like_primal(dw, qw.data), None, None, None, (None, new_state)


float8_ragged_dot.defvjp(_float8_forward, _float8_bwd)


def float8_matmul(
    a,
    a_scale_inv,
    b_nk,
    b_scale_inv,
    sizes,
    out_dtype,
    *,
    split: bool = False,
    tiles: GroupedConfig | None = None,
) -> jax.Array:
    """Rows of a [M, K] (float8, sorted by group) times their group's b_nk[g]^T ([G, N, K],
    float8, K-major) on one of commgemm's grouped kernels, the two tensor scales (`*_scale_inv`,
    the factors that dequantize) applied in its epilogue -> [M, N] in `out_dtype` (16-bit), on
    the kernel `float8_kernel` picks (`tiles`: the row-aligned kernel's tiling, which asks for
    it); ValueError where neither kernel takes the shape."""
    scale = (a_scale_inv * b_scale_inv).astype(jnp.float32).reshape(1)
    (m, k), (groups, n, _), sizes = a.shape, b_nk.shape, sizes.astype(jnp.int32)
    kernel = float8_kernel(m, k, n, groups, a.dtype, split=split, tiles=tiles)
    kw = dict(w_nk=True, scale=scale, out_dtype=out_dtype)
    if isinstance(kernel, str):
        raise ValueError(f"float8 grouped GEMM {(m, k)} x {list(b_nk.shape)}: {kernel}")
    if isinstance(kernel, PingPongTiles):
        out = grouped_pingpong.grouped_matmul(a, b_nk, sizes, kernel, **kw)
    else:
        out = grouped_kernel.grouped_matmul(a, b_nk, sizes, kernel, split_accumulator=split, **kw)
    return varying_like(stored_apart(out), a, b_nk)  # a Pallas result carries no varying axes


def float8_kernel(
    m: int,
    k: int,
    n: int,
    groups: int,
    dtype,
    *,
    split: bool = False,
    tiles: GroupedConfig | None = None,
) -> GroupedConfig | PingPongTiles | str:
    """The kernel `float8_matmul` runs x [m, K] (float8 `dtype`) times w [groups, n, K] on, or
    why none takes the shape (a str): the row-aligned kernel in `tiles` where they are given;
    else the ping-pong kernel where accumulation is fast (it has no split form) and its tiles
    fit; else the row-aligned kernel (with split accumulation in `fused.split_tiling`: 64 x
    128 warpgroup tiles, K-steps of 256 where K allows). `groups` does not change the pick
    (the ping-pong kernel's tiles fit any groups)."""
    aligned = tiles or GroupedConfig()
    reason = grouped_kernel.shape_reason(aligned, m, k, n, dtype, w_nk=True, split=split)
    if tiles is None and not split:
        pingpong = grouped_pingpong.operand_tiles(PingPongTiles(), k, dtype)
        fits = grouped_pingpong.shape_reason(pingpong, m, k, n, dtype, w_nk=True)
        if fits is None:
            return pingpong
        if reason is not None:
            return reason if reason == fits else f"{reason}; ping-pong kernel: {fits}"
    return aligned if reason is None else reason


def float8_shape_reason(m: int, k: int, n: int, groups: int, dtype, **kw) -> str | None:
    """Why neither kernel multiplies float8 x [m, K] by w [groups, n, K] (`float8_kernel`'s
    str, with its keyword arguments), or None."""
    kernel = float8_kernel(m, k, n, groups, dtype, **kw)
    return kernel if isinstance(kernel, str) else None


def float8_dx(qdy, w_kn: jax.Array, w_scale_inv, sizes, out_dtype, split: bool):
    """dX = dY @ w[g]^T for each row's group g on commgemm's float8 kernel (`float8_matmul`):
    qdy [M, N] (a tensor-scaled float8 `ScaledTensor`) times w_kn [G, K, N] (the float8 values
    as quantized along K, K-major for this contraction over N) -> [M, K] in `out_dtype`
    (16-bit); None where the kernel does not take the shape (the caller emulates)."""
    (m, n), (groups, k, _) = qdy.data.shape, w_kn.shape
    if float8_shape_reason(m, n, k, groups, qdy.data.dtype, split=split) is not None:
        return None
    return float8_matmul(qdy.data, qdy.scale_inv, w_kn, w_scale_inv, sizes, out_dtype, split=split)


def float8_dw(x, x_scale_inv, qdy, sizes, out_dtype, split: bool) -> jax.Array | None:
    """dW [G, K, N] = x_g^T @ dY_g for each group g on commgemm's float8 dW kernel
    (`grouped_dw.float8_weight_grad`): x [M, K] float8 values and their tensor scale, qdy [M, N]
    (a tensor-scaled float8 `ScaledTensor`) -> `out_dtype`; None where it does not run: split
    accumulation asked for (the kernel's is fast), or `grouped_dw.float8_reason`."""
    (m, k), n = x.shape, qdy.data.shape[1]
    if split or grouped_dw.float8_reason(m, k, n, sizes.shape[0]) is not None:
        return None
    dw = grouped_dw.float8_weight_grad(
        x, x_scale_inv, qdy.data, qdy.scale_inv, sizes.astype(jnp.int32), out_dtype
    )
    return varying_like(dw, x, qdy.data)  # a Pallas result carries no varying axes


def prequantized_reason(x, w, w_nk: bool, out_dtype) -> str | None:
    """Why commgemm's kernel cannot multiply the caller's `ScaledTensor`s x [M, K] and w
    ([G, N, K] with w_nk, else [G, K, N]) here into `out_dtype`, or None: tensor scales, float8
    values (e4m3 and e5m2 in any pairing), a 16-bit result, whole tiles."""
    from commgemm.quant import TENSOR_MODES

    if (reason := mosaic_tiles.hopper_reason()) is not None:
        return reason
    if x.mode not in TENSOR_MODES or w.mode not in TENSOR_MODES:
        return f"its float8 kernel takes tensor scales, got {x.mode.name} and {w.mode.name}"
    if x.data.dtype not in grouped_kernel.FLOAT8 or w.data.dtype not in grouped_kernel.FLOAT8:
        return f"it multiplies float8 values, got {x.data.dtype} and {w.data.dtype}"
    if jnp.dtype(out_dtype) not in (jnp.bfloat16, jnp.float16):
        return f"its result is bf16 or fp16, not {jnp.dtype(out_dtype).name}"
    (m, k), n = x.data.shape, w.data.shape[1 if w_nk else 2]
    return float8_shape_reason(m, k, n, w.data.shape[0], x.data.dtype)
