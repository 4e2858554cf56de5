"""GPU-only tests: run with `JAX_PLATFORMS=cuda python -m pytest tests/gpu` on a GPU machine;
skipped anywhere else (the root conftest keeps the CPU suite on 8 virtual CPU devices).

Each test compiles its kernels (about 10 s apiece), so the whole set takes longer than one
device call: `COMMGEMM_GPU_SHARD=i/n` runs every n-th test from the i-th (0-based), so n calls
cover them all (`bash benchmarks/run.sh check OUT i/n`)."""

import os

import jax
import pytest


def _hopper() -> str | None:
    """Why these tests cannot run here, or None on a Hopper GPU with jax >= 0.11."""
    if jax.default_backend() != "gpu":
        return "needs a GPU backend (JAX_PLATFORMS=cuda)"
    capability = str(getattr(jax.devices()[0], "compute_capability", ""))
    if not capability.startswith("9"):
        return f"needs a Hopper GPU (compute capability 9.x), got {capability or 'unknown'}"
    return None


def shard_of(spec: str) -> tuple[int, int]:
    """`i/n` as (i, n), checked."""
    try:
        index, count = (int(v) for v in spec.split("/"))
    except ValueError:
        raise pytest.UsageError(f"COMMGEMM_GPU_SHARD={spec!r}: expected i/n, e.g. 0/3") from None
    if not 0 <= index < count:
        raise pytest.UsageError(f"COMMGEMM_GPU_SHARD={spec!r}: needs 0 <= i < n")
    return index, count


def pytest_collection_modifyitems(config, items):
    if spec := os.environ.get("COMMGEMM_GPU_SHARD"):
        index, count = shard_of(spec)
        gpu = [it for it in items if "tests/gpu" in str(it.fspath).replace("\\", "/")]
        left_out = {id(it) for i, it in enumerate(gpu) if i % count != index}
        config.hook.pytest_deselected(items=[it for it in items if id(it) in left_out])
        items[:] = [it for it in items if id(it) not in left_out]
    why = _hopper()
    if why is None:
        return
    for item in items:
        if "tests/gpu" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.skip(reason=why))


@pytest.fixture
def two_gpus():
    if jax.device_count() < 2:
        pytest.skip(f"needs 2 or more GPUs, this machine has {jax.device_count()}")
    if jax.__version_info__ < (0, 11):
        pytest.skip("the fused kernels need jax >= 0.11")
