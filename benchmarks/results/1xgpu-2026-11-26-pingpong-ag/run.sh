#!/usr/bin/env bash
# One GPU: the ping-pong AG kernel's GEMM core against the best GEMM on the AG presets' local
# shapes (P = 2 with FP8, P = 4 and 8 in bf16), then its GPU tests. Run from the repo root.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD JAX_PLATFORMS=cuda
nvidia-smi -L > "$OUT/gpus.txt"
{
  python3 benchmarks/fused_core.py --out "$OUT/p2" --ops ag --sizes 2 --tilings plan,pp-gm-cm
  python3 benchmarks/fused_core.py --out "$OUT/p48" --ops ag --sizes 4,8 --no-fp8 --tilings plan,pp-gm-cm
} > "$OUT/core.log" 2>&1
timeout "${TEST_S:-200}" python3 -m pytest -q -n 0 -p no:cacheprovider tests/gpu/test_gemm_core_gpu.py \
  -k "(pingpong and ag) or (serial_path and 1728 and True)" > "$OUT/tests.log" 2>&1
tail -3 "$OUT/tests.log"
