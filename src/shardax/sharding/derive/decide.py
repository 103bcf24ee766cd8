"""From dimension classes to a layout: which class splits over ``model`` as what, and why every
other weight stays whole."""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.extend.core import Var

from shardax.errors import UsageError
from shardax.sharding.derive.dimensions import DimensionClasses, Node, rank, shape_of
from shardax.sharding.derive.walk import Walker
from shardax.sharding.paths import path_to_str


@dataclasses.dataclass(frozen=True)
class Derived:
    """What was read off the program: per parameter path, logical names for the dimensions that
    split (``"heads"``, ``"mlp"`` or ``"vocab"`` over ``model``; ``"expert"`` for a stack of
    experts' weights) and ``None`` for the others; and, for every parameter that ``model``
    leaves whole, why."""

    logical: dict[str, tuple[str | None, ...]]
    whole: dict[str, str]


def _live(jaxpr: Any) -> Any:
    """``jaxpr`` with only the equations its output depends on (and those with effects): a step
    that computes gradients and hands them elsewhere leaves its backward pass out (read as part of
    the program it would tie dimensions the forward pass never ties). Every input stays."""
    live = {var for var in jaxpr.outvars if isinstance(var, Var)}
    kept = []
    for eqn in reversed(jaxpr.eqns):
        if eqn.effects or any(var in live for var in eqn.outvars):
            kept.append(eqn)
            live.update(var for var in eqn.invars if isinstance(var, Var))
    return jaxpr.replace(eqns=kept[::-1])


def derive_split(loss_of_params: Callable[[Any, Any, Any], Any], params: Any, rest: Any, batch: Any,
                 model_size: int, expert_size: int = 1) -> Derived:
    """Megatron's split of ``params`` (a tree of abstract arrays) over a ``model`` axis of
    ``model_size`` devices, and the experts' dimension of stacked expert weights (split over an
    axis of ``expert_size``), from ``jax.make_jaxpr(loss_of_params)(params, rest, batch)``."""
    paths = [path_to_str(keypath) for keypath, _ in jax.tree_util.tree_leaves_with_path(params)]
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jax.dtypes.canonicalize_dtype(
        x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype)), batch)
    jaxpr = _live(jax.make_jaxpr(loss_of_params)(params, rest, batch).jaxpr)
    classes = DimensionClasses()
    walker = Walker(classes)
    count_params = len(paths)
    count_rest = len(jax.tree.leaves(rest))
    param_vars = jaxpr.invars[:count_params]
    for var in param_vars:
        walker.kind[var] = "weight"
    for var in jaxpr.invars[count_params + count_rest:]:
        walker.kind[var] = "act"
        classes.mark_all(var, "input")
    walker.walk(jaxpr)
    if walker.grouped_convs:
        raise UsageError(
            f"the model computes a grouped convolution outside nnx.Conv ({walker.grouped_convs[0]}); under "
            "tensor parallelism XLA's partitioner multiplies its kernel gradient by the devices the batch "
            "repeats over, so call shardax.grouped_conv in place of jax.lax.conv_general_dilated there (the "
            "same arguments), or train with a strategy without a model axis")
    return _decide(classes, dict(zip(paths, param_vars)), model_size, expert_size)


# what each primitive that cuts a dimension does to it, in a reason's words
_CUTS = {"concatenate": "concatenated (a skip joined on the channels)",
         "reshape": "reshaped (patches, heads)",
         "conv_general_dilated": "a convolution's window or grouped channels", "pad": "padded",
         "reduce_window": "pooled over a window", "gather": "gathered from",
         "split": "split into pieces (adaLN's shift, scale and gate)",
         "broadcast_in_dim": "broadcast from a smaller size"}


def _cut_reason(marks: set[str]) -> str:
    """Why a dimension that is cut stays whole: what cuts it, by the primitives that did."""
    words = sorted({_CUTS.get(mark.split(":", 1)[1], "sliced") for mark in marks
                    if mark.startswith("cut-by:")})
    return f"it is {', '.join(words) or 'sliced'}"


def _verdicts(classes: DimensionClasses, model_size: int,
              expert_size: int) -> tuple[dict[Node, str], dict[Node, str]]:
    """Per class root: the logical name it splits as, or why it cannot."""
    for whole, major in classes.soft:  # tie merged dimensions to their major part where it divides
        if whole is None or major is None:
            continue
        merged = {classes.find(whole), classes.find(major)}
        members = [n for n in classes.parent if classes.find(n) in merged]
        if all(classes.sizes[n] % model_size == 0 for n in members):
            classes.join(whole, major)
    flags: dict[Node, set[str]] = defaultdict(set)
    sizes: dict[Node, set[int]] = defaultdict(set)
    for node in classes.parent:
        root = classes.find(node)
        flags[root] |= classes.flags[node]
        sizes[root].add(classes.sizes[node])
    names, reasons = {}, {}
    for root, marks in flags.items():
        name, reason = _verdict(marks, sizes[root], model_size, expert_size)
        if name:
            names[root] = name
        else:
            reasons[root] = reason
    return names, reasons


