"""The tune cache: the measured winner per problem and the machine figures, as JSON on disk.

File: $COMMGEMM_TUNE_CACHE, else ~/.cache/commgemm/tune.json. One JSON object::

  {"version": 2,
   "plans": {"<device kind>/P<size>/<op>/<M>x<K>x<N>/<dtype>":
               {"config": {OverlapConfig fields}, "t_ms": ..., "vs_bound": ..., "timing": ...,
                "measured": ISO date}},
   "machines": {"<device kind>/P<size>": {MachineFigures fields}}}

Reading never breaks an op: a damaged file (not JSON, not an object, another version, a
directory at the path), an entry whose config does not validate, or machine figures that are not
positive and finite are skipped with one warning per file and problem, and AUTO falls back to
the cost model. Writing merges the new entries into what is on disk under a file lock (so
concurrent tuners keep each other's entries) and replaces the file atomically through a unique
temporary file in the same directory (`os.replace` never follows a link at the path).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import pathlib
import tempfile
import warnings
from collections.abc import Mapping

import numpy as np

from commgemm.autotune.costmodel import MachineFigures
from commgemm.config import Method, OverlapConfig, config_from_fields, config_to_fields

VERSION = 2
#: The config fields a cache entry stores: what AUTO chooses. The dtype fields, deterministic
#: and save_gathered_input stay the caller's.
CHOSEN_FIELDS = (
    "method",
    "num_splits",
    "bidirectional",
    "aggregate",
    "atomic_gemm",
    "chain_gemms",
    "kernel",
    "local_gemm",
)


class TuneCacheWarning(UserWarning):
    """The tune cache (or part of it) was unreadable and is ignored."""


@dataclasses.dataclass(frozen=True)
class PlanEntry:
    """A measured winner: the chosen config fields and what the tuner measured."""

    config: OverlapConfig
    t_ms: float
    vs_bound: float
    timing: str
    measured: str

    def as_json(self) -> dict:
        fields = config_to_fields(self.config)
        return {
            "config": {k: fields[k] for k in CHOSEN_FIELDS},
            "t_ms": self.t_ms,
            "vs_bound": self.vs_bound,
            "timing": self.timing,
            "measured": self.measured,
        }


@dataclasses.dataclass(frozen=True)
class TuneCache:
    plans: Mapping[str, PlanEntry]
    machines: Mapping[str, MachineFigures]


def cache_path() -> pathlib.Path:
    """$COMMGEMM_TUNE_CACHE, else ~/.cache/commgemm/tune.json."""
    env = os.environ.get("COMMGEMM_TUNE_CACHE")
    if env:
        return pathlib.Path(env)
    return pathlib.Path.home() / ".cache" / "commgemm" / "tune.json"


def plan_key(
    device_kind: str,
    size: int,
    op: str,
    shape: tuple[int, int, int],
    dtype: str,
    scaling: str | None = None,
) -> str:
    """The cache key of a problem; `scaling` (a ScalingMode's value) for quantized operands,
    whose winner is measured quantized and kept apart from the plain one's."""
    m, k, n = shape
    key = f"{device_kind}/P{size}/{op}/{m}x{k}x{n}/{np.dtype(dtype).name}"
    return key if scaling in (None, "no_scaling") else f"{key}/{scaling}"


def machine_key(device_kind: str, size: int) -> str:
    return f"{device_kind}/P{size}"


_warned: set[tuple[str, str]] = set()


def warn_entry(key: str, problem: str) -> None:
    """One warning for a cache entry that was read but cannot run the call it is keyed by."""
    _warn(cache_path(), f"plans entry {key!r}: {problem}; AUTO chooses without it")


def _warn(path: pathlib.Path | str, problem: str) -> None:
    if (str(path), problem) in _warned:
        return
    _warned.add((str(path), problem))
    warnings.warn(
        f"commgemm tune cache {path}: {problem}; ignored (AUTO uses the cost model there)",
        TuneCacheWarning,
        stacklevel=3,
    )


def _parse_plan(key: str, value: object) -> PlanEntry:
    if not isinstance(value, dict) or not isinstance(value.get("config"), dict):
        raise ValueError("not an object with a 'config' object")
    unknown = set(value["config"]) - set(CHOSEN_FIELDS)
    if unknown:
        raise ValueError(f"unknown config fields {sorted(unknown)}")
    config = config_from_fields(value["config"])
    if config.method in (Method.AUTO, Method.BULK):
        raise ValueError(f"method {config.method.name} is no winner a call can run")
    t_ms, vs_bound = float(value.get("t_ms", math.nan)), float(value.get("vs_bound", math.nan))
    return PlanEntry(
        config, t_ms, vs_bound, str(value.get("timing", "")), str(value.get("measured", ""))
    )


def _parse_machine(value: object) -> MachineFigures:
    if not isinstance(value, dict):
        raise ValueError("not an object")
    figures = MachineFigures(**value)  # TypeError on unknown or missing fields
    for field in ("flops_per_s", "bytes_per_s"):
        v = getattr(figures, field)
        if not (isinstance(v, int | float) and math.isfinite(v) and v > 0):
            raise ValueError(f"{field}={v!r} must be a positive finite number")
    for field in ("latency_s", "interference"):
        v = getattr(figures, field)
        if not (isinstance(v, int | float) and math.isfinite(v) and v >= 0):
            raise ValueError(f"{field}={v!r} must be a finite number >= 0")
    if not isinstance(figures.duplex_ring, bool):
        raise ValueError(f"duplex_ring={figures.duplex_ring!r} must be true or false")
    return figures


def _parse(path: pathlib.Path, text: str) -> tuple[TuneCache, dict]:
    """The valid part of a cache file's text, and the raw JSON of what was kept (for merging)."""
    empty = TuneCache({}, {}), {"plans": {}, "machines": {}}
    if not text.strip():
        _warn(path, "the file is empty")
        return empty
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        _warn(path, f"not JSON ({err.msg} at line {err.lineno})")
        return empty
    except RecursionError:
        _warn(path, "nested too deeply to read")
        return empty
    if not isinstance(data, dict):
        _warn(path, f"not a JSON object but {type(data).__name__}")
        return empty
    if data.get("version") != VERSION:
        _warn(
            path,
            f"version {data.get('version')!r}, this commgemm reads version {VERSION} "
            "(run `commgemm tune` again)",
        )
        return empty
    plans, machines, raw = {}, {}, {"plans": {}, "machines": {}}
    for section, parse, out in (
        ("plans", _parse_plan, plans),
        ("machines", lambda _, v: _parse_machine(v), machines),
    ):
        entries = data.get(section, {})
        if not isinstance(entries, dict):
            _warn(path, f"'{section}' is not an object")
            continue
        for key, value in entries.items():
            try:
                out[key] = parse(key, value)
            except (TypeError, ValueError, KeyError) as err:
                _warn(path, f"{section} entry {key!r}: {err}")
                continue
            raw[section][key] = value
    return TuneCache(plans, machines), raw


@functools.lru_cache(maxsize=8)
def _read_cached(path: str, stamp: tuple) -> tuple[TuneCache, dict]:
    del stamp  # part of the key only: a rewritten file is read again
    p = pathlib.Path(path)
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        _warn(p, "not UTF-8 text")
        return TuneCache({}, {}), {"plans": {}, "machines": {}}
    return _parse(p, text)


def _read(path: pathlib.Path) -> tuple[TuneCache, dict]:
    empty = TuneCache({}, {}), {"plans": {}, "machines": {}}
    try:
        st = path.stat()
    except FileNotFoundError:
        return empty
    except OSError as err:
        _warn(path, f"cannot be read ({err.strerror})")
        return empty
    if path.is_dir():
        _warn(path, "is a directory")
        return empty
    try:
        return _read_cached(str(path), (st.st_mtime_ns, st.st_size, st.st_ino))
    except OSError as err:
        _warn(path, f"cannot be read ({err.strerror})")
        return empty


def load(path: pathlib.Path | None = None) -> TuneCache:
    """The cache's valid entries ({} where there is no file, or nothing valid in it)."""
    return _read(path or cache_path())[0]


def store(
    plans: Mapping[str, PlanEntry],
    machines: Mapping[str, MachineFigures],
    path: pathlib.Path | None = None,
) -> pathlib.Path:
    """Merges `plans` and `machines` into the cache file (theirs replace entries of the same
    key) under a file lock, atomically. Raises OSError when the file cannot be written."""
    from filelock import FileLock

    path = path or cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_dir():
        raise IsADirectoryError(f"the tune cache path {path} is a directory")
    with FileLock(str(path) + ".lock", timeout=60):
        _, raw = _read(path)
        raw["plans"].update({k: v.as_json() for k, v in plans.items()})
        raw["machines"].update({k: dataclasses.asdict(v) for k, v in machines.items()})
        data = {"version": VERSION, **raw}
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)  # a reader sees the old file or the new one, never half
        except BaseException:
            pathlib.Path(tmp).unlink(missing_ok=True)
            raise
    return path
