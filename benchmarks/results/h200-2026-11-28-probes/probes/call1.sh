export PYTHONPATH=. NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
F='^W\|^I0\|^E0\|^    @\|Gloo\|^\[rank [1-9]\]'
L=--xla_gpu_enable_latency_hiding_scheduler=true
nvidia-smi --query-gpu=name --format=csv > $OUT/gpus.txt
S=$OUT/sp
(timeout 130 python3 lab/sched_probe.py $S p1 none,xla,none+lhs,xla+lhs) 2>&1 | grep -v "$F" | tail -5
(XLA_FLAGS=$L timeout 100 python3 lab/sched_probe.py $S p1lhs none,xla) 2>&1 | grep -v "$F" | tail -5
(XLA_FLAGS=$L timeout 110 python3 -m commgemm launch -n 2 --gpus-per-process 1 -- python3 lab/sched_probe.py $S p2lhs none,xla) 2>&1 | grep -v "$F" | tail -5
(timeout 100 python3 -m commgemm launch -n 2 --gpus-per-process 1 -- python3 lab/sched_probe.py $S p2 none,xla) 2>&1 | grep -v "$F" | tail -5
(timeout 140 python3 lab/moe_probe.py $OUT/mp fine,mixtral bf16,fp8) 2>&1 | grep -v "$F" | tail -12
