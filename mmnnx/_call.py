"""One call of an ``mm.jit`` step, as the engine sees it: the arguments' NNX state flattened into
one :class:`Leaf` record per input leaf (Variables first, a Variable reached twice is one input)
and their arrays, the pytree definition that rebuilds them while the step is traced, the
:class:`~mmnnx.mpmd.step_io.StepInput` / ``StepOutput`` records describing them, and the checks
of what a call may not change (a Variable replaced or added while tracing, state on another
task's devices, an optimizer whose state sits elsewhere than its parameters)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

from mmnnx import _nnx
from mmnnx._jax.arrays import all_plain_arrays
from mmnnx.errors import MPMDError, SideEffectError
from mmnnx.mpmd.step_io import StepInput, StepOutput
from mmnnx.mpmd.trace.trace_step import PYTHON_SCALARS
from mmnnx.sharding import Task, TaskStack, home_of, stack_of, task_of
from mmnnx.sharding.place import SPEC_KEY, misplaced_optimizer_state


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


def user_outputs(out_shape: Any) -> list[StepOutput]:
    """For each output leaf of the step's result: the task (or task stack) and spec of the
    Variable it belongs to, if placed.

    Gradients from ``nnx.grad`` are Variables carrying their parameter's placement, so they are
    computed on, and returned from, their parameter's task.
    """
    outputs = []
    for node in jax.tree.leaves(out_shape, is_leaf=_nnx.is_variable):
        home = home_of(node) if _nnx.is_variable(node) else None
        spec = node.get_metadata().get(SPEC_KEY, PartitionSpec()) if home else PartitionSpec()
        sharding = home.sharding(spec) if isinstance(home, Task) else None
        leaves = len(jax.tree.leaves(node))  # sown: a tuple in one Variable
        outputs += [StepOutput(home=home, spec=spec, sharding=sharding)] * leaves
    return outputs


def state_outputs(variables: Sequence[StepInput]) -> list[StepOutput]:
    """Where each Variable's new value ends: on its task (stack), laid out as it is now."""
    return [
        StepOutput(home=v.task or v.stack, spec=v.spec, sharding=v.task_sharding) for v in variables
    ]


class Leaf(NamedTuple):
    """What a call knows of one input leaf besides its value, the same on every call of one
    structure: its Variable (``None``: an array argument) and where that is placed."""

    variable: Any = None
    task: Task | None = None
    stack: TaskStack | None = None

    @property
    def placed(self) -> bool:
        return self.task is not None or self.stack is not None


_ARRAY = Leaf()


