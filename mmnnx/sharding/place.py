"""Placing a model's Variables on tasks: ``place``, ``init`` and ``placement``.

Every check runs before any array moves, so a bad rule list leaves the model untouched.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, TypeVar

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from mmnnx._gc import cyclic_gc_paused
from mmnnx._nnx import (
    annotated_spec,
    logical_names,
    mirrors_a_variable,
    variables_of,
)
from mmnnx.errors import MPMDError
from mmnnx.sharding.arrays import placeholder, processes_of, put
from mmnnx.sharding.factory import trace_factory
from mmnnx.sharding.replay import replay
from mmnnx.sharding.rules import Path, PlacementRule, compile_rules, path_str
from mmnnx.sharding.specs import check_spec
from mmnnx.sharding.stack import TaskStack
from mmnnx.sharding.task import Task

M = TypeVar("M")
Opt = TypeVar("Opt")

TASK_KEY = "mm_task"
SPEC_KEY = "mm_spec"


@dataclasses.dataclass(frozen=True)
class Assignment:
    """Where one Variable goes: its task and PartitionSpec, and the rule that chose them."""

    path: Path
    variable: nnx.Variable
    rule: PlacementRule
    spec: PartitionSpec

    @property
    def task(self) -> Task | TaskStack:
        return self.rule.task

    @property
    def sharding(self) -> NamedSharding:
        return self.task.sharding(self.spec)


def _stack_spec(rule: PlacementRule, path: Path, variable: nnx.Variable) -> PartitionSpec:
    """The spec of each chunk of a stacked Variable (a leading ``None`` added if needed)."""
    stack = rule.task
    ndim = len(variable.get_value().shape)
    where = f"stacked Variable {path_str(path)!r} on tasks {stack.name!r}"
    if ndim == 0:
        raise ValueError(f"{where}: a scalar has no leading layer axis to split over tasks")
    specs = {_task_spec(rule, t, path, variable) for t in stack.tasks}
    if len(specs) > 1:
        raise ValueError(
            f"{where}: the tasks' logical rules give it different specs {sorted(map(str, specs))}; "
            "a stack's tasks must lay out its chunks alike"
        )
    spec = _layer_axis(specs.pop(), variable)
    if len(spec) and spec[0] is not None:
        raise ValueError(
            f"{where}: its spec {spec} shards the leading layer axis over {spec[0]!r}, but that "
            "axis is split over the tasks; give it None (or a logical name that maps to None)"
        )
    return spec


def _layer_axis(spec: PartitionSpec, variable: nnx.Variable) -> PartitionSpec:
    """``spec`` with a leading ``None`` where the Variable's logical names leave out its leading
    axis: layers stacked with ``nnx.vmap`` (split over tasks, or whole on one)."""
    ndim = len(variable.get_value().shape)
    if len(spec) == ndim - 1 and logical_names(variable) is not None:
        return PartitionSpec(None, *spec)
    return spec


def _task_spec(
    rule: PlacementRule, task: Task, path: Path, variable: nnx.Variable
) -> PartitionSpec:
    where = f"Variable {path_str(path)!r} on task {task.name!r}"
    if isinstance(rule.spec, PartitionSpec):
        return rule.spec
    if rule.spec is not None:
        spec = rule.spec(path_str(path), variable)
        if not isinstance(spec, PartitionSpec):
            raise TypeError(
                f"{where}: the spec function of {rule.describe()} returned {spec!r}, "
                "not a PartitionSpec"
            )
        return spec
    return declared_spec(task, variable, where)


def declared_spec(task: Task, variable: nnx.Variable, where: str) -> PartitionSpec:
    """The spec a Variable declares for itself on ``task``: its annotated spec or logical names
    through the task's rules; replicated when it declares none."""
    annotated = annotated_spec(variable)
    if annotated is not None:  # Flax's explicit form: device axes, or logical names
        return task.resolve(annotated, where=where)
    names = logical_names(variable)
    if names is None:
        return PartitionSpec()
    return task.resolve(names)  # logical names through the rules; device axes (Flax's GSPMD guide)


