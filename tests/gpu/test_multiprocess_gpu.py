"""One process per GPU on the GPUs (`commgemm launch -n P --gpus-per-process 1`, the launch mode
of Transformer Engine and multi-host jobs): the demo's every op by every method that runs in
that mode, against a float64 reference."""

import io
import pathlib
import re
import sys

import jax
import pytest

from commgemm.launch import launch


@pytest.mark.parametrize("processes", [2, 4])
def test_demo_with_one_process_per_gpu(processes):
    """Every launched process joins the run on its own GPU and every op the demo runs is
    correct; the run ends with exit code 0."""
    if jax.device_count() < processes:
        pytest.skip(f"needs {processes} GPUs, this machine has {jax.device_count()}")
    out = io.StringIO()
    code = launch(
        processes,
        [sys.executable, "-m", "commgemm", "demo", "--size", "256", "--iters", "1"],
        gpus_per_process=1,
        timeout_s=500,
        out=out,
    )
    text = out.getvalue()
    assert code == 0, text[-4000:]
    assert f"in {processes} process(es)" in text, text[-4000:]
    found = re.search(r"(\d+) of (\d+) correct", text)
    assert found and found.group(1) == found.group(2) and int(found.group(2)) > 0, text[-4000:]


def _worker_cases(name: str) -> list[str]:
    """The `case` lines of tests/gpu/NAME run under `commgemm launch -n 2 --gpus-per-process 1`
    (the run must succeed); skips with the worker's reason where it refused (the NVLink kernels
    cannot run in this job: NCCL older than 2.29.2 or processes on several machines)."""
    worker = str(pathlib.Path(__file__).with_name(name))
    out = io.StringIO()
    code = launch(2, [sys.executable, worker], gpus_per_process=1, timeout_s=400, out=out)
    text = out.getvalue()
    assert code == 0, text[-4000:]
    refused = [ln for ln in text.splitlines() if "refused " in ln]
    if refused:
        assert "NCCL >= 2.29.2" in refused[0] or "one machine" in refused[0], refused[0]
        pytest.skip(refused[0].split("refused ", 1)[1])
    cases = [ln for ln in text.splitlines() if "case " in ln]
    assert cases, text[-4000:]
    return cases


def test_fused_kernels_with_one_process_per_gpu(two_gpus):
    """The fused kernels with one process per GPU (AG and RS, ring and direct, forward and the
    pipeline's dX and dW) against float32 references; where this job cannot run them (NCCL
    older than 2.29.2: `peers`), an explicit fused config must raise with that reason."""
    cases = _worker_cases("fused_mp_worker.py")
    assert len(cases) == 2 * 6, "\n".join(cases)
    assert all(" OK " in ln for ln in cases), "\n".join(cases)


def test_moe_block_with_one_process_per_gpu(two_gpus):
    """The MoE block with one process per GPU, its returns inside its GEMMs (and in bf16 its
    rows arriving inside them): the fused kernels traced and their losses and gradients bit for
    bit those of the block with the GEMMs and the exchanges apart (bf16 without a capacity, FP8
    with one); skipped with the reason
    where this job cannot run the NVLink kernels (NCCL older than 2.29.2: `peers`)."""
    cases = _worker_cases("moe_mp_worker.py")
    assert len(cases) == 2 * 2, "\n".join(cases)
    assert all(" OK True " in ln for ln in cases), "\n".join(cases)
    assert all("arrived=True" in ln for ln in cases if "bf16" in ln), "\n".join(cases)
