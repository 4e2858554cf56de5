"""The tune cache survives damage and concurrent writers, and never follows a planted link."""

import json
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
from helpers import P, assert_close, mesh1d, random, reference, shard

import commgemm as cg
from commgemm.autotune import cache
from commgemm.autotune.costmodel import MachineFigures
from commgemm.cli import main

KEY = cache.plan_key("cpu", 4, "ag", (64, 16, 32), "float32")
GOOD_PLAN = cache.PlanEntry(cg.OverlapConfig(method="ring_exchange"), 1.0, 1.1, "host", "")
GOOD_MACHINE = MachineFigures(1e10, 1e9, 1e-5, 0.25)


@pytest.fixture(autouse=True)
def _fresh_warnings():
    cache._warned.clear()
    cache._read_cached.cache_clear()
    yield


def _file(plans=None, machines=None, version=cache.VERSION) -> str:
    return json.dumps({"version": version, "plans": plans or {}, "machines": machines or {}})


DAMAGE = {
    "garbage bytes": (b"\xff\xfe\x00garbage", "not UTF-8"),
    "not json": (b"{plans: oops", "not JSON"),
    "empty": (b"", "empty"),
    "a list": (b"[1, 2]", "not a JSON object"),
    "old version": (json.dumps({"plans": {KEY: {"method": "ring:2"}}}).encode(), "version"),
    "plans not an object": (_file().replace('"plans": {}', '"plans": 3').encode(), "'plans'"),
    "unknown method": (
        _file({KEY: {"config": {"method": "teleport"}}}).encode(),
        "not a Method",
    ),
    "unknown kernel family": (
        _file({KEY: {"config": {"atomic_gemm": True, "kernel": {"family": "Warp"}}}}).encode(),
        "family",
    ),
    "unknown field": (_file({KEY: {"config": {"warp": 9}}}).encode(), "unknown config fields"),
    "bad fused tiles": (
        _file(
            {
                KEY: {
                    "config": {
                        "method": "pipeline",
                        "atomic_gemm": True,
                        "kernel": {"family": "DirectRSConfig", "stages": 0},
                    }
                }
            }
        ).encode(),
        "stages",
    ),
    "zero machine figures": (
        _file(machines={"cpu/P4": {"flops_per_s": 0, "bytes_per_s": 1e9, "latency_s": 0}}).encode(),
        "flops_per_s=0",
    ),
    "machine not an object": (_file(machines={"cpu/P4": 7}).encode(), "not an object"),
    "duplex_ring not a bool": (
        _file(
            machines={
                "cpu/P4": {
                    "flops_per_s": 1e12,
                    "bytes_per_s": 1e9,
                    "latency_s": 0,
                    "duplex_ring": "yes",
                }
            }
        ).encode(),
        "duplex_ring='yes'",
    ),
}


def _auto_op(rng):
    x, w = random(rng, (64, 16)), random(rng, (16, 32))
    f = shard(
        lambda a, b: cg.all_gather_matmul(a, b, "x", config=cg.OverlapConfig(method="auto")),
        mesh1d(4),
        (P("x", None), P(None, "x")),
        P(None, "x"),
    )
    assert_close(f(x, w), reference(x, w), np.float32, 16)


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_cache_warns_once_and_auto_still_runs(tmp_path, monkeypatch, rng, damage):
    content, problem = DAMAGE[damage]
    path = tmp_path / "tune.json"
    path.write_bytes(content)
    monkeypatch.setenv("COMMGEMM_TUNE_CACHE", str(path))
    with pytest.warns(cache.TuneCacheWarning, match=problem) as caught:
        found = cache.load()
        cache.load()
    assert len(caught) == 1 and str(path) in str(caught[0].message)
    assert KEY not in found.plans and "cpu/P4" not in found.machines
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", cache.TuneCacheWarning)
        _auto_op(rng)


def test_directory_at_the_path(tmp_path, monkeypatch, rng):
    monkeypatch.setenv("COMMGEMM_TUNE_CACHE", str(tmp_path))
    with pytest.warns(cache.TuneCacheWarning, match="is a directory"):
        assert cache.load().plans == {}
    with pytest.raises(IsADirectoryError):
        cache.store({KEY: GOOD_PLAN}, {})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", cache.TuneCacheWarning)
        _auto_op(rng)


def test_bad_entries_are_skipped_good_ones_kept(tmp_path):
    path = tmp_path / "tune.json"
    bad = {"config": {"method": "teleport"}}
    path.write_text(_file({KEY: GOOD_PLAN.as_json(), "other": bad}))
    with pytest.warns(cache.TuneCacheWarning, match="'other'"):
        found = cache.load(path)
    assert found.plans[KEY].config == GOOD_PLAN.config


def test_store_round_trip_and_merge(tmp_path):
    path = tmp_path / "sub" / "tune.json"
    cache.store({KEY: GOOD_PLAN}, {"cpu/P4": GOOD_MACHINE}, path)
    other = cache.plan_key("cpu", 2, "rs", (8, 8, 8), "float32")
    cache.store({other: GOOD_PLAN}, {}, path)
    found = cache.load(path)
    assert set(found.plans) == {KEY, other} and found.machines["cpu/P4"] == GOOD_MACHINE
    assert [p.name for p in path.parent.iterdir()] in (
        ["tune.json"],
        ["tune.json", "tune.json.lock"],
        ["tune.json.lock", "tune.json"],
    )


def test_store_replaces_a_planted_link_without_following_it(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    path = tmp_path / "tune.json"
    path.symlink_to(victim)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", cache.TuneCacheWarning)  # the victim is not a cache
        cache.store({KEY: GOOD_PLAN}, {}, path)
    assert victim.read_text() == "precious"
    assert not path.is_symlink() and KEY in cache.load(path).plans


def test_lock_link_is_refused(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    path = tmp_path / "tune.json"
    (tmp_path / "tune.json.lock").symlink_to(victim)
    with pytest.raises(OSError):
        cache.store({KEY: GOOD_PLAN}, {}, path)
    assert victim.read_text() == "precious" and not path.exists()


WRITER = """
import sys
from commgemm.autotune import cache
from commgemm.config import OverlapConfig
path, i = sys.argv[1], int(sys.argv[2])
for j in range(10):
    entry = cache.PlanEntry(OverlapConfig(method="pipeline", num_splits=2), 1.0, 1.0, "host", "")
    cache.store({f"key{i}-{j}": entry}, {}, __import__("pathlib").Path(path))
"""


def test_concurrent_writers_keep_every_entry(tmp_path):
    path = tmp_path / "tune.json"
    env = os.environ | {"JAX_PLATFORMS": "cpu"}
    procs = [
        subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(i)], env=env)
        for i in range(4)
    ]
    assert all(p.wait(timeout=120) == 0 for p in procs)
    assert set(cache.load(path).plans) == {f"key{i}-{j}" for i in range(4) for j in range(10)}


def test_cli_tune_keeps_its_measurements_when_the_write_fails(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("COMMGEMM_TUNE_CACHE", str(blocker / "tune.json"))  # parent is a file
    args = ["tune", "--op", "ag", "--shape", "256,32,64", "--dtype", "f32", "--iters", "2"]
    assert main(args + ["--methods", "none,ring"]) == 1
    out = capsys.readouterr()
    assert "could not write the tune cache" in out.err and '"config"' in out.err
    assert "none" in out.out and "ring" in out.out  # the table was printed
