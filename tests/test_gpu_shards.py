"""COMMGEMM_GPU_SHARD splits the GPU tests among device calls: n shards cover every test once."""

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).parent.parent

#: Collects one GPU test file under each COMMGEMM_GPU_SHARD of argv[2:] ("-": unset) in one
#: process (pytest once per shard) and prints {shard: [exit code, test ids]} as JSON.
_COLLECT = """
import json, os, sys
import pytest

class Ids:
    def pytest_collection_finish(self, session):
        self.ids = [item.nodeid for item in session.items]

found = {}
for shard in sys.argv[2:]:
    os.environ.pop("COMMGEMM_GPU_SHARD", None)
    if shard != "-":
        os.environ["COMMGEMM_GPU_SHARD"] = shard
    ids = Ids()
    code = pytest.main(["-q", "--co", "-p", "no:cacheprovider", "-n", "0", sys.argv[1]],
                       plugins=[ids])
    found[shard] = [int(code), getattr(ids, "ids", [])]
print("FOUND" + json.dumps(found))
"""


def test_shards_cover_every_gpu_test_once():
    env = os.environ | {"JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", _COLLECT, str(ROOT / "tests" / "gpu" / "test_fp8_gpu.py"),
         "-", "0/2", "1/2", "2/2"],
        env=env, capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    (line,) = [ln for ln in done.stdout.splitlines() if ln.startswith("FOUND")]
    found = json.loads(line.removeprefix("FOUND"))
    (code, whole), parts = found["-"], [found[f"{i}/2"][1] for i in range(2)]
    assert code == 0 and len(whole) > 2 and sorted(parts[0] + parts[1]) == sorted(whole)
    assert abs(len(parts[0]) - len(parts[1])) <= 1  # every other test
    assert found["2/2"][0] != 0 and "0 <= i < n" in done.stdout + done.stderr
