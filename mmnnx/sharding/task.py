"""Task: a named submesh with logical-axis rules, and the logical -> physical spec translation."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mmnnx.sharding.task_mesh import TaskMesh

DeviceAxes = str | tuple[str, ...] | None
LogicalRules = tuple[tuple[str, DeviceAxes], ...]


def logical_rules(*pairs: tuple[str, DeviceAxes], **rules: DeviceAxes) -> LogicalRules:
    """Priority-ordered ``(logical_name, device_axis_or_None)`` pairs: positional ones, then
    keywords.

    Example:
        >>> logical_rules(batch="data", mlp="model", embed=None)
        (('batch', 'data'), ('mlp', 'model'), ('embed', None))
    """
    return normalize_rules(tuple(pairs) + tuple(rules.items()), "logical_rules")


def normalize_rules(rules: Any, what: str) -> LogicalRules:
    """Checks and freezes a rule list given as pairs or a mapping."""
    if rules is None:
        return ()
    if isinstance(rules, Mapping):
        rules = tuple(rules.items())
    out = []
    for rule in rules:
        if not (isinstance(rule, Sequence) and not isinstance(rule, str) and len(rule) == 2):
            raise TypeError(f"{what}: rule {rule!r} is not a (logical_name, device_axis) pair")
        name, axes = rule
        if not isinstance(name, str):
            raise TypeError(f"{what}: logical name {name!r} in rule {tuple(rule)!r} is not a str")
        if isinstance(axes, list):
            axes = tuple(axes)
        all_str = isinstance(axes, tuple) and all(isinstance(a, str) for a in axes)
        if not (axes is None or isinstance(axes, str) or all_str):
            raise TypeError(
                f"{what}: device axis {axes!r} for logical name {name!r} must be a str, "
                "a tuple of str, or None"
            )
        out.append((name, axes))
    return tuple(out)


def axes_of(axes: DeviceAxes) -> tuple[str, ...]:
    """The device axes of a spec entry as a tuple (``None``: none)."""
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


@dataclasses.dataclass(frozen=True)
class Task:
    """A named place for computation and state: a ``mesh`` (:class:`TaskMesh` or
    ``jax.sharding.Mesh``) and priority-ordered ``logical_axes`` rules (then ``extra_axes``).

    Example:
        >>> tm = TaskMesh(devices=range(4), axis_sizes=(2, 2), axis_names=("data", "model"))
        >>> t = Task("stage0", mesh=tm, logical_axes=logical_rules(batch="data", mlp="model"))
        >>> t.spec(("batch", "mlp"))
        P('data', 'model')
    """

    name: str | None = None
    mesh: TaskMesh | Mesh | None = dataclasses.field(default=None, kw_only=True)
    logical_axes: LogicalRules | None = dataclasses.field(default=None, kw_only=True)
    extra_axes: LogicalRules | None = dataclasses.field(default=None, kw_only=True)

    def __post_init__(self):
        what = f"Task {self.name!r}"
        if self.name is not None and not isinstance(self.name, str):
            raise TypeError(f"Task name {self.name!r} is not a str")
        if self.mesh is not None and not isinstance(self.mesh, TaskMesh | Mesh):
            raise TypeError(
                f"{what}: mesh must be a TaskMesh or a jax.sharding.Mesh, got {type(self.mesh)}"
            )
        object.__setattr__(self, "logical_axes", normalize_rules(self.logical_axes, what))
        object.__setattr__(self, "extra_axes", normalize_rules(self.extra_axes, what))
        if self.mesh is not None:
            names = self.axis_names
            for logical, axes in self.logical_axes + self.extra_axes:
                for axis in axes_of(axes):
                    if axis not in names:
                        raise ValueError(
                            f"{what}: logical rule {logical!r} -> {axis!r} names a device axis "
                            f"the task mesh lacks; its axes are {names}"
                        )

    def _key(self) -> tuple:
        """What equality and hashing compare (subclasses add their fields)."""
        return (self.name, self.mesh, self.logical_axes, self.extra_axes)

    def __eq__(self, other):
        if self is other:
            return True
        return isinstance(other, Task) and self._hash == other._hash and self._key() == other._key()

    def __hash__(self):
        return self._hash

    @functools.cached_property
    def _hash(self) -> int:  # the engine hashes tasks in its inner loops; fields are frozen
        return hash(self._key())

    def __getstate__(self):  # string hashes differ between processes: never ship a cached one
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    def __repr__(self):
        return f"Task({self.name!r}, mesh={self.mesh!r})"

    @property
    def home(self) -> Task:
        """The task whose devices this one runs on: itself, or the task a :meth:`virtual_stage` is
        of.

        Example:
            >>> t = Task("t", mesh=TaskMesh(devices=[0]))
            >>> t.home is t, t.virtual_stage(1).home is t
            (True, True)
        """
        return self

    def virtual_stage(self, index: int) -> Task:
        """This task's ``index``-th pipeline stage (``"<name>:<index>"``, same mesh and rules, run
        on this task's rank), for a forward pass that visits the task more than once in a row (the V
        placement of ``zero-bubble-v``); ``virtual_stage(0)`` is this task.

        Example:
            >>> t = Task("t", mesh=TaskMesh(devices=[0]))
            >>> t.virtual_stage(1).name, t.virtual_stage(1) == t, t.virtual_stage(0) is t
            ('t:1', False, True)
        """
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            raise ValueError(f"Task {self.name!r}: virtual_stage index must be an int >= 0, got "
                             f"{index!r}")  # fmt: skip
        home = self.home
        if index == 0:
            return home
        return _VirtualStage(
            f"{home.name}:{index}",
            mesh=home.mesh,
            logical_axes=home.logical_axes,
            extra_axes=home.extra_axes,
            of=home,
            index=index,
        )

    @property
    def jax_mesh(self) -> Mesh:
        """The concrete ``jax.sharding.Mesh`` this task runs on."""
        if self.mesh is None:
            raise ValueError(f"Task {self.name!r} has no mesh")
        return self.mesh.mesh if isinstance(self.mesh, TaskMesh) else self.mesh

    @property
    def axis_names(self) -> tuple[str, ...]:
        if self.mesh is None:
            return ()
        return tuple(self.mesh.axis_names)

    @property
    def rules(self) -> LogicalRules:
        """All logical rules in priority order: ``logical_axes`` then ``extra_axes``."""
        return self.logical_axes + self.extra_axes

    def spec(self, logical_names: Sequence[str | None]) -> PartitionSpec:
        """Logical dimension names translated by the rules, in priority order, to a PartitionSpec; a
        device axis is used once per spec (a later dimension reusing it, or an unmapped name, is
        replicated).

        Example:
            >>> tm = TaskMesh(devices=range(2), axis_names=("model",))
            >>> Task("t", mesh=tm, logical_axes=[("mlp", "model")]).spec(("mlp", "mlp"))
            P('model', None)
        """
        names = tuple(logical_names)
        for n in names:
            if n is not None and not isinstance(n, str):
                raise TypeError(
                    f"Task {self.name!r}: logical name {n!r} in {names!r} must be a str or None"
                )
        unassigned = object()
        result: list[Any] = [unassigned] * len(names)
        used: set[str] = set()
        for logical, axes in self.rules:
            wanted = axes_of(axes)
            for dim, n in enumerate(names):
                if n != logical or result[dim] is not unassigned or used.intersection(wanted):
                    continue
                result[dim] = axes
                used.update(wanted)
        return PartitionSpec(*(None if r is unassigned else r for r in result))

    def resolve(self, names: Sequence[Any], *, where: str | None = None) -> PartitionSpec:
        """Spec entries mixing logical names (through the rules) and this task's device axes (kept);
        an entry that is neither is replicated, or with ``where`` raises a ``ValueError`` naming it.

        Example:
            >>> tm = TaskMesh(devices=range(4), axis_sizes=(2, 2), axis_names=("data", "model"))
            >>> Task("t", mesh=tm, logical_axes=[("batch", "data")]).resolve(("batch", "model"))
            P('data', 'model')
        """
        names = tuple(names)
        logical = {name for name, _ in self.rules}
        axes = set(self.axis_names)
        translated = self.spec(
            tuple(n if isinstance(n, str) and n in logical else None for n in names)
        )
        out: list[Any] = []
        for n, t in zip(names, translated, strict=True):
            unknown = [
                a for a in (axes_of(n) if isinstance(n, str | tuple) else ()) if a not in axes
            ]
            if n is None or (isinstance(n, str) and n in logical):
                out.append(t)
            elif isinstance(n, str | tuple) and not unknown:
                out.append(n)
            elif where is None:
                out.append(n if isinstance(n, tuple) else t)
            else:
                raise ValueError(
                    f"{where}: {unknown[0]!r} is neither a device axis of task {self.name!r} "
                    f"(axes {sorted(axes)}) nor a logical name of its rules ({sorted(logical)}); "
                    f"add a rule for it, e.g. logical_rules({unknown[0]}=None) in the task's "
                    "logical_axes to replicate that dimension"
                )
        return PartitionSpec(*out)

    def sharding(self, spec: PartitionSpec | None = None) -> NamedSharding:
        """A ``NamedSharding`` on this task's mesh (replicated when ``spec`` is None).

        Example:
            >>> t = Task("t", mesh=TaskMesh(devices=range(2)))
            >>> t.sharding(PartitionSpec("x")).spec
            P('x',)
        """
        return NamedSharding(self.jax_mesh, PartitionSpec() if spec is None else spec)


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class _VirtualStage(Task):
    """A later pipeline stage on the devices of task ``of`` (see :meth:`Task.virtual_stage`)."""

    of: Task | None = dataclasses.field(default=None, kw_only=True)
    index: int = dataclasses.field(default=1, kw_only=True)

    def _key(self) -> tuple:
        return (*super()._key(), self.of, self.index)

    @property
    def home(self) -> Task:
        assert self.of is not None
        return self.of
