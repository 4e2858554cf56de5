#!/bin/bash
# One call on one GPU, from the repository root: `OUT=<dir> CALL=<name> bash <this file>`.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD JAX_PLATFORMS=cuda
D=benchmarks/results/1xgpu-2026-11-27-pp-tiles
O=${OUT:-/tmp/out}/${CALL:-call1}
mkdir -p "$O"
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv > "$O/gpus.txt"
case ${CALL:-call1} in
call1)  # the tilings probe; the back-to-back and float8 ping-pong core tests
    timeout 330 python $D/probe.py "$O/probe.json" > "$O/probe.log" 2>&1
    echo "rc=$?" >> "$O/probe.log"
    timeout 200 python -m pytest -q -n 0 tests/gpu/test_gemm_core_gpu.py \
        -k "back_to_back or (pingpong and float8)" > "$O/tests.log" 2>&1
    echo "rc=$?" >> "$O/tests.log" ;;
call2)  # 192 x 128 tiles against 128 x 192 where both are whole waves
    timeout 200 python $D/probe.py "$O/probe.json" even-k4096,even-k1024 > "$O/probe.log" 2>&1
    echo "rc=$?" >> "$O/probe.log" ;;
call3)  # Nsight Compute: cuBLASLt's kernel (XLA's dot) against the ping-pong cores
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
    for v in xla pp pp-n128; do
        case $v in xla) K="regex:nvjet";; *) K="regex:mosaic";; esac
        timeout 150 "$NCU" --clock-control none -k "$K" --launch-skip 6 --launch-count 1 \
            --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
            --section ComputeWorkloadAnalysis --section SchedulerStats \
            --metrics sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,\
l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,lts__t_bytes.sum,smsp__cycles_active.avg \
            python $D/ncu_target.py $v > "$O/ncu_$v.txt" 2>&1
        echo "rc=$?" >> "$O/ncu_$v.txt"
    done ;;
call4)  # Nsight Compute, the variants in turn in one process: clocks, cycles, time of each
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
    timeout 300 "$NCU" --clock-control none -k "regex:nvjet|mosaic" \
        --launch-count 60 --section SpeedOfLight \
        --metrics sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,\
lts__t_bytes.sum,smsp__inst_executed.sum \
        python $D/ncu_target.py xla,pp,plan,pp-n128 > "$O/ncu_turns.txt" 2>&1
    echo "rc=$?" >> "$O/ncu_turns.txt" ;;
call5)  # SM clock and power while each GEMM runs back to back for 3 s (twice, in turn)
    nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu \
        --format=csv,noheader -lms 50 > "$O/smi.csv" &
    SMI=$!
    timeout 200 python $D/phase_clocks.py > "$O/phases.jsonl" 2> "$O/phases.err"
    echo "rc=$?" >> "$O/phases.err"; kill $SMI ;;
call6)  # 192 x 128 tiles with a partial last row on comm_heavy RS; their GPU test
    timeout 300 python $D/probe.py "$O/probe.json" partial-rs-p2,partial-rs-p4,partial-rs-p8 \
        > "$O/probe.log" 2>&1
    echo "rc=$?" >> "$O/probe.log"
    timeout 150 python -m pytest -q -n 0 tests/gpu/test_gemm_core_gpu.py -k partial_rows \
        > "$O/tests.log" 2>&1
    echo "rc=$?" >> "$O/tests.log" ;;
call7)  # the tiles computed transposed (swap_ab)
    timeout 400 python $D/probe.py "$O/probe.json" \
        swap-rs-p2,swap-rs-p4,swap-rs-p8,swap-even-k4096,swap-ag-p8 > "$O/probe.log" 2>&1
    echo "rc=$?" >> "$O/probe.log" ;;
call8)  # the GPU tests of the ping-pong cores and the serial path, partial rows included
    timeout 400 python -m pytest -q -n 0 tests/gpu/test_gemm_core_gpu.py \
        -k "pingpong or serial_path or partial or float8_gemm" > "$O/tests.log" 2>&1
    echo "rc=$?" >> "$O/tests.log" ;;
call9)  # 128 x 128 tiles in K-steps of 128
    timeout 250 python $D/probe.py "$O/probe.json" k128-rs-p2,k128-rs-p4,k128-rs-p8,k128-ag-p8 \
        > "$O/probe.log" 2>&1
    echo "rc=$?" >> "$O/probe.log" ;;
esac
