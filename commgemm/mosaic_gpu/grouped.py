"""The grouped GEMM on Hopper: jax's Mosaic GPU ragged-dot kernel (`ragged_dot_mgpu`) for the
forward and dX (w transposed), and its transposed ragged dot (`transposed_ragged_dot_mgpu`,
the tokens contracted group by group) for dW. XLA's own ragged dot runs far below the tensor
cores' rate on H200 (docs/performance.md), which is why this path exists."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax


@dataclasses.dataclass(frozen=True)
class GroupedTiles:
    """The kernel's tiling: block_m x block_n output tiles, K-steps of block_k, `stages` loaded
    ahead, tiles walked in bands grid_block_n wide."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    stages: int = 4
    grid_block_n: int = 1

    def kernel_kwargs(self) -> dict:
        """The tiling as jax's ragged-dot kernels take it."""
        return dict(block_m=self.block_m, block_n=self.block_n, block_k=self.block_k,
                    max_concurrent_steps=self.stages, grid_block_n=self.grid_block_n)  # fmt: skip

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GroupedTiles.{field.name}={value!r} must be a positive int")


def default_tiles(n: int) -> GroupedTiles:
    """128 x 128 tiles walked in bands two wide where N allows (on H200 the fastest of five
    tilings for 8 and 64 groups, M = 8192, K = 4096, N = 1792: BENCHMARKS.md)."""
    return GroupedTiles(grid_block_n=2 if n % 256 == 0 else 1)


def unsupported_reason(x, w, tiles: GroupedTiles) -> str | None:
    """Why the Hopper kernel cannot run x [M, K] @ w [G, K, N], or None."""
    device = jax.devices()[0]
    if device.platform != "gpu":
        return f"it runs on GPUs; this backend is {device.platform}"
    if not str(getattr(device, "compute_capability", "")).startswith("9"):
        return "it needs a Hopper GPU (compute capability 9.x)"
    if jax.__version_info__ < (0, 11):
        return f"it needs jax >= 0.11, this is {jax.__version__}"
    if x.dtype not in (jnp.bfloat16, jnp.float16):
        return f"it needs bfloat16 or float16 operands, got {x.dtype}"
    k, n = w.shape[1], w.shape[2]
    if k % tiles.block_k or n % (tiles.block_n * tiles.grid_block_n):
        return f"K={k} and N={n} must divide into the tiles {tiles}"
    return None


def weight_grad(x, dy, sizes, tiles: GroupedTiles | None = None) -> jax.Array:
    """dW [G, K, N] = x_g^T @ dy_g per group (rows past the groups' sum contribute nothing), in
    x's dtype, float32 accumulation: jax's transposed ragged-dot kernel (block_m x block_n tiles
    of each group's gradient, K-steps of block_k tokens; `default_tiles`, which was also dW's
    fastest of four tilings: BENCHMARKS.md) where K and N are whole tiles, else XLA's ragged
    dot."""
    tiles = tiles or default_tiles(dy.shape[1])
    (_, k), n = x.shape, dy.shape[1]
    if k % tiles.block_m or n % (tiles.block_n * tiles.grid_block_n):
        wide = jnp.promote_types(x.dtype, jnp.float32)
        _, pullback = jax.vjp(
            lambda b: lax.ragged_dot(x, b, sizes, preferred_element_type=wide),
            jnp.zeros((sizes.shape[0], k, n), x.dtype),
        )
        return pullback(dy.astype(wide))[0].astype(x.dtype)
    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu

    return transposed_ragged_dot_mgpu.transposed_ragged_dot(
        x, dy.astype(x.dtype), group_sizes=sizes, **tiles.kernel_kwargs()
    )


def _kernel(x, w, sizes, tiles: GroupedTiles, transpose_rhs: bool):
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    out = ragged_dot_mgpu.ragged_dot(
        x, w, group_sizes=sizes, transpose_rhs=transpose_rhs, **tiles.kernel_kwargs()
    )
    # rows past the groups' sum are never stored by the kernel: zero them (ragged_dot's meaning)
    rows = jnp.arange(x.shape[0], dtype=jnp.int32)[:, None]
    return jnp.where(rows < jnp.sum(sizes), out, jnp.zeros((), out.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def ragged_dot(x: jax.Array, w: jax.Array, sizes: jax.Array, tiles: GroupedTiles) -> jax.Array:
    """x [M, K] rows sorted by group, w [G, K, N], sizes [G] int32 -> [M, N] in x's dtype
    (float32 accumulation)."""
    return _kernel(x, w, sizes, tiles, transpose_rhs=False)


def _fwd(x, w, sizes, tiles):
    return _kernel(x, w, sizes, tiles, transpose_rhs=False), (x, w, sizes)


def _bwd(tiles, residuals, dy):
    x, w, sizes = residuals
    dx = _kernel(dy.astype(x.dtype), w, sizes, tiles, transpose_rhs=True)
    return dx, weight_grad(x, dy, sizes).astype(w.dtype), None


ragged_dot.defvjp(_fwd, _bwd)
