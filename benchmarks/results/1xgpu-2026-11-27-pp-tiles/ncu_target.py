"""One GEMM of comm_heavy RS P = 2's local shape (16384 x 4096 x 4096, bf16), called 12 times,
for Nsight Compute: `python ncu_target.py VARIANT[,VARIANT...]` with VARIANT "xla" (XLA's dot:
cuBLASLt's kernel), a ping-pong core "pp" (128 x 192, the default), "pp-n128" (128 x 128), or
"plan" (the cooperative RS core the fused plan runs); several variants are called in turn."""

import sys

import jax
import jax.numpy as jnp

import commgemm as cg
from commgemm.mosaic_gpu import fused, heuristics
from commgemm.mosaic_gpu.configs import PingPongRSConfig

m, k, n = 16384, 4096, 4096


def make(variant):
    if variant == "xla":
        return jax.jit(jnp.dot)
    if variant == "plan":
        tiles = heuristics.direct_rs_config(m, 2, (m, k * 2, n))
    else:
        tiles = PingPongRSConfig(tile_n=128) if variant == "pp-n128" else PingPongRSConfig()
    config = cg.OverlapConfig(method="pipeline", atomic_gemm=True, kernel=tiles)
    return jax.jit(lambda a, b: fused.matmul_reduce_scatter(a, b, None, config, w_transposed=False))


def main() -> None:
    fns = [make(v) for v in sys.argv[1].split(",")]
    a = jax.random.normal(jax.random.key(0), (m, k), jnp.bfloat16)
    b = (jax.random.normal(jax.random.key(1), (k, n), jnp.float32) / k**0.5).astype(jnp.bfloat16)
    for _ in range(12):
        for fn in fns:
            out = fn(a, b)
        jax.block_until_ready(out)
    print(sys.argv[1], "done")


if __name__ == "__main__":
    main()
