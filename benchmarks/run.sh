#!/usr/bin/env bash
# The GPU runs by name, from the repository root on a GPU machine (PYTHONPATH=. and its jax):
#   bash benchmarks/run.sh check   OUT [i/n] [W] fused kernels' outputs and gradients vs float32
#                                              (i/n: every n-th GPU test from the i-th; W: that
#                                              many pytest-xdist workers share the GPUs, since
#                                              compiling dominates)
#   bash benchmarks/run.sh tune    OUT         tune every preset x op (cache in OUT/tune.json)
#   bash benchmarks/run.sh suite   OUT [CACHE] the suite: every preset x op, AUTO (reading CACHE),
#                                              serial, XLA's dot and windowed einsum, PyTorch
#                                              async TP, by device periods
#   bash benchmarks/run.sh profile OUT         Mosaic GPU's profile of the direct RS kernel
#   bash benchmarks/run.sh tpu     OUT         on a TPU VM: every preset x op with the TPU kernels
#   bash benchmarks/run.sh fp8     OUT         one GPU: the FP8 GPU tests, then FP8 vs bf16 GEMMs
#   bash benchmarks/run.sh layers  OUT         one GPU: a training step, commgemm.nnx (bf16, float8) vs plain Flax
#   bash benchmarks/run.sh core    OUT [SIZES] one GPU: the GEMM core's and FP8 tests, then the
#                                              direct kernels' GEMM core (bf16, FP8) and the
#                                              serial path vs the best GEMM
#   bash benchmarks/run.sh grouped OUT [GROUPS] one GPU: the grouped GPU tests, then the local
#                                              grouped GEMMs (benchmarks/grouped_gemm.py)
#   bash benchmarks/run.sh layers-profile OUT  all GPUs: the layers' training step by method
#                                              against XLA's partitioning, kernel time by kind
#   bash benchmarks/run.sh multiprocess OUT    2 GPUs: the fused kernels and jax's own collective
#                                              matmul with one process per GPU (and one for all)
#   bash benchmarks/run.sh launch-modes OUT [P] P GPUs (default all): every preset x op (AUTO, serial,
#                                              XLA) in one process, then one process per GPU
#   bash benchmarks/run.sh step    OUT         all GPUs: a transformer layer's training step (3 sizes,
#                                              bf16 and FP8) by method against its bound, XLA's
#                                              partitioning and XLA's windowed einsum
#   bash benchmarks/run.sh step-modes OUT [P] [SIZES] P GPUs (default all): the layer step (SIZES,
#                                              default 8b,13b; bf16 and FP8) in one process, then
#                                              one process per GPU; both modes' table
#   bash benchmarks/run.sh moe     OUT         all GPUs: the expert-parallel MoE block's training step
#                                              (2 sizes, bf16 and FP8): AUTO, serial, AUTO with
#                                              capacity factor 1.25 and XLA's ragged
#                                              all-to-all + ragged dots
#   bash benchmarks/run.sh capabilities OUT    all GPUs (2, 4 or 8): FP8 ops, grouped GEMMs, the
#                                              backward alone and the layers' training step,
#                                              overlapped against serial and XLA's own sharding
set -euo pipefail
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
target=$1 out=$2
mkdir -p "$out"
if command -v nvidia-smi > /dev/null; then
  nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv > "$out/gpus.txt"
