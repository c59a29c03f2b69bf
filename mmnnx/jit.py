"""``mm.jit``: an NNX-aware jit that runs one step as one compiled program per task."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

from mmnnx.mpmd import _jax, markers
from mmnnx.mpmd.colour import colour
from mmnnx.mpmd.errors import MPMDError, SideEffectError
from mmnnx.mpmd.pipeline import plan_pipeline
from mmnnx.mpmd.plan import Plan, cut
from mmnnx.mpmd.runtime import Event, Executable
from mmnnx.sharding import Task, task_of
from mmnnx.sharding.place import SPEC_KEY


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def _as_tuple(x: int | Sequence[int]) -> tuple[int, ...]:
    return (x,) if isinstance(x, int) else tuple(x)


def _path_keys(path: tuple) -> list:
    return [getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in path]


def _arg_position(path: tuple) -> int | None:
    """The positional-argument index a leaf comes from (None for keyword arguments)."""
    keys = _path_keys(path)  # (args|kwargs, position or name, ...)
    return keys[1] if len(keys) > 1 and keys[0] == 0 else None


def _leaf_name(path: tuple) -> str:
    """A readable name for a leaf: ``arg0/layers/0/kernel``, or ``x`` for a keyword argument."""
    keys = _path_keys(path)
    head = f"arg{keys[1]}" if keys[0] == 0 else str(keys[1])
    return "/".join([head, *(str(k) for k in keys[2:])])


def _output_homes(out_shape: Any) -> list[tuple[Task | None, Any]]:
    """For each output leaf: the task and sharding of the Variable it belongs to, if placed.

    Gradients from ``nnx.grad`` are Variables carrying their parameter's placement, so they are
    computed on, and returned from, their parameter's task.
    """
    homes = []
    for node in jax.tree.leaves(out_shape, is_leaf=_is_variable):
        task = task_of(node) if _is_variable(node) else None
        if task is None:
            homes.append((None, None))
        else:
            spec = node.get_metadata().get(SPEC_KEY, PartitionSpec())
            homes.append((task, task.sharding(spec)))
    return homes


_SCALARS = (bool, int, float, complex)


class _Call:
    """One call's arguments as a pytree definition, the distinct Variables, and array leaves.

    Modules and Optimizers are flattened as pytrees with Variables as leaves; a Variable reached
    twice (tied weights) is one input, and the rebuilt arguments share it again.
    """

    def __init__(self, fn: JitFunction, args: tuple, kwargs: dict):
        self.fn = fn
        self.statics = tuple((i, args[i]) for i in fn.static_argnums if i < len(args))
        self.static_kwargs = tuple(
            sorted((k, v) for k, v in kwargs.items() if k in fn.static_argnames)
        )
        dyn_args = tuple(None if i in fn.static_argnums else a for i, a in enumerate(args))
        dyn_kwargs = {k: v for k, v in kwargs.items() if k not in fn.static_argnames}
        self.target = (dyn_args, dyn_kwargs)
        nodes, self.treedef = jax.tree.flatten(self.target, is_leaf=_is_variable)
        position: dict[int, int] = {}
        self.variables: list[nnx.Variable] = []
        arrays: list[Any] = []
        self.slots: list[int] = []
        for node in nodes:
            if isinstance(node, nnx.Variable):
                i = position.get(id(node))
                if i is None:
                    i = position[id(node)] = len(self.variables)
                    self.variables.append(node)
                self.slots.append(i)
            else:
                if isinstance(node, _SCALARS):
                    node = np.asarray(node)
                self.slots.append(-1 - len(arrays))
                arrays.append(node)
        self.num_variables = len(self.variables)
        self.leaves = [v.get_raw_value() for v in self.variables] + arrays
        self.tasks: list[Task | None] = [task_of(v) for v in self.variables]
        self.tasks += [None] * len(arrays)
        for i, leaf in enumerate(self.leaves):
            if not isinstance(leaf, jax.Array | np.ndarray | np.generic):
                raise MPMDError(
                    f"mm.jit: argument leaf {self.names[i]!r} is a {type(leaf).__name__}, not an "
                    "array; mark the argument static (static_argnums/static_argnames) or pass "
                    "an array"
                )
        # Placed leaves: their sharding is part of the plan. Free leaves go wherever their
        # consumers are; only a committed one on devices no task owns is an error.
        self.shardings = [
            leaf.sharding if task is not None else None
            for leaf, task in zip(self.leaves, self.tasks, strict=True)
        ]
        signature = tuple(
            (leaf.shape, leaf.dtype, sharding)
            for leaf, sharding in zip(self.leaves, self.shardings, strict=True)
        )
        # The plan holds its tasks, so their ids stay unique while it is cached.
        placement = tuple(id(t) for t in self.tasks)
        self.key = (self.treedef, signature, placement, self.statics, self.static_kwargs)

    @functools.cached_property
    def _paths(self) -> list[tuple]:
        """The path of each input (first occurrence for a shared Variable)."""
        with_paths, _ = jax.tree.flatten_with_path(self.target, is_leaf=_is_variable)
        paths: list[Any] = [None] * len(self.leaves)
        for (path, _), slot in zip(with_paths, self.slots, strict=True):
            i = slot if slot >= 0 else self.num_variables - 1 - slot
            if paths[i] is None:
                paths[i] = path
        return paths

    @property
    def names(self) -> list[str]:
        return [_leaf_name(p) for p in self._paths]

    @property
    def donated(self) -> list[bool]:
        return [
            task is not None and _arg_position(path) in self.fn.donate_argnums
            for path, task in zip(self._paths, self.tasks, strict=True)
        ]

    def rebuild(self, values: Sequence[Any]) -> tuple[tuple, dict, list[nnx.Variable]]:
        """The arguments again, with fresh Variables holding ``values`` (used while tracing)."""
        fresh = [v.replace(x) for v, x in zip(self.variables, values, strict=False)]
        arrays = values[self.num_variables :]
        nodes = [fresh[s] if s >= 0 else arrays[-1 - s] for s in self.slots]
        dyn_args, dyn_kwargs = jax.tree.unflatten(self.treedef, nodes)
        return dyn_args, dyn_kwargs, fresh

    def check_unchanged(self, dyn_args: tuple, dyn_kwargs: dict, fresh: list) -> None:
        nodes, treedef = jax.tree.flatten((dyn_args, dyn_kwargs), is_leaf=_is_variable)
        same = treedef == self.treedef and all(
            node is fresh[s] for node, s in zip(nodes, self.slots, strict=True) if s >= 0
        )
        if not same:
            raise SideEffectError(
                f"mm.jit: {getattr(self.fn.fun, '__name__', 'the step')} changed the structure of "
                "its arguments (added, removed or replaced a Variable or submodule, or changed "
                "metadata); mm.jit can only carry back new values of existing Variables"
            )

    def check_devices(self) -> None:
        """Raises if a leaf lives on devices its task (or, if unplaced, any task) does not own."""
        for name, leaf, task in zip(self.names, self.leaves, self.tasks, strict=True):
            devices = leaf.sharding.device_set if isinstance(leaf, jax.Array) else None
            if task is not None and devices != set(task.jax_mesh.devices.flat):
                raise MPMDError(
                    f"mm.jit: {name!r} is placed on task {task.name!r} but its array lives on "
                    f"devices {sorted(d.id for d in devices)}; re-run mm.place after moving it"
                )
        owned: set = set()
        for task in dict.fromkeys(t for t in self.tasks if t is not None):
            owned.update(task.jax_mesh.devices.flat)
        if owned:  # with no placed state, the tasks come from mm.task regions: checked later
            self.check_free_devices(owned)

    def check_free_devices(self, owned: set) -> None:
        for i, (leaf, task) in enumerate(zip(self.leaves, self.tasks, strict=True)):
            if task is None and isinstance(leaf, jax.Array) and leaf.committed:
                devices = leaf.sharding.device_set
                if not devices <= owned:
                    raise MPMDError(
                        f"mm.jit: argument {self.names[i]!r} is on devices "
                        f"{sorted(d.id for d in devices - owned)} that no task owns; tasks own "
                        f"devices {sorted(d.id for d in owned)}"
                    )

    def full_args(self, dyn_args: tuple, dyn_kwargs: dict) -> tuple[tuple, dict]:
        args = list(dyn_args)
        for i, v in self.statics:
            args[i] = v
        return tuple(args), {**dyn_kwargs, **dict(self.static_kwargs)}


class JitFunction:
    """The callable ``mm.jit`` returns; see :func:`jit`."""

    def __init__(self, fun, static_argnums, static_argnames, donate_argnums):
        self.fun = fun
        self.static_argnums = _as_tuple(static_argnums)
        self.static_argnames = (
            (static_argnames,) if isinstance(static_argnames, str) else tuple(static_argnames)
        )
        self.donate_argnums = _as_tuple(donate_argnums)
        self._cache: dict[Any, tuple[Executable, Any]] = {}
        self.trace_count = 0
        functools.update_wrapper(self, fun)

    def _build(self, call: _Call) -> tuple[Executable, Any]:
        call.check_devices()
        fun = self.fun

        def pure(*leaves):
            dyn_args, dyn_kwargs, fresh = call.rebuild(leaves)
            args, kwargs = call.full_args(dyn_args, dyn_kwargs)
            out = fun(*args, **kwargs)
            call.check_unchanged(dyn_args, dyn_kwargs, fresh)
            return out, [v.get_value() for v in fresh]

        self.trace_count += 1
        avals = [jax.ShapeDtypeStruct(np.shape(x), x.dtype) for x in call.leaves]
        with markers.tracing() as trace:
            graph, out_shape = _jax.trace(pure, avals)
        regions = trace.regions
        out_tree = jax.tree.structure(out_shape[0])
        tasks = list(dict.fromkeys([*(t for t in call.tasks if t is not None), *regions.values()]))
        names = {}
        for t in tasks:
            if names.setdefault(t.name, t) != t:
                raise MPMDError(f"mm.jit: two different tasks are named {t.name!r}")
        if not tasks:
            raise MPMDError(
                "mm.jit: no argument holds state placed on a task; place the model with "
                "mm.place or mm.init first"
            )
        num_user_outputs = len(graph.outputs) - call.num_variables
        out_homes = _output_homes(out_shape[0])
        state_homes = [
            s if t is not None else None for s, t in zip(call.shardings, call.tasks, strict=True)
        ]
        homes = [s for _, s in out_homes] + state_homes[: call.num_variables]
        home_tasks = [t for t, _ in out_homes] + list(call.tasks[: call.num_variables])
        op_tasks = colour(graph, call.tasks, call.names, home_tasks, tasks, regions)
        free = {v for v, t in zip(graph.inputs, call.tasks, strict=True) if t is None}
        pipeline = plan_pipeline(graph, op_tasks, tasks, trace.microbatches, free)
        if pipeline is None:
            order = [(f, None) for f in cut(graph, op_tasks, tasks)]
        else:
            order = pipeline.order
        executable = Executable(
            graph,
            tasks,
            call.tasks,
            state_homes,
            homes,
            call.donated,
            order=order,
            pipeline=pipeline,
        )
        return executable, (out_tree, num_user_outputs)

    def _lookup(self, args, kwargs) -> tuple[_Call, Executable, Any]:
        call = _Call(self, args, kwargs)
        try:
            entry = self._cache.get(call.key)
        except TypeError as e:
            raise MPMDError(
                f"mm.jit: an argument holds a leaf that is neither an array nor hashable ({e}); "
                "pass arrays, or mark the argument static with a hashable value"
            ) from None
        if entry is None:
            with _jax.no_ambient_mesh():
                entry = self._cache[call.key] = self._build(call)
        else:
            call.check_free_devices(entry[0].owned_devices)
        return call, *entry

    def __call__(self, *args, **kwargs):
        return self._run(args, kwargs)

    def _run(self, args, kwargs, **modes):
        call, executable, (out_tree, num_user_outputs) = self._lookup(args, kwargs)
        with _jax.no_ambient_mesh():  # each fragment runs on its own task's mesh
            results = executable(call.leaves, **modes)
        for variable, value in zip(call.variables, results[num_user_outputs:], strict=True):
            variable.set_raw_value(value)
        return jax.tree.unflatten(out_tree, results[:num_user_outputs])

    def timeline(self, *args, **kwargs) -> list[Event]:
        """Runs one step (updating the arguments as a call does) and returns a timed event per
        pipeline action: task, kind (F, B, I or W), stage, microbatch, start and end in seconds.

        Only this mode blocks on each action's outputs; ``mm.plot_timeline`` draws the result.
        """
        events: list[Event] = []
        self._run(args, kwargs, timeline=events)
        return events

    def memory_profile(self, *args, **kwargs) -> dict[str, tuple[int, int]]:
        """Runs one step and returns, per task, the peak bytes of live per-microbatch values
        (activations, cotangents) and the peak number of microbatches holding them."""
        memory: dict[str, tuple[int, int]] = {}
        self._run(args, kwargs, memory=memory)
        return memory

    def plan(self, *args, **kwargs) -> Plan:
        """The plan this step runs for these arguments (built and cached if needed)."""
        _, executable, _ = self._lookup(args, kwargs)
        return executable.plan


def jit(
    fun: Callable | None = None,
    *,
    static_argnums: int | Sequence[int] = (),
    static_argnames: str | Sequence[str] = (),
    donate_argnums: int | Sequence[int] = (),
) -> JitFunction:
    """Lifts an NNX step over several tasks: one compiled program per task, run asynchronously.

    Arguments may be Modules, Optimizers, other graph nodes and pytrees of arrays; Variable updates
    made inside ``fun`` are written back to the caller's objects, on their tasks. An op that reads
    state placed on task T runs on T; other ops go where the fewest bytes move.

    Example:
        >>> import jax.numpy as jnp
        >>> from mmnnx.sharding import Task, TaskMesh, place
        >>> s0, s1 = Task("s0", mesh=TaskMesh(devices=[0])), Task("s1", mesh=TaskMesh(devices=[1]))
        >>> model = place(nnx.Sequential(nnx.Linear(2, 4, rngs=nnx.Rngs(0)),
        ...                              nnx.Linear(4, 1, rngs=nnx.Rngs(1))),
        ...               [("layers/0", s0), ("layers/1", s1)])
        >>> @jit
        ... def loss_and_grads(model, x):
        ...     return nnx.value_and_grad(lambda m: m(x).sum())(model)
        >>> loss, grads = loss_and_grads(model, jnp.ones((8, 2)))
        >>> [d.id for d in grads["layers"][1]["kernel"].get_value().devices()]
        [1]
    """
    if fun is None:
        return functools.partial(
            jit,
            static_argnums=static_argnums,
            static_argnames=static_argnames,
            donate_argnums=donate_argnums,
        )
    return JitFunction(fun, static_argnums, static_argnames, donate_argnums)
