#!/usr/bin/env bash
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
start=$(date +%s); R=/tmp/r; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv > $R/gpus.txt
f() { grep -v "^W\|^I0\|^E0\|^    @\|Gloo\|^\[rank [1-9]\]\|^  warnings" ; }
save() { tar czf $OUT/r.tgz -C $R . ; }
timeout -k 5 200 python3 lab/dgrad_probe.py $R/dgrad4.json > $R/dgrad4.log 2>&1; echo "dgrad4 rc=$? $(( $(date +%s) - start ))" >> $R/times.txt; save
CUDA_VISIBLE_DEVICES=0,1 timeout -k 5 170 python3 lab/dgrad_probe.py $R/dgrad2.json > $R/dgrad2.log 2>&1; echo "dgrad2 rc=$? $(( $(date +%s) - start ))" >> $R/times.txt; save
for proto in default Simple; do
  left=$(( 560 - ($(date +%s) - start) )); [ $left -lt 40 ] && break
  env $( [ $proto = Simple ] && echo NCCL_PROTO=Simple ) timeout -k 5 $((left < 80 ? left : 80)) python3 benchmarks/step.py --out $R/proto_$proto --sizes 8b --dtypes bf16 --variants xla,comm > $R/proto_$proto.log 2>&1
  echo "proto $proto rc=$? $(( $(date +%s) - start ))" >> $R/times.txt; save
done
f < $R/dgrad4.log | tail -4; f < $R/dgrad2.log | tail -4; grep '"ms"' $R/proto_*.log; cat $R/times.txt
