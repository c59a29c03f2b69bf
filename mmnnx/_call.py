"""One call of an ``mm.jit`` step: its arguments flattened into one :class:`Leaf` per input leaf
and their arrays, rebuilt while tracing, described to the engine, checked and written back."""

from __future__ import annotations

import functools
import itertools
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

from mmnnx import _nnx
from mmnnx._added import Added, put_added, take_added
from mmnnx._error_location import with_location
from mmnnx._jax.arrays import all_plain_arrays
from mmnnx.deep_models import user_frame, warn_unrolled_blocks
from mmnnx.distributed.homes import homes_of
from mmnnx.errors import MPMDError, SideEffectError
from mmnnx.mpmd.engine import BuiltStep
from mmnnx.mpmd.run.stay_home import stay_home
from mmnnx.mpmd.step_io import StepInput, StepOutput, check_homes
from mmnnx.mpmd.trace.mesh_context import auto_twin
from mmnnx.mpmd.trace.trace_step import PYTHON_SCALARS, check_outputs
from mmnnx.sharding import Task, TaskStack, home_of, stack_of, task_of
from mmnnx.sharding.place import SPEC_KEY, check_optimizer_placement


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
    """For each output leaf: the task (or stack) and spec of the Variable it belongs to, if placed
    (``nnx.grad``'s gradients carry their parameter's placement)."""
    outputs = []
    for node in jax.tree.leaves(out_shape, is_leaf=_nnx.is_variable):
        home = home_of(node) if _nnx.is_variable(node) else None
        spec = node.get_metadata().get(SPEC_KEY, PartitionSpec()) if home else PartitionSpec()
        sharding = home.sharding(spec) if isinstance(home, Task) else None
        leaves = len(jax.tree.leaves(node))  # sown: a tuple in one Variable
        outputs += [StepOutput(home=home, spec=spec, sharding=sharding)] * leaves
    return outputs


class Leaf(NamedTuple):
    """One input leaf's Variable (``None``: an array argument) and where that is placed."""

    variable: Any = None
    task: Task | None = None
    stack: TaskStack | None = None

    @property
    def placed(self) -> bool:
        return self.task is not None or self.stack is not None


_ARRAY = Leaf()


