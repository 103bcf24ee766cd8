"""Dimension classes: a union-find over (jaxpr variable, dimension), with flags on each."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from jax.extend import core as jcore

Node = tuple[Any, int]  # (jaxpr variable, dimension)


class DimensionClasses:
    """Union-find over (variable, dimension), with flags on each dimension."""

    def __init__(self) -> None:
        self.parent: dict[Node, Node] = {}
        self.flags: dict[Node, set[str]] = defaultdict(set)
        self.sizes: dict[Node, int] = {}
        self.soft: list[tuple[Node, Node]] = []  # ties cut again when they would stop a split
        self.fresh: set[Node] = set()  # dimensions a broadcast made (a repeat's copies)

    def node(self, var: Any, dim: int) -> Node | None:
        shape = getattr(getattr(var, "aval", None), "shape", None)
        if shape is None or isinstance(var, jcore.Literal) or shape[dim] == 1:
            return None
        node = (var, dim)
        self.sizes.setdefault(node, shape[dim])
        self.parent.setdefault(node, node)
        return node

    def find(self, node: Node) -> Node:
        while self.parent[node] != node:
            self.parent[node] = self.parent[self.parent[node]]
            node = self.parent[node]
        return node

    def tie(self, a: Any, da: int, b: Any, db: int) -> None:
        na, nb = self.node(a, da), self.node(b, db)
        if na is not None and nb is not None and self.sizes[na] == self.sizes[nb]:
            self.parent[self.find(na)] = self.find(nb)
        elif na is not None and nb is not None:
            self.mark(a, da, "cut")
            self.mark(b, db, "cut")

    def join(self, a: Node | None, b: Node | None) -> None:
        """One class for ``a`` and ``b`` whatever their sizes (a merged dimension and its major part)."""
        if a is not None and b is not None:
            self.parent[self.find(a)] = self.find(b)

    def mark(self, var: Any, dim: int, flag: str) -> None:
        node = self.node(var, dim)
        if node is not None:
            self.flags[node].add(flag)

    def mark_all(self, var: Any, flag: str) -> None:
        for dim in range(rank(var)):
            self.mark(var, dim, flag)


def rank(var: Any) -> int:
    return len(getattr(getattr(var, "aval", None), "shape", ()) or ())


def fits(operand: Any, out: Any) -> bool:
    """An element-wise operand: a scalar, or ``out``'s shape with some sizes 1 (broadcast)."""
    shape, target = shape_of(operand), shape_of(out)
    return not shape or (len(shape) == len(target) and all(a in (b, 1) for a, b in zip(shape, target)))


def shape_of(var: Any) -> tuple[int, ...]:
    return tuple(getattr(getattr(var, "aval", None), "shape", ()) or ())
