"""Task descriptions of both multimesh.jax API generations, resolved to mmnnx engine tasks."""

from __future__ import annotations

import contextvars
import dataclasses
import inspect
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

import mmnnx as mm

_HIDDEN = "_mm_replicated"  # device-axis names no logical name can reach


@dataclasses.dataclass(frozen=True, eq=False)
class Task(mm.Task):
    """multimesh.jax's ``Task``: an ``mm.Task`` plus the fields only multimesh programs use.

    ``mesh_slice`` names a slice of the entered ``MultiMesh`` instead of a ``mesh`` (for
    ``register_task``); ``split_backprop`` and ``loop_dependent_mesh_slice`` are accepted as in
    multimesh (see docs/multimesh_compat.md). An ``mm.Task`` may be passed wherever a
    ``Task`` is.

    Example:
        >>> Task(name="layer0", mesh_slice={"stage": 0}).mesh_slice
        {'stage': 0}
    """

    mesh_slice: Mapping[str, int] | None = dataclasses.field(default=None, kw_only=True)
    split_backprop: tuple[str, str] | None = dataclasses.field(default=None, kw_only=True)
    loop_dependent_mesh_slice: Callable[[int], Mapping[str, int]] | None = dataclasses.field(
        default=None, kw_only=True
    )

    def __post_init__(self):
        super().__post_init__()
        if self.mesh_slice is not None:
            object.__setattr__(self, "mesh_slice", dict(self.mesh_slice))
        if self.split_backprop is not None:
            object.__setattr__(self, "split_backprop", tuple(self.split_backprop))

    def _key(self) -> tuple:
        slice_items = tuple(sorted(self.mesh_slice.items())) if self.mesh_slice else None
        return (*super()._key(), slice_items, self.split_backprop, self.loop_dependent_mesh_slice)


def _device_indices(devices: Any, what: str) -> tuple[np.ndarray, tuple[int, ...]]:
    """Device indices (into ``jax.devices()``) and mesh dims of a Gen-A ``devices`` argument."""
    if isinstance(devices, np.ndarray):
        dims = tuple(devices.shape)
        flat = list(devices.flat)
    else:
        flat = list(devices)
        dims = (len(flat),)
    all_devices = jax.devices()
    ids = []
    for d in flat:
        if isinstance(d, jax.Device):
            ids.append(all_devices.index(d))
        elif isinstance(d, int | np.integer) and not isinstance(d, bool):
            ids.append(int(d))
        else:
            raise ValueError(f"{what}: device {d!r} is neither an int nor a jax Device")
    return np.asarray(ids, dtype=int), dims


def _mesh_indices(mesh: Mesh) -> np.ndarray:
    all_devices = jax.devices()
    return np.asarray([all_devices.index(d) for d in mesh.devices.flat], dtype=int)


@dataclasses.dataclass(frozen=True)
class Placement:
    """A resolved task: devices, mesh shape, device axes and logical rules.

    ``axes`` is ``None`` for a Gen-A task without ``device_axes``: its constraints replicate.
    ``jax_mesh`` keeps a caller's ``jax.sharding.Mesh`` so that shardings print with it.
    """

    name: str
    ids: tuple[int, ...]
    dims: tuple[int, ...]
    axes: tuple[str, ...] | None
    rules: tuple[tuple[str, Any], ...]
    jax_mesh: Mesh | None = dataclasses.field(default=None, compare=False)

    @property
    def logical_names(self) -> frozenset[str]:
        return frozenset(name for name, _ in self.rules)

    def engine_task(self) -> mm.Task:
        """The mmnnx task with a name unique among the tasks this layer made."""
        return _ENGINE_TASKS.get(self)


class _EngineTasks:
    """One ``mm.Task`` per distinct placement; names made unique (mmnnx requires it)."""

    def __init__(self):
        self._tasks: dict[Placement, mm.Task] = {}
        self._names: set[str] = set()

    def get(self, p: Placement) -> mm.Task:
        task = self._tasks.get(p)
        if task is not None:
            return task
        base = re.sub(r"[/()\s]", "_", p.name) or "task"
        name, k = base, 1
        while name in self._names:
            k += 1
            name = f"{base}#{k}"
        self._names.add(name)
        axes = p.axes if p.axes is not None else tuple(f"{_HIDDEN}{i}" for i in range(len(p.dims)))
        if p.jax_mesh is not None and p.axes is not None:
            mesh: Any = p.jax_mesh
        else:
            mesh = mm.TaskMesh(devices=p.ids, axis_sizes=p.dims, axis_names=axes)
        task = mm.Task(name, mesh=mesh, logical_axes=p.rules)
        self._tasks[p] = task
        return task