class Call:
    """One call's arguments as a pytree definition and its input leaves: one :class:`Leaf`
    record each (``leaves``) and their arrays (``values``), the distinct Variables' first.

    Modules and Optimizers are flattened as pytrees with Variables as leaves; a Variable reached
    twice (tied weights) is one input, and the rebuilt arguments share it again.
    """

    def __init__(self, fn: Any, args: tuple, kwargs: dict):
        self.fn = fn
        self.step_name = getattr(fn.fun, "__name__", "the step")
        self.bound = False
        self._set_statics(args, kwargs)
        nodes, self.treedef = jax.tree.flatten(self.target, is_leaf=_nnx.is_variable)
        position: dict[int, int] = {}
        self.variables: list[nnx.Variable] = []
        arrays: list[Any] = []
        self.slots: list[int] = []
        for node in nodes:
            if _nnx.is_variable(node):
                i = position.get(id(node))
                if i is None:
                    i = position[id(node)] = len(self.variables)
                    self.variables.append(node)
                self.slots.append(i)
            else:
                self.slots.append(-1 - len(arrays))
                arrays.append(node)
        self.num_variables = len(self.variables)
        # positional: made for every Variable on every call (by keyword, it costs twice as much)
        self.leaves = [Leaf(v, task_of(v), stack_of(v)) for v in self.variables]
        self.leaves += [_ARRAY] * len(arrays)
        # the same on every call of this structure: read once, not per call
        self.placed = [leaf.placed for leaf in self.leaves]
        self.placement = tuple((id(leaf.task), id(leaf.stack)) for leaf in self.leaves)
        self.unplaced = [i for i in range(self.num_variables) if not self.placed[i]]
        self._set_values(arrays)

    def template(self, num_tail: int, num_bound: int) -> Call:
        """This call's Variables and structure, holding none of its values: the Variables' values
        are read again by every :meth:`rebound` call, and the trailing ``num_tail`` array leaves
        (a batch) are the next call's. Keeping them would keep a step's old arrays alive.

        Also records every edge (object, key, child) from the first ``num_bound`` positional
        arguments to their Variables, which :meth:`check_bound` verifies, and the size of each
        container those arguments hold, which :meth:`grown` compares."""
        template = object.__new__(Call)
        template.__dict__.update(self.__dict__)
        template.bound_arrays = self.values[self.num_variables : len(self.values) - num_tail]
        edges: dict[tuple[int, Any], tuple[Any, Any, Any]] = {}
        roots = self.target[0]
        for path in self._paths:
            position = _arg_position(path)
            if position is None or position >= num_bound:
                continue
            parent = roots[position]
            for key in path[2:]:
                slot = _nnx.child_slot(parent, key)
                if slot is None:
                    break
                holder, k = slot
                child = holder[k]
                edges.setdefault((id(holder), k), (holder, k, child, parent, key))
                parent = child
        template.edges = list(edges.values())
        holders = {id(h): h for h in _nnx.holders_of(roots[:num_bound])}
        holders.update((id(e[0]), e[0]) for e in template.edges)
        template.holders = list(holders.values())
        template.sizes = [len(h) for h in template.holders]
        template.values = template.target = None
        return template

    def check_none_added(self, call: Call) -> None:
        """Raises if ``call`` (the same arguments, walked afresh) holds a Variable that this
        template does not: one added to a bound argument, which the binding would never read
        or update (as one replaced, :meth:`check_bound`)."""
        known = {id(v) for v in self.variables}
        for name, variable in zip(call.names, call.variables, strict=False):
            if id(variable) not in known:
                raise SideEffectError(
                    f"mm.cached_partial: a bound argument changed since the binding was made "
                    f"({name!r}, an nnx.{type(variable).__name__}, was added); the binding "
                    "would never read or update it. Make a new mm.cached_partial after "
                    "changing the model"
                )

    def grown(self) -> bool:
        """Whether something was added to a bound argument since :meth:`template` (an
        attribute, a list item): :meth:`check_bound` sees only what was replaced."""
        return list(map(len, self.holders)) != self.sizes

    def check_bound(self) -> None:
        """Raises if a bound argument changed structure since :meth:`template` (a Variable or
        submodule replaced, or the model placed again): its new Variables would never be
        trained."""
        for holder, k, child, parent, key in self.edges:
            try:
                same = holder[k] is child
            except (IndexError, KeyError):
                same = False
            if not same:
                where = jax.tree_util.keystr((key,))
                raise SideEffectError(
                    f"mm.cached_partial: a bound argument changed since the binding was made "
                    f"(its {type(parent).__name__}{where} is another object now: a Variable or "
                    "submodule was replaced); the new one would never be updated. Make a new "
                    "mm.cached_partial after changing the model"
                )

    def rebound(self, args: tuple, kwargs: dict, tail: list[Any]) -> Call:
        """A :meth:`template`'s Variables and structure with new trailing array leaves
        (``tail``) and the static values of ``args``/``kwargs``: the fast path of
        :class:`CachedPartial`."""
        call = object.__new__(Call)
        call.__dict__.update(self.__dict__)
        call.bound = True
        call._set_statics(args, kwargs)
        call._set_values(self.bound_arrays + tail)
        return call

    def check_placement(self) -> None:
        """Raises if a bound Variable was placed again since the binding was made (its task is
        read once, when the binding is made)."""
        for name, leaf in zip(self.names, self.leaves[: self.num_variables], strict=False):
            now, task = task_of(leaf.variable), leaf.task
            if now != task:
                raise SideEffectError(
                    f"mm.cached_partial: {name!r} was placed again (task "
                    f"{getattr(task, 'name', None)!r} -> {getattr(now, 'name', None)!r}) after "
                    "the binding was made; make a new mm.cached_partial after mm.place"
                )

    def _set_statics(self, args: tuple, kwargs: dict) -> None:
        fn = self.fn
        self.statics = tuple((i, args[i]) for i in fn.static_argnums if i < len(args))
        self.static_kwargs = tuple(
            sorted((k, v) for k, v in kwargs.items() if k in fn.static_argnames)
        )
        dyn_args = tuple(None if i in fn.static_argnums else a for i, a in enumerate(args))
        dyn_kwargs = {k: v for k, v in kwargs.items() if k not in fn.static_argnames}
        self.target = (dyn_args, dyn_kwargs)

    def _set_values(self, arrays: list[Any]) -> None:
        """The input values (Variables' values, then the other arrays), checked, and the cache
        key."""
        arrays = [np.asarray(a) if isinstance(a, PYTHON_SCALARS) else a for a in arrays]
        self.values = [v.get_raw_value() for v in self.variables] + arrays
        # The checks below only fail for a value that is not a plain jax.Array (a step's own
        # outputs, fed back, always are): skipped when none is, as on every step of a loop.
        checked = () if all_plain_arrays(self.values) else enumerate(self.values)
        for i, value in checked:
            if i < self.num_variables and isinstance(value, tuple | dict):
                kind = type(self.variables[i]).__name__
                raise MPMDError(
                    f"mm.jit: {self.names[i]!r} holds values sown by an earlier call (an "
                    f"nnx.{kind} holding a {type(value).__name__}); take them off the model "
                    f"before the next step, e.g. nnx.pop(model, nnx.{kind}), or pop them inside "
                    "the step and return them (nnx.jit would append to them and retrace on "
                    "every call)"
                )
            if not isinstance(value, jax.Array | np.ndarray | np.generic):
                raise MPMDError(
                    f"mm.jit: argument leaf {self.names[i]!r} is a {type(value).__name__}, not "
                    "an array; mark the argument static (static_argnums/static_argnames) or pass "
                    "an array"
                )
        # Placed leaves: their sharding is part of the plan. Free leaves go wherever their
        # consumers are; only a committed one on devices no task owns is an error. The plan
        # holds its tasks, so their ids stay unique while it is cached.
        signature = tuple(
            (v.shape, v.dtype, v.sharding if placed else None)
            for placed, v in zip(self.placed, self.values, strict=True)
        )
        self.key = (self.treedef, signature, self.placement, self.statics, self.static_kwargs)

    @functools.cached_property
    def _paths(self) -> list[tuple]:
        """The path of each input (first occurrence for a shared Variable)."""
        with_paths, _ = jax.tree.flatten_with_path(self.target, is_leaf=_nnx.is_variable)
        paths: list[Any] = [None] * len(self.leaves)
        for (path, _), slot in zip(with_paths, self.slots, strict=True):
            i = slot if slot >= 0 else self.num_variables - 1 - slot
            if paths[i] is None:
                paths[i] = path
        return paths

    @property
    def names(self) -> list[str]:
        return [_leaf_name(p) for p in self._paths]

    def step_inputs(self) -> list[StepInput]:
        """What the engine is told of each input leaf (Variables first, then other arrays)."""
        donate = self.fn.donate_argnums
        return [
            StepInput(
                name=_leaf_name(path),
                task=leaf.task,
                stack=leaf.stack,
                spec=PartitionSpec()
                if leaf.variable is None
                else leaf.variable.get_metadata(SPEC_KEY, PartitionSpec()),
                sharding=getattr(value, "sharding", None),
                donated=leaf.placed and _arg_position(path) in donate,
                shape=tuple(np.shape(value)),
                dtype=value.dtype,
            )
            for leaf, value, path in zip(self.leaves, self.values, self._paths, strict=True)
        ]

    def rebuild(self, values: Sequence[Any]) -> tuple[tuple, dict, list[Any], list[Any]]:
        """The arguments again, with fresh Variables holding ``values`` (used while tracing);
        also those Variables, and the flat nodes the arguments were built from (for
        :meth:`check_unchanged`)."""
        fresh = [v.replace(x) for v, x in zip(self.variables, values, strict=False)]
        arrays = values[self.num_variables :]
        nodes = [fresh[s] if s >= 0 else arrays[-1 - s] for s in self.slots]
        dyn_args, dyn_kwargs = jax.tree.unflatten(self.treedef, nodes)
        return dyn_args, dyn_kwargs, fresh, nodes

    def take_added(self, dyn_args: tuple, dyn_kwargs: dict, fresh: list[Any]) -> list[Added]:
        """The Variables the step added as attributes of its arguments' objects (``self.sow``
        creates an ``nnx.Intermediate``), taken off those (traced) objects so that the rest of
        the structure can be checked unchanged."""
        known = {id(v) for v in fresh}
        found, _ = jax.tree.flatten_with_path((dyn_args, dyn_kwargs), is_leaf=_nnx.is_variable)
        added = []
        for path, node in found:
            if not _nnx.is_variable(node) or id(node) in known:
                continue
            parent = _parent_at((dyn_args, dyn_kwargs), path)
            if parent is None:
                continue  # not an attribute: check_unchanged names the change
            value = node.get_raw_value()
            added.append(
                Added(path=path, kind=type(node), metadata=node.get_metadata(), value=value)
            )
            delattr(parent, path[-1].name)
        return added

    def put_added(self, added: Sequence[Added], values: Sequence[Any]) -> None:
        """Sets each added Variable, holding its computed ``values``, on the caller's object."""
        start = 0
        for a in added:
            leaves = values[start : start + a.num_leaves]
            start += a.num_leaves
            variable = _nnx.variable_from(a.kind, a.metadata, jax.tree.unflatten(a.tree, leaves))
            setattr(_parent_at(self.target, a.path), a.path[-1].name, variable)

    def check_unchanged(self, dyn_args: tuple, dyn_kwargs: dict, before: list[Any]) -> None:
        """Raises if the step changed its arguments in a way mm.jit cannot carry back: their
        structure, or an array that is not a Variable (``m.buf = m.buf + 1``)."""
        step = self.step_name
        nodes, treedef = jax.tree.flatten((dyn_args, dyn_kwargs), is_leaf=_nnx.is_variable)
        if treedef != self.treedef or any(
            node is not old
            for node, old, s in zip(nodes, before, self.slots, strict=True)
            if s >= 0
        ):
            raise SideEffectError(
                f"mm.jit: {step} changed the structure of its arguments (added, removed or "
                "replaced a Variable or submodule, or changed metadata); mm.jit can only carry "
                "back new values of existing Variables"
            )
        for node, old, s in zip(nodes, before, self.slots, strict=True):
            if s < 0 and node is not old:
                name = self.names[self.num_variables - 1 - s]
                raise SideEffectError(
                    f"mm.jit: {step} assigned a new value to {name!r}, which is not an "
                    "nnx.Variable, so mm.jit cannot carry it back; hold it in a Variable (e.g. "
                    "nnx.Variable(...) or nnx.BatchStat(...)) or return the new value"
                )

    def check_devices(self, inputs: Sequence[StepInput]) -> None:
        """Raises if a leaf lives on devices its task (or, if unplaced, any task) does not own."""
        for item in inputs:
            devices = item.sharding.device_set if item.sharding is not None else None
            home = item.task or item.stack
            if home is not None and devices != set(home.jax_mesh.devices.flat):
                raise MPMDError(
                    f"mm.jit: {item.name!r} is placed on task {home.name!r} but its array lives "
                    f"on devices {sorted(d.id for d in devices)}; re-run mm.place after moving it"
                )
            if item.stack is not None and item.sharding != item.stack.sharding(item.spec):
                raise MPMDError(
                    f"mm.jit: {item.name!r} is stacked over tasks {item.stack.name!r} but its "
                    f"array is laid out as {item.sharding}; re-run mm.place after moving it"
                )
        owned: set = set()
        for home in dict.fromkeys(h for i in inputs for h in (i.task, i.stack) if h is not None):
            owned.update(home.jax_mesh.devices.flat)
        if owned:  # with no placed state, the tasks come from mm.task regions: checked later
            self.check_free_devices(owned)

    def check_free_devices(self, owned: set) -> None:
        for i, (leaf, value) in enumerate(zip(self.leaves, self.values, strict=True)):
            if leaf.task is None and isinstance(value, jax.Array) and value.committed:
                devices = value.sharding.device_set
                if not devices <= owned:
                    raise MPMDError(
                        f"mm.jit: argument {self.names[i]!r} is on devices "
                        f"{sorted(d.id for d in devices - owned)} that no task owns; tasks own "
                        f"devices {sorted(d.id for d in owned)}"
                    )

    def check_optimizer_state(self) -> None:
        """Raises if optimizer state was left on another task than the parameter it is kept for
        (the model was placed again after its optimizer was created): every step would move it
        between tasks."""
        dyn_args, dyn_kwargs = self.target
        roots = [(f"arg{i}", a) for i, a in enumerate(dyn_args) if a is not None]
        misplaced = misplaced_optimizer_state(roots + list(dyn_kwargs.items()))
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

    def deleted_input(self) -> MPMDError | None:
        """The error for the first input whose array was deleted (``.delete()``, or donated to
        an earlier call while a Variable still held it), or ``None``."""
        for i, value in enumerate(self.values):
            if isinstance(value, jax.Array) and value.is_deleted():
                return MPMDError(
                    f"mm.jit: the array of {self.names[i]!r} was deleted before this call of "
                    f"{self.step_name} (by .delete(), or donated to an earlier call with "
                    "donate_argnums while this Variable still held it); nothing was written "
                    "back. Give it a live array (Variable.set_value) or restore a checkpoint"
                )
        return None

    def full_args(self, dyn_args: tuple, dyn_kwargs: dict) -> tuple[tuple, dict]:
        args = list(dyn_args)
        for i, v in self.statics:
            args[i] = v
        return tuple(args), {**dyn_kwargs, **dict(self.static_kwargs)}


class Added:
    """A Variable a step added to an argument's object: where, its type and metadata, and how
    its value's leaves (step outputs) form the value."""

    def __init__(self, path: tuple, kind: type, metadata: dict, value: Any):
        self.path, self.kind, self.metadata, self.value = path, kind, metadata, value
        leaves, self.tree = jax.tree.flatten(value)
        self.num_leaves = len(leaves)


def _parent_at(root: Any, path: tuple) -> Any | None:
    """The object holding the attribute at the end of ``path`` (a pytree path from ``root``), or
    ``None`` if the path does not end in an attribute of an object reachable by subscripts."""
    if not path or not isinstance(path[-1], jax.tree_util.GetAttrKey):
        return None
    node = root
    for key in path[:-1]:
        slot = _nnx.child_slot(node, key)
        if slot is None:
            return None
        holder, k = slot
        node = holder[k]
    return node if hasattr(node, "__dict__") else None
