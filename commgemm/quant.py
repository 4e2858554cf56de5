"""Quantized operands: scaling modes, `ScaledTensor`, `quantize` / `dequantize`, the delayed
scaling state, the block-scale swizzle cuBLAS expects (the reference system's vocabulary), and
the recipe an op's `scaling=` takes (`ScalingRecipe`, `as_recipe`, `amax` over mesh axes).

Tensor scaling (one float32 scale per tensor): CURRENT computes the amax now; DELAYED takes the
scale from an amax history kept in a functional `ScalingState`, updated by the step like an
optimizer's state. Block scaling along `axis`: MXFP8 (32 elements a block, float8_e4m3fn
values, power-of-two E8M0 scales) and NVFP4 (16 elements a block, float4_e2m1fn values,
float8_e4m3fn block scales under one float32 global scale).

Edge cases: a zero amax gives scale 1 (the tensor is all zeros). A non-finite amax (an inf or
NaN in x) also gives scale 1 (a delayed state keeps its previous scale), so the finite elements
keep their values (clipped to the format's range) and only the non-finite ones come back
non-finite (NaN in formats without inf), as they would in a jnp product: never a tensor of NaN
from one bad element. NVFP4's values hold no NaN or inf: a 16-element block with a non-finite
element comes back all NaN. A tiny amax gives at most MAX_SCALE, never an inf scale. The ops'
quantized path is commgemm.autodiff's quantizer (commgemm.quantized_gemm, commgemm.scaled)."""

from __future__ import annotations

import dataclasses
import enum

import jax
import jax.numpy as jnp
import ml_dtypes
from jax import lax

from commgemm.vma import checks_vma, varying_axes


class ScalingMode(enum.Enum):
    NO_SCALING = "no_scaling"
    DELAYED_TENSOR_SCALING = "delayed_tensor_scaling"
    CURRENT_TENSOR_SCALING = "current_tensor_scaling"
    MXFP8_1D_SCALING = "mxfp8_1d_scaling"
    NVFP4_1D_SCALING = "nvfp4_1d_scaling"


#: Elements per block of the block-scaled modes.
BLOCK = {ScalingMode.MXFP8_1D_SCALING: 32, ScalingMode.NVFP4_1D_SCALING: 16}
FP4 = jnp.dtype(ml_dtypes.float4_e2m1fn)
E8M0 = jnp.dtype(ml_dtypes.float8_e8m0fnu)