_ENGINE_TASKS = _EngineTasks()


def _identity(axes: Sequence[str]) -> tuple[tuple[str, str], ...]:
    return tuple((a, a) for a in axes)


def _rules(pairs: Any) -> tuple[tuple[str, Any], ...]:
    out = []
    for pair in pairs or ():
        logical, device = pair
        out.append((logical, tuple(device) if isinstance(device, list) else device))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class GenAArgs:
    """The Gen-A keyword arguments of ``task`` (``mesh``, ``devices``, ``device_axes``,
    ``logical_axes``), checked when given; resolved lazily (needs the device list)."""

    name: str
    mesh: Mesh | None = None
    devices: Any = None
    device_axes: tuple[str, ...] | None = None
    logical_axes: Any = None

    def check(self) -> None:
        """The errors multimesh raises when the task is created."""
        if self.mesh is not None and (self.devices is not None or self.device_axes is not None):
            raise ValueError(f"task {self.name}: give either mesh or devices/device_axes, not both")
        if self.logical_axes is not None and self.device_axes is None and self.mesh is None:
            raise ValueError(f"task {self.name}: logical_axes given but no device_axes (or mesh)")

    def resolve(self) -> Placement:
        if self.mesh is not None:
            mesh = self.mesh
            axes = tuple(mesh.axis_names)
            rules = _rules(self.logical_axes) if self.logical_axes is not None else _identity(axes)
            return Placement(
                self.name, tuple(_mesh_indices(mesh)), tuple(mesh.axis_sizes), axes, rules, mesh
            )
        if self.devices is None:
            ids, dims = np.arange(len(jax.devices())), (len(jax.devices()),)
        else:
            ids, dims = _device_indices(self.devices, f"task {self.name}")
        if self.device_axes is not None and len(self.device_axes) != len(dims):
            raise ValueError(
                f"task {self.name}: the device mesh has {len(dims)} dims {dims} but device_axes "
                f"{tuple(self.device_axes)} name {len(self.device_axes)}"
            )
        if self.device_axes is None:
            return Placement(self.name, tuple(int(i) for i in ids), dims, None, ())
        axes = tuple(self.device_axes)
        rules = _rules(self.logical_axes) if self.logical_axes is not None else _identity(axes)
        return Placement(self.name, tuple(int(i) for i in ids), dims, axes, rules)


def global_mesh() -> Mesh | None:
    """The ambient global mesh: the innermost entered MultiMesh, else ``jax.set_mesh``'s."""
    current = mm.current_multimesh()
    if current is not None:
        return current.mesh
    return None


def resolve_gen_b(task: mm.Task, default_name: str, *, registered: bool = False) -> Placement:
    """Resolves a Gen-B ``Task``. ``registered``: the ``register_task`` rules (a mesh xor a
    mesh_slice is required); for ``task`` a missing mesh means all devices on one axis ``x``."""
    name = task.name or default_name
    mesh_slice = getattr(task, "mesh_slice", None)
    loop_slice = getattr(task, "loop_dependent_mesh_slice", None)
    if registered and (task.mesh is None) == (mesh_slice is None):
        which = "both" if task.mesh is not None else "neither"
        raise ValueError(
            f"register_task({default_name}): the Task must have exactly one of mesh and "
            f"mesh_slice; it has {which}"
        )
    mesh_obj: Any = task.mesh
    if mesh_obj is None and registered:
        mesh_obj = slice_global_mesh(mesh_slice, f"register_task({default_name})")
        if loop_slice is not None:
            for i in (0, 1):
                other = slice_global_mesh(loop_slice(i), f"register_task({default_name})")
                if other.size != mesh_obj.size:
                    raise ValueError(
                        f"register_task({default_name}): loop_dependent_mesh_slice({i}) has "
                        f"{other.size} devices but the default mesh slice has {mesh_obj.size}"
                    )
    if mesh_obj is None:
        n = len(jax.devices())
        axes: tuple[str, ...] = ("x",)
        ids, dims, jmesh = tuple(range(n)), (n,), None
    elif isinstance(mesh_obj, mm.TaskMesh):
        axes, dims = tuple(mesh_obj.axis_names), tuple(mesh_obj.axis_sizes)
        ids, jmesh = tuple(int(i) for i in mesh_obj.devices.flat), None
    else:
        axes, dims = tuple(mesh_obj.axis_names), tuple(mesh_obj.axis_sizes)
        ids, jmesh = tuple(int(i) for i in _mesh_indices(mesh_obj)), mesh_obj
    rules = task.logical_axes if task.logical_axes else _identity(axes)
    rules = tuple(rules) + tuple(task.extra_axes or ())
    return Placement(name, ids, dims, axes, rules, jmesh)


