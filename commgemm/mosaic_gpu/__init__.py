"""Fused Hopper kernels (Mosaic GPU through Pallas): the GEMM and its transfers in one kernel.

`fused` dispatches an atomic_gemm config to its kernel and says where one cannot run;
`push_gather_gemm` (ATOMIC_GEMM_AG and its ring), `scatter_add_gemm` (ATOMIC_GEMM_RS),
`pingpong_gather_gemm` and `pingpong_scatter_gemm` (ATOMIC_GEMM_AG and _RS on the ping-pong
schedule, `pingpong`) and `ring_scatter_gemm` (ATOMIC_GEMM_RS_P2P) are the kernels; `tiles`
holds what they share, `configs` their tilings.
"""

from commgemm.mosaic_gpu.configs import (
    DirectAGConfig,
    DirectRSConfig,
    PingPongAGConfig,
    PingPongRSConfig,
    RingAGConfig,
    RingRSConfig,
)

__all__ = [
    "DirectAGConfig",
    "DirectRSConfig",
    "PingPongAGConfig",
    "PingPongRSConfig",
    "RingAGConfig",
    "RingRSConfig",
]
