"""Runs multimesh.jax-style programs through mmnnx's engine (``mm.jit``).

A function handed to :func:`stage` is traced once per input signature inside ``mm.jit``:

1. it is traced to a jaxpr (``jax.make_jaxpr``) with this layer's ``with_sharding_constraint``
   standing in for ``jax.lax.with_sharding_constraint``, as multimesh's ``init`` arranges;
2. if neither an explicit task nor a name scope (a Linen module name, a ``jax.named_scope``)
   matching a ``register_task`` regex was found, it is traced again with replicating logical
   constraints and the whole program becomes one task over all devices (multimesh without a
   task context);
3. otherwise the registered scopes are handed to the engine (``mm.mpmd.resolve_scopes``), which
   runs every op whose scope matches on that task; the callback learns whether the op belongs
   to the backward pass;
4. the jaxpr is replayed inside ``mm.jit``'s trace with its name scopes kept.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend.core import jaxpr_as_fun
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import mmnnx as mm
from mmnnx.sharding.arrays import placeholder, processes_of, put
from multimesh_compat.jax import _context, _tasks

_ORIGINAL_WSC = jax.lax.with_sharding_constraint


@dataclasses.dataclass
class Session:
    """State of one trace by this layer."""

    replicate_all: bool = False
    found_tasks: bool = False


_SESSION: contextvars.ContextVar[Session | None] = contextvars.ContextVar(
    "multimesh_compat_session", default=None
)


def current_session() -> Session | None:
    return _SESSION.get()


# ---------------------------------------------------------------------------------------------
# with_sharding_constraint


def _is_spec(x: Any) -> bool:
    if x is None or isinstance(x, PartitionSpec | NamedSharding):
        return True
    if isinstance(x, tuple | list) and not isinstance(x, PartitionSpec):
        return all(
            e is None
            or isinstance(e, str)
            or (isinstance(e, tuple) and all(isinstance(a, str) for a in e))
            for e in x
        ) and not any(isinstance(e, list) for e in x)
    return False


def _names(spec: Any) -> tuple:
    if spec is None:
        return ()
    if isinstance(spec, NamedSharding):
        spec = spec.spec
    return tuple(tuple(e) if isinstance(e, list) else e for e in spec)


def _spec_per_leaf(x: Any, axis_resources: Any) -> tuple[list, Any, list]:
    leaves, treedef = jax.tree.flatten(x)
    if _is_spec(axis_resources):
        return leaves, treedef, [axis_resources] * len(leaves)
    specs, spec_tree = jax.tree.flatten(axis_resources, is_leaf=_is_spec)
    try:
        per_leaf_groups = spec_tree.flatten_up_to(x)
    except (ValueError, TypeError):
        if len(specs) != len(leaves):
            raise Exception(
                f"axis_resources of length {len(specs)} does not match args of length {len(leaves)}"
            ) from None
        return leaves, treedef, specs
    out = []
    for spec, group in zip(specs, per_leaf_groups, strict=True):
        out.extend([spec] * len(jax.tree.leaves(group)))
    return leaves, treedef, out


def _translate(names: tuple, task: _tasks.Placement) -> tuple:
    """Inside a known task: names its rules do not map become replicated, as in multimesh."""
    if task.axes is None:
        return ()
    logical = task.logical_names
    out = []
    for n in names:
        if isinstance(n, tuple):
            spec = mm.Task("t", mesh=None, logical_axes=task.rules).spec(
                tuple(m if m in logical else None for m in n)
            )
            axes = [a for e in spec if e is not None for a in (e if isinstance(e, tuple) else (e,))]
            out.append(tuple(dict.fromkeys(axes)) or None)
        else:
            out.append(n if n in logical else None)
    return tuple(out)


def with_sharding_constraint(x: Any, axis_resources: Any, *, _physical: bool = False) -> Any:
    """Annotates ``x`` (an array or pytree) with logical sharding names.

    ``axis_resources`` is a ``PartitionSpec``, a ``NamedSharding`` (its spec is used), a tuple
    of names, or a prefix pytree of these. Inside this layer's programs (``parallelize``,
    ``mjit``, ``parallelize_step``) the names are logical: a task translates them with its
    ``logical_axes``, names it does not map are replicated, and with no task at all everything
    is replicated. Elsewhere it is ``jax.lax.with_sharding_constraint`` (physical names), except
    under ``autoshard()``, where it returns ``x`` unchanged.

    Example:
        >>> import jax.numpy as jnp
        >>> from jax.sharding import PartitionSpec as P
        >>> with _context.autoshard():
        ...     with_sharding_constraint(jnp.ones((4, 2)), P("batch", None)).shape
        (4, 2)
    """
    session = _SESSION.get()
    if _context.transforms_ignored() or session is None:
        if _context.flag("autoshard") and not _context.transforms_ignored():
            leaves, _, _ = _spec_per_leaf(x, axis_resources)  # same length check
            return x
        if isinstance(axis_resources, tuple) and _is_spec(axis_resources):
            axis_resources = PartitionSpec(*axis_resources)
        return _ORIGINAL_WSC(x, axis_resources)
    leaves, treedef, specs = _spec_per_leaf(x, axis_resources)
    task = _tasks.CURRENT_TASK.get()
    out = []
    for leaf, spec in zip(leaves, specs, strict=True):
        names = _names(spec)
        if _physical:
            pass
        elif task is not None:
            names = _translate(names, task)
        elif session.replicate_all:
            names = ()
        out.append(mm.with_sharding_constraint(leaf, PartitionSpec(*names)))
    return jax.tree.unflatten(treedef, out)


@contextlib.contextmanager
def _patched_jax_wsc() -> Iterator[None]:
    """``jax.lax.with_sharding_constraint`` becomes this layer's, as multimesh's init does."""
    old = jax.lax.with_sharding_constraint
    jax.lax.with_sharding_constraint = with_sharding_constraint
    try:
        yield
    finally:
        jax.lax.with_sharding_constraint = old


def no_ambient_mesh():
    """Clears JAX's ambient mesh (a ``with MultiMesh`` block sets it): mmnnx compiles each task's
    programs on its submesh, which JAX rejects while a larger mesh is ambient (workaround for
    an engine limitation; see docs/multimesh_compat.md)."""
    return jax.set_mesh(None)


@contextlib.contextmanager
def logical() -> Iterator[None]:
    """Autoshard on, and ``jax.lax.with_sharding_constraint`` routed to this layer."""
    with _context.autoshard(True), _patched_jax_wsc():
        yield


# ---------------------------------------------------------------------------------------------
# task


def run_in_task(placement_fn: Callable[[], _tasks.Placement], fun: Callable) -> Callable:
    """``fun`` forced onto the task ``placement_fn()`` resolves to (at call time)."""

    @functools.wraps(fun)
    def wrapped(*args, **kwargs):
        if _context.transforms_ignored():
            return fun(*args, **kwargs)
        placement = placement_fn()
        session = _SESSION.get()
        if session is not None:
            session.found_tasks = True

        def body(*a, **k):
            token = _tasks.CURRENT_TASK.set(placement)
            try:
                return fun(*a, **k)
            finally:
                _tasks.CURRENT_TASK.reset(token)

        return mm.task(body, placement.engine_task())(*args, **kwargs)

    return wrapped


# ---------------------------------------------------------------------------------------------
# staging a program for mm.jit


class Matcher:
    """The task of a name scope under the active ``register_task`` registrations: the innermost
    scope component that a registration's regex matches (``None`` if none does)."""

    def __init__(self, registrations: Sequence[_tasks.Registration]):
        self.registrations = list(registrations)
        self.cache: dict[tuple[int, str, bool], _tasks.Placement] = {}

    def __call__(self, scope: str, backprop: bool) -> _tasks.Placement | None:
        if not self.registrations:
            return None
        for comp in reversed(mm.mpmd.scope_components(scope)):
            for i, reg in enumerate(self.registrations):
                m = reg.regex.fullmatch(comp)
                if m is None:
                    continue
                key = (i, m.group(0), backprop)
                if key not in self.cache:
                    placement = reg.resolve(m.group(0), backprop)
                    if backprop:
                        # A backward task on exactly its forward's submesh is merged into it:
                        # same devices, and mmnnx pipelines a stage only as one task.
                        fwd = self.cache.get((i, m.group(0), False))
                        if fwd is None:
                            fwd = self.cache[(i, m.group(0), False)] = reg.resolve(
                                m.group(0), False
                            )
                        if (fwd.ids, fwd.dims, fwd.axes, fwd.rules) == (
                            placement.ids,
                            placement.dims,
                            placement.axes,
                            placement.rules,
                        ):
                            placement = fwd
                    self.cache[key] = placement
                return self.cache[key]
        return None


