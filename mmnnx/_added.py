"""Variables a step adds to its arguments' objects (``self.sow`` creates an
``nnx.Intermediate``): taken off the traced objects, returned as results of the step, and set
again, holding the computed values, on the caller's objects."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from mmnnx import _nnx


class Added:
    """A Variable a step added to an argument's object: where, its type and metadata, and how
    its value's leaves (step outputs) form the value."""

    def __init__(self, path: tuple, kind: type, metadata: dict, value: Any):
        self.path, self.kind, self.metadata, self.value = path, kind, metadata, value
        leaves, self.tree = jax.tree.flatten(value)
        self.num_leaves = len(leaves)


def take_added(root: Any, fresh: Sequence[Any]) -> list[Added]:
    """The Variables under ``root`` (the traced arguments) not among ``fresh`` that are attributes
    of an object, each taken off its object (so the rest can be checked unchanged).

    Example:
        >>> from flax import nnx
        >>> model = nnx.Linear(1, 1, rngs=nnx.Rngs(0))
        >>> model.seen = nnx.Intermediate((1.0,))
        >>> [a.path[-1].name for a in take_added(model, nnx.state(model, nnx.Param).values())]
        ['seen']
    """
    known = {id(v) for v in fresh}
    found, _ = jax.tree.flatten_with_path(root, is_leaf=_nnx.is_variable)
    added = []
    for path, node in found:
        if not _nnx.is_variable(node) or id(node) in known:
            continue
        parent = _parent_at(root, path)
        if parent is None:
            continue  # not an attribute: the structure check names the change
        value = node.get_raw_value()
        added.append(Added(path=path, kind=type(node), metadata=node.get_metadata(), value=value))
        delattr(parent, path[-1].name)
    return added


def put_added(root: Any, added: Sequence[Added], values: Sequence[Any]) -> None:
    """Sets each added Variable, holding its computed ``values``, on its object under ``root``."""
    start = 0
    for a in added:
        leaves = values[start : start + a.num_leaves]
        start += a.num_leaves
        variable = _nnx.variable_from(a.kind, a.metadata, jax.tree.unflatten(a.tree, leaves))
        setattr(_parent_at(root, a.path), a.path[-1].name, variable)


def _parent_at(root: Any, path: tuple) -> Any | None:
    """The object holding the attribute at the end of ``path`` from ``root``, or ``None``."""
    if not path or not isinstance(path[-1], jax.tree_util.GetAttrKey):
        return None
    node = root
    for key in path[:-1]:
        slot = _nnx.child_slot(node, key)
        if slot is None:
            return None
        holder, k = slot
        node = holder[k]
    return node if hasattr(node, "__dict__") else None
