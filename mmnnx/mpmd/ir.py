"""The engine's flat intermediate representation: values (ints) and the ops between them."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

REGION_PREFIX = "mm_task:"
_REGION = re.compile(re.escape(REGION_PREFIX) + r"([^/()]+)")


@dataclasses.dataclass(frozen=True)
class Const:
    """A constant operand (a literal or a closed-over array)."""

    value: Any


Atom = int | Const


@dataclasses.dataclass
class Op:
    """One primitive application: reads ``ins``, writes ``outs`` (value ids)."""

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

    @property
    def backward(self) -> bool:
        return "transpose(" in self.scope

    @property
    def region(self) -> str | None:
        """The task name of the innermost ``mm.task`` region this op was traced in, if any."""
        found = _REGION.findall(self.scope)
        return found[-1] if found else None


@dataclasses.dataclass
class Graph:
    """A traced step: ops in a valid order, the input values, and the output atoms."""

    ops: list[Op] = dataclasses.field(default_factory=list)
    inputs: list[int] = dataclasses.field(default_factory=list)
    outputs: list[Atom] = dataclasses.field(default_factory=list)
    shapes: list[tuple[int, ...]] = dataclasses.field(default_factory=list)
    dtypes: list[Any] = dataclasses.field(default_factory=list)
    nbytes: list[int] = dataclasses.field(default_factory=list)
    _producers: dict[int, Op] | None = dataclasses.field(default=None, repr=False)
    _consumers: dict[int, list[Op]] | None = dataclasses.field(default=None, repr=False)

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
