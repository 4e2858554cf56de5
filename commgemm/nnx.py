"""Flax NNX tensor-parallel layers whose GEMMs run overlapped (`pip install commgemm[flax]`).

The layers act on global arrays under `jax.jit` (or `nnx.jit`) on a mesh with a tensor-parallel
axis `axis_name` (and optionally a data axis for the batch): activations between layers are
sequence-parallel, [B, S, H] sharded along S over the tensor axis; each GEMM is a `cg.gemm`
with the output sharding of its layer, so XLA's partitioner runs the overlapped collective the
shardings imply (commgemm.partitioned); `config=None` leaves a plain dot to XLA's own
partitioner instead (the baseline the overlap is measured against):

  ColumnParallelLinear  [B, S/P, H] -> all-gather(S) + GEMM -> [B, S, F/P]  kernel [H, F/P]
  RowParallelLinear     [B, S, F/P] -> GEMM + reduce-scatter(S) -> [B, S/P, H]  kernel [F/P, H]
  ParallelMLP           LayerNorm, column (bias, activation), row: [B, S/P, H] -> [B, S/P, H]
  ParallelAttentionProjections  QKV column-parallel (heads sharded), attention per head, the
                        output projection row-parallel: [B, S/P, H] -> [B, S/P, H]
  ParallelMoE           experts split over the axis, tokens dispatched to them and back
                        (all-to-all overlapped with the grouped GEMMs): [B, S, H] -> [B, S, H]

With `sequence_parallel=False` the activations between layers are replicated over the tensor
axis instead, and the row-parallel GEMM ends in an all-reduce. Parameters carry their
PartitionSpecs as NNX sharding metadata; `create_sharded` builds a model under jit so that every
parameter is created in its shards (no device ever holds a whole weight). The mesh's axes may
be Auto or Explicit (`jax.sharding.AxisType`). Each layer takes an
`OverlapConfig` (default Method.AUTO) and a `scaling` (quantized GEMMs are cg.gemm's:
config=None, the plain-dot baseline, takes none).

Delayed scaling (`scaling="delayed_tensor_scaling"`, or a `cg.ScalingRecipe` of that mode whose
states are the initial ones): each linear layer keeps its x's and w's `cg.ScalingState`s in a
`Float8State` variable, advanced by every call from the operands' amax (as BatchNorm keeps its
statistics), and scales dY by its current amax; or, where the recipe has a `dy_state`, by a
state of its own kept in a `Float8GradState` variable, which the backward advances and returns
as its gradient: take gradients with respect to `Float8GradState` too
(`nnx.DiffState(0, (nnx.Param, Float8GradState))`) and write them back with
`apply_float8_grads`, which returns the parameters' gradients. `ParallelMoE` keeps such states
for each of its two grouped GEMMs ("up": the tokens by w1, "down": the hidden activation by
w2).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from commgemm.config import Method, OverlapConfig
from commgemm.epilogue import Activation, apply_epilogue
from commgemm.gemm import gemm
from commgemm.grouped.activation import as_function
from commgemm.grouped.moe import (  # noqa: F401 (top_k_routing, load_balancing_loss public here)
    expert_capacity,
    load_balancing_loss,
    moe_per_shard,
    router_logits,
    top_k_routing,
)
from commgemm.quant import ScalingMode, ScalingRecipe, ScalingState, amax, as_recipe

AUTO = OverlapConfig(method=Method.AUTO)
LECUN = nnx.initializers.lecun_normal()


class Float8State(nnx.Variable):
    """Delayed scaling's states of a layer's x and w ({"x": ScalingState, "w": ScalingState}),
    advanced by each call from the operands' amax."""


class Float8GradState(nnx.Variable):
    """Delayed scaling's state of a layer's dY (a ScalingState): its gradient is the state the
    backward advanced (`apply_float8_grads` writes it back)."""


def apply_float8_grads(model: nnx.Module, grads: nnx.State) -> nnx.State:
    """Write the gradients of `model`'s `Float8GradState`s (their advanced states: dY's amax
    pushed into each history) into the model; returns the rest of `grads` (the parameters')."""
    states, rest = grads.split(Float8GradState, ...)
    nnx.update(model, states)
    return rest


def _delayed(scaling) -> ScalingRecipe | None:
    """The delayed recipe a layer starts from (its states the initial ones), or None."""
    if isinstance(scaling, ScalingRecipe):
        return scaling if scaling.mode is ScalingMode.DELAYED_TENSOR_SCALING else None
    if scaling is not None and ScalingMode(scaling) is ScalingMode.DELAYED_TENSOR_SCALING:
        return ScalingRecipe(scaling, x_state=ScalingState.create(),
                             w_state=ScalingState.create())  # fmt: skip
    return None


