"""GPU-only tests: run with `JAX_PLATFORMS=cuda python -m pytest tests/gpu` on a GPU machine;
skipped anywhere else (the root conftest keeps the CPU suite on 8 virtual CPU devices)."""

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


def pytest_collection_modifyitems(config, items):
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
