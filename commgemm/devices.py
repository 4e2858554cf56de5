"""Choosing devices for the CLI: all accelerators, or 8 virtual CPU devices when there are none."""

from __future__ import annotations

import os

VIRTUAL_CPU_DEVICES = 8


def setup_devices(cpu_devices: int = VIRTUAL_CPU_DEVICES) -> None:
    """Before jax starts: ask for `cpu_devices` virtual CPU devices (used only when no
    accelerator is found; an accelerator backend ignores it). Respects a count already set in
    XLA_FLAGS."""
    import jax

    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        try:
            jax.config.update("jax_num_cpu_devices", cpu_devices)
        except RuntimeError:  # the backend has already started: keep what it has
            pass


def environment() -> dict[str, object]:
    """Devices, backend, versions and XLA flags in effect (for `commgemm info` and JSON)."""
    import jax
    import jaxlib
    import numpy as np

    from commgemm.mosaic_gpu.peers import nccl_version, version_text

    devices = jax.devices()
    nccl = nccl_version()
    return {
        "backend": jax.default_backend(),
        "device_count": len(devices),
        "process_count": jax.process_count(),
        "process_index": jax.process_index(),
        "device_kind": devices[0].device_kind,
        "devices": [str(d) for d in devices],
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "numpy": np.__version__,
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
        "NCCL": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")},
        "nccl_library": version_text(nccl) if nccl else None,  # the one this process calls
    }