def _float8_variables(delayed: ScalingRecipe, parts=None):
    """(Float8State, Float8GradState or None, the recipe's static fields) of a layer under
    delayed scaling: x's and w's states (per GEMM in `parts`, e.g. ("up", "down")), and dY's
    where the recipe has a dy_state."""
    per = lambda state: state if parts is None else dict.fromkeys(parts, state)  # noqa: E731
    float8 = Float8State(per({"x": delayed.x_state, "w": delayed.w_state}))
    dy = None if delayed.dy_state is None else Float8GradState(per(delayed.dy_state))
    return float8, dy, (delayed.dtype, delayed.grad_dtype, delayed.split_accumulator)


def _delayed_recipe(static, states: dict, dy_state) -> ScalingRecipe:
    """The delayed recipe of a GEMM: the layer's static fields and its current states."""
    dtype, grad_dtype, split = static
    return ScalingRecipe(ScalingMode.DELAYED_TENSOR_SCALING, dtype, grad_dtype, split,
                         x_state=states["x"], w_state=states["w"], dy_state=dy_state)  # fmt: skip


def _param(rngs: nnx.Rngs, init, shape, dtype, spec, mesh) -> nnx.Param:
    value = init(rngs.params(), shape, dtype)
    return nnx.Param(value, out_sharding=spec, mesh=mesh)


class _Parallel(nnx.Module):
    """What every layer here holds: the mesh, its axes and how its GEMMs are overlapped."""

    def _setup(self, mesh, axis_name, data_axis, sequence_parallel, config, scaling):
        if axis_name not in mesh.axis_names:
            raise ValueError(f"axis_name={axis_name!r} is not an axis of the mesh {mesh}")
        if data_axis is not None and data_axis not in mesh.axis_names:
            raise ValueError(f"data_axis={data_axis!r} is not an axis of the mesh {mesh}")
        delayed = _delayed(scaling)
        if config is None and (delayed is not None or as_recipe(scaling) is not None):
            raise ValueError(
                "config=None runs XLA's plain dot (the unquantized baseline), which takes no "
                f"scaling; got scaling={scaling!r}: pass a config (e.g. the default AUTO)"
            )
        self.mesh, self.axis_name, self.data_axis = mesh, axis_name, data_axis
        self.sequence_parallel, self.config = sequence_parallel, config
        float8 = float8_dy = None
        if delayed is not None:  # the states live in variables; the recipe's static fields here
            float8, float8_dy, scaling = _float8_variables(delayed)
        self.float8, self.float8_dy, self.scaling = float8, float8_dy, scaling

    def _gemm(self, x, kernel, bias, sharded_features: bool, activation) -> jax.Array:
        """x @ kernel (+ bias, activation) with this layer's output sharding: cg.gemm, or with
        config=None XLA's own partitioning of a plain dot (the baseline)."""
        dtype = self.dtype or x.dtype
        x, kernel = x.astype(dtype), kernel[...].astype(dtype)
        bias = None if bias is None else bias[...].astype(dtype)
        sharding = self.activation_sharding(sharded_features=sharded_features)
        if self.float8 is not None:
            return self._delayed_gemm(x, kernel, bias, sharded_features, activation, sharding)
        if self.config is not None:
            return gemm(x, kernel, out_sharding=sharding, config=self.config, bias=bias,
                        activation=activation, scaling=self.scaling)  # fmt: skip
        # the result in x's dtype straight from the GEMM (float32 accumulation inside), so
        # that the backward's GEMMs also take 16-bit operands, and cg.gemm's epilogue; on
        # Explicit mesh axes the dot is told its result's sharding (it cannot infer one)
        explicit = all(t == AxisType.Explicit for t in self.mesh.axis_types)
        out = jnp.dot(x, kernel, preferred_element_type=dtype,
                      out_sharding=sharding if explicit else None)  # fmt: skip
        out = apply_epilogue(out, bias, activation, return_pre_activation=False)
        return out if explicit else jax.lax.with_sharding_constraint(out, sharding)

    def _delayed_gemm(self, x, kernel, bias, sharded_features: bool, activation, sharding):
        """`_gemm` under delayed scaling: the GEMM with the layer's states (cg.gemm told the
        operands' specs, which delayed scaling needs), then x's and w's states advanced."""
        dtype = self.scaling[0]
        states = self.float8.get_value()
        dy_state = None if self.float8_dy is None else self.float8_dy.get_value()
        recipe = _delayed_recipe(self.scaling, states, dy_state)
        tp = self.axis_name
        x_spec = self.activation_sharding(sharded_features=not sharded_features).spec
        w_spec = P(None, tp) if sharded_features else P(tp, None)
        out = gemm(x, kernel, out_sharding=sharding, config=self.config, x_spec=x_spec,
                   w_spec=w_spec, bias=bias, activation=activation, scaling=recipe)  # fmt: skip
        seen = {"x": amax(jax.lax.stop_gradient(x)), "w": amax(jax.lax.stop_gradient(kernel))}
        self.float8.set_value({k: states[k].update(seen[k], dtype) for k in ("x", "w")})
        return out

    def activation_sharding(self, *, sharded_features: bool) -> NamedSharding:
        """[B, S, features]: the batch on the data axis; S on the tensor axis (sequence
        parallel) unless the features are."""
        tp = self.axis_name
        seq = tp if self.sequence_parallel and not sharded_features else None
        return NamedSharding(self.mesh, P(self.data_axis, seq, tp if sharded_features else None))


