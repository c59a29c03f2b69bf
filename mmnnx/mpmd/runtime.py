"""The runtime: compiles each fragment once on its task's mesh, then runs a flat action list.

Per call, the host work is one loop over pre-resolved executables and transfer targets: no tracing,
no graph walks. Dispatch is asynchronous, so fragments on different submeshes overlap.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from mmnnx.mpmd._jax import constraint_names, is_constraint, run_ops
from mmnnx.mpmd.ir import Const, Graph, Op
from mmnnx.mpmd.markers import resolve_names
from mmnnx.mpmd.plan import Fragment, Plan, Transfer
from mmnnx.sharding import Task
from mmnnx.sharding.specs import check_spec

_RUN, _PUT = 0, 1


def _compatible(sharding: Any, task: Task, shape: Sequence[int]) -> NamedSharding:
    """The sharding on ``task``'s mesh closest to ``sharding``: same spec if it fits, else P()."""
    mesh = task.jax_mesh
    spec = getattr(sharding, "spec", None)
    if isinstance(sharding, NamedSharding) and spec is not None:
        src_sizes = dict(zip(sharding.mesh.axis_names, sharding.mesh.axis_sizes, strict=True))
        dst_sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
        axes = [a for e in spec if e is not None for a in ((e,) if isinstance(e, str) else e)]
        if all(a in dst_sizes and dst_sizes[a] == src_sizes.get(a) for a in axes):
            return NamedSharding(mesh, spec)
    return NamedSharding(mesh, PartitionSpec())


def _constraint_sharding(op: Op, task: Task, shape: Sequence[int]) -> NamedSharding:
    spec = resolve_names(task, constraint_names(op))
    where = f"with_sharding_constraint at {op.source} on task {task.name!r}"
    check_spec(spec, shape, task.jax_mesh, where)
    return NamedSharding(task.jax_mesh, spec)


def _donations(
    graph: Graph,
    fragments: Sequence[Fragment],
    input_tasks: Sequence[Task | None],
    donated: Sequence[bool],
) -> dict[int, Fragment]:
    """Donated inputs -> the fragment that may consume their buffer (their last reader)."""
    outputs = {a for a in graph.outputs if isinstance(a, int)}
    last: dict[int, Fragment] = {}
    for frag in fragments:
        for v in frag.in_ids:
            last[v] = frag
    out = {}
    for v, task, d in zip(graph.inputs, input_tasks, donated, strict=True):
        frag = last.get(v)
        if d and frag is not None and frag.task == task and v not in outputs:
            out[v] = frag
    return out


