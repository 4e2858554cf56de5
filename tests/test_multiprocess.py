"""Real processes under jax.distributed on the CPU (gloo), started by `commgemm launch`."""

import io
import json
import pathlib
import signal
import subprocess
import sys
import time

import pytest
from helpers import cpu_env

from commgemm.cli import main
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


def test_launch_timeout_names_the_rank_that_hangs():
    script = (
        "import os, time; r = os.environ['COMMGEMM_PROCESS_ID']; "
        "print('rank', r, 'waiting', flush=True); time.sleep(60 if r == '1' else 0)"
    )
    start = time.monotonic()
    with pytest.raises(LaunchError, match=r"timed out after 3 s; rank\(s\) \[1\]") as err:
        launch(2, [sys.executable, "-c", script], out=io.StringIO(), timeout_s=3)
    assert time.monotonic() - start < 15
    assert err.value.returncode == 124 and "rank 1 waiting" in str(err.value)


def test_mismatched_configs_across_ranks_raise_clearly():
    out = io.StringIO()
    with pytest.raises(LaunchError, match="exited with code 7"):
        launch(2, [sys.executable, WORKER, "mismatch"], cpu_devices=2, out=out, timeout_s=120)
    text = out.getvalue()
    assert "processes disagree on collective GEMM" in text
    assert "num_splits=2" in text and "num_splits=4" in text


def test_every_process_learns_where_the_others_run():
    """`distributed.machines()`: one entry per process, by index, the same on every process
    and on a second call (cached); here all on this machine."""
    from commgemm import distributed

    out = io.StringIO()
    assert launch(3, [sys.executable, WORKER, "machines"], cpu_devices=1, out=out,
                  timeout_s=120) == 0  # fmt: skip
    lines = [ln.split("machines ", 1)[1] for ln in out.getvalue().splitlines() if "machines " in ln]
    assert sorted(ln.split()[0] for ln in lines) == ["0", "1", "2"], out.getvalue()
    here = distributed.this_machine()
    assert {ln.split(" ", 1)[1] for ln in lines} == {f"{here}|{here}|{here} True"}
    assert distributed.machines() == (here,)  # one process: its own


def test_buffer_ids_agree_across_processes():
    out = io.StringIO()
    assert launch(3, [sys.executable, WORKER, "ids"], cpu_devices=1, out=out, timeout_s=120) == 0
    ids = {line.split()[-1] for line in out.getvalue().splitlines() if "buffer id" in line}
    assert len(ids) == 1


def test_cli_exits_with_the_failing_ranks_code(capsys):
    script = "import os, sys; sys.exit(5 if os.environ['COMMGEMM_PROCESS_ID'] == '1' else 0)"
    assert main(["launch", "-n", "2", "--", sys.executable, "-c", script]) == 5
    assert "rank 1 exited with code 5" in capsys.readouterr().err


def test_failing_rank_is_reported_while_others_run(capsys):
    script = (
        "import os, sys, time; r = os.environ['COMMGEMM_PROCESS_ID']; "
        "sys.exit(2) if r == '0' else time.sleep(60)"
    )
    start = time.monotonic()
    with pytest.raises(LaunchError, match="rank 0 exited with code 2"):
        launch(2, [sys.executable, "-c", script], out=io.StringIO(), timeout_s=120)
    assert time.monotonic() - start < 20
    assert "rank 0 exited with code 2; stopping the others" in capsys.readouterr().err


def _alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped by its new parent, does not count)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_sigterm_reaches_every_rank_and_its_children(tmp_path):
    """SIGTERM to the launcher stops each rank's whole process group: the `bash -c` wrapper
    and the sleep it started."""
    pids = tmp_path / "pids"
    script = f"sleep 100 & echo $! >> {pids}; echo $$ >> {pids}; wait"
    cmd = [sys.executable, "-m", "commgemm", "launch", "-n", "2", "--", "bash", "-c", script]
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (not pids.exists() or len(pids.read_text().split()) < 4):
        time.sleep(0.1)
    started = [int(p) for p in pids.read_text().split()]
    assert len(started) == 4 and all(_alive(p) for p in started)
    launcher.send_signal(signal.SIGTERM)
    _, err = launcher.communicate(timeout=30)
    assert launcher.returncode == 128 + signal.SIGTERM, err
    assert "interrupted by SIGTERM" in err
    time.sleep(0.5)
    assert not any(_alive(p) for p in started)


def test_script_without_initialize_is_told(capsys):
    code = main(["launch", "-n", "2", "--", sys.executable, "-c", "print('hi')"])
    assert code == 1
    assert "never called commgemm.initialize()" in capsys.readouterr().err


def test_op_in_a_launched_process_without_initialize_raises():
    out = io.StringIO()
    with pytest.raises(LaunchError, match="exited with code 1"):
        launch(2, [sys.executable, WORKER, "uninitialized"], cpu_devices=2, out=out, timeout_s=120)
    assert "has not joined the run: call commgemm.initialize()" in out.getvalue()


def test_coordinator_listens_on_localhost_only():
    out = io.StringIO()
    assert launch(2, [sys.executable, WORKER, "listen"], cpu_devices=1, out=out, timeout_s=120) == 0
    assert "coordinator on 127.0.0.1" in out.getvalue()


def test_extra_trace_on_one_rank_does_not_break_the_plan_check():
    """Rank 0 lowers an extra function (to log its HLO, say) before the real call: the plan
    check still pairs the calls that run and nothing fails."""
    out = io.StringIO()
    assert launch(2, [sys.executable, WORKER, "extra"], cpu_devices=2, out=out, timeout_s=180) == 0
    assert out.getvalue().count("result ok") == 2


