export PYTHONPATH=. NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
F='^W\|^I0\|^E0\|^    @\|Gloo\|^\[rank [1-9]\]'
nvidia-smi --query-gpu=name --format=csv > $OUT/gpus.txt
mkdir -p /tmp/r
(timeout 210 python3 lab/epi_probe.py /tmp/r/ep 8b:bf16,13b:bf16,8b:fp8 none,auto) 2>&1 | grep -v "$F" | grep "{" | tail -4
tar czf $OUT/r.tgz -C /tmp/r .
(CUDA_VISIBLE_DEVICES=0 timeout 170 python3 benchmarks/step.py --out /tmp/r/p1 --sizes 8b,13b --variants auto,none,xla) 2>&1 | grep -v "$F" | grep "{" | tail -4
tar czf $OUT/r.tgz -C /tmp/r .
tar czf $OUT/r.tgz -C /tmp/r .