def _engine_task_of(matcher: Matcher, scope: str, backward: bool) -> mm.Task | None:
    placement = matcher(scope, backward)
    return None if placement is None else placement.engine_task()


def registered() -> list[_tasks.Registration]:
    if _context.transforms_ignored():
        return []
    return [r for c in _tasks.active_contexts() for r in c.registrations]


def stage(fun: Callable, fallback: Callable[[], _tasks.Placement]) -> Callable:
    """``fun`` prepared for ``mm.jit`` (see the module docstring). ``fallback()`` gives the
    all-devices task used when the program has no task."""

    @functools.wraps(fun)
    def staged(*args, **kwargs):
        every, in_tree = jax.tree.flatten((args, kwargs))
        traced = [i for i, x in enumerate(every) if isinstance(x, jax.Array)]
        flat = [every[i] for i in traced]  # static values (mjit's static_argnums) stay Python

        def trace(session: Session):
            def flat_fun(*leaves):  # a fresh function each time: JAX caches traces by function
                full = list(every)
                for i, x in zip(traced, leaves, strict=True):
                    full[i] = x
                a, k = jax.tree.unflatten(in_tree, full)
                return fun(*a, **k)

            token = _SESSION.set(session)
            try:
                with _patched_jax_wsc():
                    return jax.make_jaxpr(flat_fun, return_shape=True)(*flat)
            finally:
                _SESSION.reset(token)

        session = Session()
        closed, out_shape = trace(session)
        matcher = Matcher(registered())
        scoped = matcher.registrations and any(
            matcher(scope, backward) is not None for scope, backward in mm.mpmd.scopes_of(closed)
        )
        if not session.found_tasks and not scoped:
            closed, out_shape = trace(Session(replicate_all=True))
            outs = mm.task(jaxpr_as_fun(closed), fallback().engine_task())(*flat)
        else:
            if scoped:
                mm.mpmd.resolve_scopes(functools.partial(_engine_task_of, matcher))
            outs = jaxpr_as_fun(closed)(*flat)
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    return staged