class Executable:
    """A compiled step: call it with the flat input leaves; it returns the flat outputs."""

    def __init__(
        self,
        graph: Graph,
        fragments: list[Fragment],
        tasks: list[Task],
        input_tasks: Sequence[Task | None],
        input_shardings: Sequence[Any],
        output_homes: Sequence[NamedSharding | None],
        donated: Sequence[bool] | None = None,
    ):
        self.tasks = tasks
        self.owned_devices = {d for t in tasks for d in t.jax_mesh.devices.flat}
        slots: dict[tuple, int] = {}
        sharding_of: dict[int, Any] = {}
        where: dict[int, Task | None] = {}
        self._input_slots: list[tuple[int, int]] = []
        for i, (v, t, s) in enumerate(zip(graph.inputs, input_tasks, input_shardings, strict=True)):
            slot = slots[(v, t, s if t is not None else None)] = len(slots)
            sharding_of[slot] = s
            where[v] = t
            self._input_slots.append((slot, i))
        actions: list[tuple] = []
        transfers: list[Transfer] = []
        op_task = {op.index: f.task for f in fragments for op in f.ops}
        first_constraint: dict[int, Op] = {}
        for op in graph.ops:
            if is_constraint(op) and isinstance(op.ins[0], int):
                first_constraint.setdefault(op.ins[0], op)

        def ensure(v: int, task: Task, want: NamedSharding | None = None) -> int:
            for (value, t, _), slot in slots.items():
                if value == v and t == task and (want is None or sharding_of[slot] == want):
                    return slot
            source = where[v]
            src_slot = next(s for (value, t, _), s in slots.items() if value == v and t == source)
            if want is None:
                if source is None and v in first_constraint:
                    op = first_constraint[v]
                    want = _constraint_sharding(op, op_task[op.index], graph.shapes[v])
                    if want.mesh != task.jax_mesh:
                        want = _compatible(want, task, graph.shapes[v])
                elif source is None:
                    want = task.sharding()
                else:
                    want = _compatible(sharding_of[src_slot], task, graph.shapes[v])
            slot = slots[(v, task, want)] = len(slots)
            sharding_of[slot] = want
            actions.append((_PUT, src_slot, slot, want))
            transfers.append(
                Transfer(v, source, task, graph.shapes[v], graph.dtypes[v], graph.nbytes[v], want)
            )
            return slot

        home_of = {}
        for atom, home in zip(graph.outputs, output_homes, strict=True):
            if isinstance(atom, int) and home is not None:
                home_of.setdefault(atom, home)

        donate_in = _donations(graph, fragments, input_tasks, donated or [False] * len(input_tasks))
        self.num_programs = 0
        for frag in fragments:
            in_slots = [ensure(v, frag.task) for v in frag.in_ids]
            in_shardings = [sharding_of[s] for s in in_slots]
            out_shardings = []
            for v in frag.out_ids:
                home = home_of.get(v)
                if home is not None and home.mesh == frag.task.jax_mesh:
                    out_shardings.append(home)
                elif not in_slots:
                    out_shardings.append(frag.task.sharding())
                else:
                    out_shardings.append(None)

            constraints = {
                op.index: _constraint_sharding(op, frag.task, graph.shapes[op.outs[0]])
                for op in frag.ops
                if is_constraint(op)
            }

            def constrain(x, op, constraints=constraints):
                return jax.lax.with_sharding_constraint(x, constraints[op.index])

            def body(*args, frag=frag, constrain=constrain):
                return run_ops(frag.ops, frag.in_ids, frag.out_ids, args, constrain)

            donate = tuple(i for i, v in enumerate(frag.in_ids) if donate_in.get(v) is frag)
            jitted = jax.jit(
                body,
                in_shardings=in_shardings,
                out_shardings=out_shardings,
                donate_argnums=donate,
            )
            avals = [
                jax.ShapeDtypeStruct(graph.shapes[v], graph.dtypes[v], sharding=s)
                for v, s in zip(frag.in_ids, in_shardings, strict=True)
            ]
            compiled = jitted.lower(*avals).compile()
            self.num_programs += 1
            out_slots = []
            for v, s in zip(frag.out_ids, compiled.output_shardings, strict=True):
                slot = slots[(v, frag.task, s)] = len(slots)
                sharding_of[slot] = s
                where[v] = frag.task
                out_slots.append(slot)
            actions.append((_RUN, compiled, in_slots, out_slots))

        self._outputs: list[tuple[int | None, Any]] = []
        for atom, home in zip(graph.outputs, output_homes, strict=True):
            if isinstance(atom, Const):
                value = atom.value if home is None else jax.device_put(atom.value, home)
                self._outputs.append((None, value))
            elif home is not None:
                task = next(t for t in tasks if t.jax_mesh == home.mesh)
                self._outputs.append((ensure(atom, task, home), None))
            else:
                src = next(
                    s for (value, t, _), s in slots.items() if value == atom and t == where[atom]
                )
                self._outputs.append((src, None))
        self._release(actions)
        self._num_slots = len(slots)
        self.plan = Plan(list(tasks), fragments, transfers, self.num_programs)

    def _release(self, actions: list[tuple]) -> None:
        """Drops each intermediate value right after its last reader, so activations are freed
        as soon as the step no longer needs them (the caller's inputs and outputs are kept)."""
        keep = {s for s, _ in self._outputs if s is not None}
        keep.update(slot for slot, _ in self._input_slots)
        last: dict[int, int] = {}
        for i, action in enumerate(actions):
            reads = action[2] if action[0] == _RUN else [action[1]]
            for s in reads:
                last[s] = i
        release: list[list[int]] = [[] for _ in actions]
        for s, i in last.items():
            if s not in keep:
                release[i].append(s)
        self._actions = [(*a, tuple(r)) for a, r in zip(actions, release, strict=True)]

    def __call__(self, leaves: Sequence[Any]) -> list[Any]:
        env: list[Any] = [None] * self._num_slots
        for slot, i in self._input_slots:
            env[slot] = leaves[i]
        for action in self._actions:
            if action[0] == _RUN:
                outs = action[1](*[env[s] for s in action[2]])
                for s, o in zip(action[3], outs, strict=True):
                    env[s] = o
            else:
                env[action[2]] = jax.device_put(env[action[1]], action[3])
            for s in action[-1]:
                env[s] = None
        return [env[s] if s is not None else const for s, const in self._outputs]
