"""Fused Hopper kernels (Mosaic GPU through Pallas): the GEMM and its transfers in one kernel.

`fused` dispatches an atomic_gemm config to its kernel and says where one cannot run; `tiles`
holds what the kernels share, `configs` their tilings, `heuristics` the defaults. One name per
kernel, across its config, module, algorithm and method spec:

  config            module        algorithm (method)                  spec
  DirectAGConfig    direct_ag     ATOMIC_GEMM_AG (PIPELINE)           fused-direct
  RingAGConfig      direct_ag     ATOMIC_GEMM_AG_P2P (RING_EXCHANGE)  fused
  DirectRSConfig    direct_rs     ATOMIC_GEMM_RS (PIPELINE)           fused-direct
  RingRSConfig      ring_rs       ATOMIC_GEMM_RS_P2P (RING_EXCHANGE)  fused
  PingPongAGConfig  pingpong_ag   ATOMIC_GEMM_AG (PIPELINE)           fused-direct-pp
  PingPongRSConfig  pingpong_rs   ATOMIC_GEMM_RS (PIPELINE)           fused-direct-pp

(the ring AG is the direct AG kernel forwarding each block to the next device; the ping-pong
kernels run the direct families on the shared ping-pong schedule, `pingpong`).
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