def slice_global_mesh(mesh_slice: dict[str, int], what: str) -> Mesh:
    """The ambient global mesh sliced at ``mesh_slice`` (sliced axes kept with size 1)."""
    current = mm.current_multimesh()
    if current is None:
        raise ValueError(f"{what}: a mesh_slice needs an entered MultiMesh (with mm: ...)")
    return current.slice(**mesh_slice)


# ---------------------------------------------------------------------------------------------
# register_task: regex -> task, by name scope


@dataclasses.dataclass
class Registration:
    """One ``register_task`` call: a regex over name-scope components and how to get a task."""

    matcher: str
    regex: re.Pattern
    callback: Callable | None
    task: mm.Task | None
    gen_a: dict | None

    def resolve(self, scope: str, backprop: bool) -> Placement:
        if self.gen_a is not None:
            return _resolve_gen_a_registration(self, scope, backprop)
        if self.task is not None:
            task = self.task
        else:
            task = _call(self.callback, scope, backprop)
            if not isinstance(task, mm.Task):
                raise ValueError(
                    f"register_task({self.matcher}): the callback returned {task!r}, not a Task"
                )
        return resolve_gen_b(
            task, self.matcher if self.task is not None else scope, registered=True
        )


def _call(callback: Callable, name: str, backprop: bool) -> Any:
    try:
        params = inspect.signature(callback).parameters.values()
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        takes_two = len(positional) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in params)
    except (TypeError, ValueError):
        takes_two = True
    return callback(name, backprop) if takes_two else callback(name)


def _resolve_gen_a_registration(reg: Registration, scope: str, backprop: bool) -> Placement:
    a = reg.gen_a
    what = f"in register_task({reg.matcher})"
    name = a["name"] or reg.matcher
    if a["callback"] is not None:
        result = _call(a["callback"], scope, backprop)
        if (
            isinstance(result, tuple)
            and len(result) == 2
            and isinstance(result[0], tuple | list)
            and len(result[0]) == 2
            and isinstance(result[1], str)
        ):
            (start, stop), name = result
            devices: Any = list(range(start, stop))
        else:
            devices, name = result, scope
        ids, _ = _device_indices(devices, what)
    elif a["mesh"] is not None:
        mesh = a["mesh"]
        rules = _rules(a["logical_axes"]) if a["logical_axes"] is not None else None
        axes = tuple(mesh.axis_names)
        return Placement(
            name,
            tuple(_mesh_indices(mesh)),
            tuple(mesh.axis_sizes),
            axes,
            rules if rules is not None else _identity(axes),
            mesh,
        )
    else:
        ids, _ = _device_indices(a["devices"], what)
        if isinstance(a["devices"], np.ndarray) and a["dims"] is None:
            a = {**a, "dims": a["devices"].shape}
    dims = tuple(a["dims"]) if a["dims"] is not None else (len(ids),)
    if int(np.prod(dims)) != len(ids):
        raise ValueError(f"{what}: dims {dims} do not match the {len(ids)} devices {ids.tolist()}")
    axes = tuple(a["device_axes"])
    if len(axes) != len(dims):
        raise ValueError(f"{what}: device_axes {axes} do not match dims {dims}")
    rules = _rules(a["logical_axes"]) if a["logical_axes"] is not None else _identity(axes)
    return Placement(name, tuple(int(i) for i in ids), dims, axes, rules)


