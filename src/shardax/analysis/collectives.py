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
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

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

_DTYPE_BITS = {
    "pred": 8, "s8": 8, "u8": 8, "bf16": 16, "f16": 16, "s16": 16, "u16": 16,
    "f32": 32, "s32": 32, "u32": 32, "f64": 64, "s64": 64, "u64": 64,
    "c64": 64, "c128": 128, "token": 0,
}  # fmt: skip

# Ops that hand a value on unchanged in size, so a dynamic-slice after them still slices it.
_SIZE_PRESERVING_OPS = frozenset({"bitcast", "copy", "reshape", "transpose"})

_OPENERS, _CLOSERS = "([{", ")]}"
_COMMENT = re.compile(r"/\*.*?\*/")
_COMPUTATION_HEADER = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[^\s(]+)\s*\(.*->.*\{\s*$")
_INSTRUCTION_START = re.compile(r"^\s*(?P<root>ROOT\s+)?%?(?P<name>[^\s=%]+)\s*=\s*")
_OPCODE = re.compile(r"\s*(?P<opcode>[a-z][\w\-]*)\(")
_ARRAY_SHAPE = re.compile(r"^(?P<dtype>[a-z][a-z0-9]*)\[(?P<dims>[^\]]*)\]")


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


@dataclass(frozen=True)
class _Instruction:
    name: str
    shape: str
    opcode: str
    operands: tuple[str, ...]
    attributes: dict[str, str]


@dataclass
class _Computation:
    name: str
    instructions: list[_Instruction] = field(default_factory=list)
    root: str = ""
    users: dict[str, list[tuple[_Instruction, int]]] = field(default_factory=dict)
    parameters: dict[int, str] = field(default_factory=dict)

    def add(self, instruction: _Instruction, is_root: bool) -> None:
        self.instructions.append(instruction)
        if is_root:
            self.root = instruction.name
        index = instruction.operands[0] if instruction.operands else ""
        if instruction.opcode == "parameter" and index.isdigit():
            self.parameters[int(index)] = instruction.name
        for index, operand in enumerate(instruction.operands):
            self.users.setdefault(operand, []).append((instruction, index))


def _balanced_end(text: str, start: int) -> int:
    """Index just past the bracket group opening at ``text[start]`` (double-quoted strings skipped)."""
    depth, position, in_string = 0, start, False
    while position < len(text):
        char = text[position]
        if in_string:
            if char == "\\":
                position += 1
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in _OPENERS:
            depth += 1
        elif char in _CLOSERS:
            depth -= 1
            if depth == 0:
                return position + 1
        position += 1
    return len(text)


def _split_top_level(text: str) -> list[str]:
    """Split on commas that sit outside every bracket and string."""
    parts, depth, current, in_string, escaped = [], 0, [], False, False
    for char in text:
        if escaped:
            escaped = False
        elif in_string:
            escaped, in_string = char == "\\", char != '"'
        elif char == '"':
            in_string = True
        elif char in _OPENERS:
            depth += 1
        elif char in _CLOSERS:
            depth -= 1
        elif char == "," and depth == 0:
            parts.append("".join(current).strip())
            current = []
            continue
        current.append(char)
    tail = "".join(current).strip()
    return parts + [tail] if tail else parts


def _parse_instruction(line: str) -> tuple[_Instruction, bool] | None:
    """Parse ``[ROOT] %name = shape opcode(operands), attr=value, ...``; None for other lines."""
    start = _INSTRUCTION_START.match(line)
    if start is None:
        return None
    position = start.end()
    if line[position : position + 1] == "(":
        shape_end = _balanced_end(line, position)
    else:
        shape_end = position
        while shape_end < len(line) and not line[shape_end].isspace():
            shape_end = _balanced_end(line, shape_end) if line[shape_end] in _OPENERS else shape_end + 1
    opcode = _OPCODE.match(line, shape_end)
    if opcode is None:
        return None
    operands_end = _balanced_end(line, opcode.end() - 1)
    operands = tuple(
        part.split()[-1].lstrip("%") for part in _split_top_level(line[opcode.end() : operands_end - 1])
    )
    attributes = {}
    for item in _split_top_level(line[operands_end:].lstrip(", ")):
        key, equals, value = item.partition("=")
        if equals:
            attributes[key.strip()] = value.strip()
    shape = line[position:shape_end]
    instruction = _Instruction(start["name"], shape, opcode["opcode"], operands, attributes)
    return instruction, start["root"] is not None


def _parse_module(hlo_text: str) -> dict[str, _Computation]:
    """Every computation of an HLO module by name; loose instructions go to one nameless computation."""
    computations: dict[str, _Computation] = {}
    current: _Computation | None = None
    for raw_line in hlo_text.splitlines():
        line = _COMMENT.sub("", raw_line).rstrip()
        header = _COMPUTATION_HEADER.match(line) if line and not line[0].isspace() else None
        if header is not None:
            current = computations.setdefault(header["name"], _Computation(header["name"]))
        elif line.strip() == "}":
            current = None
        elif (parsed := _parse_instruction(line)) is not None:
            if current is None:
                current = computations.setdefault("", _Computation(""))
            current.add(*parsed)
    return computations


def _called_computation(instruction: _Instruction) -> str:
    """The first computation named in ``calls=`` (``%`` and braces stripped); '' if none."""
    called = instruction.attributes.get("calls", "").strip("{}").split(",")[0]
    return called.strip().lstrip("%")


def _fused_computation_names(computations: dict[str, _Computation]) -> set[str]:
    """Computations that fusions call, plus any whose name says it is fused."""
    fused = {name for name in computations if name.startswith("fused_")}
    for computation in computations.values():
        fused.update(
            _called_computation(instruction)
            for instruction in computation.instructions
            if instruction.opcode == "fusion"
        )
    return fused


def _array_shapes(shape: str) -> list[str]:
    """Flatten a (possibly nested tuple) shape into its array shapes, layouts dropped."""
    shape = shape.strip()
    if shape.startswith("("):
        return [array for element in _split_top_level(shape[1:-1]) for array in _array_shapes(element)]
    array = _ARRAY_SHAPE.match(shape)
    return [array.group(0)] if array else []


def _array_bytes(array_shape: str) -> int:
    """Bytes of one array shape such as ``f32[512,1024]`` or ``bf16[]``."""
    array = _ARRAY_SHAPE.match(array_shape)
    if array is None:
        return 0
    dtype = array["dtype"]
    bits = _DTYPE_BITS.get(dtype)
    if bits is None:  # f8e4m3fn, s4, f4e2m1fn, ...: the width follows the type letter
        width = re.match(r"[a-z]+(\d+)", dtype)
        bits = int(width.group(1)) if width else 0
    dims = [dim.strip().lstrip("<=") for dim in array["dims"].split(",") if dim.strip()]
    elements = math.prod(int(dim) if dim.isdigit() else 0 for dim in dims)
    return math.ceil(elements * bits / 8)


def _shape_bytes(shape: str) -> int:
    """Bytes of a shape, summed over tuple elements."""
    return sum(_array_bytes(array) for array in _array_shapes(shape))


def _bytes_kept_by_use(
    computations: dict[str, _Computation],
    computation: _Computation,
    user: _Instruction,
    operand_index: int,
    seen: frozenset[tuple[str, str]],
) -> int | None:
    """Bytes one use keeps if that use ends in dynamic-slices of the value, else None."""
    if user.opcode == "dynamic-slice":
        return _shape_bytes(user.shape) if operand_index == 0 else None
    if user.opcode in _SIZE_PRESERVING_OPS or user.opcode == "get-tuple-element":
        return _sliced_bytes(computations, computation, user.name, seen)
    if user.opcode == "fusion":
        fused = computations.get(_called_computation(user))
        parameter = fused.parameters.get(operand_index) if fused else None
        return _sliced_bytes(computations, fused, parameter, seen) if parameter else None
    return None


def _sliced_bytes(
    computations: dict[str, _Computation],
    computation: _Computation,
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


def _async_result(computation: _Computation, start: _Instruction, kind: str) -> tuple[str, str]:
    """Result shape and value name of an async collective: its ``-done`` if found, else the start."""
    for user, _ in computation.users.get(start.name, []):
        if user.opcode == f"{kind}-done":
            return user.shape, user.name
    shape = start.shape.strip()
    if kind != "all-reduce" and shape.startswith("("):  # (operand, result[, contexts...])
        elements = _split_top_level(shape[1:-1])
        shape = elements[1] if len(elements) > 1 else shape
    return shape, start.name


def _sliced_elements(computations: dict[str, _Computation], computation: _Computation, value: str,
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
    computations: dict[str, _Computation], computation: _Computation, instruction: _Instruction
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
    operands = sum(_shape_bytes(shapes.get(name, "")) for name in instruction.operands)
    arrays = _array_shapes(shape)
    total = _shape_bytes(shape)
    if kind != "all-reduce":
        return [Collective(kind, instruction.name, tuple(arrays), total, groups, total, operand_bytes=operands)]
    kept = _sliced_bytes(computations, computation, value)
    if kept is not None:
        return [Collective(REDUCE_SCATTER_PATTERN, instruction.name, tuple(arrays), total, groups, kept,
                           operand_bytes=operands)]
    by_element = _sliced_elements(computations, computation, value, arrays) if len(arrays) > 1 else [None]
    sliced = [i for i, element in enumerate(by_element) if element is not None]
    if not sliced:
        return [Collective(kind, instruction.name, tuple(arrays), total, groups, total, operand_bytes=operands)]
    whole = [i for i in range(len(arrays)) if i not in sliced]
    scattered_bytes = sum(_array_bytes(arrays[i]) for i in sliced)
    whole_bytes = total - scattered_bytes
    return [
        Collective(REDUCE_SCATTER_PATTERN, instruction.name, tuple(arrays[i] for i in sliced), scattered_bytes,
                   groups, sum(by_element[i] for i in sliced), operand_bytes=scattered_bytes),
        Collective(kind, instruction.name, tuple(arrays[i] for i in whole), whole_bytes, groups, whole_bytes,
                   operand_bytes=whole_bytes),
    ]


_TRIP_COUNT = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')


def _trip_count(computations: dict[str, _Computation], loop: _Instruction) -> int:
    """A while loop's trip count: XLA's ``known_trip_count`` where it wrote one (CPU, GPU), else
    the bound of its condition ``counter < N`` (XLA:TPU's form; JAX's loops count up from 0)."""
    known = _TRIP_COUNT.search(loop.attributes.get("backend_config", ""))
    if known:
        return int(known.group(1))
    condition = computations.get(loop.attributes.get("condition", "").lstrip("%"))
    if condition is None:
        return 1
    by_name = {instruction.name: instruction for instruction in condition.instructions}
    root = by_name.get(condition.root)
    if root is None or root.opcode != "compare" or root.attributes.get("direction") != "LT" or len(root.operands) != 2:
        return 1
    bound = by_name.get(root.operands[1])
    if bound is None or bound.opcode != "constant" or not bound.operands or not bound.operands[0].isdigit():
        return 1
    return int(bound.operands[0])


def _executions(computations: dict[str, _Computation]) -> dict[str, int]:
    """Runs per program execution of each computation: while bodies times their known trip counts."""
    runs = {name: 1 for name in computations}
    for _ in range(len(computations)):  # nested loops settle within as many passes as computations
        changed = False
        for computation in computations.values():
            for instruction in computation.instructions:
                if instruction.opcode == "fusion":  # XLA:TPU fuses a reduce-scatter with its all-reduce
                    called, count = _called_computation(instruction), runs[computation.name]
                    if called in runs and runs[called] != count:
                        runs[called], changed = count, True
                if instruction.opcode != "while":
                    continue
                count = runs[computation.name] * _trip_count(computations, instruction)
                for role in ("body", "condition"):
                    called = instruction.attributes.get(role, "").lstrip("%")
                    if called in runs and runs[called] != count:
                        runs[called], changed = count, True
        if not changed:
            break
    return runs


def find_collectives(hlo_text: str) -> list[Collective]:
    """Every collective of a compiled HLO module, in program order.

    ``hlo_text`` is ``compiled.as_text()`` (``jax.jit(f).lower(*args).compile()``).
    Fused computations are read only where XLA:TPU fuses a collective (a ``kCustom`` fusion:
    its reduce-scatter is an all-reduce fused with the slice each device keeps), counted as
    often as the fusion runs. ``replica_groups`` holds the
    attribute as written; collective-permutes, which have none, show their
    ``source_target_pairs`` there instead.
    """
    computations = _parse_module(hlo_text)
    fused = _fused_computation_names(computations)
    custom = {_called_computation(instruction) for computation in computations.values()
              for instruction in computation.instructions
              if instruction.opcode == "fusion" and instruction.attributes.get("kind") == "kCustom"}
    runs = _executions(computations)
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


def _chain(instruction: _Instruction) -> tuple[str, str] | None:
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