def _check_tasks(rules: list[PlacementRule]) -> None:
    by_name: dict[str, Task] = {}
    for rule in rules:
        members = rule.task.tasks if isinstance(rule.task, TaskStack) else (rule.task,)
        for task in members:
            known = by_name.setdefault(task.name, task)
            if known != task:
                raise ValueError(
                    f"{rule.describe()}: two different tasks are named {task.name!r}: "
                    f"{known!r} and {task!r}"
                )
    owner: dict[jax.Device, tuple[str, str]] = {}  # device -> (task name, its home's name)
    for name, task in by_name.items():
        try:
            mesh = task.jax_mesh
        except ValueError as e:
            raise ValueError(f"task {name!r}: {e}") from None
        for device in mesh.devices.flat:
            first, home = owner.setdefault(device, (name, task.home.name))
            if home != task.home.name:
                raise ValueError(
                    f"tasks {first!r} and {name!r} overlap: both use device {device.id} "
                    f"({device}); tasks given to one place() call need disjoint devices "
                    "(a task's own virtual stages, Task.virtual_stage, excepted)"
                )


def plan_placement(
    model: Any, rules: Sequence[tuple] | Mapping, *, strict: bool = True
) -> list[Assignment]:
    """Matches every Variable of ``model`` to a rule and checks its spec; moves nothing."""
    return _plan(variables_of(model), rules, strict)


def _plan(
    variables: Sequence[tuple[Path, nnx.Variable]], rules: Sequence[tuple] | Mapping, strict: bool
) -> list[Assignment]:
    """:func:`plan_placement` of ``variables``; warnings point at the code calling place or init."""
    compiled = compile_rules(rules)
    _check_tasks(compiled)
    assignments: list[Assignment] = []
    unmatched: list[Path] = []
    used: set[int] = set()
    for path, variable in variables:
        rule = next((r for r in compiled if r.matches(path, variable)), None)
        if rule is None:
            unmatched.append(path)
            continue
        used.add(rule.index)
        value = variable.get_value()
        if not hasattr(value, "shape") or not hasattr(value, "dtype"):
            raise TypeError(
                f"Variable {path_str(path)!r} holds a {type(value).__name__}, not an array; "
                "only array-valued Variables can be placed"
            )
        shape = tuple(value.shape)
        if isinstance(rule.task, TaskStack):
            spec = _stack_spec(rule, path, variable)
            where = f"stacked Variable {path_str(path)!r} on tasks {rule.task.name!r}"
            (start, stop), *_ = rule.task.chunks(shape[0], where=where)
            check_spec(spec, (stop - start, *shape[1:]), rule.task.tasks[0].jax_mesh, where)
        else:
            spec = _layer_axis(_task_spec(rule, rule.task, path, variable), variable)
            where = f"Variable {path_str(path)!r} on task {rule.task.name!r}"
            check_spec(spec, shape, rule.task.jax_mesh, where)
        assignments.append(Assignment(path=path, variable=variable, rule=rule, spec=spec))
    if unmatched and strict:
        shown = ", ".join(repr(path_str(p)) for p in unmatched[:5])
        more = f" and {len(unmatched) - 5} more" if len(unmatched) > 5 else ""
        raise ValueError(
            f"no placement rule matches Variable {path_str(unmatched[0])!r} "
            f"(unmatched: {shown}{more}); add a rule for it or pass strict=False"
        )
    for rule in compiled:
        if rule.index not in used:
            warnings.warn(f"placement {rule.describe()} placed no Variable", stacklevel=4)
    return assignments


def _put_all(values: list[Any], shardings: list[Any], names: list[str]) -> list[Any]:
    """Moves ``values`` onto ``shardings``; with several processes each keeps its own part."""
    if jax.process_count() == 1:
        return jax.device_put(values, shardings)
    for value, name in zip(values, names, strict=True):
        if isinstance(value, jax.Array) and not value.is_fully_addressable:
            raise ValueError(
                f"{name}: cannot move a value held by other processes with place; build the "
                "model alike on every process and place it before making its optimizer"
            )
    return [put(v, s) for v, s in zip(values, shardings, strict=True)]


def _move(assignments: list[Assignment]) -> None:
    """Moves each assigned Variable's value to its sharding."""
    values = _put_all(
        [a.variable.get_value() for a in assignments],
        [a.sharding for a in assignments],
        [path_str(a.path) for a in assignments],
    )
    _commit(assignments, values)


def _commit(assignments: list[Assignment], values: list[Any]) -> None:
    for a, value in zip(assignments, values, strict=True):
        a.variable.set_value(value)
        a.variable.set_metadata(**{TASK_KEY: a.task, SPEC_KEY: a.spec})