class Call:
    """One call's arguments as a pytree definition and its input leaves (``leaves``, ``values``),
    the distinct Variables' first: a Variable reached twice (tied weights) is one input."""

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
        leaves = [Leaf(v, task_of(v), stack_of(v)) for v in self.variables]
        self._place(leaves + [_ARRAY] * len(arrays))
        self.unplaced = [i for i in range(self.num_variables) if not self.placed[i]]
        self._set_values(arrays)

    def traceable(
        self, fun: Callable, *, first: bool
    ) -> tuple[Callable, list[Added], list[int | None]]:
        """``fun`` as a pure function of this call's input leaves: it rebuilds the arguments around
        fresh Variables and returns ``fun``'s result, the Variables' new values and those of
        Variables it added (described in the second returned list once traced). The third
        list, once traced, holds for each Variable in ``fun``'s result the index of the input
        Variable it is (``None``: one the step made), so the call returns the caller's own
        Variable, as ``nnx.jit`` does."""
        if first:
            dyn_args, dyn_kwargs = self.target
            warn_unrolled_blocks(fun, dyn_args, dyn_kwargs, f"mm.jit({self.step_name})")
        added: list[Added] = []
        returned: list[int | None] = []

        def pure(*leaves):
            fresh = [v.replace(x) for v, x in zip(self.variables, leaves, strict=False)]
            arrays = leaves[self.num_variables :]
            nodes = [fresh[s] if s >= 0 else arrays[-1 - s] for s in self.slots]
            dyn_args, dyn_kwargs = jax.tree.unflatten(self.treedef, nodes)
            args = list(dyn_args)
            for i, v in self.statics:
                args[i] = v
            kwargs = {**dyn_kwargs, **dict(self.static_kwargs)}
            self._rebuilt = [*args, *kwargs.values()]
            out = fun(*args, **kwargs)
            check_outputs(out, self.step_name)
            index = {id(v): i for i, v in enumerate(fresh)}
            out_leaves = jax.tree.leaves(out, is_leaf=_nnx.is_variable)
            returned[:] = [index.get(id(v)) for v in out_leaves if _nnx.is_variable(v)]
            added[:] = take_added((dyn_args, dyn_kwargs), fresh)
            self.check_unchanged(dyn_args, dyn_kwargs, nodes)
            return out, [v.get_value() for v in fresh], [a.value for a in added]

        return pure, added, returned

    def located(self, error: BaseException) -> BaseException:
        """``error``, raised while tracing the step, pointed at the user's code and module."""
        return with_location(error, getattr(self, "_rebuilt", []))

    def step_outputs(
        self, out_shape: Any, inputs: Sequence[StepInput], added: Sequence[Added]
    ) -> list[StepOutput]:
        """One record per result leaf of the traced step: its return value, the Variables', the
        added ones'; forgets the traced arguments and the added values (tracers)."""
        self._rebuilt, num = [], self.num_variables
        for a in added:
            del a.value  # a tracer: the step's results give the value
        return [
            *user_outputs(out_shape[0]),
            *(StepOutput(i.task or i.stack, i.spec, i.task_sharding) for i in inputs[:num]),
            *[StepOutput()] * sum(a.num_leaves for a in added),
        ]

    def write_back(
        self,
        outs: list[Any],
        built: BuiltStep,
        added: Sequence[Added],
        returned: Sequence[int | None],
    ) -> Any:
        """Writes a run's results into the Variables and the added ones onto their objects; returns
        the step's own return value, an input Variable in it as the caller's own (``returned``:
        :meth:`traceable`'s)."""
        users, num_variables = built.num_outputs, self.num_variables
        if built.executable.graph.specs:  # sharding in types: hand back on the tasks' own meshes
            likes = [None] * users + [
                value.sharding if leaf.placed else None
                for leaf, value in zip(self.leaves[:num_variables], self.values, strict=False)
            ]
            outs = [
                auto_twin(r, like=like)
                for r, like in itertools.zip_longest(outs, likes)  # added: no like
            ]
        updates = outs[users : users + num_variables]
        if self.unplaced and jax.process_count() == 1:
            for i in self.unplaced:
                updates[i] = stay_home(self.values[i], updates[i])
        _nnx.set_values(self.variables, updates)
        put_added(self.target, added, outs[users + num_variables :])
        nodes, tree = jax.tree.flatten(
            jax.tree.unflatten(built.tree, outs[:users]), is_leaf=_nnx.is_variable
        )
        own = iter(returned)  # an input Variable returned is the caller's own
        nodes = [
            self.variables[i] if _nnx.is_variable(node) and (i := next(own)) is not None else node
            for node in nodes
        ]
        return jax.tree.unflatten(tree, nodes)

    def check_placement(self) -> None:
        """Raises if a bound Variable was placed again since the binding was made."""
        for i, leaf in enumerate(self.leaves[: self.num_variables]):
            now, task, name = task_of(leaf.variable), leaf.task, self.names[i]
            if now != task and not (now is None and i in self.unplaced):
                raise SideEffectError(
                    f"mm.cached_partial: {name!r} was placed again (task "
                    f"{getattr(task, 'name', None)!r} -> {getattr(now, 'name', None)!r}) after "
                    "the binding was made; make a new mm.cached_partial after mm.place"
                )

    def _place(self, leaves: list[Leaf]) -> None:  # read once per structure, not per call
        self.leaves, self.placed = leaves, [leaf.placed for leaf in leaves]
        self.placement = tuple((id(leaf.task), id(leaf.stack)) for leaf in leaves)

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
        """The input values (Variables', then the other arrays), checked, and the cache key."""
        # as with jax.jit, a Python number is weakly typed: 0.5 * bf16 activations stay bf16
        weak = [type(a) in PYTHON_SCALARS or getattr(a, "weak_type", False) for a in arrays]
        self.weak = [False] * self.num_variables + weak
        arrays = [np.asarray(a) if isinstance(a, PYTHON_SCALARS) else a for a in arrays]
        self.values = [v.get_raw_value() for v in self.variables] + arrays
        if self.unplaced and jax.process_count() > 1:  # state a step left on a task: its input
            tasks = dict.fromkeys(leaf.task for leaf in self.leaves if leaf.task)  # leaf order
            homes, leaves = homes_of(self.values, self.unplaced, tasks), [*self.leaves]
            for i in self.unplaced:
                leaves[i] = Leaf(leaves[i].variable, homes.get(i))
            self._place(leaves)
        # only a value that is not a plain jax.Array fails these: skipped on a loop's steps
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
        # placed leaves' shardings are part of the plan; the plan holds its tasks, so their ids
        # stay unique while it is cached
        signature = tuple(
            (v.shape, v.dtype, v.sharding if placed else None, weak)
            for placed, v, weak in zip(self.placed, self.values, self.weak, strict=True)
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
        """What the engine is told of each input leaf, after checking that each lives on its task's
        devices and no optimizer state sits elsewhere than its parameter."""
        donate = self.fn.donate_argnums
        inputs = [
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
                # a Python float is float64 to NumPy, float32 to JAX without x64
                dtype=jax.dtypes.canonicalize_dtype(value.dtype, allow_extended_dtype=True),
                weak_type=weak,
            )
            for leaf, value, path, weak in zip(
                self.leaves, self.values, self._paths, self.weak, strict=True
            )
        ]
        kept = [
            i.name
            for i, leaf, path in zip(inputs, self.leaves, self._paths, strict=True)
            if leaf.variable is None and _arg_position(path) in donate
        ]
        if kept:
            warnings.warn(
                f"mm.jit: {self.step_name} donates the array {kept[0]!r}"
                f"{f' (and {len(kept) - 1} more)' if len(kept) > 1 else ''}, which is not in a "
                "Variable: only placed Variables' buffers are donated, so it is kept (hold the "
                "state in Variables placed with mm.place or mm.init to donate it)",
                UserWarning,
                stacklevel=user_frame(),
            )
        owned = check_homes(inputs)
        if owned:  # with no placed state, the tasks come from mm.task regions: checked later
            self.check_free_devices(owned)
        dyn_args, dyn_kwargs = self.target
        roots = [(f"arg{i}", a) for i, a in enumerate(dyn_args) if a is not None]
        check_optimizer_placement(roots + list(dyn_kwargs.items()))
        return inputs

    def check_unchanged(self, dyn_args: tuple, dyn_kwargs: dict, before: list[Any]) -> None:
        """Raises if the step changed its arguments' structure, or an array not in a Variable."""
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

    def deleted_input(self) -> MPMDError | None:
        """The error for the first input whose array was deleted, or ``None``."""
        for i, value in enumerate(self.values):
            if isinstance(value, jax.Array) and value.is_deleted():
                return MPMDError(
                    f"mm.jit: the array of {self.names[i]!r} was deleted before this call of "
                    f"{self.step_name} (by .delete(), or donated to an earlier call with "
                    "donate_argnums while this Variable still held it); nothing was written "
                    "back. Give it a live array (Variable.set_value) or restore a checkpoint"
                )
        return None