def default_placement(devices: Any = None, mesh: Mesh | None = None) -> Callable:
    """The no-task fallback: one axis ``x`` over ``devices`` (default: all), or ``mesh``."""

    def make() -> _tasks.Placement:
        if mesh is not None:
            ids = tuple(int(i) for i in _tasks._mesh_indices(mesh))
            return _tasks.Placement(
                "all_devices", ids, tuple(mesh.axis_sizes), tuple(mesh.axis_names), (), mesh
            )
        devs = jax.devices() if devices is None else list(np.asarray(devices, dtype=object).flat)
        ids, _ = _tasks._device_indices(devs, "parallelize")
        jmesh = Mesh(np.asarray(devs, dtype=object), ("x",))
        return _tasks.Placement(
            "all_devices", tuple(int(i) for i in ids), (len(ids),), ("x",), (), jmesh
        )

    return make


# ---------------------------------------------------------------------------------------------
# compiled programs


def _stand_in(x: Any) -> Any:
    """A zero-cost host array with ``x``'s shape and dtype (only shapes matter for planning)."""
    if isinstance(x, jax.Array | np.ndarray) and not isinstance(x, jax.core.Tracer):
        return x
    return np.broadcast_to(np.zeros((), dtype=x.dtype), x.shape)


class ShardedFunction:
    """A program compiled by this layer: call it like the function it came from.

    Stands in for the ``jax.stages.Compiled`` multimesh returns: ``input_shardings`` and
    ``output_shardings`` have the same layout, and ``plan()`` shows mmnnx's per-task plan.
    Inputs on devices outside every task are moved first.
    """

    def __init__(self, fun: Callable, jitted: mm.JitFunction, example_args: tuple):
        self.fun = fun
        self._jitted = jitted
        self._example = example_args
        flat, self._in_tree = jax.tree.flatten((example_args, {}))
        stand_ins = [_stand_in(x) for x in flat]
        args, kwargs = jax.tree.unflatten(self._in_tree, stand_ins)
        with no_ambient_mesh():
            self._plan = jitted.plan(*args, **kwargs)
        position = {v: i for i, v in enumerate(self._plan.inputs)}
        first: dict[int, Any] = {}
        for t in self._plan.transfers:
            if t.source is None and t.value in position:
                first.setdefault(position[t.value], t.sharding)
        home = self._plan.tasks[0].sharding()
        self._in_shardings = [first.get(i, home) for i in range(len(flat))]
        self._owned = {d for t in self._plan.tasks for d in t.jax_mesh.devices.flat}

    @property
    def input_shardings(self) -> tuple[tuple, dict]:
        """``(args_shardings, kwargs_shardings)``, as ``jax.stages.Compiled`` gives them."""
        return jax.tree.unflatten(self._in_tree, self._in_shardings)

    @property
    def plan(self) -> mm.Plan:
        """mmnnx's plan: tasks, fragments per task, transfers."""
        return self._plan

    def __call__(self, *args, **kwargs):
        flat, tree = jax.tree.flatten((args, kwargs))
        if tree == self._in_tree:
            moved = []
            for x, s in zip(flat, self._in_shardings, strict=True):
                if isinstance(x, jax.Array) and not x.sharding.device_set <= self._owned:
                    x = jax.device_put(x, s)
                moved.append(x)
            args, kwargs = jax.tree.unflatten(tree, moved)
        with no_ambient_mesh():
            return self._jitted(*args, **kwargs)