class ColumnParallelLinear(_Parallel):
    """y = x @ kernel + bias, kernel [in, out] split by columns over the tensor axis.

    x: [B, S, in] (sequence-parallel: S sharded; else replicated over the axis).
    Returns [B, S, out] with out sharded over the tensor axis.
    """

    def __init__(self, in_features: int, out_features: int, *, mesh, rngs: nnx.Rngs,
                 axis_name: str = "tp", data_axis: str | None = None,
                 sequence_parallel: bool = True, use_bias: bool = True,
                 activation: Activation = None, config: OverlapConfig | None = AUTO,
                 scaling=None, dtype=None, param_dtype=jnp.float32,
                 kernel_init=LECUN):  # fmt: skip
        self._setup(mesh, axis_name, data_axis, sequence_parallel, config, scaling)
        self.kernel = _param(rngs, kernel_init, (in_features, out_features), param_dtype,
                             (None, axis_name), mesh)  # fmt: skip
        self.bias = (
            _param(rngs, nnx.initializers.zeros, (out_features,), param_dtype, (axis_name,), mesh)
            if use_bias
            else None
        )
        self.activation, self.dtype = activation, dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        return self._gemm(x, self.kernel, self.bias, True, self.activation)


class RowParallelLinear(_Parallel):
    """y = x @ kernel + bias, kernel [in, out] split by rows over the tensor axis.

    x: [B, S, in] with in sharded over the tensor axis.
    Returns [B, S, out]: S sharded (sequence-parallel: GEMM + reduce-scatter) or replicated
    over the axis (GEMM + all-reduce); the bias (replicated) added once, after the sum.
    """

    def __init__(self, in_features: int, out_features: int, *, mesh, rngs: nnx.Rngs,
                 axis_name: str = "tp", data_axis: str | None = None,
                 sequence_parallel: bool = True, use_bias: bool = True,
                 config: OverlapConfig | None = AUTO, scaling=None, dtype=None,
                 param_dtype=jnp.float32, kernel_init=LECUN):  # fmt: skip
        self._setup(mesh, axis_name, data_axis, sequence_parallel, config, scaling)
        self.kernel = _param(rngs, kernel_init, (in_features, out_features), param_dtype,
                             (axis_name, None), mesh)  # fmt: skip
        self.bias = (
            _param(rngs, nnx.initializers.zeros, (out_features,), param_dtype, (None,), mesh)
            if use_bias
            else None
        )
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        return self._gemm(x, self.kernel, self.bias, False, None)


def _layer_kwargs(mesh, axis_name, data_axis, sequence_parallel, config, scaling, dtype):
    return dict(mesh=mesh, axis_name=axis_name, data_axis=data_axis, dtype=dtype,
                sequence_parallel=sequence_parallel, config=config, scaling=scaling)  # fmt: skip


