#!/usr/bin/env bash
# Two GPUs, from the repository root: the ping-pong kernels' 2-GPU tests with the last wave
# halved (narrow_tail, the RS plan's default), then the RS op on the ping-pong kernel with and
# without it against the serial baseline.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD JAX_PLATFORMS=cuda
nvidia-smi -L > "$OUT/gpus.txt"
timeout "${TEST_S:-300}" python3 -m pytest -q -n 0 -p no:cacheprovider tests/gpu/test_fused_gpu.py \
  -k "(outputs_and_gradients and pp-gm-cm-nt) or (back_to_back and pp) or float8_pingpong" \
  > "$OUT/tests.log" 2>&1
echo "rc=$?" >> "$OUT/tests.log"
tail -3 "$OUT/tests.log"
for p in ${PRESETS:-llama8b_mlp comm_heavy llama70b_mlp}; do
  timeout 100 python3 -m commgemm bench --op rs --preset "$p" --iters 10 --warmup 2 --periods 6 \
    --methods none,fused-direct-pp-gm-cm,fused-direct-pp-gm-cm-nt --json "$OUT/rs_$p.json" \
    >> "$OUT/bench.log" 2>&1
done
grep -E "period|method|fused|none" "$OUT/bench.log" | tail -30
