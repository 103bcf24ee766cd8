"""JAX's set-up before it starts: simulated CPU devices and quiet logs."""

from __future__ import annotations

import logging
import os
import warnings

from shardax.cli import signals
from shardax.cli.errors import UsageError
from shardax.cpu_devices import simulate_cpu_devices


def configure_jax(devices: int, *, start: bool = False) -> None:
    """Before JAX starts: simulated CPU devices, quiet logs; with ``start``, JAX's backends started
    too. Signals wait for the end of it (``signals.deferred``): JAX's import and start load
    compiled extensions that an exception raised inside would crash."""
    with signals.deferred():
        import jax

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


def _one_line(message: Warning | str, category: type[Warning], filename: str, lineno: int,
              line: str | None = None) -> str:
    """A warning as the command line says it: one line, without the file it came from."""
    return f"warning: {message}\n"