def _max(dtype) -> float:
    return float(ml_dtypes.finfo(dtype).max)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ScaledTensor:
    """Quantized values and the scales that undo them: x ~= data * scale_inv (broadcast per
    block along `axis` for block modes; times global_scale_inv for NVFP4)."""

    data: jax.Array
    scale_inv: jax.Array
    global_scale_inv: jax.Array | None = None
    mode: ScalingMode = dataclasses.field(
        default=ScalingMode.CURRENT_TENSOR_SCALING, metadata=dict(static=True)
    )
    axis: int = dataclasses.field(default=-1, metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """A weight quantized once for several calls of the quantized ops (the microbatches of a
    training step), carried with the weight itself. Made by `commgemm.quantize_weight`.

    Passed as an op's `w` with `scaling=` (the recipe it was quantized by), the op multiplies
    `quantized` instead of quantizing `value` again, and the gradient flows to `value`
    (straight-through, as under the op's own quantization): a step quantizes each weight once,
    however many calls use it. `shape`, `dtype` and `ndim` are the weight's.

    `transposed` (tensor scaling; `quantize_weight(..., keep_transposed=True)`): the float8
    values of `quantized` with their last two dimensions swapped ([N, K] of a [K, N] weight,
    [G, N, K] of the experts' [G, K, N]), the other layout Hopper's float8 GEMMs read (both
    operands K-major): the ops multiply it as it is instead of transposing w's values in each
    call. None: transposed by each call that needs it."""

    value: jax.Array
    quantized: ScaledTensor
    transposed: jax.Array | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.value.shape

    @property
    def dtype(self):
        return self.value.dtype

    @property
    def ndim(self) -> int:
        return self.value.ndim


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ScalingState:
    """Delayed scaling's state: the last `len(amax_history)` amaxes (newest first) and the
    scale they give. `algorithm` "max" takes the history's max, "most_recent" its newest."""

    amax_history: jax.Array
    scale: jax.Array
    algorithm: str = dataclasses.field(default="max", metadata=dict(static=True))

    @staticmethod
    def create(history: int = 16, algorithm: str = "max") -> ScalingState:
        if history < 1:
            raise ValueError(f"history={history} must be >= 1")
        if algorithm not in ("max", "most_recent"):
            raise ValueError(f"algorithm={algorithm!r} must be 'max' or 'most_recent'")
        return ScalingState(jnp.zeros(history, jnp.float32), jnp.ones((), jnp.float32), algorithm)

    def update(self, amax: jax.Array, dtype=jnp.float8_e4m3fn) -> ScalingState:
        """The state after observing `amax` (e.g. `commgemm.amax(x, axis_name)`): the history
        shifted, the next scale from it. A non-finite amax leaves the scale as it was."""
        history = jnp.roll(self.amax_history, 1).at[0].set(jnp.asarray(amax, jnp.float32))
        chosen = history[0] if self.algorithm == "most_recent" else jnp.max(history)
        scale = jnp.where(jnp.isfinite(chosen), scale_for(chosen, dtype), self.scale)
        return ScalingState(history, scale, self.algorithm)


#: The largest tensor scale (and smallest global scale_inv's reciprocal): a power of two whose
#: reciprocal is a normal float32: a tiny amax never overflows a scale to inf (zeros to NaN).
MAX_SCALE = 2.0**100


def scale_for(amax, dtype) -> jax.Array:
    """float32 scale mapping amax onto the dtype's largest value (1 where amax is 0 or not
    finite), at most MAX_SCALE: current tensor scaling's."""
    amax = jnp.asarray(amax, jnp.float32)
    ok = (amax > 0) & jnp.isfinite(amax)
    scale = jnp.minimum(_max(dtype) / jnp.where(ok, amax, 1.0), MAX_SCALE)
    return jnp.where(ok, scale, 1.0)


def clip_cast(v: jax.Array, dtype) -> jax.Array:
    """v clipped to dtype's finite range and cast; non-finite elements stay non-finite (v - v
    is 0, or NaN for an inf or NaN: one elementwise pass, no mask for XLA to materialize)."""
    top = _max(dtype)
    return (jnp.clip(v, -top, top) + (v - v)).astype(dtype)


def _blocks(x: jax.Array, axis: int, size: int) -> jax.Array:
    """x with `axis` moved last and split into blocks: [..., n/size, size]."""
    axis = axis % x.ndim
    if x.shape[axis] % size:
        raise ValueError(
            f"dimension {axis} of size {x.shape[axis]} must divide into blocks of {size}"
        )
    moved = jnp.moveaxis(x, axis, -1)
    return moved.reshape(*moved.shape[:-1], -1, size)


def _unblocks(b: jax.Array, axis: int, ndim: int) -> jax.Array:
    return jnp.moveaxis(b.reshape(*b.shape[:-2], -1), -1, axis % ndim)


def quantize(
    x: jax.Array,
    mode: ScalingMode | str,
    *,
    dtype=jnp.float8_e4m3fn,
    axis: int = -1,
    state: ScalingState | None = None,
    amax: jax.Array | None = None,
) -> ScaledTensor | tuple[ScaledTensor, ScalingState]:
    """x in `mode`; DELAYED_TENSOR_SCALING takes and returns a `ScalingState`.

    Gradients use float8_e5m2 (pass dtype=jnp.float8_e5m2): the hybrid recipe. Block modes
    ignore `dtype` (MXFP8: float8_e4m3fn, NVFP4: float4_e2m1fn). `amax`: the whole tensor's
    amax when x is one shard of it, so that every shard shares one tensor scale (CURRENT) or
    global scale (NVFP4); default x's own.
    """
    mode = ScalingMode(mode)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"quantize takes floating x, got {x.dtype}")
    if mode in (ScalingMode.CURRENT_TENSOR_SCALING, ScalingMode.DELAYED_TENSOR_SCALING):
        if jnp.dtype(dtype) not in (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)):
            raise ValueError(
                f"{mode.name} quantizes to float8_e4m3fn or float8_e5m2, not {jnp.dtype(dtype)}"
            )
    x32 = x.astype(jnp.float32)
    if mode is ScalingMode.NO_SCALING:
        return ScaledTensor(x, jnp.ones((), jnp.float32), mode=mode, axis=axis)
    if mode is ScalingMode.CURRENT_TENSOR_SCALING:
        scale = scale_for(_amax(x) if amax is None else amax, dtype)
        return ScaledTensor(clip_cast(x32 * scale, dtype), 1.0 / scale, mode=mode, axis=axis)
    if mode is ScalingMode.DELAYED_TENSOR_SCALING:
        if state is None:
            raise ValueError("DELAYED_TENSOR_SCALING needs state= (ScalingState.create())")
        data = clip_cast(x32 * state.scale, dtype)
        new = state.update(_amax(x) if amax is None else amax, dtype)
        return ScaledTensor(data, 1.0 / state.scale, mode=mode, axis=axis), new
    blocks = _blocks(x32, axis, BLOCK[mode])
    block_amax = jnp.max(jnp.where(jnp.isfinite(blocks), jnp.abs(blocks), 0), -1, keepdims=True)
    if mode is ScalingMode.MXFP8_1D_SCALING:
        # the smallest power of two that brings the block's amax within float8_e4m3fn's range
        # (rounded up, as Transformer Engine does, so no value saturates)
        # from the float's exponent bits, not log2: exact on every backend (a GPU's fused
        # log2 may round a power of two the other way)
        ratio = jnp.where(block_amax > 0, block_amax, 1.0) / _max(jnp.float8_e4m3fn)
        mantissa, exponent = jnp.frexp(ratio)  # ratio = mantissa * 2^exponent, mantissa in [.5, 1)
        exponent = jnp.where(mantissa == 0.5, exponent - 1, exponent)
        scale_inv = jnp.ldexp(jnp.ones_like(ratio), exponent)
        data = _unblocks(clip_cast(blocks / scale_inv, jnp.float8_e4m3fn), axis, x.ndim)
        return ScaledTensor(data, scale_inv[..., 0].astype(E8M0), mode=mode, axis=axis)
    tensor_amax = jnp.max(block_amax) if amax is None else jnp.asarray(amax, jnp.float32)
    # products with reciprocals, no chained divisions: a compiler may reassociate a / b / c
    # inside a fused loop, and values one bit apart round apart at a format's midpoints
    ok = (tensor_amax > 0) & jnp.isfinite(tensor_amax)
    top = _max(FP4) * _max(jnp.float8_e4m3fn)
    global_scale_inv = jnp.where(
        ok, jnp.maximum(tensor_amax * (1.0 / top), 1.0 / MAX_SCALE), 1.0 / _max(jnp.float8_e4m3fn)
    )
    to_block_scale = 1.0 / (_max(FP4) * global_scale_inv)
    block_scale = (block_amax * to_block_scale).astype(jnp.float8_e4m3fn)
    # float4_e2m1fn holds no NaN or inf: a block with a non-finite element gets a NaN block
    # scale, so that it dequantizes to NaN rather than to finite values
    finite = jnp.all(jnp.isfinite(blocks), -1, keepdims=True)
    block_scale = jnp.where(finite, block_scale, jnp.asarray(jnp.nan, jnp.float8_e4m3fn))
    effective = _held(block_scale).astype(jnp.float32) * global_scale_inv
    to_values = 1.0 / jnp.where(effective > 0, effective, 1.0)  # one per block
    data = _unblocks(clip_cast(blocks * to_values, FP4), axis, x.ndim)
    return ScaledTensor(data, block_scale[..., 0], global_scale_inv, mode=mode, axis=axis)