def place(model: M, rules: Sequence[tuple] | Mapping, *, strict: bool = True) -> M:
    """Moves every Variable of ``model`` to the task its first matching rule names; returns
    ``model``.

    ``rules``: ``(filter, task)`` or ``(filter, task, spec)`` items (or ``{filter: task}``); a
    ``str`` filter is a regular expression searched in the ``/``-joined path, any NNX filter works
    too. ``spec`` is a PartitionSpec or ``(path, variable) -> PartitionSpec``; without it the
    Variable's logical names go through the task's rules, else it is replicated. Task and spec are
    kept in the Variable's metadata (``mm_task``, ``mm_spec``). ``strict``: an unmatched Variable is
    an error.

    Example:
        >>> from mmnnx.sharding import TaskMesh
        >>> s0 = Task("s0", mesh=TaskMesh(devices=range(0, 4)))
        >>> s1 = Task("s1", mesh=TaskMesh(devices=range(4, 8)))
        >>> model = nnx.Sequential(nnx.Linear(4, 8, rngs=nnx.Rngs(0)),
        ...                        nnx.Linear(8, 2, rngs=nnx.Rngs(1)))
        >>> model = place(model, [("layers/0", s0),
        ...                       ("layers/1/kernel", s1, PartitionSpec("x")),
        ...                       ("layers/1", s1)])
        >>> sorted(d.id for d in model.layers[1].kernel.get_value().devices())
        [4, 5, 6, 7]
    """
    _move(plan_placement(model, rules, strict=strict))
    return model


def place_made(
    model: M,
    rules: Sequence[tuple] | Mapping,
    make: Callable[[str, nnx.Variable, Any], jax.Array],
    *,
    strict: bool = True,
) -> M:
    """Places abstract ``model`` as :func:`place` would, values by ``make(path, variable,
    sharding)``."""
    assignments = plan_placement(model, rules, strict=strict)
    values = [
        make(path_str(a.path), a.variable, a.sharding)
        if jax.process_index() in processes_of(a.sharding)
        else _placeholder_for(a)
        for a in assignments
    ]
    _commit(assignments, values)
    return model


def init(factory: Callable[[], M], rules: Sequence[tuple] | Mapping, *, strict: bool = True) -> M:
    """Builds ``factory()`` with each task's Variables created directly on that task's submesh.

    The factory is traced once; each Variable is then computed on one device (equal layers share one
    compiled program) and moved to its task in batches of at most 64 MiB, so no full copy of the
    model is ever on one device (a task spanning processes runs one jitted init instead). The values
    equal ``place(factory(), rules)``'s for the same seed; ``factory`` must create its own
    ``nnx.Rngs``. Raises as :func:`place` does, before anything is built, and for a factory that
    changes state made outside it.

    Example:
        >>> from mmnnx.sharding import TaskMesh
        >>> s0 = Task("s0", mesh=TaskMesh(devices=range(0, 4)))
        >>> s1 = Task("s1", mesh=TaskMesh(devices=range(4, 8)))
        >>> model = init(lambda: nnx.Sequential(nnx.Linear(4, 8, rngs=nnx.Rngs(0)),
        ...                                     nnx.Linear(8, 2, rngs=nnx.Rngs(1))),
        ...              [("layers/0", s0), ("layers/1", s1)])
        >>> model.layers[0].kernel.get_value().sharding.mesh.devices.size
        4
    """
    with cyclic_gc_paused():
        return _init(factory, rules, strict)


def _init(factory: Callable[[], M], rules: Sequence[tuple] | Mapping, strict: bool) -> M:
    traced = trace_factory(factory)
    assignments = _plan(variables_of(traced.model), rules, strict)
    here = {a.path: a for a in assignments if jax.process_index() in processes_of(a.sharding)}
    elsewhere = [a for a in assignments if a.path not in here]  # each process makes its own
    _commit(elsewhere, [_placeholder_for(a) for a in elsewhere])
    skipped = {a.path for a in elsewhere}
    computed = [(k, p) for k, p in enumerate(traced.outputs) if p not in skipped]
    values = _build_here(
        traced.jaxpr,
        [k for k, _ in computed],
        [here[p].sharding if p in here else None for _, p in computed],
    )
    unplaced = []  # what no rule places: left where it was made, as place leaves it
    for (_, p), value in zip(computed, values, strict=True):
        if p in here:
            _commit([here.pop(p)], [value])
        else:
            unplaced.append((p, value))
    nnx.update(traced.model, nnx.from_flat_state(unplaced))
    _move(list(here.values()))  # Variables whose value the factory made without jax
    return traced.model


