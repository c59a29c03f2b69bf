"""Placement rules: ``(filter, task[, spec])`` tuples compiled to predicates over Variable paths."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from flax import nnx
from jax.sharding import PartitionSpec

from mmnnx.sharding.stack import TaskStack
from mmnnx.sharding.task import Task

Path = tuple[Any, ...]
SpecOrFn = PartitionSpec | Callable[[str, nnx.Variable], PartitionSpec] | None


def path_str(path: Path) -> str:
    """Joins a Variable path with ``/``: ``('layers', 0, 'kernel')`` -> ``'layers/0/kernel'``."""
    return "/".join(str(p) for p in path)


@dataclasses.dataclass(frozen=True)
class PlacementRule:
    """One compiled rule: which Variables it matches, their task, and optionally their spec."""

    index: int
    filter: Any
    task: Task | TaskStack
    spec: SpecOrFn
    predicate: Callable[[Path, Any], bool]

    def describe(self) -> str:
        return f"rule {self.index} ({self.filter!r} -> task {self.task.name!r})"

    def matches(self, path: Path, variable: nnx.Variable) -> bool:
        return bool(self.predicate(path, variable))


def _predicate(flt: Any, index: int) -> Callable[[Path, Any], bool]:
    if isinstance(flt, str):
        try:
            regex = re.compile(flt)
        except re.error as e:
            raise ValueError(
                f"placement rule {index}: invalid regular expression {flt!r}: {e}"
            ) from None
        return lambda path, _: regex.search(path_str(path)) is not None
    if isinstance(flt, list | tuple):
        parts = [_predicate(f, index) for f in flt]
        return lambda path, v: any(p(path, v) for p in parts)
    if isinstance(flt, bool) or flt is ... or flt is None or callable(flt):
        return nnx.filterlib.to_predicate(flt)
    raise TypeError(
        f"placement rule {index}: filter {flt!r} of type {type(flt).__name__} is not supported; "
        "use a regular expression (str) or an NNX filter (nnx.PathContains, nnx.OfType, a "
        "Variable type, a callable (path, variable) -> bool, ...)"
    )


def compile_rules(rules: Sequence[tuple] | Mapping) -> list[PlacementRule]:
    """Checks and compiles ``(filter, task)`` / ``(filter, task, spec)`` tuples (or a dict), in
    order; a list of tasks becomes a :class:`TaskStack`."""
    if isinstance(rules, Mapping):
        rules = list(rules.items())
    if isinstance(rules, str | bytes) or not isinstance(rules, Sequence):
        raise TypeError(
            f"placement rules must be a sequence of (filter, task) tuples or a dict "
            f"{{filter: task}}, got {type(rules).__name__}"
        )
    compiled = []
    for index, rule in enumerate(rules):
        if not isinstance(rule, tuple | list) or len(rule) not in (2, 3):
            raise TypeError(
                f"placement rule {index}: {rule!r} is not a (filter, task) or (filter, task, spec) "
                "tuple"
            )
        flt, task, *rest = rule
        spec = rest[0] if rest else None
        members = list(task) if isinstance(task, list | tuple) else [task]
        for member in members:
            if not isinstance(member, Task):
                raise TypeError(
                    f"placement rule {index}: {member!r} is not an mm.Task (a rule names a task, "
                    "or a list of tasks that split stacked layers)"
                )
            if member.name is None or member.mesh is None:
                raise ValueError(
                    f"placement rule {index}: task {member!r} needs a name and a mesh to place "
                    "state on"
                )
        if isinstance(task, list | tuple):
            try:
                task = TaskStack(tuple(task))
            except (TypeError, ValueError) as e:
                raise type(e)(f"placement rule {index}: {e}") from None
        if spec is not None and not isinstance(spec, PartitionSpec) and not callable(spec):
            raise TypeError(
                f"placement rule {index}: spec {spec!r} is neither a PartitionSpec nor a callable "
                "(path, variable) -> PartitionSpec"
            )
        compiled.append(
            PlacementRule(
                index=index, filter=flt, task=task, spec=spec, predicate=_predicate(flt, index)
            )
        )
    return compiled