def quantize_by(x: jax.Array, scale_inv: jax.Array, dtype) -> ScaledTensor:
    """x quantized to a float8 `dtype` by a tensor scale chosen before (`scale_inv`, the factor
    that dequantizes). Values that were quantized by that scale and dequantized to bf16 come
    back as the same float8 values: a bf16 value lies within 2^-9 of its float8 value times
    the scale, well inside half a float8 step (2^-5 at least)."""
    data = clip_cast(x.astype(jnp.float32) / scale_inv, dtype)
    return ScaledTensor(data, scale_inv, mode=ScalingMode.CURRENT_TENSOR_SCALING)


def _amax(x: jax.Array) -> jax.Array:
    """The largest finite |x| as float32 (0 for an empty or all-non-finite x): one bad element
    does not decide the scale of the rest. Read in x's own dtype (exact), so that this pass and
    the quantizing one each read x once, with no float32 copy between them."""
    finite = jnp.where(jnp.isfinite(x), jnp.abs(x), jnp.zeros((), x.dtype))
    return jnp.max(finite, initial=jnp.zeros((), x.dtype)).astype(jnp.float32)


def _held(a):
    """`a` as computed: XLA's GPU compiler, allowed excess precision (its default), drops a
    round trip such as float32 -> float8 -> float32 inside one program, which would undo the
    quantization; an optimization barrier keeps the narrow values."""
    return jax.lax.optimization_barrier(a)


