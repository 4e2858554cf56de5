#!/usr/bin/env bash
# One GPU: the RS family's GEMM core (the plan and the ping-pong kernel) on the RS presets'
# local shapes, P = 2 with FP8, P = 4 and 8 in bf16. Run from the repo root.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD JAX_PLATFORMS=cuda
nvidia-smi -L > "$OUT/gpus.txt"
{
  python3 benchmarks/fused_core.py --out "$OUT/p2" --ops rs --sizes 2 --tilings plan,pp-gm-cm
  [ -n "$P48" ] && python3 benchmarks/fused_core.py --out "$OUT/p48" --ops rs --sizes 4,8 --no-fp8 --tilings plan,pp-gm-cm
} > "$OUT/core.log" 2>&1
tail -2 "$OUT/core.log"
