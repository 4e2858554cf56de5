"""COMMGEMM_GPU_SHARD splits the GPU tests among device calls: n shards cover every test once."""

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).parent.parent


def _collect(shard: str | None) -> tuple[int, list[str], str]:
    """(exit code, the test ids collected, the output) of collecting one GPU test file."""
    env = os.environ | {"JAX_PLATFORMS": "cpu"}
    env.pop("COMMGEMM_GPU_SHARD", None)
    if shard is not None:
        env["COMMGEMM_GPU_SHARD"] = shard
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "--co", "-p", "no:cacheprovider", "-n", "0",
         str(ROOT / "tests" / "gpu" / "test_fp8_gpu.py")],
        env=env, capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    ids = [ln for ln in done.stdout.splitlines() if "::" in ln]
    return done.returncode, ids, done.stdout + done.stderr


def test_shards_cover_every_gpu_test_once():
    _, whole, _ = _collect(None)
    parts = [_collect(f"{i}/2")[1] for i in range(2)]
    assert len(whole) > 2 and sorted(parts[0] + parts[1]) == sorted(whole)
    assert abs(len(parts[0]) - len(parts[1])) <= 1  # every other test
    code, _, out = _collect("2/2")
    assert code != 0 and "0 <= i < n" in out
