#!/usr/bin/env bash
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
start=$(date +%s); R=/tmp/r; mkdir -p $R
f() { grep -v "^W\|^I0\|^E1\|^    @\|Gloo\|^  warnings\|Source Location\|cuda_status.cc\|^$" ; }
save() { tar czf $OUT/r.tgz -C $R . ; }
one() { # name limit env...
  name=$1 lim=$2; shift 2
  env "$@" timeout -k 5 $lim python3 lab/dgrad_probe.py $R/$name.json > $R/$name.log 2>&1
  echo "$name rc=$? $(( $(date +%s) - start ))" >> $R/times.txt; save
  echo "== $name"; f < $R/$name.log | tail -6 | cut -c1-600
}
one fast4 130 SIZES=13b BASE=auto-fast-dgrad NOPROMO=1
one promo4 130 SIZES=13b BASE=
one fast2 110 CUDA_VISIBLE_DEVICES=0,1 SIZES=13b BASE=auto-fast-dgrad NOPROMO=1
one promo2 110 CUDA_VISIBLE_DEVICES=0,1 SIZES=13b BASE=
cat $R/times.txt
