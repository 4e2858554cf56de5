#!/bin/bash
# One call on one GPU, from the repository root: `OUT=<dir> CALL=<name> bash <this file>`.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD JAX_PLATFORMS=cuda
O=${OUT:-/tmp/out}/${CALL:-call1}
mkdir -p "$O"
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv > "$O/gpus.txt"
TILINGS=plan,plan-whole,plan-stream,pp-gm-cm-nt,pp-gm-cm-nt-w1
case ${CALL:-call1} in
call1)  # the RS cores' GPU tests (streamed tails among them), then comm_heavy RS's cores
    timeout 200 python -m pytest -q -n 0 -p no:cacheprovider tests/gpu/test_gemm_core_gpu.py \
        -k "test_gemm_core and rs" > "$O/tests.log" 2>&1
    echo "rc=$?" >> "$O/tests.log"
    timeout 380 python benchmarks/fused_core.py --out "$O" --ops rs --presets comm_heavy \
        --sizes 2,4,8 --no-fp8 --tilings $TILINGS > "$O/core.log" 2>&1
    echo "rc=$?" >> "$O/core.log" ;;
call2)  # comm_heavy RS P = 2 again, then the llama presets' RS cores at P = 4, 8 (where the
        # plan is the cooperative kernel)
    timeout 150 python benchmarks/fused_core.py --out "$O/again" --ops rs --presets comm_heavy \
        --sizes 2 --no-fp8 --tilings $TILINGS > "$O/again.log" 2>&1
    echo "rc=$?" >> "$O/again.log"
    timeout 420 python benchmarks/fused_core.py --out "$O" --ops rs \
        --presets llama8b_mlp,llama13b_mlp,llama70b_mlp --sizes 4,8 --no-fp8 \
        --tilings $TILINGS > "$O/core.log" 2>&1
    echo "rc=$?" >> "$O/core.log" ;;
call3)  # the table of the GEMM-core issue, AG: every preset's local shapes at P = 2, 4, 8
    timeout 570 python benchmarks/fused_core.py --out "$O" --ops ag --no-fp8 \
        --tilings plan,plan-nt,default,cm,pp-gm-cm-nt,pp-gm-cm-nt-w1,pp-gm-cm-nt-n128-w1 \
        > "$O/core.log" 2>&1
    echo "rc=$?" >> "$O/core.log" ;;
call4)  # the same, RS (the plan now streams comm_heavy's tail at P = 2)
    timeout 570 python benchmarks/fused_core.py --out "$O" --ops rs --no-fp8 \
        --tilings plan,plan-whole,pp-gm-cm-nt,pp-gm-cm-nt-w1 > "$O/core.log" 2>&1
    echo "rc=$?" >> "$O/core.log" ;;
esac
