"""Pieces every algorithm uses: the local GEMM under a config, and ring permutations."""

from __future__ import annotations

import jax
from jax import lax

from commgemm.config import OverlapConfig
from commgemm.operands import dot
from commgemm.quantized_gemm import QuantizedRhs


def matmul(
    a: jax.Array,
    w: jax.Array,
    config: OverlapConfig,
    w_transposed: bool,
    *,
    result_dtype: str | None = None,
) -> jax.Array:
    """a [r, K] @ w -> [r, n], accumulated in config.accumulate_dtype and returned in
    `result_dtype` (default: the accumulate dtype). Named "gemm" in profiles. Under an op's
    `scaling=`, a is a quantized payload and w a `commgemm.quantized_gemm.QuantizedRhs`, which
    multiplies it.

    The result is asked of XLA in a 16-bit result dtype directly (see operands.dot). With
    config.local_gemm "mosaic" the GEMMs the Hopper kernel can run go to it
    (commgemm.mosaic_gpu.gemm_core), the others to XLA; with "auto" the float8 GEMMs it runs
    faster (`gemm_core.auto_takes`).
    """
    kernel = config.local_gemm == "mosaic"
    if kernel or (config.local_gemm == "auto" and isinstance(w, QuantizedRhs)):
        from commgemm.mosaic_gpu import gemm_core

        if kernel:
            takes = gemm_core.gemm_reason(a, w, w_transposed, result_dtype) is None
        else:
            takes = gemm_core.auto_takes(a, w, w_transposed, result_dtype)
        if takes:
            return gemm_core.matmul(a, w, w_transposed)
    if isinstance(w, QuantizedRhs):  # the op's scaling=
        with jax.named_scope("gemm"):
            return w.matmul(a, w_transposed, config.accumulate_dtype, result_dtype)
    with jax.named_scope("gemm"):
        return dot(
            a,
            w,
            ((1,), (1 if w_transposed else 0,)),
            accumulate_dtype=config.accumulate_dtype,
            result_dtype=result_dtype or config.accumulate_dtype,
        )


def reduce_dtype(config: OverlapConfig) -> str:
    """The dtype partial sums travel in: config.reduce_dtype, else the output dtype."""
    return config.reduce_dtype or config.out_dtype


def ring_perm(size: int, shift: int) -> list[tuple[int, int]]:
    """ppermute pairs sending from each device to the one `shift` places further round the ring."""
    return [(i, (i + shift) % size) for i in range(size)]


def send_one(chunk: jax.Array, axis_name: str, size: int, shift: int) -> jax.Array:
    """`chunk` moved `shift` places round the ring of `axis_name` (one ppermute)."""
    return lax.ppermute(chunk, axis_name, ring_perm(size, shift))


def split_rows(a: jax.Array, parts: int) -> list[jax.Array]:
    """a [r, ...] as `parts` equal row blocks (r divisible by parts, checked by the caller)."""
    rows = a.shape[0] // parts
    return [a[i * rows : (i + 1) * rows] for i in range(parts)]


def after(value: jax.Array, previous: object | None) -> jax.Array:
    """`value`, held back until `previous` exists.

    Chunked collectives have no data dependency on one another, so XLA's combiner passes merge
    them into one (undoing the pipeline). Tying chunk c+1's collective input to chunk c's
    collective output keeps them separate and in order, while the GEMMs stay free to overlap.
    """
    if previous is None or not jax.tree.leaves(previous):
        return value
    return lax.optimization_barrier((value, previous))[0]
