"""Fused Hopper kernels (Mosaic GPU through Pallas): the GEMM and its transfers in one kernel.

`fused` dispatches an atomic_gemm config to its kernel and says where one cannot run;
`push_gather_gemm` (ATOMIC_GEMM_AG) and `scatter_add_gemm` (ATOMIC_GEMM_RS) are the direct
kernels, the ring kernels live in `fused`; `tiles` holds what the kernels share.
"""

from commgemm.mosaic_gpu.configs import (
    DirectAGConfig,
    DirectRSConfig,
    RingAGConfig,
    RingRSConfig,
)

__all__ = ["DirectAGConfig", "DirectRSConfig", "RingAGConfig", "RingRSConfig"]
