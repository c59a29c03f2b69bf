"""The runner: interprets a step's emitted steps (:mod:`~mmnnx.mpmd.run.emit`), compiling them on
first use: per call, one loop over a flat list of typed steps, dispatched asynchronously. It
runs the program as ``plan()`` prints it, and never writes into the plan.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from mmnnx._gc import cyclic_gc_paused
from mmnnx._jax.arrays import checks_special_values, copier, is_plain_array, launchable_as, move_to
from mmnnx._jax.launch import DirectLaunch
from mmnnx.mpmd.ir import Graph
from mmnnx.mpmd.lower.plan import Plan
from mmnnx.mpmd.lower.program import StepProgram
from mmnnx.mpmd.run.direct import COPY, KEEP, OTHER, DirectSteps
from mmnnx.mpmd.run.emit import Launch, Move, Put, Step, emit
from mmnnx.mpmd.run.peers import Peers
from mmnnx.mpmd.run.programs import Compiler
from mmnnx.mpmd.run.timing import Timer, witness_for
from mmnnx.mpmd.trace.mesh_context import no_ambient_mesh
from mmnnx.sharding.arrays import put


def _unchanged(value: Any) -> Any:
    return value


class Executable:
    """A step's plan, compiled on first use: call it with the flat input leaves; it returns the flat
    outputs. :attr:`compiled_plan` adds what only compiling tells. With several processes,
    ``plan.program`` is this process's share, and ``peers()`` returns the
    :class:`~mmnnx.mpmd.run.peers.Peers` that carry layouts and arrays between processes."""

    def __init__(self, graph: Graph, plan: Plan, *, peers: Callable[[], Peers] | None = None):
        self.graph = graph
        self.plan = plan
        self.program: StepProgram = plan.program
        self.tasks = plan.tasks
        self.owned_devices = {d for t in self.tasks for d in t.jax_mesh.devices.flat}
        self.may_fail = any(op.may_fail for op in graph.ops)
        self.compiled_plan: Plan | None = None
        self._make_peers = peers
        self._peers: Peers | None = None
        self._steps: list[Step] | None = None
        self._same_layout: dict[tuple, bool] = {}

    def compile(self) -> Plan:
        """Compiles every distinct program of the step (once, side by side on threads) and
        resolves every transfer; returns :attr:`compiled_plan`."""
        if self._steps is None:
            if self.program.process is not None:
                if self._make_peers is None:
                    raise ValueError("a program localized to one process needs its peers")
                self._peers = self._make_peers()
            with Compiler(self.graph) as compiler, cyclic_gc_paused(), no_ambient_mesh():
                self._build(compiler)
        return self.compiled_plan

    def _build(self, compiler: Compiler) -> None:
        program = self.program
        emitted = emit(self.graph, program, compiler, self._peers, self._mover, self.plan.pipeline)
        steps, fragment_programs = emitted.steps, emitted.fragment_programs
        self._constants, self._outputs = emitted.constants, emitted.outputs
        self._rewrap, self._num_slots = emitted.rewrap, emitted.num_slots
        self._inputs = program.inputs
        for step in steps:
            if isinstance(step, Launch):
                step.program = step.program.result()
        self._steps = steps
        donated = {
            slot
            for step in steps
            if isinstance(step, Launch)
            for slot, arg in zip(step.args, jax.tree.leaves(step.program.args_info), strict=True)
            if arg.donated
        }
        self._consumed = [  # programs whose every result a later one may donate
            i
            for i, step in enumerate(steps)
            if isinstance(step, Launch) and step.results and all(s in donated for s in step.results)
        ]
        self._witness_of: dict[int, Callable] | None = None
        self._direct = [
            DirectLaunch.of(step.program) if isinstance(step, Launch) else None for step in steps
        ]
        self._checked_layouts: tuple | None = None
        self._replay: DirectSteps | None = None  # set with _checked_layouts
        shared = compiler.shared
        transfers = [
            t
            if t.sharding is not None
            else dataclasses.replace(
                t, sharding=emitted.resolved.get((t.value, t.source, t.target))
            )
            for t in self.plan.transfers
        ]
        self.compiled_plan = dataclasses.replace(
            self.plan,
            transfers=transfers,
            num_loaded=sum(id(lowered) in shared.loaded for lowered in fragment_programs),
            num_reused=sum(id(lowered) in shared.reused for lowered in fragment_programs),
            num_lowered=sum(id(lowered) not in compiler.moved for lowered in fragment_programs),
        )

    def _witnesses(self) -> dict[int, Callable]:
        """Per program whose every result a later one may donate, its :func:`witness_for`."""
        if self._witness_of is None:
            by_layout: dict[Any, Callable] = {}
            self._witness_of = {}
            for i in self._consumed:
                first = jax.tree.leaves(self._steps[i].program.out_info)[0]
                key = (first.shape, first.dtype, first.sharding)
                if key not in by_layout:
                    by_layout[key] = witness_for(first)
                self._witness_of[i] = by_layout[key]
        return self._witness_of

    def __call__(
        self, leaves: Sequence[Any], *, timer: Timer | None = None, memory: dict | None = None
    ) -> list[Any]:
        """Runs the step. ``timer``: told of every program launched and value moved or
        received (see :mod:`~mmnnx.mpmd.run.timing`). ``memory``: a dict to fill with each
        task's peak live per-microbatch bytes and microbatch count (``{task: (bytes,
        microbatches)}``)."""
        if self._steps is None:
            self.compile()
        env: list[Any] = [None] * self._num_slots
        for slot, i in self._inputs:
            env[slot] = leaves[i]
        for slot, value in self._constants:
            env[slot] = value
        laid_out = self._laid_out_as_checked(leaves)
        if laid_out and timer is None and memory is None:
            self._replay.run(env)
        else:
            self._interpret(env, leaves, laid_out, timer, memory)
        outputs = [env[s] if s is not None else const for s, const in self._outputs]
        for i, layout in self._rewrap:
            outputs[i] = jax.make_array_from_single_device_arrays(
                outputs[i].shape, layout, [outputs[i]]
            )
        return outputs

    def _interpret(
        self,
        env: list[Any],
        leaves: Sequence[Any],
        laid_out: bool,
        timer: Timer | None,
        memory: dict | None,
    ) -> None:
        """Runs every step on ``env``; programs are launched directly where the inputs are
        ``laid_out`` as on the last checked call, else what this checked call finds is kept for
        :class:`DirectSteps`."""
        witnesses = self._witnesses() if timer is not None and timer.wants_witnesses else {}
        direct = self._direct if laid_out else None
        checking = direct is None
        ways: dict[int, int] = {}  # on a checked call: how each move went
        if timer is not None:
            timer.begin()
        for i, step in enumerate(self._steps):
            kind = type(step)
            if kind is Launch:
                began = time.perf_counter() if timer is not None else 0.0
                launch = direct[i] if direct is not None else None
                if launch is not None:
                    slots = (
                        step.args if launch.kept is None else [step.args[k] for k in launch.kept]
                    )
                    outs = launch.launch([env[s] for s in slots])
                else:
                    args = [env[s] for s in step.args]
                    plan = self._direct[i]
                    if checking and plan is not None:  # launched directly only if laid out so
                        kept = args if plan.kept is None else [args[k] for k in plan.kept]
                        if not all(
                            launchable_as(a, w) for a, w in zip(kept, plan.shardings, strict=True)
                        ):
                            self._direct[i] = None
                    outs = step.program(*args)
                if timer is not None:
                    witness = witnesses.get(i)
                    timer.launched(
                        step.rank, step.labels, step.args, step.results, outs, began, witness
                    )
                for s, o in zip(step.results, outs, strict=True):
                    env[s] = o
            elif kind is Move:
                began = time.perf_counter() if timer is not None else 0.0
                value = env[step.source]
                way = ways[i] = self._move_way(step, value)
                if way == OTHER:
                    value = self._other(step, env)
                else:  # laid out as planned: the move decided at compile; or as wanted already
                    value = env[step.target] = step.mover(value) if way == COPY else value
                if timer is not None:
                    timer.moved(step.source, step.target, step.transfer, value, began)
            elif kind is Put:
                self._other(step, env)
            else:  # Cross: a transfer involving another process
                began = time.perf_counter() if timer is not None else 0.0
                received = self._other(step, env)
                if timer is not None and received is not None:
                    timer.received(step.target, step.transfer, began, time.perf_counter())
            if memory is not None:
                self._record(env, memory)
            for s in step.drop:
                env[s] = None
        if checking:
            values = [leaves[i] for _, i in self._inputs]
            plain = all(is_plain_array(v) for v in values)
            self._checked_layouts = tuple(v.sharding for v in values) if plain else None
            self._replay = DirectSteps.of(self._steps, self._direct, ways, self._other)

    def _move_way(self, step: Move, value: Any) -> int:
        """How ``step`` moves ``value``: ``COPY`` (its runtime copy, laid out as planned), ``KEEP``
        (laid out as wanted already) or ``OTHER`` (:func:`~mmnnx._jax.arrays.move_to`)."""
        have = getattr(value, "sharding", None)
        if step.mover is not None and have == step.source_layout:
            return COPY
        if have is not None and self._equivalent(have, step.sharding, value.ndim):
            return KEEP
        return OTHER

    def _other(self, step: Step, env: list[Any]) -> Any:
        """Runs a step that neither launches a program nor copies by a move decided at compile;
        returns the value it wrote (``None``: this process's end of a route receives nothing)."""
        kind = type(step)
        if kind is Move:
            value = env[step.target] = move_to(env[step.source], step.sharding)
        elif kind is Put:
            value = env[step.target] = put(env[step.source], step.sharding)
        else:  # Cross: a transfer involving another process
            value = step.route(env[step.source], self._peers)
            if value is not None:
                # Wait for what another process sends before launching what reads it: a
                # process running ahead fills its devices' bounded queues of launched
                # programs (and the transfer server's of copies) with work waiting on the
                # others, who may need a slot of the same queues first (docs/distributed.md).
                value.block_until_ready()
                env[step.target] = value
        return value

    def _laid_out_as_checked(self, leaves: Sequence[Any]) -> bool:
        """Whether this call may launch programs directly: its inputs are live plain arrays laid out
        as on the last checked call (every other layout follows from theirs)."""
        checked = self._checked_layouts
        if checked is None or checks_special_values():
            return False
        for (_, i), layout in zip(self._inputs, checked, strict=True):
            leaf = leaves[i]
            if not is_plain_array(leaf):
                return False
            have = leaf.sharding
            if (have is not layout and have != layout) or leaf.is_deleted():
                return False
        return True

    def _mover(self, source: Any, target: Any, value: int) -> Callable[[Any], Any] | None:
        """How a value laid out as ``source`` reaches ``target``: kept, one runtime copy, or
        ``None`` (``jax.device_put`` decides)."""
        if source is None or target is None:
            return None
        ndim = len(self.graph.shapes[value])
        if self._equivalent(source, target, ndim):
            return _unchanged
        return copier(source, target, ndim, self.graph.dtypes[value])

    def _equivalent(self, have: Any, want: Any, ndim: int) -> bool:
        """Whether layouts ``have`` and ``want`` put the same slices on the same devices
        (memoised)."""
        if have == want:
            return True
        key = (have, want, ndim)
        same = self._same_layout.get(key)
        if same is None:
            same = self._same_layout[key] = have.is_equivalent_to(want, ndim)
        return same

    def _record(self, env: list, memory: dict) -> None:
        live: dict[str, tuple[int, set]] = {}
        for slot, (task, m) in self.program.activations.items():
            if env[slot] is not None:
                total, microbatches = live.get(task, (0, set()))
                microbatches.add(m)
                live[task] = (total + env[slot].nbytes, microbatches)
        for name, (total, microbatches) in live.items():
            peak_bytes, peak_count = memory.get(name, (0, 0))
            memory[name] = (max(peak_bytes, total), max(peak_count, len(microbatches)))