def _placeholder_for(a: Assignment) -> jax.Array:
    abstract = a.variable.get_value()
    return placeholder(abstract.shape, abstract.dtype, a.sharding)


def _build_here(traced: Any, wanted: list[int], shardings: list[Any]) -> list[Any]:
    """The factory's outputs ``wanted``, made here and moved in batches of ``_UNPLACED_BYTES``."""
    at = {i: k for k, i in enumerate(wanted)}
    values: list[Any] = [None] * len(wanted)
    pending: list[int] = []
    pending_bytes = 0

    def flush() -> None:
        nonlocal pending_bytes
        local = [k for k in pending if shardings[k].is_fully_addressable]
        moved = jax.device_put([values[k] for k in local], [shardings[k] for k in local])
        for k, value in zip(local, moved, strict=True):
            values[k] = value
        for k in pending:  # spanning processes: each keeps its part of the same value
            if not shardings[k].is_fully_addressable:
                values[k] = put(values[k], shardings[k])
        pending.clear()
        pending_bytes = 0

    def made(i: int, value: Any) -> None:
        nonlocal pending_bytes
        k = at[i]
        values[k] = value
        if shardings[k] is not None:
            pending.append(k)
            pending_bytes += value.nbytes
            if pending_bytes >= _UNPLACED_BYTES:
                flush()

    replay(traced, wanted, jax.local_devices()[0], made)
    flush()
    return values


# How many bytes of made Variables mm.init lets wait on its first device before moving them.
_UNPLACED_BYTES = 64 * 2**20


class Mirror(NamedTuple):
    """An optimizer-state Variable and the model Variable it was made from."""

    path: Path
    state: nnx.Variable
    param_path: Path
    param: nnx.Variable


def optimizer_mirrors(opt: Any, model: Any) -> list[Mirror]:
    """Each optimizer-state Variable of ``opt`` whose path ends with (the longest such) path of a
    Variable of ``model`` of its shape."""
    params = {path: v for path, v in variables_of(model) if not mirrors_a_variable(v)}
    mirrors = []
    for path, state in variables_of(opt):
        if not mirrors_a_variable(state):
            continue
        for start in range(1, len(path)):
            param = params.get(path[start:])
            if param is not None and _shape(param) == _shape(state):
                mirrors.append(Mirror(path=path, state=state, param_path=path[start:], param=param))
                break
    return mirrors


def _shape(variable: nnx.Variable) -> tuple[int, ...] | None:
    return getattr(variable.get_value(), "shape", None)


class Misplaced(NamedTuple):
    """Optimizer state on another task than the placed Variable it is kept for."""

    path: str
    task: Task | TaskStack | None
    param_path: str
    param_task: Task | TaskStack


def check_optimizer_placement(roots: Sequence[tuple[str, Any]]) -> None:
    """Raises :class:`~mmnnx.MPMDError` if :func:`misplaced_optimizer_state` finds any."""
    misplaced = misplaced_optimizer_state(roots)
    if misplaced:
        first = misplaced[0]
        raise MPMDError(
            f"mm.jit: optimizer state {first.path!r} is on task "
            f"{getattr(first.task, 'name', None)!r} but the parameter it is kept for, "
            f"{first.param_path!r}, is on task {first.param_task.name!r} ({len(misplaced)} "
            "optimizer Variables like this): the model was placed after its optimizer was "
            "created, and every step would move that state between tasks. Call "
            "mm.place_optimizer(opt, model) after mm.place(model, ...)"
        )


def misplaced_optimizer_state(roots: Sequence[tuple[str, Any]]) -> list[Misplaced]:
    """Among named roots (a step's arguments), the optimizer state that is not on the task of the
    placed model Variable it is kept for."""
    found = []
    for opt_name, opt in roots:
        if not any(mirrors_a_variable(v) for _, v in variables_of(opt)):
            continue
        for name, model in roots:
            if model is opt:
                continue
            for m in optimizer_mirrors(opt, model):
                param_task = home_of(m.param)
                if param_task is not None and home_of(m.state) != param_task:
                    found.append(
                        Misplaced(
                            path=path_str((opt_name, *m.path)),
                            task=home_of(m.state),
                            param_path=path_str((name, *m.param_path)),
                            param_task=param_task,
                        )
                    )
    return found