def dequantize(t: ScaledTensor, dtype=jnp.float32) -> jax.Array:
    """The values `t` stands for, in `dtype`."""
    t = _held(t)
    if t.mode in (ScalingMode.MXFP8_1D_SCALING, ScalingMode.NVFP4_1D_SCALING):
        blocks = _blocks(t.data.astype(jnp.float32), t.axis, BLOCK[t.mode])
        scale = t.scale_inv.astype(jnp.float32)[..., None]
        if t.global_scale_inv is not None:
            scale = scale * t.global_scale_inv
        return _unblocks(blocks * scale, t.axis, t.data.ndim).astype(dtype)
    return (t.data.astype(jnp.float32) * t.scale_inv).astype(dtype)


def dequantize_fusible(t: ScaledTensor, dtype=jnp.float32) -> jax.Array:
    """`dequantize(t, dtype)` bit for bit, with no optimization barrier for tensor modes: the
    float8 values re-rounded to their grid in float32 (`_on_grid`, a no-op on them), so XLA
    may fuse this into the pass that quantized t. Block modes: `dequantize`."""
    if t.mode not in TENSOR_MODES:
        return dequantize(t, dtype)
    return (_on_grid(t.data.astype(jnp.float32), t.data.dtype) * t.scale_inv).astype(dtype)


def _on_grid(v: jax.Array, dtype) -> jax.Array:
    """float32 v (in float8 `dtype`'s finite range, or not finite) rounded as a cast to it
    rounds: its mantissa bits from its smallest normal up, its subnormals' step below."""
    mantissa, normal, step = _GRIDS[jnp.dtype(dtype).name]  # bits; log2s of those values
    rounded = lax.reduce_precision(v, exponent_bits=8, mantissa_bits=mantissa)
    return jnp.where(jnp.abs(v) < 2.0**normal, jnp.round(v * 2.0**-step) * 2.0**step, rounded)


_GRIDS = {"float8_e4m3fn": (3, -6, -9), "float8_e5m2": (2, -14, -16)}


