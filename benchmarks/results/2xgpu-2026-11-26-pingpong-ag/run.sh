#!/usr/bin/env bash
# Two GPUs: the AG op on the ping-pong kernel against AUTO (the cooperative direct plan) and the
# serial baseline on the four presets, then the ping-pong AG kernel's 2-GPU tests. Run from the
# repo root.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD JAX_PLATFORMS=cuda
nvidia-smi -L > "$OUT/gpus.txt"
for p in ${PRESETS:-llama70b_mlp llama13b_mlp llama8b_mlp comm_heavy}; do
  python3 -m commgemm bench --op ag --preset "$p" --iters 10 --warmup 2 --periods 6 \
    --methods "${METHODS:-none,auto,fused-direct-pp-gm-cm}" --json "$OUT/ag_$p.json" >> "$OUT/bench.log" 2>&1
done
grep -E "period|method|fused|auto|none" "$OUT/bench.log" | tail -40
timeout "${TEST_S:-240}" python3 -m pytest -q -n 0 -p no:cacheprovider tests/gpu/test_fused_gpu.py \
  -k "${TESTS:-ag and pp}" > "$OUT/tests.log" 2>&1
tail -3 "$OUT/tests.log"
