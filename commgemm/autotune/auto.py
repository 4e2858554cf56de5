"""AUTO at plan time: the tune cache's winner for the problem, else the cost model's choice.
Reads the cache; never measures."""

from __future__ import annotations

import jax

from commgemm.autotune import cache
from commgemm.autotune.costmodel import choose, default_figures
from commgemm.backend import auto_may_fuse
from commgemm.config import Collective, OverlapConfig, split_requirement, uses_tpu_kernels
from commgemm.quant import ScalingRecipe

#: The tuner's and the cache's short names of the collectives.
OP_NAMES = {
    Collective.ALL_GATHER: "ag",
    Collective.REDUCE_SCATTER: "rs",
    Collective.ALL_REDUCE: "ar",
}


def global_shape(
    collective: Collective, x: jax.Array, w: jax.Array, size: int, *, w_transposed: bool
) -> tuple[int, int, int]:
    """(M, K, N) of the problem one per-shard call (x the 2-D view) is a shard of."""
    rows = x.shape[0]
    n_local = w.shape[0] if w_transposed else w.shape[1]
    if collective is Collective.ALL_GATHER:
        return size * rows, x.shape[1], size * n_local
    return rows, size * x.shape[1], n_local


def resolve_auto(
    cfg: OverlapConfig,
    collective: Collective,
    x: jax.Array,
    w: jax.Array,
    size: int,
    *,
    w_transposed: bool,
    recipe: ScalingRecipe | None = None,
) -> OverlapConfig:
    """The concrete config for method=AUTO on this per-shard call: the cached winner for the
    global shape and `recipe`'s scaling mode (where it can run here), else the cost model's
    choice (with cfg.deterministic, among the plans whose result is the same on every call).
    The dtype fields, save_gathered_input and deterministic stay cfg's. With `recipe`, only
    fused kernels that AUTO may run on its quantized operands are candidates
    (`backend.auto_may_fuse`): a fused pick the plan then had to split was measured slower than
    serial (the split ring at P = 4)."""
    from commgemm.mosaic_gpu.fused import varies_between_calls
    from commgemm.mosaic_gpu.tiles import hopper_reason

    shape = global_shape(collective, x, w, size, w_transposed=w_transposed)
    kind = jax.devices()[0].device_kind
    found = cache.load()
    scaling = None if recipe is None else recipe.mode.value
    key = cache.plan_key(kind, size, OP_NAMES[collective], shape, x.dtype.name, scaling)
    entry = found.plans.get(key)
    chosen = entry.config if entry is not None else None
    if chosen is not None and (problem := _unfit(chosen, collective, x.shape[0], size)):
        cache.warn_entry(key, problem)
        chosen = None

    def runs(candidate: OverlapConfig) -> bool:  # and takes the recipe's operands
        trial = candidate.replace(interpret=cfg.interpret)
        return _fused_runs(cfg, collective, x, w, size, w_transposed, candidate) and (
            auto_may_fuse(trial, recipe)
        )

    if chosen is not None and chosen.atomic_gemm:
        varies = cfg.deterministic and varies_between_calls(collective, chosen, size)
        if not runs(chosen) or varies:
            chosen = None
    if chosen is not None and chosen.local_gemm == "mosaic" and hopper_reason() is not None:
        chosen = chosen.replace(local_gemm="auto")  # measured on a machine with the kernel
    if chosen is None:
        chosen = _model_choice(
            collective,
            x,
            w,
            size,
            found,
            w_transposed=w_transposed,
            fused=collective is not Collective.ALL_REDUCE,
            runs=runs,
            deterministic=cfg.deterministic,
            tpu=uses_tpu_kernels(cfg.replace(atomic_gemm=True, interpret=cfg.interpret)),
            interpret=cfg.interpret,
            quantized=recipe is not None,
        )
    chosen_fields = {f: getattr(chosen, f) for f in cache.CHOSEN_FIELDS}
    return cfg.replace(**chosen_fields, interpret=cfg.interpret and chosen.atomic_gemm)


def unfused_plan(
    collective: Collective,
    x: jax.Array,
    w: jax.Array,
    size: int,
    *,
    w_transposed: bool,
    quantized: bool = False,
) -> OverlapConfig:
    """The cost model's pick among the XLA methods alone (no fused kernel) for one per-shard
    call (x the 2-D view): where a fused forward's backward cannot run a fused kernel. With
    the machine's `AUTO_MARGINS` (`quantized`: the FP8 families'), so on GPUs that is serial
    unless a split plan is predicted faster beyond the model's measured error."""
    return _model_choice(
        collective, x, w, size, cache.load(), w_transposed=w_transposed, quantized=quantized
    )


def _model_choice(
    collective: Collective,
    x: jax.Array,
    w: jax.Array,
    size: int,
    found: cache.TuneCache,
    *,
    w_transposed: bool,
    **options,
) -> OverlapConfig:
    """The cost model's choice (`costmodel.choose` with `options`) for one per-shard call,
    with the figures the tuner measured on this machine (`found`, the tune cache) or the
    defaults."""
    kind = jax.devices()[0].device_kind
    fig = found.machines.get(cache.machine_key(kind, size)) or default_figures(
        jax.default_backend(), kind
    )
    shape = global_shape(collective, x, w, size, w_transposed=w_transposed)
    chosen, _ = choose(
        collective,
        shape,
        x.shape[0],
        size,
        x.dtype.itemsize,
        fig,
        backend=jax.default_backend(),
        **options,
    )
    return chosen


def _unfit(chosen: OverlapConfig, collective: Collective, rows: int, size: int) -> str | None:
    """Why a cached winner cannot run this call (the plan's own checks, which would otherwise
    fail on a config the user never wrote), or None."""
    try:
        chosen.replace(collective=collective).algorithm(collective)
    except ValueError as err:
        return str(err)
    need = split_requirement(collective, chosen.method, size, chosen.num_splits)
    if rows % need:
        return f"x's split dimension {rows} is not divisible by {need}"
    return None


def _fused_runs(cfg, collective, x, w, size, w_transposed, candidate: OverlapConfig) -> bool:
    """Whether the fused `candidate` (its method and kernel config) can run this call under
    cfg's dtype fields (the TPU kernels on a TPU, or with cfg.interpret; else the Hopper
    ones)."""
    if collective is Collective.ALL_REDUCE:
        return False
    trial = cfg.replace(
        method=candidate.method,
        num_splits=1,
        bidirectional=False,
        aggregate=False,
        atomic_gemm=True,
        kernel=candidate.kernel,
        chain_gemms=False,
        interpret=cfg.interpret,
    )
    from commgemm.backend import fused_backend

    reason = fused_backend(trial).unsupported_reason
    return reason(collective, x, w, size, trial, w_transposed=w_transposed) is None