def test_tuner_ranks_agree_on_process_0s_winner(tmp_path, monkeypatch):
    """Each rank's timings favour another candidate; every rank takes process 0's."""
    monkeypatch.setenv("COMMGEMM_TUNE_CACHE", str(tmp_path / "tune.json"))
    out = io.StringIO()
    assert launch(2, [sys.executable, WORKER, "tune"], cpu_devices=2, out=out,
                  timeout_s=180) == 0, out.getvalue()  # fmt: skip
    winners = [line.split()[-1] for line in out.getvalue().splitlines() if "winner" in line]
    assert winners == ["NONE", "NONE"], out.getvalue()


def test_agreed_gives_every_rank_one_answer():
    """Each rank decides for itself (rank i holds name i and a common one); `agreed` gives
    every rank the same union (any) and intersection (every)."""
    out = io.StringIO()
    assert launch(2, [sys.executable, WORKER, "agreed"], cpu_devices=1, out=out,
                  timeout_s=180) == 0, out.getvalue()  # fmt: skip
    lines = out.getvalue().splitlines()
    answers = [line.split("agreed ")[1] for line in lines if "agreed " in line]
    assert answers == ["abe e", "abe e"], out.getvalue()


def test_two_hosts_of_four_devices_as_eight_processes():
    """The 2-host x 4-GPU layout (tensor parallel within a host, data parallel across) as 8
    CPU processes of one device each: AG, RS and AR by every XLA method, against numpy."""
    out = io.StringIO()
    code = launch(8, [sys.executable, WORKER, "hosts"], cpu_devices=1, out=out, timeout_s=300)
    assert code == 0 and out.getvalue().count("hosts ok") == 8, out.getvalue()


@pytest.mark.parametrize(
    "script,extra,variants",
    [("step.py", ["--sizes", "8b", "--variants", "auto,none,xla,local,xla-flags"],
      {"auto", "none", "xla"}),
     ("moe_step.py", ["--sizes", "fine"], {"auto", "none", "xla", "ragged-a2a"})],
)  # fmt: skip
def test_step_benchmarks_with_one_process_per_device_group(tmp_path, script, extra, variants):
    """benchmarks/step.py and moe_step.py under `commgemm launch -n 2` (4 CPU devices each):
    every variant's first loss agrees with XLA's (bf16, and FP8 where the script has it); only
    process 0 writes; the windowed-einsum child, which would run outside the run, is left out."""
    root = pathlib.Path(__file__).parent.parent
    out = io.StringIO()
    code = launch(
        2,
        [sys.executable, str(root / "benchmarks" / script), "--out", str(tmp_path), "--quick",
         *extra],
        cpu_devices=4, timeout_s=300, out=out,
    )  # fmt: skip
    assert code == 0, out.getvalue()[-3000:]
    result = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert result["processes"] == 2 and result["devices"] == 8
    assert [r["dtype"] for r in result["rows"]] == ["bf16", "fp8"]
    bf16 = result["rows"][0]
    assert bf16["loss_ok"] == dict.fromkeys(variants, True)
    assert "xla-flags" not in bf16
    assert all(result["rows"][1]["loss_ok"].values())


def test_launch_modes_benchmark_in_both_modes(tmp_path):
    """benchmarks/launch_modes.py in one process and under `commgemm launch -n 2`: each run
    records every problem's serial and AUTO rows with AUTO's plan and errors against serial
    within bf16's rounding of the result, and the table pairs the two runs row by row."""
    root = pathlib.Path(__file__).parent.parent
    script = [str(root / "benchmarks" / "launch_modes.py"), "--out", str(tmp_path),
              "--presets", "notebook", "--ops", "rs", "--iters", "2", "--periods", "0"]  # fmt: skip
    out = io.StringIO()
    assert launch(2, [sys.executable, *script], cpu_devices=4, timeout_s=300, out=out) == 0, (
        out.getvalue()[-3000:]
    )
    env = cpu_env(8)
    subprocess.run([sys.executable, *script], check=True, env=env, capture_output=True)
    for processes in (1, 2):
        data = json.loads((tmp_path / f"modes-8dev-{processes}proc.json").read_text())
        assert data["processes"] == processes and data["devices"] == 8
        (record,) = data["records"]
        assert (record["preset"], record["op"]) == ("notebook", "rs")
        assert record["auto_plan"] and not record["failures"]
        assert set(record["host_ms"]) == {"xla", "none", "auto"}
        # K = 2048, standard normal: |y| up to about 250, where bf16's step is 1; a ring's
        # partial sums, rounded to bf16 at each of its 7 hops, differ by a few such steps
        assert record["max_error"]["none"] == 0.0 and record["max_error"]["auto"] <= 8.0
    table = subprocess.run(
        [sys.executable, script[0], "--table", str(tmp_path)], check=True, capture_output=True,
        text=True,
    ).stdout  # fmt: skip
    (row,) = [line for line in table.splitlines() if "notebook" in line]
    assert row.startswith("| 8 | notebook | rs |")


def test_launch_rejects_bad_arguments():
    with pytest.raises(ValueError, match="n=0"):
        launch(0, ["true"])
    with pytest.raises(ValueError, match="no command"):
        launch(2, [])
    with pytest.raises(ValueError, match="timeout_s=0"):
        launch(1, ["true"], timeout_s=0)
    with pytest.raises(ValueError, match="cpu_devices=0"):
        launch(1, ["true"], cpu_devices=0)
