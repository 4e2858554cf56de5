"""XLA flags the overlap can use on GPUs, for the user to apply before jax starts.

Measured on 2 GPUs (docs/performance.md): none of these helps every preset, so
the library sets none by default; its own schedule hints (commgemm.xla.common.after) are
per call and need no flag.
"""

from __future__ import annotations

import os

#: flag -> (the XLA flag, what it does).
KNOWN = {
    "cublas_gemm": (
        "--xla_gpu_enable_triton_gemm=false",
        "cuBLAS instead of Triton GEMM fusions: faster on some shapes, slower on others",
    ),
    "copy_engine_p2p": (
        "--xla_gpu_use_memcpy_local_p2p=true",
        "collective-permutes by copy engines, leaving the SMs to the GEMM",
    ),
}


def xla_flags(
    *, cublas_gemm: bool = False, copy_engine_p2p: bool = False, apply: bool = False
) -> str:
    """The XLA_FLAGS string for the chosen options; with apply=True, also appended to
    os.environ["XLA_FLAGS"] (raises RuntimeError once jax has started its backends, since XLA
    reads the flags only then)."""
    chosen = [
        KNOWN[name][0]
        for name, on in (("cublas_gemm", cublas_gemm), ("copy_engine_p2p", copy_engine_p2p))
        if on
    ]
    flags = " ".join(chosen)
    if apply and flags:
        from jax._src import xla_bridge

        if xla_bridge.backends_are_initialized():
            raise RuntimeError(
                "jax has already started its backends, so new XLA flags would be ignored: call "
                "commgemm.flags.xla_flags(..., apply=True) before the first jax computation"
            )
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()
    return flags
