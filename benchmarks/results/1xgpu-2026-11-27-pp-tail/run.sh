#!/bin/bash
# One call on one GPU, from the repository root: `OUT=<dir> CALL=<name> bash <this file>`.
# (After the runs, the helpers each call repeated were gathered into the functions below; every
# call's commands are the ones it ran.)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD JAX_PLATFORMS=cuda
D=benchmarks/results/1xgpu-2026-11-27-pp-tail
O=${OUT:-/tmp/out}/${CALL:-call1}
mkdir -p "$O"
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv > "$O/gpus.txt"
core() {  # fused_core.py into $O/$1, its log's tail in $O/$1.log
    local name=$1; shift
    timeout "${LIMIT:-280}" python benchmarks/fused_core.py --out "$O/$name" --no-fp8 "$@" \
        > "$O/$name.full.log" 2>&1
    echo "rc=$?" >> "$O/$name.full.log"; tail -20 "$O/$name.full.log" > "$O/$name.log"
}
probe() {  # crash_probe.py SPEC [M K N [OP]], one line each in $O/probe.log
    timeout 60 python $D/crash_probe.py "$@" >> "$O/probe.log" 2>> "$O/probe.err" \
        || echo "$* failed rc=$?" >> "$O/probe.log"
}
gpu_tests() {  # pytest -k $2 of the one-GPU core tests under timeout $1, into $O/tests.log
    timeout "$1" python -m pytest -q -n 0 tests/gpu/test_gemm_core_gpu.py -k "$2" \
        > "$O/tests.log" 2>&1
    echo "rc=$?" >> "$O/tests.log"
}
merge() {  # the parts named $1 (e.g. "bcd") into one file of rows and one of logs
    python - "$O" "$1" <<'PY'
import json, pathlib, sys
out, parts = pathlib.Path(sys.argv[1]), sys.argv[2]
rows = [r for p in parts if (out / p / "fused_core.json").exists()
        for r in json.loads((out / p / "fused_core.json").read_text())["rows"]]
(out / "fused_core_rows.json").write_text(json.dumps(rows, indent=1))
(out / "core.log").write_text("".join(f"== {p}\n" + (out / f"{p}.log").read_text()
                                      for p in parts if (out / f"{p}.log").exists()))
PY
}
early_probes() {  # call 1's failing variant and its neighbours, the narrowed llama13b shape
    for spec in pp-gm-cm-n128 pp-gm-cm-n128-s6 pp-gm-n128-s6 pp-cm-n128-s6 pp-gm-cm-w16 \
            pp-gm-cm gm-nt cm-nt; do
        probe fused-direct-$spec
    done
    probe fused-direct-pp-gm-cm-nt 8192 5120 1728
}
case ${CALL:-call1} in
call1)  # the ping-pong sweep on the rows the cores missed
    LIMIT=200 core p8 --presets llama8b_mlp,llama13b_mlp --sizes 8 --ops ag --pp-sweep \
        --tilings plan-nt,cm-nt,pp-gm-cm,n192-cm
    LIMIT=370 core ch --presets comm_heavy --sizes 2,4,8 --pp-sweep \
        --tilings plan,default,w16,cm,cm-nt,cm-t0,pp-gm-cm ;;
call2)  # which variant failed to launch in call 1; then the GPU tests of the ping-pong cores
    early_probes
    gpu_tests 300 "pingpong or (serial_path and 1728 and True)" ;;
call3)  # the probe again (call 2's had a bug); the cores with narrowed last waves
    early_probes
    T=plan,plan-nt,cm,cm-nt,default,cm-t0,pp-gm-cm-nt
    LIMIT=100 core a --presets llama8b_mlp,llama13b_mlp --sizes 8 --ops ag --pp-sweep --tilings $T
    LIMIT=100 core b --presets comm_heavy --sizes 2,4,8 --ops rs --pp-sweep --tilings $T
    LIMIT=100 core c --presets llama8b_mlp --sizes 2,4,8 --ops rs --pp-sweep --tilings $T
    LIMIT=120 core d --presets llama70b_mlp,llama13b_mlp --sizes 2,4 --ops ag --pp-sweep --tilings $T
    merge abcd ;;
call4)  # after the fix (the load warpgroup awaits the last slots' releases): call 1's failing
    # variant and call 3's narrowed RS cores 64 times back to back, call 3's rows, the GPU tests
    probe fused-direct-pp-cm-n128-s6
    probe fused-direct-pp-gm-cm-nt 16384 4096 4096 rs
    probe fused-direct-pp-gm-cm-nt 8192 2048 14336 rs
    probe fused-direct-pp-gm-cm-nt 8192 8192 7168 ag
    T=plan,plan-nt,cm,cm-nt,default,cm-t0,pp-gm-cm-nt
    LIMIT=100 core b --presets comm_heavy --sizes 2,4,8 --ops rs --pp-sweep --tilings $T
    LIMIT=100 core c --presets llama8b_mlp --sizes 2,4,8 --ops rs --pp-sweep --tilings $T
    LIMIT=120 core d --presets llama70b_mlp,llama13b_mlp --sizes 2,4 --ops ag --pp-sweep --tilings $T
    gpu_tests 150 "pingpong_core"
    merge bcd
    rm -rf "$O"/[bcd] "$O"/*.full.log "$O"/[bcd].log ;;
call5)  # the partial last column's tiles narrow (a tree not committed): GPU tests, 64 calls back
    # to back, the rows the cores missed
    gpu_tests 260 "pingpong or (serial_path and 1728 and True)"
    probe fused-direct-pp-gm-cm-nt 16384 4096 4096 rs
    probe fused-direct-pp-gm-cm-nt 8192 4096 1792 ag
    T=plan,plan-nt,cm-nt,pp-gm-cm-nt
    LIMIT=80 core a --presets llama8b_mlp --sizes 8 --ops ag --pp-sweep --tilings $T
    LIMIT=100 core b --presets comm_heavy --sizes 2,4,8 --ops rs --pp-sweep --tilings $T
    LIMIT=80 core c --presets llama70b_mlp --sizes 2 --ops rs --pp-sweep --tilings $T
    merge abc
    rm -rf "$O"/[abc] "$O"/*.full.log "$O"/[abc].log ;;
esac
