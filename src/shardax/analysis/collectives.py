"""Audit the communication of a compiled XLA program.

Give :func:`find_collectives` the text of a compiled program::

    hlo_text = jax.jit(step).lower(*args).compile().as_text()
    for op in find_collectives(hlo_text):
        print(op.kind, op.shapes, op.bytes, op.replica_groups)

Every collective is listed once with the bytes of its result on one device. Asynchronous
pairs (``all-reduce-start`` / ``all-reduce-done`` and the like, as GPU programs show them)
count once, with the shape of the ``-done`` result. Collectives inside loop bodies are
listed once each, however many times the loop runs. XLA:TPU can spread one collective over a
chain of fusions that overlap it with compute (its ``AsyncCollectiveStart`` ... ``Done``
custom calls); each fusion of the chain holds a copy of the collective with the same
``channel_id`` and ``chain_id``, and the chain is listed once.

On the CPU backend the SPMD partitioner writes a reduce-scatter as an all-reduce of the
full tensor whose only uses are dynamic-slices down to the local shard. Such an all-reduce
is reported with kind ``"reduce-scatter (all-reduce + dynamic-slice)"``: ``bytes`` is the
full all-reduce result and ``shard_bytes`` what the slices keep. A tuple all-reduce whose
elements are partly sliced and partly used whole is listed twice under its name: once with
this kind for the sliced elements, once as an all-reduce for the rest.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from dataclasses import dataclass

from shardax.analysis.hlo import (
    Computation,
    Instruction,
    array_bytes,
    array_shapes,
    called_computation,
    executions,
    fused_computation_names,
    parse_module,
    shape_bytes,
    split_top_level,
)

REDUCE_SCATTER_PATTERN = "reduce-scatter (all-reduce + dynamic-slice)"


_COLLECTIVE_KINDS = frozenset(
    {
        "all-reduce",
        "all-gather",
        "reduce-scatter",
        "all-to-all",
        "ragged-all-to-all",
        "collective-permute",
        "collective-broadcast",
    }
)


# Ops that hand a value on unchanged in size, so a dynamic-slice after them still slices it.
_SIZE_PRESERVING_OPS = frozenset({"bitcast", "copy", "reshape", "transpose"})


@dataclass(frozen=True)
class Collective:
    """One collective operation of a compiled program, as seen by one device.

    ``kind`` is the HLO op (``"all-reduce"``, ``"all-gather"``, ``"reduce-scatter"``,
    ``"all-to-all"``, ``"collective-permute"``, ...) or :data:`REDUCE_SCATTER_PATTERN`;
    ``name`` the instruction name; ``shapes`` the result's array shapes without layouts
    (several when XLA combined ops into a tuple); ``bytes`` their total size;
    ``replica_groups`` the device-group attribute as written (``''`` if absent);
    ``shard_bytes`` the bytes the dynamic-slices keep for the reduce-scatter pattern,
    otherwise equal to ``bytes``; ``executions`` how many times it runs per step (the trip
    counts of the loops around it, e.g. once per layer inside a scan).
    """

    kind: str
    name: str
    shapes: tuple[str, ...]
    bytes: int
    replica_groups: str
    shard_bytes: int
    executions: int = 1
    operand_bytes: int = 0  # bytes of its inputs (0 when they could not be found)


def _bytes_kept_by_use(
    computations: dict[str, Computation],
    computation: Computation,
    user: Instruction,
    operand_index: int,
    seen: frozenset[tuple[str, str]],
) -> int | None:
    """Bytes one use keeps if that use ends in dynamic-slices of the value, else None."""
    if user.opcode == "dynamic-slice":
        return shape_bytes(user.shape) if operand_index == 0 else None
    if user.opcode in _SIZE_PRESERVING_OPS or user.opcode == "get-tuple-element":
        return _sliced_bytes(computations, computation, user.name, seen)
    if user.opcode == "fusion":
        fused = computations.get(called_computation(user))
        parameter = fused.parameters.get(operand_index) if fused else None
        return _sliced_bytes(computations, fused, parameter, seen) if parameter else None
    return None


def _sliced_bytes(
    computations: dict[str, Computation],
    computation: Computation,
    value: str,
    seen: frozenset[tuple[str, str]] = frozenset(),
) -> int | None:
    """Bytes kept when every use of ``value`` ends in a dynamic-slice of it; None otherwise.

    Several uses of one value keep the largest slice among them (two fusions slicing the
    same shard do not double it); uses of different tuple elements add up.
    """
    key = (computation.name, value)
    uses = computation.users.get(value, [])
    if key in seen or value == computation.root or not uses:
        return None
    kept_by_element: dict[str, int] = {}
    for user, operand_index in uses:
        kept = _bytes_kept_by_use(computations, computation, user, operand_index, seen | {key})
        if kept is None:
            return None
        element = user.attributes.get("index", "") if user.opcode == "get-tuple-element" else ""
        kept_by_element[element] = max(kept_by_element.get(element, 0), kept)
    return sum(kept_by_element.values())


def _collective_kind(opcode: str) -> str | None:
    """The collective an opcode performs (``-start`` forms included, ``-done`` forms not)."""
    base = opcode.removesuffix("-start")
    return base if base in _COLLECTIVE_KINDS else None


def _async_result(computation: Computation, start: Instruction, kind: str) -> tuple[str, str]:
    """Result shape and value name of an async collective: its ``-done`` if found, else the start."""
    for user, _ in computation.users.get(start.name, []):
        if user.opcode == f"{kind}-done":
            return user.shape, user.name
    shape = start.shape.strip()
    if kind != "all-reduce" and shape.startswith("("):  # (operand, result[, contexts...])
        elements = split_top_level(shape[1:-1])
        shape = elements[1] if len(elements) > 1 else shape
    return shape, start.name


def _sliced_elements(computations: dict[str, Computation], computation: Computation, value: str,
                     shapes: list[str]) -> list[int | None]:
    """Per element of a tuple value: the bytes its uses keep when they all slice it, else None."""
    kept: list[int | None] = [None] * len(shapes)
    for user, _ in computation.users.get(value, []):
        if user.opcode != "get-tuple-element":
            return [None] * len(shapes)
        index = int(user.attributes.get("index", "-1"))
        if 0 <= index < len(shapes):
            kept[index] = _sliced_bytes(computations, computation, user.name)
    return kept


def _collectives_from(
    computations: dict[str, Computation], computation: Computation, instruction: Instruction
) -> list[Collective]:
    """Describe ``instruction`` as Collectives: none when it is not one, two when a tuple
    all-reduce hands some elements only to slices (a reduce-scatter) and others on whole."""
    kind = _collective_kind(instruction.opcode)
    if kind is None:
        return []
    shape, value = instruction.shape, instruction.name
    if instruction.opcode.endswith("-start"):
        shape, value = _async_result(computation, instruction, kind)
    attributes = instruction.attributes
    groups = attributes.get("replica_groups", attributes.get("source_target_pairs", ""))
    if "device_ids" in attributes:  # mesh['a'=4,'b'=2], device_ids=([2,4]T(1,0)) {'b'}
        groups = f"{groups}, device_ids={attributes['device_ids']}"
    shapes = {other.name: other.shape for other in computation.instructions}
    operands = sum(shape_bytes(shapes.get(name, "")) for name in instruction.operands)
    arrays = array_shapes(shape)
    total = shape_bytes(shape)
    if kind != "all-reduce":
        return [Collective(kind, instruction.name, tuple(arrays), total, groups, total,
                           operand_bytes=operands)]
    kept = _sliced_bytes(computations, computation, value)
    if kept is not None:
        return [Collective(REDUCE_SCATTER_PATTERN, instruction.name, tuple(arrays), total, groups, kept,
                           operand_bytes=operands)]
    by_element = _sliced_elements(computations, computation, value, arrays) if len(arrays) > 1 else [None]
    sliced = [i for i, element in enumerate(by_element) if element is not None]
    if not sliced:
        return [Collective(kind, instruction.name, tuple(arrays), total, groups, total,
                           operand_bytes=operands)]
    whole = [i for i in range(len(arrays)) if i not in sliced]
    scattered_bytes = sum(array_bytes(arrays[i]) for i in sliced)
    whole_bytes = total - scattered_bytes
    return [
        Collective(REDUCE_SCATTER_PATTERN, instruction.name, tuple(arrays[i] for i in sliced),
                   scattered_bytes, groups, sum(by_element[i] for i in sliced),
                   operand_bytes=scattered_bytes),
        Collective(kind, instruction.name, tuple(arrays[i] for i in whole), whole_bytes, groups, whole_bytes,
                   operand_bytes=whole_bytes),
    ]


def find_collectives(hlo_text: str) -> list[Collective]:
    """Every collective of a compiled HLO module, in program order.

    ``hlo_text`` is ``compiled.as_text()`` (``jax.jit(f).lower(*args).compile()``).
    Fused computations are read only where XLA:TPU fuses a collective (a ``kCustom`` fusion:
    its reduce-scatter is an all-reduce fused with the slice each device keeps), counted as
    often as the fusion runs. ``replica_groups`` holds the
    attribute as written; collective-permutes, which have none, show their
    ``source_target_pairs`` there instead.
    """
    computations = parse_module(hlo_text)
    fused = fused_computation_names(computations)
    custom = {called_computation(instruction) for computation in computations.values()
              for instruction in computation.instructions
              if instruction.opcode == "fusion" and instruction.attributes.get("kind") == "kCustom"}
    runs = executions(computations)
    found, chains = [], set()
    for computation in computations.values():
        if computation.name in fused and computation.name not in custom:
            continue
        for instruction in computation.instructions:
            chain = _chain(instruction)
            if chain is not None and chain in chains:
                continue  # another fusion's copy of a collective already counted
            described = _collectives_from(computations, computation, instruction)
            if described and chain is not None:
                chains.add(chain)
            found.extend(dataclasses.replace(collective, executions=runs[computation.name])
                         for collective in described)
    return found


_CHAIN_ID = re.compile(r'chain_id="(\d+)"')


def _chain(instruction: Instruction) -> tuple[str, str] | None:
    """``(channel_id, chain_id)`` of a collective that XLA:TPU spread over a chain of fusions."""
    chain = _CHAIN_ID.search(instruction.attributes.get("frontend_attributes", ""))
    return (instruction.attributes.get("channel_id", ""), chain.group(1)) if chain else None


def summarize(collectives: Iterable[Collective]) -> dict[str, dict[str, int]]:
    """Per kind, what one step executes: ``{kind: {"count": n, "bytes": total}}``.

    Collectives inside loops count once per iteration.
    """
    summary: dict[str, dict[str, int]] = {}
    for collective in collectives:
        entry = summary.setdefault(collective.kind, {"count": 0, "bytes": 0})
        entry["count"] += collective.executions
        entry["bytes"] += collective.bytes * collective.executions
    return summary
