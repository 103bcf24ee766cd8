"""The walk over a jaxpr: each primitive ties its operands' dimensions to its results' and marks
their roles (produced or consumed by a weight, reduced over, cut, an input's)."""

from __future__ import annotations

from typing import Any

from jax.extend import core as jcore

from shardax.sharding.derive.dimensions import DimensionClasses, fits, rank, shape_of
from shardax.sharding.grouped_conv import SCOPE as GROUPED_CONV_SCOPE

_REDUCTIONS = {"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "argmax",
               "argmin", "reduce_xor"}
_CUMULATIVE = {"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"}
_CALLS = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
          "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr",
          "custom_vjp_call_jaxpr": "fun_jaxpr", "checkpoint": "jaxpr", "remat": "jaxpr", "remat2": "jaxpr",
          "custom_lin": None}
_FRESH = {"iota", "random_bits", "random_seed", "random_wrap", "random_unwrap", "rng_bit_generator",
          "rng_uniform"}


# primitives whose results are random bits: what a model draws from its RNG streams in __call__
RANDOM_DRAWS = frozenset({"random_bits", "threefry2x32"})


class Walker:
    """Walks a jaxpr, tying dimensions and marking roles; ``kind`` says what each value is made of."""

    def __init__(self, classes: DimensionClasses) -> None:
        self.classes = classes
        self.kind: dict[Any, str] = {}  # "act" (depends on the batch) or "weight" (on parameters only)
        self.grouped_convs: list[str] = []  # grouped convolutions outside shardax.grouped_conv
        self._routed = 0  # inside shardax.grouped_conv
        self._walked: dict[int, Any] = {}  # the jaxprs walked so far, by id (kept, so no id is reused)
        self._primitive = ""  # the equation being walked

    def kind_of(self, var: Any) -> str | None:
        return None if isinstance(var, jcore.Literal) else self.kind.get(var)

    def walk(self, jaxpr: Any) -> None:
        for eqn in jaxpr.eqns:
            kinds = {self.kind_of(v) for v in eqn.invars}
            if eqn.primitive.name in RANDOM_DRAWS:
                # a draw from the model's own RNG stream (a GAN's noise) is data, like the batch
                kinds.add("act")
            out_kind = "act" if "act" in kinds else "weight" if "weight" in kinds else None
            for out in eqn.outvars:
                if out_kind:
                    self.kind[out] = out_kind
            self.equation(eqn)

    def bind(self, outer: list[Any], inner: list[Any]) -> None:
        """Inner variables stand for outer ones (a call's arguments or results)."""
        for o, i in zip(outer, inner):
            if self.kind_of(o) and not isinstance(i, jcore.Literal):
                self.kind[i] = self.kind_of(o)
            if shape_of(o) == shape_of(i):
                for dim in range(rank(o)):
                    self.classes.tie(o, dim, i, dim)

    def fresh(self, closed: Any) -> Any:
        """The jaxpr of ``closed``, with variables of its own if it was walked before: a jitted
        function (``jax.nn.relu``) called twice on the same shapes shares one cached jaxpr, whose
        variables would tie the dimensions of both calls together (a square weight's two)."""
        jaxpr = getattr(closed, "jaxpr", closed)
        if id(jaxpr) in self._walked:
            renamed: dict[Any, Any] = {}

            def new(var: Any) -> Any:
                if isinstance(var, (jcore.Literal, jcore.DropVar)):
                    return var
                return renamed.setdefault(var, jcore.Var(var.aval))

            jaxpr = jaxpr.replace(
                constvars=[new(v) for v in jaxpr.constvars], invars=[new(v) for v in jaxpr.invars],
                outvars=[new(v) for v in jaxpr.outvars],
                eqns=[e.replace(invars=[new(v) for v in e.invars], outvars=[new(v) for v in e.outvars])
                      for e in jaxpr.eqns])
        self._walked[id(jaxpr)] = jaxpr
        return jaxpr

    def call(self, eqn: Any, closed: Any) -> None:
        inner = self.fresh(closed)
        routed = GROUPED_CONV_SCOPE in str(eqn.source_info.name_stack)
        self.bind(eqn.invars, inner.invars)
        self._routed += routed
        self.walk(inner)
        self._routed -= routed
        for o, i in zip(eqn.outvars, inner.outvars):
            if self.kind_of(i):
                self.kind[o] = self.kind_of(i)
        self.bind(eqn.outvars, inner.outvars)

    def _cut(self, var: Any, dim: int) -> None:
        """``var``'s ``dim`` is cut (sliced, joined, reshaped, windowed) by the equation being walked."""
        self.classes.mark(var, dim, "cut")
        self.classes.mark(var, dim, f"cut-by:{self._primitive}")

    def equation(self, eqn: Any) -> None:
        name, params, ins, outs = eqn.primitive.name, eqn.params, eqn.invars, eqn.outvars
        self._primitive = name
        handler = getattr(self, "_" + name, None)
        if name in _CALLS and params.get(_CALLS[name]) is not None:
            self.call(eqn, params[_CALLS[name]])
        elif handler is not None:
            handler(ins, outs, params)
        elif name in _REDUCTIONS:
            self.reduce(ins[0], outs[0], params["axes"])
        elif name in _CUMULATIVE:
            self.elementwise(ins, outs)
            self.classes.mark(ins[0], params["axis"], "reduced")
        elif name in _FRESH:
            pass
        elif all(shape_of(o) == shape_of(outs[0]) for o in outs) and all(fits(i, outs[0]) for i in ins):
            self.elementwise(ins, outs)
        else:  # unknown: nothing through it may be split
            for var in (*ins, *outs):
                self.classes.mark_all(var, "unknown:" + name)

    def elementwise(self, ins: list[Any], outs: list[Any]) -> None:
        for var in (*ins, *outs[1:]):
            if rank(var) == rank(outs[0]):  # equal sizes, or 1 (broadcast: never tied)
                for dim in range(rank(var)):
                    self.classes.tie(var, dim, outs[0], dim)

    def reduce(self, operand: Any, out: Any, axes: tuple[int, ...]) -> None:
        kept = [d for d in range(rank(operand)) if d not in axes]
        for d_out, d_in in enumerate(kept):
            self.classes.tie(operand, d_in, out, d_out)
        for dim in axes:
            self.classes.mark(operand, dim, "reduced")

    # -- primitives that move dimensions --------------------------------------------------
    def _broadcast_in_dim(self, ins: list[Any], outs: list[Any], params: dict) -> None:
        mapped = params["broadcast_dimensions"]
        for d_in, d_out in enumerate(mapped):
            self.classes.tie(ins[0], d_in, outs[0], d_out)
        for dim in range(rank(outs[0])):
            node = self.classes.node(outs[0], dim)
            if dim not in mapped and node is not None:
                self.classes.fresh.add(node)

    def _transpose(self, ins: list[Any], outs: list[Any], params: dict) -> None:
        for d_out, d_in in enumerate(params["permutation"]):
            self.classes.tie(ins[0], d_in, outs[0], d_out)

    def _squeeze(self, ins: list[Any], outs: list[Any], params: dict) -> None:
        kept = [d for d in range(rank(ins[0])) if d not in params["dimensions"]]
        for d_out, d_in in enumerate(kept):
            self.classes.tie(ins[0], d_in, outs[0], d_out)

    def _expand_dims(self, ins: list[Any], outs: list[Any], params: dict) -> None:
        kept = [d for d in range(rank(outs[0])) if d not in params["dimensions"]]
        for d_in, d_out in enumerate(kept):
            self.classes.tie(ins[0], d_in, outs[0], d_out)

    def _reshape(self, ins: list[Any], outs: list[Any], params: dict) -> None:
        source, target = shape_of(ins[0]), shape_of(outs[0])
        for group_in, group_out in _reshape_groups(source, target):
            big_in = [d for d in group_in if source[d] > 1]
            big_out = [d for d in group_out if target[d] > 1]
            if not big_in or not big_out:
                continue
            if len(big_in) == 1 and len(big_out) == 1:
                self.classes.tie(ins[0], big_in[0], outs[0], big_out[0])
                continue
            if len(big_in) == 1 or len(big_out) == 1:
                # a split or a merge: the major part goes with the whole
                whole, parts = (ins[0], big_in[0]), [(outs[0], d) for d in big_out]
                if len(big_out) == 1:
                    whole, parts = (outs[0], big_out[0]), [(ins[0], d) for d in big_in]
                major, minor = parts[0], parts[1:]
                node_whole, node_major = self.classes.node(*whole), self.classes.node(*major)
                if all(self.classes.node(*m) in self.classes.fresh for m in minor):
                    self.classes.soft.append((node_whole, node_major))  # a repeat (grouped-query kv heads)
                else:
                    self.classes.join(node_whole, node_major)
                for var, dim in minor:
                    self._cut(var, dim)
                continue
            for var, dims in ((ins[0], group_in), (outs[0], group_out)):
                for dim in dims:
                    self._cut(var, dim)

    def _dot_general(self, ins: list[Any], outs: list[Any], params: dict) -> None:
        (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = params["dimension_numbers"]
        lhs, rhs, out = ins[0], ins[1], outs[0]
        for a, b in zip(lhs_contract, rhs_contract):
            self.classes.tie(lhs, a, rhs, b)
        for i, (a, b) in enumerate(zip(lhs_batch, rhs_batch)):
            self.classes.tie(lhs, a, out, i)
            self.classes.tie(rhs, b, out, i)
        free_lhs = [d for d in range(rank(lhs)) if d not in lhs_contract and d not in lhs_batch]
        free_rhs = [d for d in range(rank(rhs)) if d not in rhs_contract and d not in rhs_batch]
        for i, d in enumerate(free_lhs + free_rhs):
            self.classes.tie(*(((lhs, d) if i < len(free_lhs) else (rhs, d)) + (out, len(lhs_batch) + i)))
        self._roles(lhs, rhs, lhs_contract, free_lhs, lhs_batch)
        self._roles(rhs, lhs, rhs_contract, free_rhs, rhs_batch)

    def _roles(self, weight: Any, other: Any, contract: Any, free: list[int], batch: Any) -> None:
        if self.kind_of(weight) == "weight" and self.kind_of(other) == "act":
            for dim in contract:
                self.classes.mark(weight, dim, "consumed")
            for dim in free:
                self.classes.mark(weight, dim, "produced")
            for dim in batch:  # a stack of weights, each applied to its own activations (a mixture's experts)
                self.classes.mark(weight, dim, "batched")
        elif self.kind_of(weight) == "act" and self.kind_of(other) == "act":
            for dim in contract:
                self.classes.mark(weight, dim, "reduced")  # e.g. queries . keys over head_dim
            for dim in batch:
                self.classes.mark(weight, dim, "attention")

    def _conv_general_dilated(self, ins: list[Any], outs: list[Any], params: dict) -> None:
        lhs_spec, rhs_spec, out_spec = params["dimension_numbers"]
        lhs, rhs, out = ins[0], ins[1], outs[0]
        if params.get("feature_group_count", 1) > 1 and not self._routed:
            self.grouped_convs.append(f"feature_group_count={params['feature_group_count']}, kernel "
                                      f"{tuple(shape_of(rhs))}")
        self.classes.tie(lhs, lhs_spec[0], out, out_spec[0])
        if params.get("feature_group_count", 1) == 1 and params.get("batch_group_count", 1) == 1:
            self.classes.tie(lhs, lhs_spec[1], rhs, rhs_spec[1])
            self.classes.tie(rhs, rhs_spec[0], out, out_spec[1])
            self._roles(rhs, lhs, (rhs_spec[1],), [rhs_spec[0]], ())
        else:
            for var, dim in ((lhs, lhs_spec[1]), (rhs, rhs_spec[0]), (rhs, rhs_spec[1]), (out, out_spec[1])):
                self._cut(var, dim)
        for var, spec in ((lhs, lhs_spec), (rhs, rhs_spec), (out, out_spec)):
            for dim in spec[2:]:
                self._cut(var, dim)

    def _gather(self, ins: list[Any], outs: list[Any], params: dict) -> None:
        operand, indices, out = ins[0], ins[1], outs[0]
        numbers, sizes = params["dimension_numbers"], params["slice_sizes"]
        skipped = set(numbers.collapsed_slice_dims) | set(numbers.operand_batching_dims)
        kept = [d for d in range(rank(operand)) if d not in skipped]
        for d_in, d_out in zip(kept, numbers.offset_dims):
            if sizes[d_in] == shape_of(operand)[d_in]:
                self.classes.tie(operand, d_in, out, d_out)
            else:
                self._cut(operand, d_in)
        batch_out = [d for d in range(rank(out)) if d not in numbers.offset_dims]
        for d_out, d_index in zip(batch_out, range(rank(indices) - 1)):
            self.classes.tie(indices, d_index, out, d_out)
        for d_op, d_index in zip(numbers.operand_batching_dims, numbers.start_indices_batching_dims):
            self.classes.tie(operand, d_op, indices, d_index)
        lookup = self.kind_of(operand) == "weight" and self.kind_of(indices) == "act"
        for dim in numbers.start_index_map:
            self.classes.mark(operand, dim, "lookup" if lookup else "reduced")

    def _top_k(self, ins: list[Any], outs: list[Any], params: dict) -> None:
        axis = params.get("axis", rank(ins[0]) - 1)
        for out in outs:
            for dim in range(rank(out)):
                if dim != axis:
                    self.classes.tie(ins[0], dim, out, dim)
        self.classes.mark(ins[0], axis, "reduced")

    def _slice(self, ins: list[Any], outs: list[Any], params: dict) -> None:
        strides = params.get("strides") or (1,) * rank(ins[0])
        for dim, size in enumerate(shape_of(outs[0])):
            if size == shape_of(ins[0])[dim] and strides[dim] == 1:
                self.classes.tie(ins[0], dim, outs[0], dim)
            else:
                self._cut(ins[0], dim)

    def _dynamic_slice(self, ins: list[Any], outs: list[Any], params: dict) -> None:
        self._slice(ins[:1], outs, {})

    def _dynamic_update_slice(self, ins: list[Any], outs: list[Any], params: dict) -> None:
        for dim, size in enumerate(shape_of(ins[0])):
            self.classes.tie(ins[0], dim, outs[0], dim)
            if shape_of(ins[1])[dim] == size:
                self.classes.tie(ins[1], dim, outs[0], dim)
            else:
                self._cut(ins[0], dim)

    def _concatenate(self, ins: list[Any], outs: list[Any], params: dict) -> None:
        axis = params["dimension"]
        for var in ins:
            for dim in range(rank(var)):
                if dim == axis:
                    self._cut(var, dim)
                else:
                    self.classes.tie(var, dim, outs[0], dim)
        self._cut(outs[0], axis)

    def _pad(self, ins: list[Any], outs: list[Any], params: dict) -> None:
        for dim, config in enumerate(params["padding_config"]):
            if tuple(config) == (0, 0, 0):
                self.classes.tie(ins[0], dim, outs[0], dim)
            else:
                self._cut(ins[0], dim)
                self._cut(outs[0], dim)

    def _split(self, ins: list[Any], outs: list[Any], params: dict) -> None:
        for out in outs:
            for dim in range(rank(out)):
                if dim == params["axis"]:
                    self._cut(out, dim)
                else:
                    self.classes.tie(ins[0], dim, out, dim)
        self._cut(ins[0], params["axis"])

    def _sort(self, ins: list[Any], outs: list[Any], params: dict) -> None:
        self.elementwise(ins, outs)
        self.classes.mark(outs[0], params["dimension"], "reduced")

    def _scan(self, ins: list[Any], outs: list[Any], params: dict) -> None:
        body = self.fresh(params["jaxpr"])
        consts, carry = params["num_consts"], params["num_carry"]
        self.bind(ins[:consts + carry], body.invars[:consts + carry])
        for outer, inner in zip(ins[consts + carry:], body.invars[consts + carry:]):
            self._stacked(outer, inner)
        self.walk(body)
        self.bind(outs[:carry], body.outvars[:carry])
        self.bind(ins[consts:consts + carry], body.outvars[:carry])
        for outer, inner in zip(outs[carry:], body.outvars[carry:]):
            self._stacked(outer, inner)
            if self.kind_of(inner):
                self.kind[outer] = self.kind_of(inner)
        for outer, inner in zip(outs[:carry], body.outvars[:carry]):
            if self.kind_of(inner):
                self.kind[outer] = self.kind_of(inner)

    def _stacked(self, outer: Any, inner: Any) -> None:
        """A scanned value: its leading dimension is the steps (never split), the rest the body's."""
        if self.kind_of(outer) and not isinstance(inner, jcore.Literal):
            self.kind[inner] = self.kind_of(outer)
        self.classes.mark(outer, 0, "stacked")
        for dim in range(rank(inner)):
            self.classes.tie(outer, dim + 1, inner, dim)

    def _cond(self, ins: list[Any], outs: list[Any], params: dict) -> None:
        for branch in params["branches"]:
            inner = self.fresh(branch)
            self.bind(ins[1:], inner.invars)
            self.walk(inner)
            self.bind(outs, inner.outvars)
            for o, i in zip(outs, inner.outvars):
                if self.kind_of(i):
                    self.kind[o] = self.kind_of(i)

    def _while(self, ins: list[Any], outs: list[Any], params: dict) -> None:
        cond_consts, body_consts = params["cond_nconsts"], params["body_nconsts"]
        body = self.fresh(params["body_jaxpr"])
        carry = ins[cond_consts + body_consts:]
        self.bind(ins[cond_consts:cond_consts + body_consts] + carry, body.invars)
        self.walk(body)
        self.bind(carry, body.outvars)
        self.bind(outs, body.outvars)


def _reshape_groups(source: tuple[int, ...], target: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """Dimensions of ``source`` and ``target`` grouped so that each group's sizes multiply alike."""
    groups, i, j = [], 0, 0
    while i < len(source) or j < len(target):
        group_in, group_out = [], []
        size_in = size_out = 1
        while True:
            if size_in <= size_out and i < len(source):
                size_in *= source[i]
                group_in.append(i)
                i += 1
            elif j < len(target):
                size_out *= target[j]
                group_out.append(j)
                j += 1
            else:
                break
            if size_in == size_out and (i == len(source) or source[i] != 1 or j == len(target)):
                break
        groups.append((group_in, group_out))
    return groups
