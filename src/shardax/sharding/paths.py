"""Tree paths as people write them: ``"encoder/layers/0/kernel"``, and glob patterns over them."""

from __future__ import annotations

from collections.abc import Callable
from fnmatch import fnmatchcase
from typing import Any

import jax
from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey


def _key_name(key: Any) -> str:
    if isinstance(key, DictKey):
        return str(key.key)
    if isinstance(key, SequenceKey):
        return str(key.idx)
    if isinstance(key, GetAttrKey):
        return key.name
    if isinstance(key, FlattenedIndexKey):
        return str(key.key)
    return str(key)


def path_to_str(keypath: tuple[Any, ...]) -> str:
    """``(DictKey('l1'), DictKey('kernel'), GetAttrKey('value'))`` -> ``"l1/kernel"``.

    The trailing ``value`` that NNX Variables add to every leaf's path is dropped: users name
    the parameter, not its box.
    """
    names = [_key_name(key) for key in keypath]
    if len(keypath) > 1 and isinstance(keypath[-1], GetAttrKey) and names[-1] == "value":
        names = names[:-1]
    return "/".join(names) if names else "<root>"


def path_matches(pattern: str, path: str) -> bool:
    """Glob match on the whole path or on any trailing part of it.

    ``"kernel"`` matches ``"l1/kernel"``; ``"l*/bias"`` matches ``"l2/bias"``; ``"l1/*"``
    matches everything under ``l1``.
    """
    return fnmatchcase(path, pattern) or fnmatchcase(path, "*/" + pattern)


def map_with_path(
    fn: Callable[[str, Any], Any], tree: Any, *rest: Any, is_leaf: Callable[[Any], bool] | None = None
) -> Any:
    """``jax.tree.map`` whose function also gets the leaf's readable path."""
    return jax.tree_util.tree_map_with_path(
        lambda keypath, leaf, *others: fn(path_to_str(keypath), leaf, *others),
        tree,
        *rest,
        is_leaf=is_leaf,
    )


def leaves_with_paths(tree: Any) -> list[tuple[str, Any]]:
    """``[(path, leaf), ...]`` in tree order."""
    return [(path_to_str(k), leaf) for k, leaf in jax.tree_util.tree_leaves_with_path(tree)]
