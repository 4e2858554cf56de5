"""Which family of kernels runs a config: the `Backend` protocol and `backend_for`.

A backend runs the three per-shard collective GEMMs on 2-D views (x [rows, K], w [K, n] or
[n, K] with w_transposed); each is a module that has these functions:
  the XLA-scheduled methods (NONE, PIPELINE, RING_EXCHANGE): commgemm.xla, any JAX backend;
  the fused Hopper kernels (atomic_gemm on an NVIDIA GPU): commgemm.mosaic_gpu.fused;
  the Pallas TPU kernels (atomic_gemm on a TPU, or interpreted): commgemm.pallas_tpu.ops.
The fused families also say why they cannot run a call or take a recipe's quantized operands
(`FusedBackend.unsupported_reason`, `scaling_reason`), which the plan asks before any
collective is traced.
"""

from __future__ import annotations

from typing import Protocol, cast

import jax

from commgemm.config import Collective, OverlapConfig, uses_tpu_kernels
from commgemm.quant import ScalingRecipe
from commgemm.xla import BY_METHOD


class Backend(Protocol):
    """The per-shard collective GEMMs of one kernel family (module-level functions)."""

    def all_gather_matmul(
        self,
        x: jax.Array,
        w,
        axis_name: str,
        config: OverlapConfig,
        *,
        w_transposed: bool,
        return_gathered: bool = False,
    ) -> jax.Array | tuple[jax.Array, jax.Array]: ...

    def matmul_reduce_scatter(
        self, x: jax.Array, w, axis_name: str, config: OverlapConfig, *, w_transposed: bool
    ) -> jax.Array: ...

    def matmul_all_reduce(
        self, x: jax.Array, w, axis_name: str, config: OverlapConfig, *, w_transposed: bool
    ) -> jax.Array: ...


class FusedBackend(Backend, Protocol):
    """A backend of fused kernels, which run some calls and not others."""

    def unsupported_reason(
        self,
        collective: Collective,
        x: jax.Array,
        w: jax.Array,
        size: int,
        config: OverlapConfig,
        *,
        w_transposed: bool,
    ) -> str | None: ...

    def scaling_reason(self, config: OverlapConfig, recipe: ScalingRecipe) -> str | None: ...


#: Collective -> the name of a backend's function for it.
FN_NAMES = {
    Collective.ALL_GATHER: "all_gather_matmul",
    Collective.REDUCE_SCATTER: "matmul_reduce_scatter",
    Collective.ALL_REDUCE: "matmul_all_reduce",
}


def fused_backend(config: OverlapConfig) -> FusedBackend:
    """The fused kernels an atomic_gemm config runs: the TPU kernels (on a TPU, or with
    interpret) or the Hopper ones. Imported on first use: both import Pallas."""
    if uses_tpu_kernels(config):
        from commgemm.pallas_tpu import ops

        return cast(FusedBackend, ops)
    from commgemm.mosaic_gpu import fused

    return cast(FusedBackend, fused)


def auto_may_fuse(config: OverlapConfig, recipe: ScalingRecipe | None) -> bool:
    """Whether AUTO may run the fused `config` on operands quantized by `recipe` (None: plain):
    the kernel takes them, and the recipe accumulates the forward fast (the fused kernels'
    promoted form is slower than XLA's promoted FP8 GEMM); the TPU kernels' float8 path only
    where asked for explicitly."""
    if recipe is None:
        return True
    if recipe.split_accumulator[0] or uses_tpu_kernels(config):
        return False
    return fused_backend(config).scaling_reason(config, recipe) is None


def backend_for(config: OverlapConfig) -> Backend:
    """The backend that runs `config`: the fused kernels for atomic_gemm, else its method's
    XLA module."""
    if config.atomic_gemm:
        return fused_backend(config)
    return cast(Backend, BY_METHOD[config.method])