def _verdict(marks: set[str], sizes: set[int], model_size: int, expert_size: int) -> tuple[str | None, str]:
    """One class's verdict: the logical name it splits as (then no reason), or why it cannot."""
    bad = sorted(size for size in sizes if size % model_size)
    unknown = sorted(m.split(":", 1)[1] for m in marks if m.startswith("unknown:"))
    if _experts(marks):
        uneven = sorted(size for size in sizes if size % expert_size)
        if unknown:
            return None, (f"the experts' dimension, passing through {', '.join(unknown)}, which shardax "
                          "does not follow")
        if uneven:
            return None, f"the experts' dimension: sizes {uneven} do not divide over expert={expert_size}"
        return "expert", ""
    whole = _kept_whole(marks, unknown)
    if whole:
        return None, whole
    if "produced" in marks and "consumed" in marks and "reduced" in marks:
        return None, "the model width: normalised or reduced over between the weights that share it"
    if "produced" in marks and "consumed" in marks and not bad:
        return ("heads" if "attention" in marks else "mlp"), ""
    if ("produced" in marks or "lookup" in marks) and "consumed" not in marks and not bad:
        return "vocab", ""
    if bad:
        return None, f"sizes {bad} are not multiples of model={model_size}"
    if "reduced" in marks:
        return None, "reduced over between activations (attention's head_dim, a softmax)"
    return None, "no weight produces it and a later one consumes it"


def _kept_whole(marks: set[str], unknown: list[str]) -> str | None:
    """Why a class stays whole whatever its sizes: an input's dimension, one passing where shardax
    does not follow, a scan's steps, or one that is cut (None: none of these)."""
    if "input" in marks:
        return "it is a dimension of the batch's inputs or targets"
    if unknown:
        return f"it passes through {', '.join(unknown)}, which shardax does not follow"
    if "stacked" in marks:
        return "the steps of a scan (a stack's layers: a pipeline's stage axis, never split over model)"
    if "cut" in marks:
        return _cut_reason(marks)
    return None


def _experts(marks: set[str]) -> bool:
    """A dimension of a stack of weights, each applied to its own activations, whose results no
    later weight reads across (a mixture's experts: the router's weights combine them): each
    device computes its own experts' part."""
    return "batched" in marks and "consumed" not in marks and not marks & {"input", "stacked", "cut"}


def _decide(classes: DimensionClasses, param_vars: dict[str, Any], model_size: int,
            expert_size: int) -> Derived:
    names, reasons = _verdicts(classes, model_size, expert_size)
    dims_of: dict[str, list[Node | None]] = {
        path: [classes.find(n) if (n := classes.node(var, d)) is not None else None for d in range(rank(var))]
        for path, var in param_vars.items()
    }
    members: dict[Node, list[tuple[str, int]]] = defaultdict(list)
    for path, roots in dims_of.items():
        for dim, root in enumerate(roots):
            if root in names:
                members[root].append((path, dim))

    def weight_bytes(root: Node) -> int:
        return sum(math.prod(shape_of(param_vars[path])) for path, _ in members[root])

    experts = _choose([r for r in members if names[r] == "expert"], members, weight_bytes, reasons)
    split = _choose([r for r in members if names[r] != "expert"], members, weight_bytes, reasons)
    logical, whole = {}, {}
    for path, roots in dims_of.items():
        taken = {dim: names[roots[dim]] for dim in (experts.get(path), split.get(path)) if dim is not None}
        if taken:
            logical[path] = tuple(taken.get(d) for d in range(len(roots)))
        if path in split:
            continue
        why = []
        for dim, root in enumerate(roots):
            size = shape_of(param_vars[path])[dim]
            if root is None:
                why.append(f"{size}: size 1")
            elif taken.get(dim) == "expert":
                why.append(f"{size}: the experts' dimension (split over an expert axis, not over model)")
            else:
                why.append(f"{size}: {reasons.get(root) or 'taken by a larger weight'}")
        whole[path] = "; ".join(why) if why else "a scalar"
    return Derived(logical, whole)


def _choose(roots: list[Node], members: dict[Node, list[tuple[str, int]]],
            weight_bytes: Callable[[Node], int], reasons: dict[Node, str]) -> dict[str, int]:
    """The classes that split, largest weights first, each weight on at most one dimension:
    ``{path: dimension}``; every class passed over gets its reason."""
    taken: dict[str, int] = {}
    for root in sorted(roots, key=weight_bytes, reverse=True):
        paths = [path for path, _ in members[root]]
        if len(set(paths)) < len(paths):
            reasons[root] = "two dimensions of one weight are this same dimension"
        elif any(path in taken for path in paths):
            other = next(path for path in paths if path in taken)
            reasons[root] = f"{other} shares it and already splits on another dimension"
        else:
            taken.update({path: dim for path, dim in members[root]})
    return taken