class ParallelMLP(nnx.Module):
    """LayerNorm, ColumnParallelLinear (bias, activation), RowParallelLinear: [B, S, H] ->
    [B, S, H] (no residual), with the activations' shardings of the two layers."""

    def __init__(self, hidden: int, ffn: int, *, mesh, rngs: nnx.Rngs, axis_name: str = "tp",
                 data_axis: str | None = None, sequence_parallel: bool = True,
                 activation: Activation = "gelu", config: OverlapConfig | None = AUTO,
                 scaling=None, dtype=None):  # fmt: skip
        kw = _layer_kwargs(mesh, axis_name, data_axis, sequence_parallel, config, scaling, dtype)
        self.norm = nnx.LayerNorm(hidden, rngs=rngs, dtype=dtype)
        self.up = ColumnParallelLinear(hidden, ffn, rngs=rngs, activation=activation, **kw)
        self.down = RowParallelLinear(ffn, hidden, rngs=rngs, **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(self.up(self.norm(x)))


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Softmax attention with a causal mask: q, k, v [B, S, heads, d] -> [B, S, heads, d]."""
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


class ParallelAttentionProjections(nnx.Module):
    """Self-attention's projections in tensor parallelism: QKV column-parallel (the heads split
    over the tensor axis, so each device attends with its own heads over the whole sequence),
    `attention_fn` per head, the output projection row-parallel. [B, S, H] -> [B, S, H] (no
    residual, no norm)."""

    def __init__(self, hidden: int, num_heads: int, *, mesh, rngs: nnx.Rngs,
                 axis_name: str = "tp", data_axis: str | None = None,
                 sequence_parallel: bool = True, config: OverlapConfig | None = AUTO,
                 scaling=None, dtype=None,
                 attention_fn: Callable[..., jax.Array] = causal_attention):  # fmt: skip
        size = mesh.shape[axis_name]
        if hidden % num_heads or num_heads % size:
            raise ValueError(
                f"hidden={hidden} must be a multiple of num_heads={num_heads}, and num_heads of "
                f"the tensor axis' size {size}"
            )
        kw = _layer_kwargs(mesh, axis_name, data_axis, sequence_parallel, config, scaling, dtype)
        self.num_heads, self.attention_fn = num_heads, attention_fn
        # columns grouped [heads, 3, d] so each device's shard holds whole heads of q, k and v
        self.qkv = ColumnParallelLinear(hidden, 3 * hidden, rngs=rngs, **kw)
        self.out = RowParallelLinear(hidden, hidden, rngs=rngs, **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        (b, s, h), heads, d = x.shape, self.num_heads, x.shape[-1] // self.num_heads
        # [B, S, heads, 3, d]: device i's columns are heads i*heads/P.. of q, k and v alike
        mesh = self.qkv.mesh
        keep = lambda a: a if a is not None and mesh.shape[a] > 1 else None  # noqa: E731
        by_head = NamedSharding(mesh, P(keep(self.qkv.data_axis), None, keep(self.qkv.axis_name)))
        if all(t == AxisType.Explicit for t in mesh.axis_types):
            if not jax.sharding.get_abstract_mesh().axis_names:  # attention_fn's arrays need it
                with jax.set_mesh(mesh):
                    return self(x)
            qkv = self.qkv(x).reshape(b, s, heads, 3, d, out_sharding=by_head)
            out = self.attention_fn(*(qkv[:, :, :, i] for i in range(3)))
            return self.out(out.reshape(b, s, h, out_sharding=by_head))  # heads stay sharded
        qkv = self.qkv(x).reshape(b, s, heads, 3, d)
        # heads stay sharded, forward and backward (the constraints' transposes hold the
        # cotangents too; left to itself XLA gathered dq, dk and dv over every head)
        q, k, v = (jax.lax.with_sharding_constraint(qkv[:, :, :, i], by_head) for i in range(3))
        out = jax.lax.with_sharding_constraint(self.attention_fn(q, k, v), by_head)
        return self.out(out.reshape(b, s, h))


class ParallelMoE(nnx.Module):
    """A mixture-of-experts feed-forward block with expert parallelism: a router (replicated),
    top-k routing, the tokens dispatched to their experts' shards (`cg.all_to_all_grouped_matmul`,
    the expert GEMMs running as tokens arrive), the activation ("gelu": exact, "gelu_tanh" or
    None; on the rows that hold tokens: `commgemm.grouped.activation`), the way back
    (`cg.grouped_matmul_all_to_all`) and the gated combine. [B, S, H] -> [B, S, H] (no residual),
    the experts split over `axis_name` (num_experts divisible by its size); tokens stay where
    they are, sequence-parallel as the other layers keep them: [B/D, S/P, H] on each shard (B
    divisible by the data axis' size, S by the tensor axis'). `scaling`: both grouped GEMMs'
    (FP8); under delayed scaling each keeps its own states ("up", "down"; module docstring).
    `capacity_factor` (default None: no token dropped): each expert takes at most
    ceil(capacity_factor * T*k / E) token copies from each shard's T tokens, the rest dropped
    (they add nothing to their tokens' outputs; `commgemm.grouped.moe`), for exchanges and
    activations about P / capacity_factor times smaller. With `load_balancing`, each call sows
    the routing's auxiliary loss over all tokens (`load_balancing_loss`, a float32 scalar) as
    `nnx.Intermediate` "load_balancing_loss": take it with `nnx.capture(nnx.Intermediate)` (or
    `nnx.pop`) and add it, scaled, to the training loss."""

    def __init__(self, hidden: int, ffn: int, num_experts: int, *, mesh, rngs: nnx.Rngs,
                 top_k: int = 2, axis_name: str = "tp", data_axis: str | None = None,
                 config: OverlapConfig | None = AUTO, scaling=None, dtype=None,
                 param_dtype=jnp.float32, activation: Activation = "gelu",
                 capacity_factor: float | None = None, load_balancing: bool = False):  # fmt: skip
        size = mesh.shape[axis_name]
        if num_experts % size or not 1 <= top_k <= num_experts:
            raise ValueError(
                f"num_experts={num_experts} must be a multiple of the axis' size {size}, and "
                f"top_k={top_k} between 1 and num_experts"
            )
        float8 = float8_dy = None
        if (delayed := _delayed(scaling)) is not None:  # states per GEMM: up, down
            float8, float8_dy, scaling = _float8_variables(delayed, ("up", "down"))
        self.float8, self.float8_dy = float8, float8_dy
        self.mesh, self.axis_name, self.data_axis = mesh, axis_name, data_axis
        self.top_k, self.config, self.scaling = top_k, config, scaling
        self.dtype, self.activation = dtype, activation
        as_function(activation)  # an unknown activation fails here
        if capacity_factor is not None:
            expert_capacity(1, num_experts, capacity_factor)  # a bad factor fails here
        self.capacity_factor, self.load_balancing = capacity_factor, load_balancing
        init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1)
        self.router = _param(rngs, LECUN, (hidden, num_experts), param_dtype, (None, None), mesh)
        self.w1 = _param(rngs, init, (num_experts, hidden, ffn), param_dtype,
                         (axis_name, None, None), mesh)  # fmt: skip
        self.w2 = _param(rngs, init, (num_experts, ffn, hidden), param_dtype,
                         (axis_name, None, None), mesh)  # fmt: skip

    def __call__(self, x: jax.Array) -> jax.Array:
        dtype = self.dtype or x.dtype
        # each shard's own tokens [B/D, S/P, H], where the sequence-parallel layers keep them
        tokens = P(self.data_axis, self.axis_name, None)
        experts = P(self.axis_name)
        delayed = self.float8 is not None
        states = self.float8.get_value() if delayed else None
        dy = None if self.float8_dy is None else self.float8_dy.get_value()
        axes = tuple(a for a in (self.data_axis, self.axis_name) if a is not None)

        def body(a, router, w1, w2, states, dy):
            scaling, over = self.scaling, axes if delayed else None
            if delayed:  # each GEMM's recipe from its states (dY's too, with a dy_state)
                scaling = tuple(
                    _delayed_recipe(self.scaling, states[part], None if dy is None else dy[part])
                    for part in ("up", "down")
                )
            out = moe_per_shard(a.reshape(-1, a.shape[-1]), router, w1, w2, k=self.top_k,
                                axis_name=self.axis_name, config=self.config, scaling=scaling,
                                activation=self.activation, amax_over=over,
                                capacity_factor=self.capacity_factor)  # fmt: skip
            out, seen = out if delayed else (out, None)
            aux = None
            if self.load_balancing:  # the logits moe_per_shard routes by (XLA computes them once)
                logits = router_logits(a.reshape(-1, a.shape[-1]), router)
                aux = load_balancing_loss(logits, self.top_k, axes)
            return out.reshape(a.shape), seen, aux

        out, seen, aux = jax.shard_map(
            body, mesh=self.mesh, in_specs=(tokens, P(), experts, experts, P(), P()),
            out_specs=(tokens, P(), P()),
        )(x.astype(dtype), self.router[...], self.w1[...].astype(dtype),
          self.w2[...].astype(dtype), states, dy)  # fmt: skip
        if self.load_balancing:
            self.sow(nnx.Intermediate, "load_balancing_loss", aux)
        if delayed:  # the states advanced by the operands' amax, as the linear layers do
            self.float8.set_value({part: {k: v.update(seen[part][k], self.scaling[0])
                                          for k, v in states[part].items()}
                                   for part in states})  # fmt: skip
        return out


def create_sharded(factory: Callable[[], nnx.Module], mesh) -> nnx.Module:
    """`factory()` built under jit with every parameter constrained to its PartitionSpec on
    `mesh`: XLA creates each parameter in its shards, none is ever whole on one device."""

    @nnx.jit
    def build():
        model = factory()
        state = nnx.state(model)
        specs = nnx.get_partition_spec(state)
        nnx.update(model, jax.lax.with_sharding_constraint(state, specs))
        return model

    with jax.set_mesh(mesh):
        return build()