def swizzle_block_scales(scales: jax.Array) -> jax.Array:
    """Block scales [rows, cols] in the layout cuBLAS reads for block-scaled GEMMs: padded to
    128 x 4 tiles, each tile's 512 scales in the order (row % 32, row // 32 % 4, col % 4),
    tiles row-major. Returns a flat array; `unswizzle_block_scales` inverts it."""
    rows, cols = scales.shape
    pr, pc = -rows % 128, -cols % 4
    padded = jnp.pad(scales, ((0, pr), (0, pc)))
    r, c = padded.shape
    tiles = padded.reshape(r // 128, 4, 32, c // 4, 4)  # [row tile, row/32, row%32, col tile, col]
    return tiles.transpose(0, 3, 2, 1, 4).reshape(-1)


def unswizzle_block_scales(flat: jax.Array, rows: int, cols: int) -> jax.Array:
    """The inverse of `swizzle_block_scales` for scales of shape [rows, cols]."""
    r, c = rows + -rows % 128, cols + -cols % 4
    tiles = flat.reshape(r // 128, c // 4, 32, 4, 4).transpose(0, 3, 2, 1, 4)
    return tiles.reshape(r, c)[:rows, :cols]


TENSOR_MODES = (ScalingMode.CURRENT_TENSOR_SCALING, ScalingMode.DELAYED_TENSOR_SCALING)
FLOAT8 = ("float8_e4m3fn", "float8_e5m2")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ScalingRecipe:
    """How an op quantizes its operands: `mode`, the forward operands' float8 `dtype` and dY's
    `grad_dtype` (tensor modes; block modes have fixed formats).

    `split_accumulator` (forward, dgrad, wgrad): whether a tensor-scaled FP8 GEMM on an NVIDIA
    GPU promotes its partial sums to float32 every few K-steps (True: XLA's ANY_F8_ANY_F8_ANY,
    Transformer Engine's split accumulator) or accumulates in the tensor cores' narrower
    accumulator (False: ..._FAST_ACCUM). The direct fused kernels do either: split adds each
    K-step's product into a float32 total, in smaller tiles (`mosaic_gpu.tiles.accumulated`).
    Default (False, True, True), the reference system's: fast for the forward, promoted for the
    two gradients. XLA's GEMM keeps promoting either way (same speed, same error). The fused
    kernels' fast form, which the forward's default lets AUTO pick, has a larger error than the
    promoted GEMM; their split form has XLA's error but runs slower than XLA's promoted FP8
    GEMM. Fast dgrad (split_accumulator[1] False) lets a fused op's dX run on the fused kernels
    (commgemm.autodiff); with the default it runs on XLA's promoted GEMMs. Fast wgrad
    (split_accumulator[2] False) lets the grouped ops' dW (`grouped_matmul`'s, the collective
    grouped ops' and the MoE layer's) run on commgemm's float8 dW kernel
    (`mosaic_gpu.grouped_dw`); with the default dW multiplies dequantized 16-bit operands.
    Whether fast accumulation biases long sums in training is not known here, so the default
    stays the reference's. Elsewhere the GEMMs accumulate in float32 and the flags do nothing.

    DELAYED_TENSOR_SCALING takes
    the operands' scales from `x_state` and `w_state` (`ScalingState`s the caller keeps and
    advances with `state.update(amax(x, axis_name))`, like optimizer state). dY's amax is known
    only in the backward, so its state comes back the way Flax's FP8 ops return theirs
    ("overwrite with gradient"): with `dy_state`, the backward quantizes dY with its scale and
    the gradient of the recipe's `dy_state` is the advanced state (dY's amax over every device
    that holds a part of it, pushed into the history), which the caller keeps in place of the
    old one: `jax.grad(loss, argnums=(..., recipe_arg))`. A dy_state belongs to one op call
    (two calls sharing one would add their states); a scan over layers takes stacked states.
    Without dy_state, dY is scaled by its current amax."""

    mode: ScalingMode = dataclasses.field(
        default=ScalingMode.CURRENT_TENSOR_SCALING, metadata=dict(static=True)
    )
    dtype: str = dataclasses.field(default="float8_e4m3fn", metadata=dict(static=True))
    grad_dtype: str = dataclasses.field(default="float8_e5m2", metadata=dict(static=True))
    split_accumulator: tuple[bool, bool, bool] = dataclasses.field(
        default=(False, True, True), metadata=dict(static=True)
    )
    x_state: ScalingState | None = None
    w_state: ScalingState | None = None
    dy_state: ScalingState | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", ScalingMode(self.mode))
        for name in ("dtype", "grad_dtype"):
            value = jnp.dtype(getattr(self, name)).name
            if value not in FLOAT8:
                raise ValueError(f"ScalingRecipe {name}={value!r} must be one of {FLOAT8}")
            object.__setattr__(self, name, value)
        split = tuple(bool(b) for b in self.split_accumulator)
        if len(split) != 3:
            raise ValueError(
                f"split_accumulator={self.split_accumulator!r} needs three flags: "
                "(forward, dgrad, wgrad)"
            )
        object.__setattr__(self, "split_accumulator", split)
        delayed = self.mode is ScalingMode.DELAYED_TENSOR_SCALING
        if delayed != (self.x_state is not None and self.w_state is not None):
            raise ValueError(
                "DELAYED_TENSOR_SCALING needs x_state= and w_state= (ScalingState.create()), "
                "and only it takes them"
            )
        if self.dy_state is not None and not delayed:
            raise ValueError("dy_state= is DELAYED_TENSOR_SCALING's (dY's amax history)")


Scaling = ScalingRecipe | ScalingMode | str | None


def as_recipe(scaling: Scaling) -> ScalingRecipe | None:
    """`scaling` as a recipe; None for no quantization (None or NO_SCALING)."""
    if scaling is None or isinstance(scaling, ScalingRecipe):
        recipe = scaling
    else:
        mode = ScalingMode(scaling)
        if mode is ScalingMode.DELAYED_TENSOR_SCALING:
            raise ValueError(
                "DELAYED_TENSOR_SCALING keeps state: pass scaling=cg.ScalingRecipe("
                "'delayed_tensor_scaling', x_state=..., w_state=...)"
            )
        recipe = ScalingRecipe(mode)
    if recipe is not None and recipe.mode is ScalingMode.NO_SCALING:
        return None
    return recipe


def check_weight_scaling(fn_name: str, w, scaling: Scaling) -> None:
    """A `QuantizedWeight` comes with the scaling it was quantized by."""
    if isinstance(w, QuantizedWeight) and as_recipe(scaling) is None:
        raise ValueError(
            f"{fn_name}: w is a QuantizedWeight; pass scaling= (the recipe it was quantized by), "
            "or the weight itself (w.value) for an unquantized GEMM"
        )


def amax(
    x: jax.Array, axis_names: str | tuple[str, ...] = (), local: jax.Array | None = None
) -> jax.Array:
    """The largest finite |x| of the whole tensor that x is a shard of: the max over the mesh
    axes in `axis_names` that x varies over (a lax.pmax; outside shard_map, x's own). `local`:
    x's own (float32) where the caller has it."""
    names = (axis_names,) if isinstance(axis_names, str) else tuple(axis_names or ())
    local = _amax(x) if local is None else local
    over = tuple(a for a in names if a in varying_axes(x)) if names else ()
    if names and not checks_vma(names[0]):  # nothing tracked: every axis may vary
        over = names
    return lax.pmax(local, over) if over else local