fi
export COMMGEMM_TUNE_CACHE=$out/tune.json
case $target in
  check) COMMGEMM_GPU_SHARD=${3:-} JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false \
    python3 -m pytest -q tests/gpu ${4:+-n $4} --junitxml="$out/gpu_tests.xml" ;;
  tune)
    for preset in llama70b_mlp llama8b_mlp comm_heavy; do
      for op in ag rs; do python3 -m commgemm tune --op $op --preset $preset --iters 12; done
    done ;;
  suite)
    if [ -n "${3:-}" ]; then cp "$3" "$out/tune.json"; fi
    python3 benchmarks/gpu_suite.py --out "$out/suite" --iters 15 --spans 0 --periods 6 \
      --timeout 380 --modes default,windowed_einsum ;;
  profile) python3 benchmarks/kernel_profile.py --out "$out" ;;
  tpu)
    for preset in llama70b_mlp llama8b_mlp comm_heavy llama13b_mlp notebook; do
      for op in ag rs; do
        python3 -m commgemm bench --op $op --preset $preset --iters 20 \
          --methods none,ring,fused,fused-direct,auto --json "$out/$preset-$op.json"
      done
    done ;;
  fp8)  # the benchmark runs even when a test fails; the exit status is the tests'
    status=0
    JAX_PLATFORMS=cuda python3 -m pytest -q tests/gpu/test_fp8_gpu.py \
      --junitxml="$out/fp8_tests.xml" || status=$?
    python3 benchmarks/fp8_gemm.py --out "$out"
    exit $status ;;
  layers) python3 benchmarks/layers_step.py --out "$out" ;;
  step) python3 benchmarks/step.py --out "$out" ;;
  launch-modes)
    p=${3:-$(python3 -c 'from commgemm.launch import gpu_count; print(gpu_count())')}
    export CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((p - 1)))
    python3 benchmarks/launch_modes.py --out "$out" 2>&1 | tee "$out/one_process.log" || true
    python3 -m commgemm launch -n "$p" --gpus-per-process 1 -- \
      python3 benchmarks/launch_modes.py --out "$out" 2>&1 | tee "$out/processes.log" || true
    python3 benchmarks/launch_modes.py --table "$out" ;;
  step-modes)
    p=${3:-$(python3 -c 'from commgemm.launch import gpu_count; print(gpu_count())')}
    export CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((p - 1)))
    python3 benchmarks/step.py --out "$out/one_process" --sizes "${4:-8b,13b}" \
      --variants auto,none,xla,comm,local 2>&1 | tee "$out/one_process.log" || true
    python3 -m commgemm launch -n "$p" --gpus-per-process 1 -- python3 benchmarks/step.py \
      --out "$out/per_gpu" --sizes "${4:-8b,13b}" --variants auto,xla,comm,local 2>&1 \
      | tee "$out/per_gpu.log" || true
    python3 benchmarks/launch_modes.py --table "$out" ;;
  moe) python3 benchmarks/moe_step.py --out "$out" ;;
  core)  # the benchmark runs even when a test fails; the exit status is the tests'
    status=0
    JAX_PLATFORMS=cuda python3 -m pytest -q tests/gpu/test_gemm_core_gpu.py tests/gpu/test_fp8_gpu.py \
      --junitxml="$out/core_tests.xml" || status=$?
    python3 benchmarks/fused_core.py --out "$out" --sizes "${3:-2,4,8}"
    exit $status ;;
  grouped)  # the benchmark runs even when a test fails; the exit status is the tests'
    status=0
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.4 JAX_PLATFORMS=cuda python3 -m pytest -q -n 2 tests/gpu \
      -k grouped -p no:warnings --junitxml="$out/grouped_tests.xml" || status=$?
    python3 benchmarks/grouped_gemm.py --out "$out" --groups "${3:-8,16,64,128}"
    exit $status ;;
  capabilities) python3 benchmarks/capabilities.py --out "$out" ;;
  layers-profile) python3 benchmarks/layers_profile.py --out "$out" ;;
  multiprocess)
    one="python3 benchmarks/multiprocess_fused.py"
    $one > "$out/one_process.log" 2>&1 || true
    python3 -m commgemm launch -n 2 --gpus-per-process 1 --timeout 140 -- $one \
      > "$out/two_processes.log" 2>&1 || true
    COMMGEMM_LIFT_PROCESS_CHECK=1 python3 -m commgemm launch -n 2 --gpus-per-process 1 \
      --timeout 140 -- $one > "$out/two_processes_lifted.log" 2>&1 || true
    grep -h "OK\|FAILED" "$out"/*.log | cut -c1-400 ;;
  *) echo "unknown target $target: check, tune, suite, profile, tpu, fp8, layers, core, layers-profile, multiprocess, launch-modes, step, step-modes, moe, grouped or capabilities" >&2; exit 2 ;;
esac
