#!/usr/bin/env bash
# x4 call A: the layer step at P = 4 in both modes (8b, 13b), then 70b one process if time is left
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
start=$(date +%s)
R=/tmp/r; mkdir -p $R
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $R/gpus.txt
git log -1 --format=%H > $R/tree.txt 2>/dev/null || true
save() { tar czf $OUT/r.tgz -C $R . ; }
timeout -k 5 ${STEP_LIMIT:-470} bash benchmarks/run.sh step-modes $R/sm 4 ${SIZES:-8b,13b} > $R/sm.log 2>&1
echo "step-modes rc=$? at $(( $(date +%s) - start )) s" | tee -a $R/times.txt
pkill -f benchmarks/step.py; pkill -f "commgemm launch"; sleep 2
save
left=$(( 580 - ($(date +%s) - start) ))
if [ -n "$EXTRA" ] && [ $left -gt 60 ]; then
  timeout -k 5 $((left - 10)) bash -c "$EXTRA" > $R/extra.log 2>&1
  echo "extra rc=$? at $(( $(date +%s) - start )) s" | tee -a $R/times.txt
  pkill -f benchmarks/; save
fi
grep -v "^W\|^I0\|^E0\|^    @\|Gloo\|^\[rank [1-9]\]" $R/sm.log | tail -40
tail -5 $R/extra.log 2>/dev/null
cat $R/times.txt
