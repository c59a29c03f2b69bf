"""The engine's flat intermediate representation: values (ints) and the ops between them."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from mmnnx.sharding.specs import itemsize

REGION_PREFIX = "mm_task:"
"""``mm.task(fn, t)`` traces ``fn`` under the name scope ``REGION_PREFIX + t.name``: every op in
it (and in its backward pass) runs on ``t``."""

GROUP_PREFIX = "mm_microbatch:"
"""``mm.microbatch`` traces its body under the name scope ``GROUP_PREFIX + str(group)``."""


@dataclasses.dataclass(frozen=True)
class Const:
    """A constant operand (a literal or a closed-over array)."""

    value: Any


Atom = int | Const


@dataclasses.dataclass
class Op:
    """One primitive application: reads ``ins``, writes ``outs`` (value ids). ``backward``,
    ``region`` (the innermost ``mm.task``'s) and ``group`` (the ``mm.microbatch`` call) come from
    its name scope; ``may_fail``: it calls back into Python; ``mesh``: under explicit mesh axes, the
    abstract mesh it was traced under, which re-tracing it must restore."""

    index: int
    primitive: Any
    params: dict
    ins: list[Atom]
    outs: list[int]
    multiple_results: bool
    source: str
    name: str
    scope: str = ""
    effectful: bool = False
    backward: bool = False
    region: str | None = None
    group: int | None = None
    may_fail: bool = False
    mesh: Any = None  # under explicit axes: the abstract mesh the op was traced under

    def derived(self, primitive: Any, params: dict, ins: list[Atom], outs: list[int]) -> Op:
        """An op of ``primitive`` standing in for (part of) this one; indexed when it joins a
        graph."""
        return dataclasses.replace(
            self,
            index=-1,
            primitive=primitive,
            params=params,
            ins=ins,
            outs=outs,
            multiple_results=primitive.multiple_results,
            name=primitive.name,
        )


@dataclasses.dataclass
class Graph:
    """A traced step: ops in a valid order, the input values, and the output atoms."""

    ops: list[Op] = dataclasses.field(default_factory=list)
    inputs: list[int] = dataclasses.field(default_factory=list)
    outputs: list[Atom] = dataclasses.field(default_factory=list)
    shapes: list[tuple[int, ...]] = dataclasses.field(default_factory=list)
    dtypes: list[Any] = dataclasses.field(default_factory=list)
    nbytes: list[int] = dataclasses.field(default_factory=list)
    # Under explicit mesh axes: each value's sharding type, which every program must keep
    specs: dict[int, Any] = dataclasses.field(default_factory=dict)
    _producers: dict[int, Op] | None = dataclasses.field(default=None, repr=False)
    _consumers: dict[int, list[Op]] | None = dataclasses.field(default=None, repr=False)
    # (the ops list it was computed for, its length, the result): cut.after_backward's cache
    _after_backward: tuple | None = dataclasses.field(default=None, repr=False)

    def copy(self) -> Graph:
        """A graph planning can change without changing this one (the ops are shared: planning
        replaces ops, never changes one)."""
        return Graph(
            ops=list(self.ops),
            inputs=list(self.inputs),
            outputs=list(self.outputs),
            shapes=list(self.shapes),
            dtypes=list(self.dtypes),
            nbytes=list(self.nbytes),
            specs=dict(self.specs),
        )

    def new_value(self, info: tuple[tuple[int, ...], Any, int]) -> int:
        shape, dtype, nbytes = info
        self.shapes.append(shape)
        self.dtypes.append(dtype)
        self.nbytes.append(nbytes)
        return len(self.shapes) - 1

    def producers(self) -> dict[int, Op]:
        """Value id -> the op that makes it (computed once; the graph is complete by then)."""
        if self._producers is None:
            self._producers = {v: op for op in self.ops for v in op.outs}
        return self._producers

    def consumers(self) -> dict[int, list[Op]]:
        """Value id -> the ops that read it, in graph order (computed once)."""
        if self._consumers is None:
            self._consumers = {}
            for op in self.ops:
                for a in op.ins:
                    if isinstance(a, int):
                        self._consumers.setdefault(a, []).append(op)
        return self._consumers


def live_ops(ops: Sequence[Op], needed: Iterable[Any], keep: Callable = lambda op: False) -> list:
    """The ops of ``ops`` with an effect, that ``keep`` accepts or that make a value ``needed`` or
    read by another kept one, in order."""
    needed = set(needed)
    kept = []
    for op in reversed(ops):
        if op.effectful or keep(op) or any(v in needed for v in op.outs):
            kept.append(op)
            needed.update(a for a in op.ins if type(a) is int)
    return kept[::-1]


def aval_info(aval: Any) -> tuple[tuple[int, ...], Any, int]:
    """A value's ``(shape, dtype, bytes)`` from a JAX abstract value (bytes 0 for a token)."""
    shape = tuple(getattr(aval, "shape", ()))
    dtype = getattr(aval, "dtype", np.dtype("float32"))
    return shape, dtype, _nbytes(shape, dtype)


@functools.lru_cache(maxsize=4096)
def _nbytes(shape: tuple[int, ...], dtype: Any) -> int:
    try:
        return math.prod(shape) * itemsize(dtype)
    except TypeError:
        return 0
