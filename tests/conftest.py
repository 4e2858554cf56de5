"""8 virtual CPU devices and float64 references, set before jax starts."""

import os
import zlib

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_enable_x64", True)  # float64 references and check_grads

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import commgemm as cg  # noqa: E402


@pytest.fixture
def rng(request) -> np.random.Generator:
    """Fresh random data per test, reproducible from the test's name."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(autouse=True)
def _clean_registry():
    yield
    cg.destroy_all_overlap_buffers()
