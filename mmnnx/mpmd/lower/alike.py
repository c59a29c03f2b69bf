"""Keys saying when two programs of a step are alike: the same computation on other devices.

The keys leave out value ids and devices (which enter only as positions in the task's mesh, with
its shape, axes, device kind and logical rules), so programs of equal keys lower to the same
module: the runner lowers the first and moves it to the others' devices
(:func:`mmnnx._jax.retarget.retarget`). What a key cannot compare by value it compares by
identity: alike programs may be missed, never confused.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
from jax.sharding import NamedSharding, SingleDeviceSharding

from mmnnx._jax.retarget import lowers_without_devices
from mmnnx.mpmd.ir import Graph, Op, live_ops
from mmnnx.mpmd.lower.program import Run
from mmnnx.mpmd.plan.cut import Fragment
from mmnnx.mpmd.primitives import is_constraint
from mmnnx.sharding import Task

_SMALL_CONSTANT = 1024  # elements: constants up to this size are compared by value


class _Unique:
    """Compares equal to nothing but itself: a part of a key compared by identity."""

    __slots__ = ("of",)

    def __init__(self, of: Any):
        self.of = of  # kept alive with the key, so no other object takes its id


class AlikeKeys:
    """The keys of one step's programs (``graph``'s), each fragment's made once."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self._fragments: dict[int, tuple[Fragment, Hashable | None]] = {}
        self._positions: dict[Task, dict[Any, int] | None] = {}

    def program(
        self, runs: Sequence[Run], in_shardings: Sequence[Sequence[Any]]
    ) -> Hashable | None:
        """The key of the program of ``runs`` (on one task) taking arguments laid out as
        ``in_shardings``; ``None``: alike no other program."""
        task = runs[0].task
        place = self._place(task)
        if place is None:
            return None
        parts: list[Hashable] = [place]
        for run, shardings in zip(runs, in_shardings, strict=True):
            fragment = self.fragment(run.fragment)
            if fragment is None:
                return None
            parts += [
                fragment,
                run.variant[1],
                run.donate,
                run.summed,
                run.returned,
                len(run.sums),
                run.packing.layout if run.packing is not None else None,
                self.layouts(task, shardings),
                self.layouts(task, run.out_shardings),
            ]
        return _hashable(tuple(parts))

    def start(self, task: Task, what: Hashable, shardings: Sequence[Any]) -> Hashable | None:
        """The key of a small program on ``task`` that ``what`` describes without slots or devices;
        ``None``: alike no other."""
        place = self._place(task)
        if place is None:
            return None
        return _hashable((place, what, self.layouts(task, shardings)))

    def fragment(self, fragment: Fragment) -> Hashable | None:
        """``fragment``'s ops with its values numbered in the order it reads and makes them;
        ``None`` where an op lowers differently on other devices."""
        known = self._fragments.get(id(fragment))
        if known is None:
            known = self._fragments[id(fragment)] = (fragment, _fragment_key(fragment, self.graph))
        return known[1]

    def layouts(self, task: Task, shardings: Sequence[Any]) -> tuple:
        """Each of ``shardings`` as the positions of its devices in ``task``'s mesh and the
        layout."""
        positions = self._positions.get(task)
        return tuple(_layout(s, positions) for s in shardings)

    def _place(self, task: Task) -> Hashable | None:
        """``task`` as its programs see it; ``None`` for a task over several processes."""
        mesh = task.jax_mesh
        devices = list(mesh.devices.flat)
        if len({d.process_index for d in devices}) > 1:
            return None
        self._positions.setdefault(task, {d: i for i, d in enumerate(devices)})
        kinds = tuple(sorted({(d.platform, d.device_kind) for d in devices}))
        return (mesh.devices.shape, mesh.axis_names, tuple(mesh.axis_types), kinds, task.rules)


def live_view(fragment: Fragment) -> tuple[list[Op], dict[int, int]]:
    """What ``fragment`` computes, as a program of it runs: the ops its results need, in order
    (the others are dropped when it is lowered), but for ``mm.with_sharding_constraint`` on a
    one-device task (nothing to lay out), which reads as its operand: ``aliases`` maps such a
    constraint's result to the value it stands for."""
    one_device = fragment.task.jax_mesh.size == 1
    aliases: dict[int, int] = {}
    ops = []
    for op in live_ops(fragment.ops, fragment.out_ids):
        if one_device and is_constraint(op) and type(op.ins[0]) is int:
            aliases[op.outs[0]] = aliases.get(op.ins[0], op.ins[0])
        else:
            ops.append(op)
    return ops, aliases