def place_optimizer(opt: Opt, model: Any) -> Opt:
    """Places the optimizer state kept for each placed Variable of ``model`` (Adam's moments) on
    that Variable's task and spec; returns ``opt``. Call it after placing a model again whose
    optimizer exists (``mm.jit`` refuses state left on another task). Raises ``ValueError`` when
    ``opt`` keeps per-Variable state but none for ``model``'s.

    Example:
        >>> import optax
        >>> from mmnnx.sharding import TaskMesh
        >>> s0, s1 = Task("s0", mesh=TaskMesh(devices=[0])), Task("s1", mesh=TaskMesh(devices=[1]))
        >>> model = place(nnx.Linear(2, 3, rngs=nnx.Rngs(0)), [(".*", s0)])
        >>> opt = nnx.Optimizer(model, optax.adam(0.1), wrt=nnx.Param)
        >>> model = place(model, [(".*", s1)])
        >>> opt = place_optimizer(opt, model)
        >>> [d.id for d in opt.opt_state[0].mu["kernel"].get_value().devices()]
        [1]
    """
    mirrors = optimizer_mirrors(opt, model)
    if not mirrors and any(mirrors_a_variable(v) for _, v in variables_of(opt)):
        raise ValueError(
            f"place_optimizer: no state of this {type(opt).__name__} is kept for a Variable of "
            f"this {type(model).__name__}; pass the optimizer and the model it was created for"
        )
    moved = [m for m in mirrors if home_of(m.param) is not None]
    specs = [m.param.get_metadata(SPEC_KEY, PartitionSpec()) for m in moved]
    tasks = [home_of(m.param) for m in moved]
    values = _put_all(
        [m.state.get_value() for m in moved],
        [task.sharding(spec) for task, spec in zip(tasks, specs, strict=True)],
        [f"the optimizer state of {task.name!r}" for task in tasks],
    )
    for m, task, spec, value in zip(moved, tasks, specs, values, strict=True):
        m.state.set_value(value)
        m.state.set_metadata(**{TASK_KEY: task, SPEC_KEY: spec})
    return opt


def placement(model: Any) -> dict[str, tuple[str, PartitionSpec]]:
    """Maps each placed Variable's ``/``-joined path to its ``(task_name, PartitionSpec)``.

    Example:
        >>> from mmnnx.sharding import TaskMesh
        >>> t = Task("t", mesh=TaskMesh(devices=[0]))
        >>> placement(place(nnx.Linear(2, 3, rngs=nnx.Rngs(0)), [(".*", t)]))
        {'bias': ('t', P()), 'kernel': ('t', P())}
    """
    out = {}
    for path, variable in variables_of(model):
        meta = variable.get_metadata()
        task = meta.get(TASK_KEY)
        if isinstance(task, Task | TaskStack):
            out[path_str(path)] = (task.name, meta.get(SPEC_KEY, PartitionSpec()))
    return out


def task_of(variable: nnx.Variable) -> Task | None:
    """The task ``place``/``init`` put a Variable on, or ``None`` (also for a stack:
    :func:`stack_of`)."""
    task = variable.get_metadata(TASK_KEY, None)
    return task if isinstance(task, Task) else None


def stack_of(variable: nnx.Variable) -> TaskStack | None:
    """The tasks a stacked Variable's leading axis is split over (a rule naming a list), or
    ``None``.

    Example:
        >>> from mmnnx.sharding import TaskMesh
        >>> s0, s1 = Task("s0", mesh=TaskMesh(devices=[0])), Task("s1", mesh=TaskMesh(devices=[1]))
        >>> layers = nnx.vmap(lambda r: nnx.Linear(2, 2, rngs=r))(nnx.Rngs(0).split(4))
        >>> stack_of(place(layers, [(".*", [s0, s1])]).kernel).name
        's0+s1'
    """
    stack = variable.get_metadata(TASK_KEY, None)
    return stack if isinstance(stack, TaskStack) else None


def home_of(variable: nnx.Variable) -> Task | TaskStack | None:
    """Where ``place``/``init`` put a Variable: a task, a task stack, or ``None``."""
    home = variable.get_metadata(TASK_KEY, None)
    return home if isinstance(home, Task | TaskStack) else None
