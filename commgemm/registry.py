"""The overlap-buffer registry: plans created once and looked up by integer id, as the reference
system's CreateCommOverlapBuffer / DestroyCommOverlapBuffer expose them.

A buffer here is the validated plan (config, optional buffer shape / dtype and TP size).
The pure-JAX algorithms need no workspace of their own: XLA allocates it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading

import jax
import numpy as np

from commgemm.config import OverlapConfig


@dataclasses.dataclass(frozen=True)
class OverlapBuffer:
    """A registered plan. `buffer_shape` / `buffer_dtype` / `tp_size` are optional checks:
    when set, an op using this buffer verifies its operand against them."""

    id: int
    config: OverlapConfig
    buffer_shape: tuple[int, ...] | None = None
    buffer_dtype: str | None = None
    tp_size: int | None = None


_lock = threading.Lock()
_by_id: dict[int, OverlapBuffer] = {}
_by_key: dict[tuple, int] = {}


def _stable_id(key: tuple) -> int:
    """The same parameters give the same id in every process (no counter, no order)."""
    return int(hashlib.blake2b(repr(key).encode(), digest_size=6).hexdigest(), 16)


def create_overlap_buffer(
    config: OverlapConfig,
    *,
    buffer_shape: tuple[int, ...] | None = None,
    buffer_dtype: object | None = None,
    tp_size: int | None = None,
) -> int:
    """Registers `config` and returns its id. The id is a hash of the parameters, so the same
    parameters give the same id in every process and after a destroy; different parameters give
    different ids."""
    if not isinstance(config, OverlapConfig):
        raise TypeError(f"config must be an OverlapConfig, got {type(config).__name__}")
    shape = None if buffer_shape is None else tuple(int(d) for d in buffer_shape)
    if shape is not None and any(d < 1 for d in shape):
        raise ValueError(f"buffer_shape={shape} must have positive dimensions")
    dtype = None if buffer_dtype is None else np.dtype(buffer_dtype).name
    if tp_size is not None and int(tp_size) < 1:
        raise ValueError(f"tp_size={tp_size} must be >= 1")
    key = (config, shape, dtype, tp_size)
    buffer_id = _stable_id(key)
    with _lock:
        if key in _by_key:
            return _by_key[key]
        _by_id[buffer_id] = OverlapBuffer(buffer_id, config, shape, dtype, tp_size)
        _by_key[key] = buffer_id
        return buffer_id


def get_overlap_buffer(buffer_id: int) -> OverlapBuffer:
    """The buffer registered under `buffer_id`. Raises KeyError naming the id if unknown."""
    with _lock:
        try:
            return _by_id[buffer_id]
        except KeyError:
            raise KeyError(
                f"no overlap buffer with id {buffer_id!r}; live ids: {sorted(_by_id)}"
            ) from None


def destroy_overlap_buffer(buffer_id: int) -> None:
    """Removes one buffer. Raises KeyError naming the id if unknown."""
    with _lock:
        try:
            buf = _by_id.pop(buffer_id)
        except KeyError:
            raise KeyError(f"no overlap buffer with id {buffer_id!r} to destroy") from None
        _by_key.pop((buf.config, buf.buffer_shape, buf.buffer_dtype, buf.tp_size), None)


def destroy_all_overlap_buffers() -> None:
    """Removes every buffer."""
    with _lock:
        _by_id.clear()
        _by_key.clear()


def resolve(config: OverlapConfig | int | None) -> tuple[OverlapConfig, OverlapBuffer | None]:
    """An op's `config` argument (config, buffer id or None) as a config and its buffer, if any."""
    if config is None:
        return OverlapConfig(), None
    if isinstance(config, OverlapConfig):
        return config, None
    if isinstance(config, jax.Array | jax.core.Tracer):
        raise TypeError(
            "config must be a static OverlapConfig or buffer id, got a traced value: pass the "
            "buffer id as a Python int (a static argument of jit), not as an array"
        )
    if isinstance(config, int | np.integer) and not isinstance(config, bool):
        buf = get_overlap_buffer(int(config))
        return buf.config, buf
    raise TypeError(
        f"config must be an OverlapConfig, a buffer id (int) or None, got {type(config).__name__}"
    )
