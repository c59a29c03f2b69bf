"""Where a pipelined step's running sums live: a gradient's sum takes its parameter's layout.

A microbatch sum whose layout nothing pins would start replicated, so each backward would
all-reduce its gradients into a whole copy on every device. After the loop, a gradient meets its
parameter (or that parameter's optimizer state, laid out alike) elementwise: ``p - lr * g``,
``b1 * mu + (1 - b1) * g``. :func:`sum_layouts` follows those elementwise ops of the same shape
from each sum to a step input or output placed on the sum's task and gives the sum that layout:
the backward's gradient is then reduce-scattered into a sum held in shards (with FSDP, 1/N of
it per device). The layout changes no result, only which collective the backward runs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from jax.sharding import NamedSharding, PartitionSpec

from mmnnx.mpmd.ir import Const, Graph, Op
from mmnnx.mpmd.step_io import StepInput, StepOutput
from mmnnx.sharding import Task


class _Classes:
    """Union-find over value ids."""

    def __init__(self) -> None:
        self.parent: dict[int, int] = {}

    def find(self, v: int) -> int:
        root = v
        while self.parent.get(root, root) != root:
            root = self.parent[root]
        while v != root:
            self.parent[v], v = root, self.parent.get(v, v)
        return root

    def join(self, a: int, b: int) -> None:
        self.parent[self.find(a)] = self.find(b)


# Primitives computing each element from the same element of their operands (and scalars): an
# optimizer update's arithmetic. A transpose or a square matmul keeps a shape, not a layout.
# fmt: off
_ELEMENTWISE = frozenset({
    "abs", "add", "add_any", "and", "atan2", "cbrt", "ceil", "clamp", "convert_element_type",
    "copy", "cos", "div", "eq", "erf", "exp", "exp2", "expm1", "floor", "ge", "gt",
    "integer_pow", "is_finite", "le", "log", "log1p", "logistic", "lt", "max", "min", "mul",
    "ne", "neg", "nextafter", "not", "or", "pow", "rem", "round", "rsqrt", "select_n", "sign",
    "sin", "sqrt", "square", "sub", "tanh", "xor",
})
# fmt: on


def _elementwise(graph: Graph, op: Op) -> bool:
    """Whether ``op`` computes each element of its one result from the same element of each of
    its non-scalar operands."""
    if getattr(op.primitive, "name", None) not in _ELEMENTWISE or len(op.outs) != 1:
        return False
    shape = graph.shapes[op.outs[0]]
    operands = [a for a in op.ins if isinstance(a, int) and graph.shapes[a] != ()]
    return bool(shape) and bool(operands) and all(graph.shapes[a] == shape for a in operands)


def sum_layouts(
    graph: Graph,
    sums: Iterable[int],
    after: Sequence[Op],
    inputs: Sequence[StepInput],
    outputs: Sequence[StepOutput],
) -> dict[int, tuple[NamedSharding, ...]]:
    """The layouts each running sum of ``sums`` (value ids) meets through elementwise ops of
    ``after`` (those after the loop): those of step inputs and outputs placed on a task, one
    per spec and mesh; :func:`layout_on` picks the sum's.

    Example:
        >>> import numpy as np
        >>> from jax import lax
        >>> from jax.sharding import PartitionSpec as P
        >>> from mmnnx.sharding import TaskMesh
        >>> t = Task("t", mesh=TaskMesh(devices=range(2), axis_names=("fsdp",)))
        >>> g = Graph(inputs=[0], shapes=[(4,), (4,), (4,)], dtypes=[np.float32] * 3)
        >>> op = Op(0, lax.sub_p, {}, [0, 1], [2], False, "", "sub")
        >>> p = StepInput(name="p", task=t, spec=P("fsdp"), sharding=t.sharding(P("fsdp")))
        >>> layout_on(t, sum_layouts(g, [1], [op], [p], [])[1]).spec
        P('fsdp',)
    """
    classes = _Classes()
    for op in after:
        if _elementwise(graph, op):
            for a in op.ins:
                if isinstance(a, int) and graph.shapes[a] != ():
                    classes.join(a, op.outs[0])
    anchors = [
        (v, item.task_sharding)
        for v, item in zip(graph.inputs, inputs, strict=True)
        if item.task is not None
    ]
    anchors += [
        (atom, output.sharding)
        for atom, output in zip(graph.outputs, outputs, strict=True)
        if not isinstance(atom, Const)
    ]
    met: dict[int, dict[tuple, NamedSharding]] = {}
    for v, s in anchors:
        if isinstance(s, NamedSharding):
            key = (id(s.mesh), trimmed(s.spec))
            met.setdefault(classes.find(v), {}).setdefault(key, s)
    return {u: tuple(met.get(classes.find(u), {}).values()) for u in sums}


def layout_on(task: Task, layouts: Sequence[NamedSharding]) -> NamedSharding | None:
    """The one layout of ``layouts`` on ``task``'s mesh; ``None`` if none or several.

    Example:
        >>> from mmnnx.sharding import TaskMesh
        >>> layout_on(Task("t", mesh=TaskMesh(devices=range(2), axis_names=("x",))), ()) is None
        True
    """
    mesh = task.jax_mesh
    here = {trimmed(s.spec): s for s in layouts if s.mesh == mesh}
    return next(iter(here.values())) if len(here) == 1 else None


def trimmed(spec: PartitionSpec) -> tuple:
    """``spec``'s entries without trailing ``None``: equal for specs laying an array out alike.

    Example:
        >>> trimmed(PartitionSpec("x", None)) == trimmed(PartitionSpec("x"))
        True
    """
    entries = list(spec)
    while entries and entries[-1] is None:
        entries.pop()
    return tuple(entries)
