"""Accelerator targets for ``shardax plan --target``: TPU slices compiled for on a CPU host.

With libtpu installed (``pip install "shardax[tpu-plan]"``), JAX describes a TPU slice that is not
there (``jax.experimental.topologies.get_topology_desc``) and XLA:TPU compiles for its devices
ahead of time: the compiled program's memory, cost analysis and collectives are the accelerator
compiler's own, with no TPU present.

A target is named as Cloud TPU names slices: ``tpu-v5p-8`` (v4 and v5p count TensorCores, two
per chip), ``tpu-v5e-16``, ``tpu-v6e-64`` (v5e and v6e count chips). A raw topology such as
``tpu-v5p:4x4x4`` is accepted too.

Each chip's figures are its published peaks, per chip:

==== ================== ============ ============== ===================== =============================
chip bf16 FLOP/s         HBM          HBM bandwidth  ICI, one way per link source
==== ================== ============ ============== ===================== =============================
v4   275e12             32 GiB       1.2e12 B/s     4.5e10 B/s (6 links)  cloud.google.com/tpu/docs/v4
v5e  197e12             16 GB        8.19e11 B/s    4.5e10 B/s (4 links)  cloud.google.com/tpu/docs/v5e
v5p  459e12             95 GB        2.765e12 B/s   9e10 B/s (6 links)    cloud.google.com/tpu/docs/v5p
v6e  918e12             32 GB        1.64e12 B/s    9e10 B/s (4 links)    cloud.google.com/tpu/docs/v6e
==== ================== ============ ============== ===================== =============================

(ICI per link: "How to Scale Your Model", jax-ml.github.io/scaling-book, part 2; the Cloud TPU
pages give 4800 Gbps per v5p chip, 1600 per v5e and 3584 per v6e in all links together.)
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
from typing import Any

from shardax.errors import UsageError

INSTALL_HINT = 'pip install "shardax[tpu-plan]"'


@dataclasses.dataclass(frozen=True)
class Chip:
    """Published peaks of one accelerator chip (see the module docstring for sources)."""

    name: str
    peak_flops: float  # dense bf16 FLOP/s
    hbm_bytes: int
    hbm_bandwidth: float  # bytes/s
    ici_link_bandwidth: float  # bytes/s one way, per link
    torus_dims: int  # 3: v4/v5p cubes; 2: v5e/v6e planes
    counts_cores: bool  # slice names count TensorCores (two per chip), not chips


CHIPS: dict[str, Chip] = {
    "v4": Chip("TPU v4", 275e12, 32 * 2**30, 1.2e12, 4.5e10, 3, True),
    "v5e": Chip("TPU v5e", 197e12, 16 * 10**9, 8.19e11, 4.5e10, 2, False),
    "v5p": Chip("TPU v5p", 459e12, 95 * 10**9, 2.765e12, 9e10, 3, True),
    "v6e": Chip("TPU v6e", 918e12, 32 * 10**9, 1.64e12, 9e10, 2, False),
}


@dataclasses.dataclass(frozen=True)
class Target:
    """A TPU slice: its chip, its topology (``"v5p:2x2x1"``) and the name it was asked by."""

    name: str
    chip: Chip
    generation: str
    topology: str

    @property
    def chips(self) -> int:
        return math.prod(int(size) for size in self.topology.split(":")[1].split("x"))

    def devices(self) -> list[Any]:
        """The slice's devices as XLA:TPU sees them (no TPU needed): what a mesh is laid over."""
        return list(_topology(self.generation, self.topology).devices)

    @property
    def hosts(self) -> int:
        return len({device.process_index for device in self.devices()})

    def per_device(self) -> dict[str, float]:
        """The chip's peaks shared among the JAX devices on it (v4 shows each TensorCore as a device)."""
        share = self.chips / len(self.devices())
        return {"peak_flops": self.chip.peak_flops * share, "hbm_bytes": self.chip.hbm_bytes * share,
                "hbm_bandwidth": self.chip.hbm_bandwidth * share,
                # a ring along one mesh axis uses that axis's links both ways
                "ici_bandwidth": 2 * self.chip.ici_link_bandwidth * share}

    def describe(self) -> str:
        return (f"{self.name}: {self.chips} {self.chip.name} chips ({self.topology}), {len(self.devices())} devices "
                f"on {self.hosts} host{'s' if self.hosts > 1 else ''}")