def _grouped_put(make: Callable[[], Any], shardings: list, tree: Any) -> Any:
    """Runs ``make`` once per device set of ``shardings`` (jitted, keeping only that set's
    outputs), so no array is built outside its devices."""
    groups: dict[frozenset, list[int]] = {}
    for i, s in enumerate(shardings):
        groups.setdefault(frozenset(s.device_set), []).append(i)
    out: list[Any] = [None] * len(shardings)
    for idx in groups.values():

        def part(idx=idx):
            with logical():  # constraints in init code are logical: dropped here
                leaves = jax.tree.leaves(make())
            return [leaves[i] for i in idx]

        targets = [shardings[i] for i in idx]
        with no_ambient_mesh():
            if all(s.is_fully_addressable for s in targets):
                values = jax.jit(part, out_shardings=targets)()
            elif all(jax.process_index() not in processes_of(s) for s in targets):
                shapes = jax.eval_shape(part)  # another process's devices: nothing to make here
                values = [
                    placeholder(x.shape, x.dtype, s) for x, s in zip(shapes, targets, strict=True)
                ]
            else:  # devices of several processes: each makes the value and keeps its part
                values = [put(x, s) for x, s in zip(jax.jit(part)(), targets, strict=True)]
        for i, v in zip(idx, values, strict=True):
            out[i] = v
    return jax.tree.unflatten(tree, out)


def parallelize(
    fun: Callable,
    init_params: Callable[[], Any] | None = None,
    get_input_batch: Callable[[], Any] | None = None,
    initial_batch: Any = None,
    devices: Any = None,
):
    """Compiles ``fun(params, batch)`` across its tasks and derives where inputs live.

    Parameter and batch shapes come from ``init_params()`` and ``get_input_batch()`` (traced
    abstractly) or from the arrays of ``initial_batch``. Each input is placed where its first
    consumer task wants it (its logical constraint translated by that task); with no task in
    ``fun`` everything is replicated over ``devices`` (default: all devices).

    Returns ``(compiled, init_sharded_params, get_sharded_batch)`` when ``get_input_batch`` is
    given, else ``(compiled, init_sharded_params)``. The helpers build the arrays directly with
    the derived shardings; ``compiled(params, batch)`` runs the step. Like the published
    example, ``init_params`` and ``get_input_batch`` may be passed positionally.

    Example:
        >>> import jax.numpy as jnp
        >>> f = lambda p, x: (p * x).sum()
        >>> step, init, batch = parallelize(f, lambda: jnp.ones(8), lambda: jnp.arange(8.0))
        >>> float(step(init(), batch()))
        28.0
    """
    if initial_batch is None and get_input_batch is None:
        raise ValueError("parallelize needs either a get_input_batch function or an initial_batch")
    if init_params is None:
        raise ValueError("parallelize needs init_params (a function returning the parameters)")
    with logical():
        param_shapes = jax.eval_shape(init_params)
        if initial_batch is None:
            batch_shapes = jax.eval_shape(get_input_batch)
        else:
            batch_shapes = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), initial_batch
            )
        jitted = mm.jit(stage(fun, default_placement(devices)))
        compiled = ShardedFunction(fun, jitted, (param_shapes, batch_shapes))
    (param_sh, batch_sh), _ = compiled.input_shardings
    p_leaves, p_tree = jax.tree.flatten(param_shapes)
    b_leaves, b_tree = jax.tree.flatten(batch_shapes)
    p_sh = jax.tree.leaves(param_sh, is_leaf=lambda s: isinstance(s, jax.sharding.Sharding))
    b_sh = jax.tree.leaves(batch_sh, is_leaf=lambda s: isinstance(s, jax.sharding.Sharding))

    def init_sharded_params():
        return _grouped_put(init_params, p_sh, p_tree)

    if get_input_batch is None:
        return compiled, init_sharded_params

    def get_sharded_batch():
        return _grouped_put(get_input_batch, b_sh, b_tree)

    return compiled, init_sharded_params, get_sharded_batch


