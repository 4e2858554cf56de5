#!/bin/bash
# One call on one GPU, from the repository root: `OUT=<dir> CALL=<name> bash <this file>`.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD JAX_PLATFORMS=cuda
D=benchmarks/results/1xgpu-2026-11-27-narrow
O=${OUT:-/tmp/out}/${CALL:-call1}
mkdir -p "$O"
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv > "$O/gpus.txt"
case ${CALL:-call1} in
call1)  # the narrow columns' GPU tests, then the probe
    timeout 200 python -m pytest -q -n 0 tests/gpu/test_gemm_core_gpu.py -k narrow_columns \
        > "$O/tests.log" 2>&1
    echo "rc=$?" >> "$O/tests.log"
    timeout 360 python $D/probe.py "$O/probe.json" > "$O/probe.log" 2>&1
    echo "rc=$?" >> "$O/probe.log" ;;
call2)  # which tiles the narrow RS core gets wrong
    timeout 300 python $D/diag.py > "$O/diag.log" 2>&1
    echo "rc=$?" >> "$O/diag.log" ;;
call3)  # the RS kernel's unit coordinates computed once a unit (`begin`): tests, probe
    timeout 200 python -m pytest -q -n 0 tests/gpu/test_gemm_core_gpu.py -k narrow_columns \
        > "$O/tests.log" 2>&1
    echo "rc=$?" >> "$O/tests.log"
    timeout 300 python $D/probe.py "$O/probe.json" \
        comm_heavy-rs-p2,comm_heavy-rs-p4,comm_heavy-rs-p8,llama8b-ag-p8 > "$O/probe.log" 2>&1
    echo "rc=$?" >> "$O/probe.log" ;;
call4)  # the RS kernel's stores unpredicated on one device: tests, probe
    timeout 200 python -m pytest -q -n 0 tests/gpu/test_gemm_core_gpu.py -k narrow_columns \
        > "$O/tests.log" 2>&1
    echo "rc=$?" >> "$O/tests.log"
    timeout 300 python $D/probe.py "$O/probe.json" \
        comm_heavy-rs-p2,comm_heavy-rs-p4,comm_heavy-rs-p8 > "$O/probe.log" 2>&1
    echo "rc=$?" >> "$O/probe.log" ;;
call5)  # the first narrow tiles' origins printed from inside the RS and AG kernels
    timeout 200 python $D/diag2.py > "$O/diag2.log" 2>&1
    echo "rc=$?" >> "$O/diag2.log" ;;
call6)  # the narrow tiles' stores printed from inside the RS and AG kernels
    timeout 200 python $D/diag3.py > "$O/diag3.log" 2>&1
    echo "rc=$?" >> "$O/diag3.log" ;;
call7)  # the RS core with more registers for its load warpgroup
    timeout 250 python $D/diag4.py > "$O/diag4.log" 2>&1
    echo "rc=$?" >> "$O/diag4.log" ;;
call8)  # the RS kernel's count of its units no longer computed before the warpgroups split
    timeout 250 python -m pytest -q -n 0 tests/gpu/test_gemm_core_gpu.py -k narrow_columns \
        > "$O/tests.log" 2>&1
    echo "rc=$?" >> "$O/tests.log" ;;
call9)  # what the narrow cores' load warpgroup loads, printed from inside the kernels
    timeout 200 python $D/diag5.py > "$O/diag5.log" 2>&1
    echo "rc=$?" >> "$O/diag5.log" ;;
call10)  # the units' count computed inside each warpgroup, after its register change
    timeout 250 python -m pytest -q -n 0 tests/gpu/test_gemm_core_gpu.py -k narrow_columns \
        > "$O/tests.log" 2>&1
    echo "rc=$?" >> "$O/tests.log"
    timeout 100 python $D/diag5.py > "$O/diag5.log" 2>&1
    echo "rc=$?" >> "$O/diag5.log" ;;
call11)  # the RS kernel's unit -> tile by lax.div instead of jnp's floor division
    timeout 250 python -m pytest -q -n 0 tests/gpu/test_gemm_core_gpu.py -k narrow_columns \
        > "$O/tests.log" 2>&1
    echo "rc=$?" >> "$O/tests.log"
    timeout 100 python $D/diag5.py > "$O/diag5.log" 2>&1
    echo "rc=$?" >> "$O/diag5.log" ;;
call12)  # a narrow unit's deal as each warpgroup computes it, printed from inside the kernels
    timeout 150 python $D/diag6.py > "$O/diag6.log" 2>&1
    echo "rc=$?" >> "$O/diag6.log" ;;
call13)  # the RS kernel's tile as the AG kernel computes it (rem, tile_origin called directly)
    timeout 250 python -m pytest -q -n 0 tests/gpu/test_gemm_core_gpu.py -k narrow_columns \
        > "$O/tests.log" 2>&1
    echo "rc=$?" >> "$O/tests.log" ;;
call14)  # call 13's tree: the probe on comm_heavy RS and llama8b AG P = 8
    timeout 300 python $D/probe.py "$O/probe.json" \
        comm_heavy-rs-p2,comm_heavy-rs-p4,comm_heavy-rs-p8,llama8b-ag-p8 > "$O/probe.log" 2>&1
    echo "rc=$?" >> "$O/probe.log" ;;
esac