def _fragment_key(fragment: Fragment, graph: Graph) -> Hashable | None:
    number = {v: i for i, v in enumerate(fragment.in_ids)}
    shapes, dtypes, specs = graph.shapes, graph.dtypes, graph.specs
    values = [(shapes[v], dtypes[v], specs.get(v)) for v in fragment.in_ids]
    ops, aliases = live_view(fragment)
    ops_key = []
    for op in ops:
        key = op_key(op, graph)
        if key is None:
            return None
        ins = tuple([number.get(aliases.get(a, a), _Unique(a)) for a in op.ins if type(a) is int])
        for v in op.outs:
            number[v] = len(number)
        ops_key.append((key, ins))
    outs = tuple(number.get(aliases.get(v, v), _Unique(v)) for v in fragment.out_ids)
    return _hashable((tuple(ops_key), tuple(values), outs))


def op_key(op: Op, graph: Graph) -> Hashable | None:
    """``op`` without its values: its primitive, parameters, constant operands (and where the
    others go), and the shapes, dtypes and types of what it reads and makes; ``None`` for an op
    that lowers differently on other devices of one kind.

    Example:
        >>> import jax
        >>> from mmnnx.mpmd.ir import Const
        >>> graph = Graph(shapes=[(2,), (2,)], dtypes=["float32"] * 2)
        >>> add = lambda i, o: Op(0, jax.lax.add_p, {}, [i, Const(1.0)], [o], False, "", "add")
        >>> op_key(add(0, 1), graph) == op_key(add(1, 0), graph)
        True
    """
    if not lowers_without_devices(op.primitive):
        return None
    shapes, dtypes, specs = graph.shapes, graph.dtypes, graph.specs
    operands = tuple(
        [
            (shapes[a], dtypes[a], specs.get(a)) if type(a) is int else _constant(a.value)
            for a in op.ins
        ]
    )
    made = tuple([(shapes[v], dtypes[v], specs.get(v)) for v in op.outs])
    return (op.primitive, _params(op.params), operands, made, op.mesh)


_PLAIN = frozenset({int, float, bool, str, type(None)})


def _params(params: dict) -> tuple:
    return tuple([(name, _value(v)) for name, v in params.items()])


def _value(v: Any) -> Hashable:
    """A parameter as a hashable key: containers item by item, arrays by identity, scalars
    with their type (``1 == 1.0``, yet they may lower differently)."""
    kind = type(v)
    if kind in _PLAIN:
        return (kind, v)
    if kind is tuple or kind is list:
        return (kind, tuple([_value(x) for x in v]))
    if isinstance(v, dict):
        return (dict, tuple((k, _value(x)) for k, x in v.items()))
    if isinstance(v, np.ndarray):
        return _Unique(v)
    return v


def _constant(value: Any) -> Hashable:
    """A constant operand's key: its type, dtype, shape and (when small) value."""
    kind = type(value)
    if kind in _PLAIN:
        return (kind, value)
    shape = tuple(getattr(value, "shape", ()))
    if math.prod(shape) > _SMALL_CONSTANT:
        return _Unique(value)
    try:
        data = np.asarray(value)
    except Exception:  # not an array (a token, a key): compared by identity
        return _Unique(value)
    return (kind, data.dtype, shape, data.tobytes())


def _layout(sharding: Any, positions: dict[Any, int] | None) -> Hashable:
    if sharding is None or positions is None:
        return sharding if positions is not None else _Unique(sharding)
    if type(sharding) is SingleDeviceSharding:
        device = positions.get(sharding._device)
        return _Unique(sharding) if device is None else (device, sharding._memory_kind)
    if type(sharding) is NamedSharding and hasattr(sharding.mesh, "devices"):
        mesh = sharding.mesh
        at = tuple(positions.get(d) for d in mesh.devices.flat)
        if None in at:
            return _Unique(sharding)
        return (
            at,
            mesh.devices.shape,
            mesh.axis_names,
            tuple(mesh.axis_types),
            sharding.spec,
            sharding._memory_kind,
        )
    return _Unique(sharding)


def _hashable(key: tuple) -> Hashable | None:
    """``key``, or ``None`` if a part of it cannot be hashed (then alike no other)."""
    try:
        hash(key)
    except TypeError:
        return None
    return key
