"""JAX's set-up before it starts: simulated CPU devices and quiet logs."""

from __future__ import annotations

import logging
import os

from shardax.cli.errors import UsageError


def configure_jax(devices: int) -> None:
    """Before JAX starts: simulated CPU devices, quiet logs."""
    import jax

    if devices < 1:
        raise UsageError(f"--devices {devices} must be at least 1")
    try:
        jax.config.update("jax_num_cpu_devices", devices)
    except RuntimeError:  # JAX already started in this process (shardax used as a library)
        if jax.devices()[0].platform == "cpu" and jax.device_count() != devices:
            raise UsageError(f"--devices {devices}: JAX already started here with {jax.device_count()} devices") from None
    logging.getLogger("absl").setLevel(logging.CRITICAL)  # orbax logs what it also raises; the CLI reports it
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


