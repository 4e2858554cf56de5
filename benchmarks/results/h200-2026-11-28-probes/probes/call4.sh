export PYTHONPATH=. NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
F='^W\|^I0\|^E0\|^    @\|Gloo\|^\[rank [1-9]\]'
nvidia-smi --query-gpu=name --format=csv > $OUT/gpus.txt
(PYTHONPATH=lab/pre:. timeout 330 python3 lab/moe_probe.py $OUT/mp mixtral:fp8,mixtral:bf16,fine:bf16) 2>&1 | grep -v "$F" | grep "{\|rror" | tail -6
