"""The runtime: compiles each fragment once on its task's mesh, then runs a flat action list.

Per call, the host work is one loop over pre-resolved executables and transfer targets: no tracing,
no graph walks. Dispatch is asynchronous, so fragments on different submeshes overlap.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from mmnnx.mpmd._jax import constraint_names, is_constraint, run_ops
from mmnnx.mpmd.ir import Const, Graph, Op
from mmnnx.mpmd.markers import resolve_names
from mmnnx.mpmd.pipeline import Pipeline
from mmnnx.mpmd.plan import Fragment, Plan, Transfer
from mmnnx.sharding import Task
from mmnnx.sharding.specs import check_spec

_RUN, _PUT = 0, 1


def _compatible(sharding: Any, task: Task) -> NamedSharding:
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
    order: Sequence[tuple[Fragment, int | None]],
    input_tasks: Sequence[Task | None],
    donated: Sequence[bool],
) -> dict[int, Fragment]:
    """Donated inputs -> the fragment that may consume their buffer (their last reader).

    A fragment that runs once per microbatch never donates: later microbatches read the input too.
    """
    outputs = {a for a in graph.outputs if isinstance(a, int)}
    last: dict[int, tuple[Fragment, int | None]] = {}
    for frag, m in order:
        for v in frag.in_ids:
            last[v] = (frag, m)
    out = {}
    for v, task, d in zip(graph.inputs, input_tasks, donated, strict=True):
        frag, m = last.get(v, (None, None))
        if d and frag is not None and m is None and frag.task == task and v not in outputs:
            out[v] = frag
    return out


@dataclasses.dataclass(frozen=True)
class Event:
    """One executed action, timed (``timeline`` mode): seconds since the step started."""

    task: str
    kind: str
    stage: int
    microbatch: int
    start: float
    end: float


class Executable:
    """A compiled step: call it with the flat input leaves; it returns the flat outputs.

    ``order`` lists the fragments to dispatch, each with the microbatch it runs for (``None`` for a
    fragment outside the microbatch loop). A fragment is compiled once, however often it runs.
    """

    def __init__(
        self,
        graph: Graph,
        tasks: list[Task],
        input_tasks: Sequence[Task | None],
        input_shardings: Sequence[Any],
        output_homes: Sequence[NamedSharding | None],
        donated: Sequence[bool] | None = None,
        *,
        order: Sequence[tuple[Fragment, int | None]],
        pipeline: Pipeline | None = None,
    ):
        self.tasks = tasks
        self.owned_devices = {d for t in tasks for d in t.jax_mesh.devices.flat}
        per_replica = set(pipeline.region_values) if pipeline else set()
        index_value = pipeline.index_value if pipeline else None
        if index_value is not None:
            per_replica.add(index_value)
        accumulated = pipeline.accumulated if pipeline else {}
        sum_of = {v: u for u, v in accumulated.items()}
        self._summed = set(sum_of)

        slots: dict[tuple, int] = {}
        by_value: dict[tuple, list[int]] = {}
        sharding_of: dict[int, Any] = {}
        where: dict[tuple[int, int | None], Task | None] = {}
        self._input_slots: list[tuple[int, int]] = []
        self._constants: list[tuple[int, Any]] = []
        self._region_slots: dict[int, tuple[Task, int]] = {}
        actions: list[tuple] = []
        transfers: list[Transfer] = []
        op_task = {op.index: f.task for f, _ in order for op in f.ops}
        first_constraint: dict[int, Op] = {}
        for op in graph.ops:
            if is_constraint(op) and isinstance(op.ins[0], int):
                first_constraint.setdefault(op.ins[0], op)

        def replica(v: int, m: int | None) -> int | None:
            return m if v in per_replica else None

        def find(v: int, task: Task | None, m: int | None, want: Any = None) -> int | None:
            for slot in by_value.get((v, task, m), ()):
                if want is None or sharding_of[slot] == want:
                    return slot
            return None

        def new_slot(v: int, task: Task | None, sharding: Any, m: int | None) -> int:
            slot = slots[(v, task, sharding, m)] = len(slots)
            by_value.setdefault((v, task, m), []).append(slot)
            sharding_of[slot] = sharding
            if m is not None:
                self._region_slots[slot] = (task, m)
            return slot

        def ensure(v: int, task: Task, m: int | None, want: NamedSharding | None = None) -> int:
            m = replica(v, m)
            found = find(v, task, m, want)
            if found is not None:
                return found
            if v == index_value:
                slot = new_slot(v, task, task.sharding(), m)
                del self._region_slots[slot]  # a constant, not an activation
                self._constants.append((slot, jax.device_put(np.int32(m), task.sharding())))
                return slot
            source = where[(v, m)]
            src_slot = find(v, source, m)
            if want is None:
                if source is None and v in first_constraint:
                    op = first_constraint[v]
                    want = _constraint_sharding(op, op_task[op.index], graph.shapes[v])
                    if want.mesh != task.jax_mesh:
                        want = _compatible(want, task)
                elif source is None:
                    want = task.sharding()
                else:
                    want = _compatible(sharding_of[src_slot], task)
            slot = new_slot(v, task, want, m)
            actions.append((_PUT, src_slot, slot, want))
            if m in (None, 0):
                transfers.append(
                    Transfer(
                        v, source, task, graph.shapes[v], graph.dtypes[v], graph.nbytes[v], want
                    )
                )
            return slot

        for i, (v, t, s) in enumerate(zip(graph.inputs, input_tasks, input_shardings, strict=True)):
            where[(v, None)] = t
            self._input_slots.append((new_slot(v, t, s, None), i))

        home_of = {}
        for atom, home in zip(graph.outputs, output_homes, strict=True):
            if isinstance(atom, int) and home is not None:
                home_of.setdefault(atom, home)

        donate_in = _donations(graph, order, input_tasks, donated or [False] * len(input_tasks))
        compiled_of: dict[tuple[int, bool], Any] = {}
        labels = _labels(pipeline)
        for frag, m in order:
            in_slots = [ensure(v, frag.task, m) for v in frag.in_ids]
            summed = [v for v in frag.out_ids if v in sum_of]
            totals = [find(sum_of[v], frag.task, None) for v in summed]
            accumulate = bool(summed) and totals[0] is not None
            key = (id(frag), accumulate)
            compiled = compiled_of.get(key)
            if compiled is None:
                in_shardings = [sharding_of[s] for s in in_slots]
                total_shardings = [sharding_of[t] for t in totals] if accumulate else []
                compiled = compiled_of[key] = self._compile(
                    graph, frag, in_shardings, home_of, donate_in, total_shardings
                )
            out_slots = []
            shardings = compiled.output_shardings[: len(frag.out_ids)]
            for v, s in zip(frag.out_ids, shardings, strict=True):
                r = replica(v, m)
                out_slots.append(new_slot(v, frag.task, s, r))
                where[(v, r)] = frag.task
            if accumulate:
                actions.append(
                    (_RUN, compiled, in_slots + totals, out_slots + totals, labels.get(id(frag)), m)
                )
                continue
            actions.append((_RUN, compiled, in_slots, out_slots, labels.get(id(frag)), m))
            for v in summed:  # the first microbatch's value starts the sum
                u, slot = sum_of[v], out_slots[frag.out_ids.index(v)]
                by_value.setdefault((u, frag.task, None), []).append(slot)
                where[(u, None)] = frag.task
                self._region_slots.pop(slot, None)  # now a running sum, not an activation

        self._outputs: list[tuple[int | None, Any]] = []
        for atom, home in zip(graph.outputs, output_homes, strict=True):
            if isinstance(atom, Const):
                value = atom.value if home is None else jax.device_put(atom.value, home)
                self._outputs.append((None, value))
            elif home is not None:
                task = next(t for t in tasks if t.jax_mesh == home.mesh)
                self._outputs.append((ensure(atom, task, None, home), None))
            else:
                self._outputs.append((find(atom, where[(atom, None)], None), None))
        self.num_programs = len(compiled_of)
        self._release(actions)
        self._num_slots = len(slots)
        fragments = list({id(f): f for f, _ in order}.values())
        self.plan = Plan(list(tasks), fragments, transfers, self.num_programs, pipeline)

    def _compile(self, graph, frag, in_shardings, home_of, donate_in, total_shardings=()):
        """Compiles ``frag``; with ``total_shardings``, a variant that also takes the running
        sums of its microbatch-summed outputs and returns them updated (donating the old ones)."""
        out_shardings = []
        for v in frag.out_ids:
            home = home_of.get(v)
            if home is not None and home.mesh == frag.task.jax_mesh:
                out_shardings.append(home)
            elif not frag.in_ids:
                out_shardings.append(frag.task.sharding())
            else:
                out_shardings.append(None)
        constraints = {
            op.index: _constraint_sharding(op, frag.task, graph.shapes[op.outs[0]])
            for op in frag.ops
            if is_constraint(op)
        }

        def constrain(x, op):
            return jax.lax.with_sharding_constraint(x, constraints[op.index])

        n = len(frag.in_ids)
        summed = [i for i, v in enumerate(frag.out_ids) if v in self._summed][
            : len(total_shardings)
        ]

        def body(*args):
            outs = run_ops(frag.ops, frag.in_ids, frag.out_ids, args[:n], constrain)
            return [*outs, *(total + outs[i] for total, i in zip(args[n:], summed, strict=True))]

        donate = [i for i, v in enumerate(frag.in_ids) if donate_in.get(v) is frag]
        donate += range(n, n + len(total_shardings))
        jitted = jax.jit(
            body,
            in_shardings=[*in_shardings, *total_shardings],
            out_shardings=[*out_shardings, *total_shardings],
            donate_argnums=tuple(donate),
        )
        avals = [
            jax.ShapeDtypeStruct(graph.shapes[v], graph.dtypes[v], sharding=s)
            for v, s in zip(frag.in_ids, in_shardings, strict=True)
        ]
        avals += [
            jax.ShapeDtypeStruct(
                graph.shapes[frag.out_ids[i]], graph.dtypes[frag.out_ids[i]], sharding=s
            )
            for i, s in zip(summed, total_shardings, strict=True)
        ]
        return jitted.lower(*avals).compile()

    def _release(self, actions: list[tuple]) -> None:
        """Drops each intermediate value right after its last reader, so activations are freed
        as soon as the step no longer needs them (the caller's inputs and outputs are kept)."""
        keep = {s for s, _ in self._outputs if s is not None}
        keep.update(slot for slot, _ in self._input_slots)
        last: dict[int, int] = {}
        for i, action in enumerate(actions):
            reads = action[2] if action[0] == _RUN else [action[1]]
            writes = action[3] if action[0] == _RUN else [action[2]]
            for s in writes:  # a value nothing reads is dropped right away
                last.setdefault(s, i)
            for s in reads:
                last[s] = i
        release: list[list[int]] = [[] for _ in actions]
        for s, i in last.items():
            if s not in keep:
                release[i].append(s)
        self._actions = [(*a, tuple(r)) for a, r in zip(actions, release, strict=True)]

    def __call__(
        self, leaves: Sequence[Any], *, timeline: list | None = None, memory: dict | None = None
    ) -> list[Any]:
        """Runs the step. ``timeline``: a list to append one timed :class:`Event` per fragment run
        (blocking on each one's outputs). ``memory``: a dict to fill with each task's peak live
        per-microbatch bytes and microbatch count (``{task: (bytes, microbatches)}``)."""
        env: list[Any] = [None] * self._num_slots
        for slot, i in self._input_slots:
            env[slot] = leaves[i]
        for slot, value in self._constants:
            env[slot] = value
        start = time.perf_counter()
        for action in self._actions:
            if action[0] == _RUN:
                began = time.perf_counter() if timeline is not None else 0.0
                outs = action[1](*[env[s] for s in action[2]])
                if timeline is not None and action[4] is not None:
                    jax.block_until_ready(outs)
                    task, kind, stage = action[4]
                    m = action[5] if action[5] is not None else 0
                    timeline.append(
                        Event(task, kind, stage, m, began - start, time.perf_counter() - start)
                    )
                for s, o in zip(action[3], outs, strict=True):
                    env[s] = o
            else:
                value = env[action[1]]
                if getattr(value, "sharding", None) != action[3]:
                    value = jax.device_put(value, action[3])
                env[action[2]] = value
            if memory is not None:
                self._record(env, memory)
            for s in action[-1]:
                env[s] = None
        return [env[s] if s is not None else const for s, const in self._outputs]

    def _record(self, env: list, memory: dict) -> None:
        live: dict[str, tuple[int, set]] = {}
        for slot, (task, m) in self._region_slots.items():
            if env[slot] is not None:
                total, microbatches = live.get(task.name, (0, set()))
                microbatches.add(m)
                live[task.name] = (total + env[slot].nbytes, microbatches)
        for name, (total, microbatches) in live.items():
            peak_bytes, peak_count = memory.get(name, (0, 0))
            memory[name] = (max(peak_bytes, total), max(peak_count, len(microbatches)))


def _labels(pipeline: Pipeline | None) -> dict[int, tuple[str, str, int]]:
    """Fragment id -> (task, kind, stage) of each pipeline stage fragment, for timeline events;
    fragments outside the microbatch loop are not timed."""
    if pipeline is None:
        return {}
    return {id(f): (f.task.name, kind, stage) for (kind, stage), f in pipeline.stages.items()}
