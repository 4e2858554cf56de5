export PYTHONPATH=. NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
F='^W\|^I0\|^E0\|^    @\|Gloo\|^\[rank [1-9]\]'
nvidia-smi --query-gpu=name --format=csv > $OUT/gpus.txt
(timeout 150 python3 -m commgemm launch -n 2 --gpus-per-process 1 -- python3 lab/sm_probe.py /tmp/r/sm p2) 2>&1 | grep -v "$F" | tail -25
(timeout 120 python3 lab/sm_probe.py /tmp/r/sm p1) 2>&1 | grep -v "$F" | tail -25
tar czf $OUT/r.tgz -C /tmp/r .
(timeout 200 python3 lab/moe_probe.py /tmp/r/mp fine bf16,fp8) 2>&1 | grep -v "$F" | grep "{" | tail -4
tar czf $OUT/r.tgz -C /tmp/r .
