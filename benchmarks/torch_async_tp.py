"""PyTorch async-TP reference column: torch.ops.symm_mem.fused_all_gather_matmul and
fused_matmul_reduce_scatter, one process per GPU (started by gpu_suite.py through
torch.distributed.run). Times with CUDA events, medians, bf16."""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist
from torch.distributed import _symmetric_memory as symm_mem

PRESETS = {
    "llama70b_mlp": (8192, 8192, 28672),
    "llama8b_mlp": (8192, 4096, 14336),
    "comm_heavy": (16384, 8192, 4096),
    "llama13b_mlp": (8192, 5120, 13824),
    "notebook": (2048, 2048, 1024),
}


def time_ms(fn, iters: int, calls: int = 8) -> float:
    """Median over `iters` samples of CUDA-event time per call, each sample `calls` calls back
    to back (steady state, as commgemm's device periods; until stage 17 one call a sample, which
    also counted the launch gap after the start event)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / calls)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--presets", default="llama70b_mlp,llama8b_mlp,comm_heavy")
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    group = dist.group.WORLD
    symm_mem.enable_symm_mem_for_group(group.group_name)
    rows = []
    for preset in args.presets.split(","):
        m, k, n = PRESETS[preset]
        dt = torch.bfloat16
        a = torch.randn(m // world, k, device="cuda", dtype=dt)
        b = torch.randn(k, n // world, device="cuda", dtype=dt)

        def ag(a=a, b=b):
            return torch.ops.symm_mem.fused_all_gather_matmul(a, [b], 0, group.group_name)

        try:
            t = time_ms(ag, args.iters)
            rows.append({"preset": preset, "op": "ag", "t_ms": t})
        except Exception as err:  # noqa: BLE001 - record why the column is empty
            rows.append({"preset": preset, "op": "ag", "error": repr(err)})
        a2 = torch.randn(m, k // world, device="cuda", dtype=dt)
        b2 = torch.randn(k // world, n, device="cuda", dtype=dt)

        def rs(a2=a2, b2=b2):
            return torch.ops.symm_mem.fused_matmul_reduce_scatter(
                a2, b2, "sum", 0, group.group_name
            )

        try:
            t = time_ms(rs, args.iters)
            rows.append({"preset": preset, "op": "rs", "t_ms": t})
        except Exception as err:  # noqa: BLE001
            rows.append({"preset": preset, "op": "rs", "error": repr(err)})
        if rank == 0:
            print(preset, rows[-2:], flush=True)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "torch": torch.__version__,
                    "world": world,
                    "rows": [r for r in rows if "t_ms" in r],
                    "all": rows,
                },
                f,
                indent=1,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
