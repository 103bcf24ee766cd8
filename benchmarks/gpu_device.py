"""The device a GPU benchmark runs on, or one line saying why it will not run here."""

from __future__ import annotations

import jax


def first_device(allow_cpu: bool, needs: str, with_cpu: str) -> tuple[jax.Device, bool]:
    """(this machine's first device, whether it is a GPU). Without a GPU, and without
    ``--allow-cpu``, the script stops: what it ``needs``, what the machine has, and what
    ``--allow-cpu`` does instead (``with_cpu``)."""
    device = jax.devices()[0]
    on_gpu = device.platform == "gpu"
    if not on_gpu and not allow_cpu:
        raise SystemExit(f"{needs}; this machine's first device is {device.platform!r} (--allow-cpu "
                         f"{with_cpu})")
    return device, on_gpu