class Context:
    """A set of ``register_task`` registrations (the default one, or a MultiMesh's)."""

    def __init__(self):
        self.registrations: list[Registration] = []

    def register_task(
        self,
        matcher: str,
        *,
        callback: Callable | None = None,
        task: mm.Task | None = None,
        **gen_a: Any,
    ) -> None:
        """Registers a task for the name scopes ``matcher`` (a name or regex) matches.

        Gen-B: give a fixed ``task`` or a ``callback(name, backprop) -> Task``. Gen-A keyword
        arguments (``name``, ``mesh``, ``dims``, ``devices``, ``device_axes``,
        ``logical_axes``) are accepted too; see :func:`multimesh_compat.jax.register_task`.
        """
        self.registrations.append(make_registration(matcher, callback, task, gen_a))

    def clear(self) -> None:
        self.registrations.clear()


_GEN_A_KEYS = ("name", "mesh", "dims", "devices", "device_axes", "logical_axes")


def make_registration(matcher: str, callback, task, gen_a: dict) -> Registration:
    unknown = set(gen_a) - set(_GEN_A_KEYS)
    if unknown:
        raise TypeError(f"register_task: unexpected keyword arguments {sorted(unknown)}")
    pattern = matcher if ("(" in matcher or ")" in matcher) else f"({matcher})"
    regex = re.compile(pattern)
    if gen_a:
        what = f"in register_task({matcher})"
        a = {k: gen_a.get(k) for k in _GEN_A_KEYS}
        a["callback"] = callback
        if a["device_axes"] is not None and a["mesh"] is not None:
            raise ValueError(f"{what}: give either device_axes or mesh, not both")
        if callback is not None and a["dims"] is None and a["mesh"] is None:
            raise ValueError(f"{what}: a callback needs dims (or mesh)")
        if a["mesh"] is None and a["devices"] is None and callback is None:
            raise ValueError(f"{what}: give mesh, devices or callback")
        if a["device_axes"] is None and a["mesh"] is None:
            raise ValueError(f"{what}: give device_axes or mesh")
        if a["devices"] is not None:
            _device_indices(a["devices"], what)  # rejects devices that are not ints or Devices
        return Registration(matcher, regex, None, None, a)
    if callback is None and task is None:
        raise Exception("must specify callback or task to register_task")
    if task is not None and not isinstance(task, mm.Task):
        raise ValueError(f"register_task({matcher}): task {task!r} is not a Task")
    return Registration(matcher, regex, callback, task, None)


DEFAULT_CONTEXT = Context()


class MultiMesh(mm.MultiMesh):
    """mmnnx's ``MultiMesh`` with multimesh.jax's per-mesh ``register_task``.

    Entering it (``with mesh:``) makes the global mesh ambient, as ``mm.MultiMesh`` does,
    turns autoshard on, and activates the tasks registered on it.

    Example:
        >>> mesh = MultiMesh(axis_sizes=(2, 2, 2), axis_names=("stage", "batch", "model"))
        >>> mesh.register_task("layer0", task=Task(mesh_slice={"stage": 0}))
        >>> len(mesh.tasks.registrations)
        1
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tasks = Context()

    def register_task(self, matcher: str, *, callback=None, task=None, **gen_a) -> None:
        """Registers a name-scoped task that is active while this MultiMesh is entered."""
        self.tasks.register_task(matcher, callback=callback, task=task, **gen_a)

    def __enter__(self):
        from multimesh_compat.jax._context import _setting

        out = super().__enter__()
        self._autoshard = _setting("autoshard", True)
        self._autoshard.__enter__()
        return out

    def __exit__(self, *exc_info):
        self._autoshard.__exit__(*exc_info)
        return super().__exit__(*exc_info)


def active_contexts() -> list[Context]:
    """Registrations in force: the default context, then the entered MultiMesh's."""
    out = [DEFAULT_CONTEXT]
    current = mm.current_multimesh()
    if isinstance(current, MultiMesh):
        out.append(current.tasks)
    return out


def innermost_context() -> Context:
    return active_contexts()[-1]


# The compat task whose function is being traced (innermost), for constraint translation.
CURRENT_TASK: contextvars.ContextVar[Placement | None] = contextvars.ContextVar(
    "multimesh_compat_task", default=None
)
