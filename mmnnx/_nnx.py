"""The one module that knows how Flax NNX stores things: which objects are Variables, how a
model's Variables are walked, where Flax keeps logical axis names, and how a step's new values
are written back. A Flax upgrade changes this file (and the package ``_jax`` for JAX) only.

It imports nothing of mmnnx's, so every layer may use it.

Example:
    >>> from flax import nnx
    >>> from mmnnx import _nnx
    >>> [path for path, _ in _nnx.variables_of(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))]
    [('bias',), ('kernel',)]
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import flax
import jax
from flax import nnx
from jax.sharding import PartitionSpec

Path = tuple[Any, ...]

# Flax 0.12 keeps logical names under "out_sharding"; older releases used the other two keys.
_LOGICAL_KEYS = ("out_sharding", "sharding_names", "sharding")

_VARIABLE_TYPES: dict[type, bool] = {}


def is_variable(x: Any) -> bool:
    """``isinstance(x, nnx.Variable)``, memoised per type (Flax's metaclass check is slow).

    Example:
        >>> from flax import nnx
        >>> is_variable(nnx.Param(1.0)), is_variable(1.0)
        (True, False)
    """
    kind = type(x)
    known = _VARIABLE_TYPES.get(kind)
    if known is None:
        known = isinstance(x, nnx.Variable)
        if not isinstance(x, jax.core.Tracer):  # a traced Variable's answer depends on its value
            _VARIABLE_TYPES[kind] = known
    return known


def variables_of(node: Any) -> list[tuple[Path, nnx.Variable]]:
    """Every Variable reachable from ``node``, shared ones once, with its path of keys.

    Example:
        >>> from flax import nnx
        >>> model = nnx.Sequential(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
        >>> [p for p, _ in variables_of(model)]
        [('layers', 0, 'bias'), ('layers', 0, 'kernel')]
    """
    return [(path, v) for path, v in nnx.iter_graph(node) if is_variable(v)]


def variable_from(kind: type, metadata: dict, value: Any) -> nnx.Variable:
    """A ``kind`` Variable holding ``value`` with ``metadata``, made as Flax rebuilds one (no eager
    sharding).

    Example:
        >>> from flax import nnx
        >>> v = variable_from(nnx.Intermediate, nnx.Intermediate(()).get_metadata(), (1.0,))
        >>> v.get_value()
        (1.0,)
    """
    return kind.from_metadata(value, metadata)


def remove_variables(roots: Sequence[Any], variables: Sequence[nnx.Variable]) -> None:
    """Deletes ``variables`` from the Modules under ``roots`` holding them as attributes.

    Example:
        >>> from flax import nnx
        >>> layer = nnx.Linear(1, 1, rngs=nnx.Rngs(0))
        >>> layer.h = nnx.Intermediate((1.0,))
        >>> remove_variables([layer], [layer.h])
        >>> hasattr(layer, "h")
        False
    """
    doomed = {id(v) for v in variables}
    for root in roots:
        nodes = dict(nnx.iter_graph(root))
        for path, node in nodes.items():
            if id(node) in doomed and path:
                parent = nodes.get(path[:-1])
                if str(path[-1]) in getattr(parent, "__dict__", {}):
                    delattr(parent, str(path[-1]))


def mirrors_a_variable(x: Any) -> bool:
    """Whether ``x`` is optimizer state made from a model Variable (``nnx.OptVariable``, which
    copies the parameter's metadata, its placement included).

    Example:
        >>> import optax
        >>> from flax import nnx
        >>> opt = nnx.Optimizer(nnx.Linear(1, 1, rngs=nnx.Rngs(0)), optax.adam(0.1), wrt=nnx.Param)
        >>> mirrors_a_variable(opt.opt_state[0].mu["kernel"]), mirrors_a_variable(opt.step)
        (True, False)
    """
    return isinstance(x, nnx.OptVariable)


def outside_state_error(error: BaseException) -> str | None:
    """What a traced function changed that was created outside it, if ``error`` is Flax's
    ``TraceContextError``: ``"an nnx.Rngs"`` or ``"a Variable"``.

    Example:
        >>> import jax
        >>> from flax import nnx
        >>> rngs = nnx.Rngs(0)
        >>> try:
        ...     jax.eval_shape(lambda: rngs.params())
        ... except Exception as e:
        ...     outside_state_error(e)
        'an nnx.Rngs'
    """
    if not isinstance(error, flax.errors.TraceContextError):
        return None
    return "an nnx.Rngs" if "Rng" in str(error) else "a Variable"


@contextlib.contextmanager
def taken_as_data(kind: type) -> Iterator[None]:
    """Inside this block Flax takes a ``kind`` value assigned to a Module attribute as data: its
    check misses tracers, so a Module built under a trace would keep a traced array attribute as
    static.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from flax import nnx
        >>> seen = []
        >>> def build():
        ...     x = jnp.ones(2)
        ...     with taken_as_data(type(x)):
        ...         inside = nnx.is_data(x)
        ...     seen.append((nnx.is_data(x), inside))
        ...     return x
        >>> _ = jax.make_jaxpr(build)()
        >>> seen
        [(False, True)]
    """
    registry = flax.nnx.pytreelib.DATA_REGISTRY
    added = kind not in registry
    registry.add(kind)
    try:
        yield
    finally:
        if added:
            registry.discard(kind)


def holders_of(roots: Sequence[Any]) -> list[dict | list]:
    """The mutable containers holding the children of everything reachable from ``roots``
    (``__dict__``s, ``nnx.State`` mappings, plain lists and dicts): a child added anywhere makes one
    of them longer.

    Example:
        >>> from flax import nnx
        >>> model = nnx.Sequential(nnx.Linear(1, 1, rngs=nnx.Rngs(0)))
        >>> sizes = [len(h) for h in holders_of([model])]
        >>> model.layers[0].scale = nnx.Param(1.0)
        >>> [len(h) for h in holders_of([model])] == sizes
        False
    """
    found: dict[int, dict | list] = {}
    for root in roots:
        for _, node in nnx.iter_graph(root):
            if isinstance(node, nnx.Pytree):
                holder = vars(node)
            elif isinstance(node, nnx.State):
                holder = node.raw_mapping
            elif type(node) in (list, dict):
                holder = node
            else:
                continue
            found.setdefault(id(holder), holder)
    return list(found.values())


def child_slot(parent: Any, key: Any) -> tuple[Any, Any] | None:
    """``(holder, k)`` such that ``holder[k]`` is ``parent``'s child at pytree key ``key`` (``None``
    if unknown); an ``nnx.State``'s raw mapping, since it wraps nested dicts anew on every access.

    Example:
        >>> import jax
        >>> from flax import nnx
        >>> layer = nnx.Linear(1, 1, rngs=nnx.Rngs(0))
        >>> holder, k = child_slot(layer, jax.tree_util.GetAttrKey("kernel"))
        >>> holder[k] is layer.kernel
        True
    """
    if isinstance(key, jax.tree_util.SequenceKey) and isinstance(parent, list | tuple):
        return parent, key.idx
    if isinstance(key, jax.tree_util.GetAttrKey | jax.tree_util.SequenceKey):
        name = key.name if isinstance(key, jax.tree_util.GetAttrKey) else str(key.idx)
        attrs = getattr(parent, "__dict__", None)
        return (attrs, name) if attrs is not None and name in attrs else None
    if isinstance(key, jax.tree_util.DictKey):
        holder = parent.raw_mapping if isinstance(parent, nnx.State) else parent
        return (holder, key.key) if isinstance(holder, dict) else None
    return None


def annotated_spec(variable: nnx.Variable) -> PartitionSpec | None:
    """The ``PartitionSpec`` a Variable was annotated with (``out_sharding``), if any.

    Example:
        >>> from flax import nnx
        >>> from jax.sharding import PartitionSpec as P
        >>> with nnx.use_eager_sharding(False):
        ...     layer = nnx.Linear(2, 2, kernel_metadata={"out_sharding": P(None, "model")},
        ...                        rngs=nnx.Rngs(0))
        >>> annotated_spec(layer.kernel)
        P(None, 'model')
    """
    meta = variable.get_metadata()
    for key in _LOGICAL_KEYS:
        if isinstance(spec := meta.get(key), PartitionSpec):
            return spec
    return None


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
    """Writes a step's new values into the caller's Variables: Flax checks the trace level of the
    first write; the rest store into the slot directly (ten times faster than Flax's
    ``_unsafe_bypass_check``; benchmarks/HISTORY.md). The doctest checks the slot still works.

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


def state_kind(variable: nnx.Variable) -> str:
    """How ``mm.microbatch`` treats a Variable its function updates: ``"count"`` (an RNG counter),
    ``"fixed"`` (parameters, RNG keys: not pipelined) or ``"chained"`` (each microbatch from the
    last's).

    Example:
        >>> from flax import nnx
        >>> [state_kind(v) for v in (nnx.Param(1.0), nnx.BatchStat(0.0))]
        ['fixed', 'chained']
    """
    if isinstance(variable, nnx.RngCount):
        return "count"
    if isinstance(variable, nnx.Param | nnx.RngKey):
        return "fixed"
    return "chained"


def capturing(module: nnx.Module) -> bool:
    """Whether ``module`` runs under ``nnx.capture``, rather than where ``sow`` writes onto it.

    Example:
        >>> from flax import nnx
        >>> layer = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
        >>> capturing(layer), nnx.capture(lambda m: capturing(m), nnx.Intermediate)(layer)[0]
        (False, True)
    """
    return hasattr(module, "__captures__")  # set by nnx.capture on every module it wraps