_NAMED = re.compile(r"^(?:tpu-)?(?P<gen>v4|v5e|v5p|v6e)-(?P<count>\d+)$")
_RAW = re.compile(r"^(?:tpu-)?(?P<gen>v4|v5e|v5p|v6e):(?P<dims>\d+(?:x\d+){1,2})$")


def topology_for(generation: str, chips: int) -> str:
    """The slice shape Cloud TPU gives ``chips`` chips: 2x2x1, 2x2x2, 2x2x4, 2x4x4, 4x4x4, ... for
    the cubes (v4, v5p); 2x2, 2x4, 4x4, 4x8, 8x8, ... for the planes (v5e, v6e)."""
    chip = CHIPS[generation]
    dims = [2, 2, 1] if chip.torus_dims == 3 else [1, 1]
    while math.prod(dims) < chips:
        smallest = min(dims)
        dims[max(i for i, size in enumerate(dims) if size == smallest)] *= 2
    return f"{generation}:{'x'.join(map(str, dims))}"


def parse_target(text: str) -> Target:
    """``tpu-v5p-8``, ``tpu-v5e-256`` or ``tpu-v6e:4x4``: a :class:`Target` (checked against the chip table)."""
    name = text.strip().lower()
    named, raw = _NAMED.match(name), _RAW.match(name)
    if raw:
        return Target(text, CHIPS[raw["gen"]], raw["gen"], f"{raw['gen']}:{raw['dims']}")
    if named:
        generation, count = named["gen"], int(named["count"])
        chips = count // 2 if CHIPS[generation].counts_cores else count
        smallest = 8 if CHIPS[generation].counts_cores else 4
        if count < smallest or count & (count - 1):
            raise UsageError(f"--target {text!r}: {generation} slices come in powers of two from {generation}-"
                             f"{smallest}; try tpu-{generation}-{smallest} or a topology such as tpu-{generation}:"
                             f"{topology_for(generation, 16).split(':')[1]}")
        return Target(text, CHIPS[generation], generation, topology_for(generation, chips))
    raise UsageError(f"--target {text!r} is not a TPU slice; write it like tpu-v5p-8, tpu-v5e-16, tpu-v6e-64 "
                     f"or tpu-v4-32 (chips: {', '.join(CHIPS)})")


def require_tpu_compiler() -> None:
    """Refuse in one line when libtpu, which compiles for TPUs on this host, is not installed."""
    try:
        import libtpu  # noqa: F401
    except ImportError:
        raise UsageError(f"--target needs XLA:TPU's compiler (libtpu), which is not installed; "
                         f"{INSTALL_HINT} installs it (no TPU needed)") from None


@functools.lru_cache(maxsize=None)
def _topology(generation: str, topology: str) -> Any:
    require_tpu_compiler()
    # libtpu looks for a TPU host's metadata when it loads; none is needed to compile
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", f"{generation}-8")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    # libtpu takes a lock file so that one process owns the host's TPUs; compiling owns none
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    try:
        return topologies.get_topology_desc(topology_name=topology, platform="tpu")
    except Exception as error:  # libtpu's own message says which shapes it takes
        raise UsageError(f"--target {topology!r}: XLA:TPU does not describe this slice ({str(error).splitlines()[0]})"
                         ) from None


@dataclasses.dataclass(frozen=True)
class Roofline:
    """A step's time bounded by the chip's peaks, per device: the slowest of compute, HBM traffic
    and ICI traffic, if each overlapped the others perfectly (a lower bound on the step time)."""

    compute_s: float
    memory_s: float
    network_s: float
    model_flops: float  # the model's useful FLOPs per device per step (6 N tokens + attention)
    peak_flops: float

    @property
    def step_s(self) -> float:
        return max(self.compute_s, self.memory_s, self.network_s)

    @property
    def bound(self) -> str:
        times = {"compute": self.compute_s, "HBM": self.memory_s, "ICI": self.network_s}
        return max(times, key=times.get)

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation at the roofline step time (an upper bound)."""
        return self.model_flops / (self.step_s * self.peak_flops) if self.step_s else 0.0


def roofline(target: Target, flops: float, hbm_bytes: float, wire_bytes: float, model_flops: float) -> Roofline:
    peaks = target.per_device()
    return Roofline(compute_s=flops / peaks["peak_flops"], memory_s=hbm_bytes / peaks["hbm_bandwidth"],
                    network_s=wire_bytes / peaks["ici_bandwidth"], model_flops=model_flops,
                    peak_flops=peaks["peak_flops"])
