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

GPUs the same way, with JAX's CUDA plugin (``pip install "shardax[gpu-plan]"``: the plugin
alone, no CUDA libraries, no GPU) and a description of the GPU for XLA:GPU's compiler (a
``GpuTargetConfigProto``): ``h100-8`` is one host of 8 H100 SXM GPUs, ``h100-16`` two. H100
SXM: 989e12 dense bf16 FLOP/s, 80 GB of HBM3 at 3.35e12 B/s, NVLink 4 at 900 GB/s both ways
together, so 450e9 B/s sent per GPU (NVIDIA's H100 datasheet); XLA:GPU's cost analysis is not
available without a GPU, so FLOPs are the model's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import re
from collections.abc import Iterator
from typing import Any

from shardax.analysis import heap
from shardax.errors import UsageError

INSTALL_HINT = 'pip install "shardax[tpu-plan]"'
GPU_INSTALL_HINT = 'pip install "shardax[gpu-plan]"'


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
    platform: str = "tpu"
    sent_bandwidth: float | None = None  # bytes/s one device sends in a collective (default: two ICI links)
    network: str = "ICI"
    # Temporaries XLA:TPU places in the chip's own memory rather than HBM, when a step has that
    # many: memory space 1 of its buffer assignment (3 on v4), read from compiles of `small` at 32
    # rows a chip (v5p 47-50 MB over nine steps, v5e 117 MB and 100 MiB at 4096 rows a chip, v6e
    # 100 MB, v4 134 MB).
    on_chip_bytes: int = 0


CHIPS: dict[str, Chip] = {
    "v4": Chip("TPU v4", 275e12, 32 * 2**30, 1.2e12, 4.5e10, 3, True, on_chip_bytes=134 * 10**6),
    "v5e": Chip("TPU v5e", 197e12, 16 * 10**9, 8.19e11, 4.5e10, 2, False, on_chip_bytes=117 * 10**6),
    "v5p": Chip("TPU v5p", 459e12, 95 * 10**9, 2.765e12, 9e10, 3, True, on_chip_bytes=48 * 10**6),
    "v6e": Chip("TPU v6e", 918e12, 32 * 10**9, 1.64e12, 9e10, 2, False, on_chip_bytes=100 * 10**6),
    "h100": Chip("NVIDIA H100 SXM", 989e12, 80 * 10**9, 3.35e12, 4.5e11, 0, False, "cuda", 4.5e11, "NVLink"),
}

GPUS_PER_HOST = 8

# What XLA:GPU's compiler needs to know of an H100 SXM to compile for one it cannot see
# (stream_executor.GpuTargetConfigProto, text form; figures from NVIDIA's H100 documentation).
H100_TARGET_CONFIG = """gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 shared_memory_per_block_optin: 232448 threads_per_core_limit: 2048
  core_count: 132 fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: 3350000000000 l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: 85520809984 cuda_compute_capability { major: 9 minor: 0 }
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 8 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""


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
        """The slice's devices as XLA sees them (no accelerator needed): what a mesh is laid over."""
        if self.chip.platform == "cuda":
            return list(_gpu_topology(self.topology).devices)
        return list(_topology(self.generation, self.topology).devices)

    @property
    def hosts(self) -> int:
        return len({device.process_index for device in self.devices()})

    def per_device(self) -> dict[str, float]:
        """The chip's peaks shared among the JAX devices on it (one per chip on every target here)."""
        share = self.chips / len(self.devices())
        return {"peak_flops": self.chip.peak_flops * share, "hbm_bytes": self.chip.hbm_bytes * share,
                "hbm_bandwidth": self.chip.hbm_bandwidth * share,
                # a ring along one mesh axis uses that axis's links both ways
                "ici_bandwidth": (self.chip.sent_bandwidth or 2 * self.chip.ici_link_bandwidth) * share}

    def describe(self) -> str:
        hosts = f"on {self.hosts} host{'s' if self.hosts > 1 else ''}"
        if self.chip.platform == "cuda":
            return f"{self.name}: {self.chips} {self.chip.name} GPUs {hosts}"
        return (f"{self.name}: {self.chips} {self.chip.name} chips ({self.topology}), {len(self.devices())} "
                f"devices {hosts}")


_GPU = re.compile(r"^(?:gpu-)?(?P<gen>h100)-(?P<count>\d+)$")
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
    """``tpu-v5p-8``, ``tpu-v5e-256`` or ``tpu-v6e:4x4``: a :class:`Target` (checked against the chip
    table)."""
    name = text.strip().lower()
    gpu = _GPU.match(name)
    if gpu:
        count = int(gpu["count"])
        if (count < 1 or (count > GPUS_PER_HOST and count % GPUS_PER_HOST)
                or (count < GPUS_PER_HOST and count & (count - 1))):
            raise UsageError(f"--target {text!r}: GPUs come 1, 2, 4 or 8 to a host, or in whole hosts of "
                             f"{GPUS_PER_HOST}; try h100-8 or h100-16")
        hosts, per_host = max(count // GPUS_PER_HOST, 1), min(count, GPUS_PER_HOST)
        return Target(text, CHIPS["h100"], "h100", f"h100:{hosts}x{per_host}")
    named, raw = _NAMED.match(name), _RAW.match(name)
    if raw:
        return Target(text, CHIPS[raw["gen"]], raw["gen"], f"{raw['gen']}:{raw['dims']}")
    if named:
        generation, count = named["gen"], int(named["count"])
        chips = count // 2 if CHIPS[generation].counts_cores else count
        smallest = 8 if CHIPS[generation].counts_cores else 4
        if count < smallest or count & (count - 1):
            raise UsageError(f"--target {text!r}: {generation} slices come in powers of two from "
                             f"{generation}-{smallest}; try tpu-{generation}-{smallest} or a topology such "
                             f"as tpu-{generation}:{topology_for(generation, 16).split(':')[1]}")
        return Target(text, CHIPS[generation], generation, topology_for(generation, chips))
    raise UsageError(f"--target {text!r} is not a TPU slice or GPU host; write it like tpu-v5p-8, "
                     f"tpu-v5e-16, tpu-v6e-64, tpu-v4-32 or h100-8 (chips: {', '.join(CHIPS)})")


def require_compiler(target: Target) -> None:
    """Refuse in one line when the compiler for the target's platform is not installed."""
    if target.chip.platform != "cuda":
        return require_tpu_compiler()
    if cuda_plugin() is None:
        raise UsageError(f"--target {target.name}: needs XLA:GPU's compiler (JAX's CUDA plugin), which is "
                         f"not installed; {GPU_INSTALL_HINT} installs it (no GPU or CUDA libraries needed)")


def cuda_plugin() -> str | None:
    """The installed JAX CUDA plugin (CUDA 12 or 13; JAX 0.11's GPU images carry 13), if any."""
    import importlib.util

    return next((name for name in ("jax_cuda12_plugin", "jax_cuda13_plugin")
                 if importlib.util.find_spec(name) is not None), None)


@functools.lru_cache(maxsize=None)
def _gpu_topology(topology: str) -> Any:
    hosts, per_host = topology.split(":")[1].split("x")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    from jax.experimental import topologies

    try:
        return topologies.get_topology_desc(topology_name="", platform="cuda",
                                            topology=f"1 x {hosts} x {per_host}",
                                            target_config=H100_TARGET_CONFIG)
    except NotImplementedError:
        # the plugin did not register: it found no CUDA, and JAX was not told CPU only
        raise UsageError("XLA:GPU's compiler did not start: on a host without CUDA, JAX's CUDA plugin loads "
                         "only when JAX runs on CPU; set JAX_PLATFORMS=cpu before JAX starts "
                         "(`shardax plan` does)") from None


def require_tpu_compiler() -> None:
    """Refuse in one line when libtpu, which compiles for TPUs on this host, is not installed."""
    try:
        import libtpu  # noqa: F401
    except ImportError:
        raise UsageError(f"--target needs XLA:TPU's compiler (libtpu), which is not installed; "
                         f"{INSTALL_HINT} installs it (no TPU needed)") from None


@contextlib.contextmanager
def _libtpu_environment(generation: str) -> Iterator[None]:
    """What libtpu needs to load on a host without TPUs (and the flags that make it write each
    program's buffer assignment, see :mod:`shardax.analysis.heap`), and the process environment
    put back as it was afterwards: libtpu writes warnings into ``TPU_WORKER_ID`` and the like when it
    finds no TPU host, which would make this process (and those it starts) look like a pod."""
    saved = dict(os.environ)
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # no TPU host metadata server to ask
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", f"{generation}-8")
    os.environ.setdefault("TPU_WORKER_ID", "0")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    # libtpu takes a lock file so that one process owns the host's TPUs; compiling owns none
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    if "xla_jf_dump_to" not in os.environ.get("LIBTPU_INIT_ARGS", ""):  # the heap each compile reserves
        os.environ["LIBTPU_INIT_ARGS"] = (f"{os.environ.get('LIBTPU_INIT_ARGS', '')} "
                                          f"{heap.libtpu_flags()}").strip()
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@functools.lru_cache(maxsize=None)
def _topology(generation: str, topology: str) -> Any:
    require_tpu_compiler()
    from jax.experimental import topologies

    # v4 as Cloud TPU runs it: one device per chip, both TensorCores together (libtpu's default
    # describes each core as a device, and JAX's meshes refuse that); v5p is described so already.
    chips = {"chip_config_name": "megacore"} if generation == "v4" else {}
    try:
        with _libtpu_environment(generation):
            return topologies.get_topology_desc(topology_name=topology, platform="tpu", **chips)
    except Exception as error:  # libtpu's own message says which shapes it takes
        raise UsageError(f"--target {topology!r}: XLA:TPU does not describe this slice "
                         f"({str(error).splitlines()[0]})"
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
    network: str = "ICI"

    @property
    def step_s(self) -> float:
        return max(self.compute_s, self.memory_s, self.network_s)

    @property
    def bound(self) -> str:
        times = {"compute": self.compute_s, "HBM": self.memory_s, self.network: self.network_s}
        return max(times, key=times.get)

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation at the roofline step time (an upper bound)."""
        return self.model_flops / (self.step_s * self.peak_flops) if self.step_s else 0.0


def roofline(target: Target, flops: float, hbm_bytes: float, wire_bytes: float,
             model_flops: float) -> Roofline:
    peaks = target.per_device()
    return Roofline(compute_s=flops / peaks["peak_flops"], memory_s=hbm_bytes / peaks["hbm_bandwidth"],
                    network_s=wire_bytes / peaks["ici_bandwidth"], model_flops=model_flops,
                    peak_flops=peaks["peak_flops"], network=target.chip.network)