class _MJit:
    def __init__(self, fun, mesh, devices, in_shardings, out_shardings, kw):
        self.fun = fun
        self.in_shardings = in_shardings
        self.out_shardings = out_shardings
        static = kw.pop("static_argnums", ())
        self.static_argnums = (static,) if isinstance(static, int) else tuple(static)
        names = kw.pop("static_argnames", ())
        self.static_argnames = (names,) if isinstance(names, str) else tuple(names)
        donate = kw.pop("donate_argnums", ())
        if kw:
            raise TypeError(f"mjit: unsupported keyword arguments {sorted(kw)}")
        if mesh is None and devices is None and isinstance(out_shardings, NamedSharding):
            mesh = out_shardings.mesh
        self.placement = default_placement(devices, mesh)
        self.jitted = mm.jit(
            stage(self._constrained, self.placement),
            static_argnums=self.static_argnums,
            static_argnames=self.static_argnames,
            donate_argnums=donate,
        )
        functools.update_wrapper(self, fun)

    def _constrain(self, tree, shardings):
        if shardings is None:
            return tree

        def one(x, s):
            if isinstance(s, NamedSharding):
                return with_sharding_constraint(x, s.spec, _physical=_physical_ok())
            return x

        try:
            return jax.tree.map(one, tree, shardings, is_leaf=lambda s: s is None)
        except (ValueError, TypeError):
            if isinstance(shardings, NamedSharding):
                return jax.tree.map(lambda x: one(x, shardings), tree)
            return tree

    def _constrained(self, *args, **kwargs):
        if self.in_shardings is not None:
            dyn = [i for i in range(len(args)) if i not in self.static_argnums]
            shardings = self.in_shardings
            if not isinstance(shardings, tuple | list):
                shardings = (shardings,) * len(dyn)
            args = list(args)
            for i, s in zip(dyn, shardings, strict=False):
                args[i] = self._constrain(args[i], s)
        out = self.fun(*args, **kwargs)
        return self._constrain(out, self.out_shardings)

    def __call__(self, *args, **kwargs):
        with no_ambient_mesh():
            return self.jitted(*args, **kwargs)

    def plan(self, *args, **kwargs) -> mm.Plan:
        """mmnnx's plan for these arguments."""
        with no_ambient_mesh():
            return self.jitted.plan(*args, **kwargs)


def _physical_ok() -> bool:
    session = _SESSION.get()
    return session is not None and session.replicate_all and _tasks.CURRENT_TASK.get() is None


def mjit(
    fun: Callable,
    *args: Any,
    mesh: Mesh | None = None,
    devices: Any = None,
    in_shardings: Any = None,
    out_shardings: Any = None,
    **kw: Any,
) -> Callable:
    """A ``jit`` for programs with tasks: runs ``fun`` through mmnnx's engine.

    ``NamedSharding`` entries of ``in_shardings`` / ``out_shardings`` become sharding
    constraints on those values inside ``fun`` (logical inside tasks; in a program without
    tasks, which runs on one task over ``mesh`` or ``devices``, they are kept as given).
    ``static_argnums``, ``static_argnames`` and ``donate_argnums`` are passed on.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> double = mjit(lambda x: 2 * x, devices=jax.devices()[:2])
        >>> double(jnp.arange(4)).tolist()
        [0, 2, 4, 6]
    """
    if args:
        in_shardings = args[0] if in_shardings is None else in_shardings
        if len(args) > 1 and out_shardings is None:
            out_shardings = args[1]
    if out_shardings is None and mesh is None and devices is None:
        raise ValueError("mjit needs out_shardings, mesh or devices")
    return _MJit(fun, mesh, devices, in_shardings, out_shardings, dict(kw))
