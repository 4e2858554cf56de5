#!/bin/bash
# One call on one GPU, from the repository root: `OUT=<dir> CALL=<name> bash <this file>`.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD JAX_PLATFORMS=cuda
D=benchmarks/results/1xgpu-2026-11-27-sass
O=${OUT:-/tmp/out}/${CALL:-call1}
mkdir -p "$O"
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv > "$O/gpus.txt"
case ${CALL:-call1} in
call1)  # the cores' PTX, ptxas report and SASS, and their timings
    { which nvdisasm cuobjdump ptxas; ls /usr/local/cuda*/bin 2>&1 | head -50;
      python -c "import jax, jaxlib; print(jax.__version__, jaxlib.__version__)"; } \
        > "$O/tools.txt" 2>&1
    timeout 400 python $D/dump.py "$O" > "$O/dump.log" 2>&1
    echo "rc=$?" >> "$O/dump.log" ;;
call2)  # call 1 again, then the SASS of each core (the toolkit's ptxas and nvdisasm), in one tarball
    timeout 300 python $D/dump.py "$O/dump" > "$O/dump.log" 2>&1
    echo "rc=$?" >> "$O/dump.log"
    for ptx in "$O"/dump/*/*.ptx; do
        base=${ptx%.ptx}
        /usr/local/cuda/bin/ptxas -arch=sm_90a -O3 -v "$ptx" -o "$base.cubin" > "$base.ptxas-v" 2>&1
        /usr/local/cuda/bin/nvdisasm -c -hex "$base.cubin" > "$base.sass" 2>&1
    done
    cp "$O/dump/timings.json" "$O/"
    head -c 3000 "$O"/dump/*/*.ptxas > "$O/ptxas_head.txt" 2>&1
    tar -C "$O" -czf "$O/dump.tar.gz" dump && rm -rf "$O/dump" ;;
call3)  # order.py in its first form (K groups outside M groups: with 64-wide K-steps the same kernels)
    timeout 500 python $D/order.py "$O/order.json" > "$O/order.log" 2>&1
    echo "rc=$?" >> "$O/order.log" ;;
call4)  # the wgmmas of a K-step in Mosaic GPU's order and in CUTLASS's (patched in the process)
    timeout 500 python $D/order.py "$O/order.json" > "$O/order.log" 2>&1
    echo "rc=$?" >> "$O/order.log" ;;
call5)  # the RS core in 128 x 208 tiles (w [n, K], 4 stages) on comm_heavy RS
    timeout 500 python $D/wide208.py "$O/wide208.json" > "$O/wide208.log" 2>&1
    echo "rc=$?" >> "$O/wide208.log" ;;
call6)  # tiles computed transposed, 64 (N) x 256 (M), on the tree with swap_ab_head.patch
    timeout 500 python $D/swapped.py "$O/swapped.json" > "$O/swapped.log" 2>&1
    echo "rc=$?" >> "$O/swapped.log" ;;
call7)  # H200: SM clock and power while each GEMM runs back to back for 3 s (twice, in turn)
    nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active \
        --format=csv,noheader -lms 50 > "$O/smi.csv" &
    SMI=$!
    timeout 200 python benchmarks/results/1xgpu-2026-11-27-pp-tiles/phase_clocks.py \
        > "$O/phases.jsonl" 2> "$O/phases.err"
    echo "rc=$?" >> "$O/phases.err"; kill $SMI ;;
call8)  # a control: three copies of the default RS core beside XLA's dot, every round kept
    timeout 400 python $D/control.py "$O/control.json" > "$O/control.log" 2>&1
    echo "rc=$?" >> "$O/control.log" ;;
call9)  # the control on call 3's "llama70b" shape (then labelled llama70b-rs-p2; now 8192x14336x8192)
    timeout 400 python $D/control.py "$O/control.json" 8192x14336x8192 > "$O/control.log" 2>&1
    echo "rc=$?" >> "$O/control.log" ;;
call10)  # the control on the preset's llama70b RS P = 2 local shape
    timeout 400 python $D/control.py "$O/control.json" llama70b-rs-p2 > "$O/control.log" 2>&1
    echo "rc=$?" >> "$O/control.log" ;;
call11)  # the AG core in 128 x 128 tiles on llama8b AG P = 8 over stages, grid order, band width
    timeout 500 python $D/sweep.py "$O/sweep.json" > "$O/sweep.log" 2>&1
    echo "rc=$?" >> "$O/sweep.log" ;;
call12)  # the same over narrower bands, 128- and 192-wide tiles
    timeout 500 python $D/sweep.py "$O/sweep.json" bands > "$O/sweep.log" 2>&1
    echo "rc=$?" >> "$O/sweep.log" ;;
call13)  # band widths 1, 2, 4, 8 on the rows and comm_heavy's AG rows
    timeout 560 python $D/bands.py "$O/bands.json" > "$O/bands.log" 2>&1
    echo "rc=$?" >> "$O/bands.log" ;;
call14)  # band widths on every preset's AG local shapes
    timeout 560 python $D/allrows.py "$O/allrows_ag.json" ag > "$O/allrows_ag.log" 2>&1
    echo "rc=$?" >> "$O/allrows_ag.log" ;;
call15)  # band widths on every preset's RS local shapes
    timeout 560 python $D/allrows.py "$O/allrows_rs.json" rs > "$O/allrows_rs.log" 2>&1
    echo "rc=$?" >> "$O/allrows_rs.log" ;;
call16)  # the cooperative RS plan's core in bands along N and M on comm_heavy RS P = 2
    timeout 400 python $D/planbands.py "$O/planbands.json" > "$O/planbands.log" 2>&1
    echo "rc=$?" >> "$O/planbands.log" ;;
esac
