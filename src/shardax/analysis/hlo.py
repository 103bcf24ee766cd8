"""A reader of compiled XLA programs' text (``compiled.as_text()``): computations, their
instructions and operands, array shapes and their bytes, and how often each computation runs
per step (while loops' trip counts, fusions). ``shardax.analysis.collectives`` reads the
collectives off it."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

_DTYPE_BITS = {
    "pred": 8, "s8": 8, "u8": 8, "bf16": 16, "f16": 16, "s16": 16, "u16": 16,
    "f32": 32, "s32": 32, "u32": 32, "f64": 64, "s64": 64, "u64": 64,
    "c64": 64, "c128": 128, "token": 0,
}  # fmt: skip


_OPENERS, _CLOSERS = "([{", ")]}"


_COMMENT = re.compile(r"/\*.*?\*/")


_COMPUTATION_HEADER = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[^\s(]+)\s*\(.*->.*\{\s*$")


_INSTRUCTION_START = re.compile(r"^\s*(?P<root>ROOT\s+)?%?(?P<name>[^\s=%]+)\s*=\s*")


_OPCODE = re.compile(r"\s*(?P<opcode>[a-z][\w\-]*)\(")


_ARRAY_SHAPE = re.compile(r"^(?P<dtype>[a-z][a-z0-9]*)\[(?P<dims>[^\]]*)\]")


@dataclass(frozen=True)
class Instruction:
    name: str
    shape: str
    opcode: str
    operands: tuple[str, ...]
    attributes: dict[str, str]


@dataclass
class Computation:
    name: str
    instructions: list[Instruction] = field(default_factory=list)
    root: str = ""
    users: dict[str, list[tuple[Instruction, int]]] = field(default_factory=dict)
    parameters: dict[int, str] = field(default_factory=dict)

    def add(self, instruction: Instruction, is_root: bool) -> None:
        self.instructions.append(instruction)
        if is_root:
            self.root = instruction.name
        index = instruction.operands[0] if instruction.operands else ""
        if instruction.opcode == "parameter" and index.isdigit():
            self.parameters[int(index)] = instruction.name
        for index, operand in enumerate(instruction.operands):
            self.users.setdefault(operand, []).append((instruction, index))


def _scan(text: str, start: int = 0) -> Iterator[tuple[int, str, int, bool]]:
    """Each character from ``start`` with the bracket depth after it and whether it lies outside
    every double-quoted string (backslash escapes inside strings honoured)."""
    depth, in_string, escaped = 0, False, False
    for position in range(start, len(text)):
        char = text[position]
        outside = not in_string and char != '"'
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
        yield position, char, depth, outside


def _balanced_end(text: str, start: int) -> int:
    """Index just past the bracket group opening at ``text[start]`` (double-quoted strings skipped)."""
    for position, char, depth, outside in _scan(text, start):
        if outside and char in _CLOSERS and depth == 0:
            return position + 1
    return len(text)


def split_top_level(text: str) -> list[str]:
    """Split on commas that sit outside every bracket and string."""
    cuts = [position for position, char, depth, outside in _scan(text)
            if outside and char == "," and depth == 0]
    parts = [text[begin + 1:end].strip() for begin, end in zip([-1, *cuts], [*cuts, len(text)])]
    return parts if parts[-1] else parts[:-1]


def _parse_instruction(line: str) -> tuple[Instruction, bool] | None:
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
        part.split()[-1].lstrip("%") for part in split_top_level(line[opcode.end() : operands_end - 1])
    )
    attributes = {}
    for item in split_top_level(line[operands_end:].lstrip(", ")):
        key, equals, value = item.partition("=")
        if equals:
            attributes[key.strip()] = value.strip()
    shape = line[position:shape_end]
    instruction = Instruction(start["name"], shape, opcode["opcode"], operands, attributes)
    return instruction, start["root"] is not None


def parse_module(hlo_text: str) -> dict[str, Computation]:
    """Every computation of an HLO module by name; loose instructions go to one nameless computation."""
    computations: dict[str, Computation] = {}
    current: Computation | None = None
    for raw_line in hlo_text.splitlines():
        line = _COMMENT.sub("", raw_line).rstrip()
        header = _COMPUTATION_HEADER.match(line) if line and not line[0].isspace() else None
        if header is not None:
            current = computations.setdefault(header["name"], Computation(header["name"]))
        elif line.strip() == "}":
            current = None
        elif (parsed := _parse_instruction(line)) is not None:
            if current is None:
                current = computations.setdefault("", Computation(""))
            current.add(*parsed)
    return computations


def called_computation(instruction: Instruction) -> str:
    """The first computation named in ``calls=`` (``%`` and braces stripped); '' if none."""
    called = instruction.attributes.get("calls", "").strip("{}").split(",")[0]
    return called.strip().lstrip("%")


def fused_computation_names(computations: dict[str, Computation]) -> set[str]:
    """Computations that fusions call, plus any whose name says it is fused."""
    fused = {name for name in computations if name.startswith("fused_")}
    for computation in computations.values():
        fused.update(
            called_computation(instruction)
            for instruction in computation.instructions
            if instruction.opcode == "fusion"
        )
    return fused


def array_shapes(shape: str) -> list[str]:
    """Flatten a (possibly nested tuple) shape into its array shapes, layouts dropped."""
    shape = shape.strip()
    if shape.startswith("("):
        return [array for element in split_top_level(shape[1:-1]) for array in array_shapes(element)]
    array = _ARRAY_SHAPE.match(shape)
    return [array.group(0)] if array else []


def array_bytes(array_shape: str) -> int:
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


def shape_bytes(shape: str) -> int:
    """Bytes of a shape, summed over tuple elements."""
    return sum(array_bytes(array) for array in array_shapes(shape))


_TRIP_COUNT = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')


def _trip_count(computations: dict[str, Computation], loop: Instruction,
                parent: Computation | None = None) -> int:
    """A while loop's trip count: XLA's ``known_trip_count`` where it wrote one (CPU, GPU), else
    read off its condition ``counter < N``, the counter's step in the body and its start in the
    loop's initial tuple (XLA:TPU's form; JAX's loops count up from 0 by 1, and XLA:TPU's windowed
    einsums, unrolled twice, by 2)."""
    known = _TRIP_COUNT.search(loop.attributes.get("backend_config", ""))
    if known:
        return int(known.group(1))
    condition = computations.get(loop.attributes.get("condition", "").lstrip("%"))
    if condition is None:
        return 1
    by_name = {instruction.name: instruction for instruction in condition.instructions}
    root = by_name.get(condition.root)
    if (root is None or root.opcode != "compare" or root.attributes.get("direction") != "LT"
            or len(root.operands) != 2):
        return 1
    bound = _constant(by_name, root.operands[1])
    if bound is None:
        return 1
    counter = by_name.get(root.operands[0])
    index = (counter.attributes.get("index", "")
             if counter is not None and counter.opcode == "get-tuple-element" else "")
    if not index.isdigit():
        return bound
    step = _counter_step(computations.get(loop.attributes.get("body", "").lstrip("%")), int(index))
    start = _initial_value(parent, loop, int(index))
    return max(-(-(bound - start) // step), 0)


def _through_copies(by_name: dict[str, Instruction], name: str) -> Instruction | None:
    """The instruction ``name`` is, or is a copy (of a copy...) of."""
    instruction = by_name.get(name)
    while instruction is not None and instruction.opcode == "copy" and instruction.operands:
        instruction = by_name.get(instruction.operands[0])
    return instruction


def _constant(by_name: dict[str, Instruction], name: str) -> int | None:
    """The integer a scalar ``constant`` (or a copy of one) holds; None for anything else."""
    instruction = _through_copies(by_name, name)
    if instruction is None or instruction.opcode != "constant" or not instruction.operands:
        return None
    return int(instruction.operands[0]) if instruction.operands[0].isdigit() else None


def _counter_step(body: Computation | None, index: int) -> int:
    """What the loop body adds to tuple element ``index`` (or a copy of it) each trip (1 unless it
    reads ``+ c``)."""
    if body is None:
        return 1
    by_name = {instruction.name: instruction for instruction in body.instructions}
    root = by_name.get(body.root)
    if root is None or root.opcode != "tuple" or index >= len(root.operands):
        return 1
    update = by_name.get(root.operands[index])
    if update is None or update.opcode != "add":
        return 1
    steps = [_constant(by_name, operand) for operand in update.operands]
    counters = [_through_copies(by_name, operand) for operand in update.operands]
    reads_counter = any(other is not None and other.opcode == "get-tuple-element"
                        and other.attributes.get("index") == str(index) for other in counters)
    known = [step for step in steps if step is not None]
    return known[0] if reads_counter and len(known) == 1 and known[0] > 0 else 1


def _initial_value(parent: Computation | None, loop: Instruction, index: int) -> int:
    """The counter's start: element ``index`` of the loop's initial tuple when it is a constant, else 0."""
    if parent is None or not loop.operands:
        return 0
    by_name = {instruction.name: instruction for instruction in parent.instructions}
    initial = by_name.get(loop.operands[0])
    if initial is None or initial.opcode != "tuple" or index >= len(initial.operands):
        return 0
    start = _constant(by_name, initial.operands[index])
    return start if start is not None else 0


def executions(computations: dict[str, Computation]) -> dict[str, int]:
    """Runs per program execution of each computation: while bodies times their known trip counts."""
    runs = {name: 1 for name in computations}
    trips: dict[tuple[str, str], int] = {}
    for _ in range(len(computations)):  # nested loops settle within as many passes as computations
        changed = False
        for computation in computations.values():
            for instruction in computation.instructions:
                if instruction.opcode == "fusion":  # XLA:TPU fuses a reduce-scatter with its all-reduce
                    called, count = called_computation(instruction), runs[computation.name]
                    if called in runs and runs[called] != count:
                        runs[called], changed = count, True
                if instruction.opcode != "while":
                    continue
                key = (computation.name, instruction.name)
                if key not in trips:
                    trips[key] = _trip_count(computations, instruction, computation)
                count = runs[computation.name] * trips[key]
                for role in ("body", "condition"):
                    called = instruction.attributes.get(role, "").lstrip("%")
                    if called in runs and runs[called] != count:
                        runs[called], changed = count, True
        if not changed:
            break
    return runs
