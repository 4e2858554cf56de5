#!/usr/bin/env bash
# One call on the GPU machine: tune every preset (cache in $OUT), the suite (our methods incl.
# AUTO, XLA, XLA windowed einsum, PyTorch async TP), the demo in one and in two processes, and
# `commgemm bench` in one and two processes. Everything lands in $OUT/results.tgz.
#   device run:  bash benchmarks/gpu_run.sh
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 COMMGEMM_TUNE_CACHE=$OUT/r/tune.json
mkdir -p $OUT/r
{
  for preset in llama70b_mlp llama8b_mlp comm_heavy; do
    for op in ag rs; do
      timeout 60 python3 -m commgemm tune --op $op --preset $preset --iters 20 | tail -3
    done
  done
} 2>&1 | tee $OUT/r/tune.log
timeout 300 python3 benchmarks/gpu_suite.py --out $OUT/r/suite --iters 20 --timeout 120 \
  --modes default,windowed_einsum 2>&1 | tee $OUT/r/suite.log | grep -E "^\[|^\||timed out"
timeout 90 python3 -m commgemm demo --size 4096 --dtype bfloat16 --processes 2 \
  > $OUT/r/demo_2proc.txt 2>&1; grep -E "demo on|correct" $OUT/r/demo_2proc.txt
for n in 1 2; do
  timeout 60 python3 -m commgemm bench --preset comm_heavy --op ag --processes $n --iters 20 \
    --methods none,ring,ring:2,auto --json $OUT/r/bench_${n}proc.json > $OUT/r/bench_${n}proc.txt 2>&1
  tail -9 $OUT/r/bench_${n}proc.txt
done
tar czf $OUT/results.tgz -C $OUT r && rm -rf $OUT/r
