#!/bin/bash
# One call on four GPUs, from the repository root: `OUT=<dir> CALL=<name> bash <this file>`.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD JAX_PLATFORMS=cuda
O=${OUT:-/tmp/out}/${CALL:-call1}
mkdir -p "$O"
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv > "$O/gpus.txt"
PLAN=fused-direct-wgm-cm-ct-m64-n256
case ${CALL:-call1} in
call1)  # the fused RS op with its tail streamed on 4 GPUs (four partial sums a tile, added in
        # arrival order): outputs and gradients; then comm_heavy RS's op with the tail split in
        # 4 (the plan before), streamed (the plan now), whole, and AUTO
    timeout 240 python -m pytest -q -n 0 -p no:cacheprovider tests/gpu/test_fused_gpu.py \
        -k "sk" > "$O/tests.log" 2>&1
    echo "rc=$?" >> "$O/tests.log"
    timeout 300 python -m commgemm bench --op rs --preset comm_heavy --iters 20 --periods 6 \
        --methods none,$PLAN-t4-a2,$PLAN-sk-a2,$PLAN-a2,auto --json "$O/bench.json" \
        > "$O/bench.log" 2>&1
    echo "rc=$?" >> "$O/bench.log" ;;
call2)  # after the plan-time tail check: the streamed tail's tests again
    timeout 240 python -m pytest -q -n 0 -p no:cacheprovider tests/gpu/test_fused_gpu.py \
        -k "sk" > "$O/tests.log" 2>&1
    echo "rc=$?" >> "$O/tests.log" ;;
esac
