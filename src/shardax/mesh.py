"""Device meshes: parse a shape, lay devices out topology-aware, describe the result.

A mesh shape can be written three ways, all meaning the same thing::

    {"data": 4, "model": 2}
    [("data", 4), ("model", 2)]
    "data=4,model=2"

One axis may be ``-1``: it takes whatever devices the others leave.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Union

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from shardax.errors import UsageError

logger = logging.getLogger(__name__)

MeshShape = Union[str, Mapping[str, int], Sequence[tuple[str, int]]]
AxisTypes = Union[Literal["auto", "explicit"], AxisType]

_AXIS_TYPES = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}


def describe_mesh(mesh: Mesh) -> str:
    """``"data=4,model=2"``: the mesh written the way ``--mesh`` takes it (used in every error)."""
    return ",".join(f"{name}={size}" for name, size in mesh.shape.items())


def _format_shape(axes: Sequence[tuple[str, int]]) -> str:
    return ",".join(f"{name}={size}" for name, size in axes)


def parse_mesh_shape(shape: MeshShape) -> list[tuple[str, int]]:
    """Normalise any accepted spelling of a mesh shape to ``[(name, size), ...]`` (``-1`` kept)."""
    if isinstance(shape, str):
        pairs = []
        for part in (p.strip() for p in shape.split(",")):
            name, sep, size = part.partition("=")
            if not sep or not size.strip().lstrip("-").isdigit():
                raise UsageError(
                    f"mesh shape {shape!r}: part {part!r} is not 'name=size'; "
                    "write it like 'data=4,model=2' (one axis may be -1)"
                )
            pairs.append((name.strip(), int(size)))
    elif isinstance(shape, Mapping):
        pairs = [(str(name), size) for name, size in shape.items()]
    elif isinstance(shape, Sequence) and all(
        isinstance(p, (tuple, list)) and len(p) == 2 for p in shape
    ):
        pairs = [(str(name), size) for name, size in shape]
    else:
        raise UsageError(
            f"mesh shape {shape!r} is not understood; give a dict {{'data': 4, 'model': 2}}, "
            "a list of (name, size) pairs, or a string 'data=4,model=2'"
        )
    return _validated(pairs, shape)


def _validated(pairs: list[tuple[str, Any]], given: Any) -> list[tuple[str, int]]:
    if not pairs:
        raise UsageError(f"mesh shape {given!r} has no axes; give at least one, e.g. 'data=-1'")
    names = [name for name, _ in pairs]
    if any(not name for name in names):
        raise UsageError(f"mesh shape {given!r} has an empty axis name; name every axis, e.g. 'data=4'")
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise UsageError(
            f"mesh shape {given!r} names axis {duplicates[0]!r} twice; each axis name must be unique"
        )
    for name, size in pairs:
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or (size < 1 and size != -1):
            raise UsageError(
                f"mesh shape {given!r}: axis {name!r} has size {size!r}; sizes are positive "
                "integers, or -1 for 'the remaining devices'"
            )
    if sum(size == -1 for _, size in pairs) > 1:
        raise UsageError(
            f"mesh shape {given!r} has more than one -1 axis; only one axis can fill the remaining devices"
        )
    return [(name, int(size)) for name, size in pairs]


def resolve_mesh_shape(shape: MeshShape, num_devices: int) -> list[tuple[str, int]]:
    """Fill a ``-1`` axis and check the product against ``num_devices``; returns concrete sizes.

    A product smaller than ``num_devices`` is allowed (the mesh uses the first devices, as
    ``jax.make_mesh`` does); a larger one, or a ``-1`` that cannot be filled evenly, is an error.
    """
    pairs = parse_mesh_shape(shape)
    fixed = math.prod(size for _, size in pairs if size != -1)
    if any(size == -1 for _, size in pairs):
        if num_devices % fixed:
            suggestion = [(n, s if s != -1 else 1) for n, s in pairs]
            raise UsageError(
                f"mesh shape {_format_shape(pairs)!r}: {num_devices} devices do not divide by "
                f"the other axes' product {fixed}, so the -1 axis cannot be filled; "
                f"use sizes whose product divides {num_devices}, e.g. "
                f"{_format_shape(_fit(suggestion, num_devices))!r}"
            )
        pairs = [(n, s if s != -1 else num_devices // fixed) for n, s in pairs]
    elif fixed > num_devices:
        raise UsageError(
            f"mesh shape {_format_shape(pairs)!r} needs {fixed} devices but only {num_devices} "
            f"are available; use a shape whose product is at most {num_devices}, e.g. "
            f"{_format_shape(_fit(pairs, num_devices))!r}"
        )
    return pairs


def _fit(pairs: list[tuple[str, int]], num_devices: int) -> list[tuple[str, int]]:
    """A shape with the same axis names whose product is exactly ``num_devices`` (for suggestions)."""
    sizes = [1] * len(pairs)
    remaining = num_devices
    for i, (_, wanted) in enumerate(pairs[1:], start=1):
        size = math.gcd(remaining, max(wanted, 1))
        sizes[i] = size
        remaining //= size
    sizes[0] = remaining
    return [(name, size) for (name, _), size in zip(pairs, sizes)]


def _axis_types(axis_types: AxisTypes, count: int) -> tuple[AxisType, ...]:
    if isinstance(axis_types, AxisType):
        return (axis_types,) * count
    if axis_types not in _AXIS_TYPES:
        raise UsageError(
            f"axis_types={axis_types!r} is not one of 'auto', 'explicit' "
            "(or a jax.sharding.AxisType)"
        )
    return (_AXIS_TYPES[axis_types],) * count


class DeviceMeshManager:
    """Builds device meshes with JAX's topology-aware device order.

    Args:
      devices: the devices to lay out; defaults to ``jax.devices()`` (all processes' devices).
      axis_types: ``"auto"`` (the compiler propagates shardings; the default) or
        ``"explicit"`` (shardings are part of array types, see JAX's explicit sharding).
    """

    def __init__(self, devices: Sequence[Any] | None = None, axis_types: AxisTypes = "auto") -> None:
        self.devices = list(devices) if devices is not None else None
        self.axis_types = axis_types

    def _devices(self) -> list[Any]:
        return self.devices if self.devices is not None else list(jax.devices())

    def create_device_mesh(self, shape: MeshShape, *, axis_types: AxisTypes | None = None) -> Mesh:
        """A mesh of the given shape, e.g. ``"data=4,model=2"`` or ``{"data": -1}``."""
        devices = self._devices()
        pairs = resolve_mesh_shape(shape, len(devices))
        names = tuple(name for name, _ in pairs)
        sizes = tuple(size for _, size in pairs)
        if math.prod(sizes) < len(devices):
            logger.info("mesh %s uses %d of %d devices", _format_shape(pairs), math.prod(sizes), len(devices))
        types = _axis_types(self.axis_types if axis_types is None else axis_types, len(names))
        return jax.make_mesh(sizes, names, axis_types=types, devices=devices)

    def create_data_parallel_mesh(self, num_devices: int | None = None, axis_name: str = "data") -> Mesh:
        """A 1-D mesh over ``num_devices`` devices (all by default) for data parallelism."""
        return self.create_device_mesh([(axis_name, -1 if num_devices is None else num_devices)])

    def create_model_parallel_mesh(self, num_devices: int | None = None, axis_name: str = "model") -> Mesh:
        """A 1-D mesh over ``num_devices`` devices (all by default) for model parallelism."""
        return self.create_device_mesh([(axis_name, -1 if num_devices is None else num_devices)])

    def create_hybrid_mesh(
        self,
        data_parallel: int,
        model_parallel: int,
        axis_names: tuple[str, str] = ("data", "model"),
    ) -> Mesh:
        """A 2-D ``data x model`` mesh; either size may be ``-1``."""
        return self.create_device_mesh([(axis_names[0], data_parallel), (axis_names[1], model_parallel)])

    def create_multi_slice_mesh(self, ici_shape: MeshShape, dcn_shape: MeshShape) -> Mesh:
        """A mesh whose axes span fast links inside a host/slice (ICI) times slow links between them (DCN).

        ``ici_shape`` is the layout within one granule (a slice, or a process on GPU/CPU),
        ``dcn_shape`` how many granules each axis spans; both name the same axes in the same
        order, and each mesh axis is ``ici * dcn`` long. Traffic on an axis whose DCN size is 1
        never leaves a host, so put ``model`` there and ``data`` across hosts.
        """
        devices = self._devices()
        dcn = parse_mesh_shape(dcn_shape)
        granules = len({_granule(d) for d in devices})
        dcn = resolve_mesh_shape(dcn, granules)
        ici = resolve_mesh_shape(ici_shape, len(devices) // max(granules, 1))
        if [n for n, _ in ici] != [n for n, _ in dcn]:
            raise UsageError(
                f"ici_shape {_format_shape(ici)!r} and dcn_shape {_format_shape(dcn)!r} must name the "
                "same axes in the same order"
            )
        grid = mesh_utils.create_hybrid_device_mesh(
            [s for _, s in ici],
            [s for _, s in dcn],
            devices,
            process_is_granule=devices[0].platform != "tpu",
        )
        names = tuple(n for n, _ in ici)
        types = _axis_types(self.axis_types, len(names))
        return Mesh(grid, names, axis_types=types)

    def get_mesh_info(self, mesh: Mesh) -> dict[str, Any]:
        """Axis names and sizes, devices, platform and process count of ``mesh``."""
        return get_mesh_info(mesh)


def _granule(device: Any) -> int:
    if device.platform == "tpu" and hasattr(device, "slice_index"):
        return device.slice_index
    return device.process_index


def get_mesh_info(mesh: Mesh) -> dict[str, Any]:
    """A plain dict describing ``mesh`` (what a log line or a report needs)."""
    devices = list(mesh.devices.flat)
    return {
        "axis_names": tuple(mesh.axis_names),
        "axis_sizes": dict(mesh.shape),
        "shape": describe_mesh(mesh),
        "num_devices": len(devices),
        "devices": [device.id for device in devices],
        "platform": devices[0].platform,
        "device_kind": devices[0].device_kind,
        "process_count": len({device.process_index for device in devices}),
        "axis_types": tuple(str(t).split(".")[-1].lower() for t in mesh.axis_types),
    }
