"""Benchmark results on disk: each row printed as it is measured, and every row so far written
with the device and jax version that produced them."""

from __future__ import annotations

import json
import pathlib

import jax


def record(path: pathlib.Path, rows: list[dict], row: dict | None = None, **fields) -> None:
    """Append `row` (if given) to `rows` and print it as one JSON line; write `rows` to `path` as
    JSON beside the device's kind, the jax version and `fields` (the run's own settings), so a
    run cut short keeps what it measured."""
    if row is not None:
        rows.append(row)
        print(json.dumps(row), flush=True)
    header = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, **fields}
    pathlib.Path(path).write_text(json.dumps({**header, "rows": rows}, indent=1))
