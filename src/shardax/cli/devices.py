"""JAX's set-up before it starts: simulated CPU devices, the platforms it may start, quiet logs."""

from __future__ import annotations

import glob
import logging
import os
import warnings
from typing import Any

from shardax.cli import signals
from shardax.cli.errors import UsageError
from shardax.cpu_devices import simulate_cpu_devices


def configure_jax(devices: int, *, start: bool = False) -> None:
    """Before JAX starts: simulated CPU devices, no accelerator platform that is not there, quiet
    logs; with ``start``, JAX's backends started too. Signals wait for the end of it
    (``signals.deferred``): JAX's import and start load compiled extensions that an exception raised
    inside would crash."""
    with signals.deferred():
        import jax

        _only_cpu_without_accelerators(jax)

        if devices < 1:
            raise UsageError(f"--devices {devices} must be at least 1")
        try:
            simulate_cpu_devices(devices)
        except RuntimeError:  # JAX already started in this process (shardax used as a library)
            if jax.devices()[0].platform == "cpu" and jax.device_count() != devices:
                raise UsageError(f"--devices {devices}: JAX already started here with {jax.device_count()} "
                                 "devices") from None
        # orbax logs what it also raises; the CLI reports it
        logging.getLogger("absl").setLevel(logging.CRITICAL)
        warnings.formatwarning = _one_line
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        if start:
            jax.devices()


def _only_cpu_without_accelerators(jax: Any) -> None:
    """On a machine with neither a TPU chip nor a GPU, JAX starts its CPU backend only
    (``JAX_PLATFORMS=cpu``): it would otherwise start the TPU plugin that the tpu-plan extra installs
    (libtpu), which finds no chip and says so in lines on stderr, for every command. Platforms the
    user chose (``JAX_PLATFORMS``, ``JAX_FORCE_TPU_INIT``) are kept; ``shardax plan --target tpu-...``
    loads XLA:TPU's compiler by itself, without the TPU backend."""
    if os.environ.get("JAX_PLATFORMS") or "JAX_FORCE_TPU_INIT" in os.environ or jax.config.jax_platforms:
        return
    if not _accelerator_present():
        jax.config.update("jax_platforms", "cpu")


# the device files of TPU chips (accel: v2-v4; vfio: v5e and later), NVIDIA GPUs and AMD GPUs (ROCm)
_ACCELERATOR_FILES = ("/dev/accel*", "/dev/vfio/[0-9]*", "/dev/nvidia[0-9]*", "/dev/kfd")


def _accelerator_present() -> bool:
    """Whether this machine shows a TPU chip or a GPU: any of their device files (what JAX's own
    check reads too, in a private module of its own)."""
    return any(glob.glob(pattern) for pattern in _ACCELERATOR_FILES)


def _one_line(message: Warning | str, category: type[Warning], filename: str, lineno: int,
              line: str | None = None) -> str:
    """A warning as the command line says it: one line, without the file it came from."""
    return f"warning: {message}\n"
