"""Real processes under jax.distributed on the CPU (gloo), started by `commgemm launch`."""

import io
import pathlib
import sys
import time

import pytest

from commgemm.launch import LaunchError, launch

WORKER = str(pathlib.Path(__file__).with_name("mp_worker.py"))


@pytest.mark.parametrize("processes,devices", [(2, 4), (4, 2)])
def test_every_collective_and_method_across_processes(processes, devices):
    """The demo checks every collective x method against a float64 reference and fails if any
    is off; here it runs as `processes` processes of `devices` CPU devices each."""
    out = io.StringIO()
    code = launch(
        processes,
        [sys.executable, "-m", "commgemm", "demo", "--size", "64", "--iters", "1"],
        cpu_devices=devices,
        timeout_s=300,
        out=out,
    )
    text = out.getvalue()
    assert code == 0, text
    assert f"on 8 x cpu (cpu) in {processes} process(es)" in text
    assert "24 of 24 correct" in text


def test_process_that_dies_fails_the_launch_quickly():
    script = (
        "import os, sys, time; r = int(os.environ['COMMGEMM_PROCESS_ID']); "
        "print('rank says hello', r, flush=True); sys.exit(3) if r == 1 else time.sleep(60)"
    )
    start = time.monotonic()
    with pytest.raises(LaunchError, match="rank 1 exited with code 3") as err:
        launch(2, [sys.executable, "-c", script], out=io.StringIO(), timeout_s=120)
    assert time.monotonic() - start < 20
    assert "rank says hello 1" in str(err.value)


def test_launch_timeout():
    start = time.monotonic()
    with pytest.raises(LaunchError, match="timed out after 2 s"):
        launch(
            2, [sys.executable, "-c", "import time; time.sleep(60)"], out=io.StringIO(), timeout_s=2
        )
    assert time.monotonic() - start < 15


def test_mismatched_configs_across_ranks_raise_clearly():
    out = io.StringIO()
    with pytest.raises(LaunchError, match="exited with code 7"):
        launch(2, [sys.executable, WORKER, "mismatch"], cpu_devices=2, out=out, timeout_s=120)
    text = out.getvalue()
    assert "processes disagree on collective GEMM" in text
    assert "num_splits=2" in text and "num_splits=4" in text


def test_buffer_ids_agree_across_processes():
    out = io.StringIO()
    assert launch(3, [sys.executable, WORKER, "ids"], cpu_devices=1, out=out, timeout_s=120) == 0
    ids = {line.split()[-1] for line in out.getvalue().splitlines() if "buffer id" in line}
    assert len(ids) == 1


def test_launch_rejects_bad_arguments():
    with pytest.raises(ValueError, match="n=0"):
        launch(0, ["true"])
    with pytest.raises(ValueError, match="no command"):
        launch(2, [])
