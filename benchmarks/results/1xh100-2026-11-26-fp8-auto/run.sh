#!/usr/bin/env bash
# One GPU: the AG presets' P = 2 local GEMMs in FP8 on the ping-pong core against XLA's FP8
# dot (what local_gemm "auto" chooses between), then the GPU tests of the default FP8 path and
# of the ping-pong AG core. Run from the repo root.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD JAX_PLATFORMS=cuda
nvidia-smi -L > "$OUT/gpus.txt"
python3 benchmarks/fused_core.py --out "$OUT/p2" --ops ${OPS:-ag} --sizes 2 --tilings pp-gm-cm > "$OUT/core.log" 2>&1
timeout "${TEST_S:-240}" python3 -m pytest -q -n 0 -p no:cacheprovider tests/gpu/test_gemm_core_gpu.py tests/gpu/test_fp8_gpu.py \
  -k "${TESTS:-(serial_path and True and 1728) or ops_on_one_gpu or kept_transposed_dense or (pingpong and ag and not float8)}" > "$OUT/tests.log" 2>&1
tail -3 "$OUT/tests.log"
