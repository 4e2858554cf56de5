"""8 virtual CPU devices, float64 references and unoptimized CPU code, set before jax
starts."""

import importlib.metadata
import os
import zlib

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if os.environ["JAX_PLATFORMS"] == "cpu" and "optimization_level" not in _flags:
    # The tests' programs are tiny: compiling them, not running them, takes the time. So no
    # LLVM optimization of the CPU code, and on jaxlib 0.10 its older, faster-compiling CPU
    # fusion emitters (jaxlib 0.11 has no such flag, and an unknown flag stops XLA).
    _flags += " --xla_backend_optimization_level=0"
    if tuple(map(int, importlib.metadata.version("jaxlib").split(".")[:2])) < (0, 11):
        _flags += " --xla_cpu_use_fusion_emitters=false"
    os.environ["XLA_FLAGS"] = _flags.strip()
    # LLVM's expensive passes off too (jax's switch for programs cheaper to run than to
    # optimize; in the environment, so the scripts and processes tests start get it): the
    # slowest tests about 7% faster
    os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

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
