"""The one module that knows how Flax NNX stores things: which objects are Variables, how a
model's Variables are walked, where Flax keeps logical axis names, and how a step's new values
are written back. A Flax upgrade changes this file (and ``mpmd/_jax.py`` for JAX) only.

It imports nothing of mmnnx's, so every layer may use it.

Example:
    >>> from flax import nnx
    >>> from mmnnx import _nnx
    >>> [path for path, _ in _nnx.variables_of(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))]
    [('bias',), ('kernel',)]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from flax import nnx

Path = tuple[Any, ...]

# Flax 0.12 keeps logical names under "out_sharding"; older releases used the other two keys.
_LOGICAL_KEYS = ("out_sharding", "sharding_names", "sharding")

_VARIABLE_TYPES: dict[type, bool] = {}


def is_variable(x: Any) -> bool:
    """``isinstance(x, nnx.Variable)``, memoised per type: Flax's metaclass check runs in Python
    and mm.jit asks it of every node of every argument on every call.

    Example:
        >>> from flax import nnx
        >>> is_variable(nnx.Param(1.0)), is_variable(1.0)
        (True, False)
    """
    kind = type(x)
    known = _VARIABLE_TYPES.get(kind)
    if known is None:
        known = isinstance(x, nnx.Variable)
        if not _is_tracer(x):  # a traced Variable's answer depends on its value
            _VARIABLE_TYPES[kind] = known
    return known


def _is_tracer(x: Any) -> bool:
    import jax  # noqa: PLC0415  (flax imports jax already)

    return isinstance(x, jax.core.Tracer)


def variables_of(node: Any) -> list[tuple[Path, nnx.Variable]]:
    """Every Variable reachable from ``node`` (a Module, an Optimizer, a graph of them), shared
    ones once, with its path of keys.

    Example:
        >>> from flax import nnx
        >>> model = nnx.Sequential(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
        >>> [p for p, _ in variables_of(model)]
        [('layers', 0, 'bias'), ('layers', 0, 'kernel')]
    """
    return [(path, v) for path, v in nnx.iter_graph(node) if is_variable(v)]


def logical_names(variable: nnx.Variable) -> tuple[str | None, ...] | None:
    """The logical axis names a Variable was annotated with (``nnx.with_partitioning``), if any.

    Example:
        >>> from flax import nnx
        >>> init = nnx.with_partitioning(nnx.initializers.ones_init(), ("embed", "mlp"))
        >>> with nnx.use_eager_sharding(False):
        ...     layer = nnx.Linear(2, 2, kernel_init=init, rngs=nnx.Rngs(0))
        >>> logical_names(layer.kernel)
        ('embed', 'mlp')
    """
    meta = variable.get_metadata()
    for key in _LOGICAL_KEYS:
        names = meta.get(key)
        if isinstance(names, tuple | list) and all(n is None or isinstance(n, str) for n in names):
            return tuple(names)
    return None


def set_values(variables: Sequence[nnx.Variable], values: Sequence[Any]) -> None:
    """Writes a step's new values into the caller's Variables.

    Flax checks on every write that the Variable may be updated at the current trace level
    (about 2 us each); all of a call's Variables come from the caller's level, so the first write
    is checked and the rest store the value directly. Flax's own bypass,
    ``set_raw_value(x, _unsafe_bypass_check=True)``, still goes through ``Variable.__setattr__``:
    measured 1.4 us per Variable against 0.15 us for the slot write below (flax 0.12.8), which
    would add 0.12 ms to a 0.7 ms step of 100 Variables. The doctest checks the slot still works.

    Example:
        >>> from flax import nnx
        >>> a, b = nnx.Param(1.0), nnx.Param(2.0)
        >>> set_values([a, b], [3.0, 4.0])
        >>> a.get_value(), b.get_value()
        (3.0, 4.0)
    """
    if not variables:
        return
    variables[0].set_raw_value(values[0])
    for variable, value in zip(variables[1:], values[1:], strict=True):
        object.__setattr__(variable, "_raw_value", value)
