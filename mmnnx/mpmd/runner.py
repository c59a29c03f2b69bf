"""The runner: compiles the programs a :class:`StepProgram` names, then interprets its actions.

Compiling walks the actions once in dispatch order (a fragment's input layouts are those of the
values it reads, so they are known by the time it is reached) and turns them into a flat list of
typed steps (:class:`_Launch`, :class:`_Move`, :class:`_Put`, :class:`_Cross`), each holding what
it needs pre-resolved. Per call, the host work is one loop over that list: no tracing, no graph
walks. Dispatch is asynchronous, so fragments on different submeshes overlap. The runner runs the
program it is given, as ``plan()`` prints it: packing and cross-process routes are decided by
the passes before it (``passes.py``), and it never writes into the plan.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from mmnnx._gc import cyclic_gc_paused
from mmnnx._jax.arrays import checks_special_values, copier, is_plain_array, launchable_as, move_to
from mmnnx._jax.compile import SharedCompiles
from mmnnx._jax.launch import DirectLaunch
from mmnnx.mpmd.evaluate import run_ops
from mmnnx.mpmd.ir import Graph
from mmnnx.mpmd.lower import compatible, constraint_layout
from mmnnx.mpmd.mesh_context import explicit_twin
from mmnnx.mpmd.pack import slice_offsets
from mmnnx.mpmd.peers import Peers
from mmnnx.mpmd.plan import Plan
from mmnnx.mpmd.primitives import constraint_layouts
from mmnnx.mpmd.program import (
    AwaitLayout,
    Buffer,
    Constant,
    ConstantOutput,
    PackWeights,
    PublishLayout,
    Recv,
    Release,
    Route,
    Run,
    Send,
    StepProgram,
    Zeros,
)
from mmnnx.mpmd.routes import RoutePlan
from mmnnx.mpmd.timing import Timer, witness_for
from mmnnx.sharding.arrays import placeholder, put


def _unchanged(value: Any) -> Any:
    return value


def _rank(task: Any) -> str:
    """The task whose devices run ``task``'s programs, one at a time: itself, or the task a
    virtual stage belongs to (submeshes of distinct tasks do not overlap)."""
    return task.home.name


@dataclasses.dataclass
class _Part:
    """One fragment's share of a compiled program: what it computes from its arguments, and
    their layouts, shapes and donations."""

    body: Callable[..., list]
    in_shardings: list[Any]
    out_shardings: list[Any]
    donate: tuple[int, ...]
    avals: list[Any]
    explicit: Any


def _part(graph: Graph, run: Run, in_shardings: Sequence[Any]) -> _Part:
    """``run``'s share of a program, taking :attr:`Run.args` laid out as ``in_shardings`` and
    returning :attr:`Run.results`.

    A packed argument's members are sliced at offsets the program takes as arguments (after the
    sums; :func:`~mmnnx.mpmd.pack.slice_offsets`), not as constants: XLA then compiles one
    kernel for the members of equal shape (a block's residuals, layer after layer) where
    constant offsets would make each slice-reading kernel distinct. A block's members are sliced
    at its base plus their distance from it, both arguments: blocks laid out alike share the
    distances, so a stage takes one offset per block and per distance, not one per member. A
    ``fixed`` buffer's (a block's weights) are sliced at offsets fixed in the program."""
    frag = run.fragment
    packing = run.packing
    n = len(frag.in_ids) if packing is None else len(packing.args)
    if packing is None:
        sums: list[tuple[Buffer | None, tuple[int, ...]]] = [(None, (i,)) for i in run.summed]
        buffers: dict[int, Buffer] = {}
    else:
        sums = [(s.buffer, s.positions) for s in packing.sums]
        buffers = dict(packing.buffers)
    total_shardings = list(in_shardings[n : n + len(sums)])
    offsets = [] if packing is None else slice_offsets(packing.reads, buffers)
    offset_arg = {at: n + len(sums) + j for j, at in enumerate(offsets)}
    returned = run.returned
    packs = () if packing is None else packing.packs

    def inputs(args: Sequence[Any]) -> list:
        if packing is None:
            return list(args[:n])

        def member(k: int, at: int, shape: tuple[int, ...], size: int) -> Any:
            buffer = buffers[k]
            if buffer.fixed:  # at the same offset in every block: the blocks' kernels stay alike
                return jax.lax.slice(args[k], (at,), (at + size,)).reshape(shape)
            base = buffer.base_of(at)
            start = args[offset_arg[base]]
            if at != base:
                start = jax.lax.add(start, args[offset_arg[at - base]])
            # offsets are never negative: no ops to wrap them around
            member = jax.lax.dynamic_slice(args[k], (start,), (size,), allow_negative_indices=False)
            return member.reshape(shape)

        return [
            args[r.arg]
            if r.member is None
            else member(r.arg, r.member.offset, r.member.shape, r.member.size)
            for r in packing.reads
        ]

    def body(*args):
        outs = run_ops(frag.ops, frag.in_ids, frag.out_ids, inputs(args))

        def flat(positions: Sequence[int]) -> Any:
            return jnp.concatenate([jnp.ravel(outs[p]) for p in positions])

        totals = [
            total + (outs[at[0]] if buffer is None else flat(at))
            for total, (buffer, at) in zip(args[n : n + len(sums)], sums, strict=True)
        ]
        return [*(outs[i] for i in returned), *(flat(b.positions) for b in packs), *totals]

    out_shardings = [
        *(run.out_shardings[i] for i in returned),
        *(frag.task.sharding() for _ in packs),
        *total_shardings,
    ]
    explicit = None
    if graph.specs:  # traced with sharding in types: every program keeps the types
        explicit = explicit_twin(frag.task.jax_mesh)

        def typed(v: int) -> NamedSharding:
            return NamedSharding(explicit, graph.specs.get(v, PartitionSpec()))

        in_shardings = [typed(v) for v in frag.in_ids]
        in_shardings += [typed(frag.out_ids[i]) for i in run.summed]
        total_shardings = list(in_shardings[n:])
        out_shardings = [typed(frag.out_ids[i]) for i in returned] + total_shardings
    if packing is None:
        avals = [
            jax.ShapeDtypeStruct(graph.shapes[v], graph.dtypes[v], sharding=s)
            for v, s in zip(frag.in_ids, in_shardings[:n], strict=True)
        ]
    else:
        first = {}
        for j, r in enumerate(packing.reads):
            first.setdefault(r.arg, j)
        avals = [
            jax.ShapeDtypeStruct((buffer.size,), buffer.dtype, sharding=in_shardings[k])
            if (buffer := buffers.get(k)) is not None
            else jax.ShapeDtypeStruct(
                graph.shapes[frag.in_ids[first[k]]],
                graph.dtypes[frag.in_ids[first[k]]],
                sharding=in_shardings[k],
            )
            for k in range(n)
        ]
    avals += [
        jax.ShapeDtypeStruct(
            graph.shapes[frag.out_ids[at[0]]], graph.dtypes[frag.out_ids[at[0]]], sharding=s
        )
        if buffer is None
        else jax.ShapeDtypeStruct((buffer.size,), buffer.dtype, sharding=s)
        for (buffer, at), s in zip(sums, total_shardings, strict=True)
    ]
    avals += [
        jax.ShapeDtypeStruct((), jnp.int32, sharding=in_shardings[i]) for i in offset_arg.values()
    ]
    donate = (*_donated_args(run), *range(n, n + len(total_shardings)))
    return _Part(body, list(in_shardings), out_shardings, donate, avals, explicit)


def _donated_args(run: Run) -> list[int]:
    """The arguments ``run``'s program donates for its fragment's donated inputs: where inputs
    are packed, the argument each unpacked one is passed as; a packed member is not donated
    (its buffer holds other members too)."""
    if run.packing is None:
        return list(run.donate)
    reads = run.packing.reads
    return sorted({reads[p].arg for p in run.donate if reads[p].member is None})


def lower_fragments(
    graph: Graph, runs: Sequence[Run], in_shardings: Sequence[Sequence[Any]]
) -> Any:
    """Lowers the fragments of ``runs`` (on one task; the ``in_shardings`` of each one's
    :attr:`~Run.args`) as one program taking their arguments one run after the other and
    returning their results in the same order: one fragment's program, or an overlapped pair
    as one launch that the compiler may interleave. A run with ``sums`` also takes the running
    sums of its summed outputs and returns them updated (donating the old ones)."""
    parts = [_part(graph, run, s) for run, s in zip(runs, in_shardings, strict=True)]
    bounds = []
    start = 0
    for part in parts:
        bounds.append((start, start + len(part.avals)))
        start += len(part.avals)

    def body(*args):
        return [
            out
            for part, (lo, hi) in zip(parts, bounds, strict=True)
            for out in part.body(*args[lo:hi])
        ]

    jitted = jax.jit(
        body,
        in_shardings=[s for part in parts for s in part.in_shardings],
        out_shardings=[s for part in parts for s in part.out_shardings],
        donate_argnums=tuple(
            lo + i for part, (lo, _) in zip(parts, bounds, strict=True) for i in part.donate
        ),
    )
    explicit = parts[0].explicit
    with (
        constraint_layouts(functools.partial(constraint_layout, runs[0].task)),
        jax.set_mesh(explicit) if explicit is not None else contextlib.nullcontext(),
    ):
        return jitted.lower(*(a for part in parts for a in part.avals))


def lower_packing(buffers: Sequence[Buffer], shardings: Sequence[Any], task: Any) -> Any:
    """One program concatenating step inputs (laid out as ``shardings``, one argument per
    member, buffer after buffer) into each of ``buffers``, flat on ``task``, lowered."""
    layouts = iter(shardings)
    avals = [
        jax.ShapeDtypeStruct(m.shape, buffer.dtype, sharding=next(layouts))
        for buffer in buffers
        for m in buffer.members
    ]

    def pack(*members):
        out, at = [], 0
        for buffer in buffers:
            taken = members[at : at + len(buffer.members)]
            out.append(jnp.concatenate([jnp.ravel(m) for m in taken]))
            at += len(buffer.members)
        return out

    return jax.jit(pack, out_shardings=[task.sharding()] * len(buffers)).lower(*avals)


def lower_zeros(shapes: Sequence[tuple], dtypes: Sequence[Any], shardings: Sequence) -> Any:
    """One program making zero-filled running sums of ``shapes`` and ``dtypes`` in their layouts
    (called each step: the sums are donated to the programs that add to them), lowered."""

    def zeros():
        return [jax.numpy.zeros(shape, dtype) for shape, dtype in zip(shapes, dtypes, strict=True)]

    return jax.jit(zeros, out_shardings=list(shardings)).lower()


class _Compiler:
    """Compiles lowered programs on a pool of threads (XLA releases the GIL while it compiles),
    so the programs of a step compile side by side. A program whose output layouts the compiler
    chooses is waited for at once: the programs reading its results are lowered for them.
    A program equal to one already compiled for other devices loads that one's executable
    (equal pipeline stages compile once)."""

    def __init__(self):
        self.shared = SharedCompiles()
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max(1, min(8, cores or 1)), thread_name_prefix="mmnnx-compile"
        )

    def submit(self, lowered: Any) -> concurrent.futures.Future:
        return self.shared.submit(lowered, self._pool)

    def output_shardings(self, lowered: Any, compiling: concurrent.futures.Future) -> list:
        """The program's output layouts: pinned ones without waiting for its compilation."""
        shardings = [leaf.sharding for leaf in jax.tree.leaves(lowered.out_info)]
        if all(s is not None for s in shardings):
            return shardings
        return list(compiling.result().output_shardings)

    def __enter__(self) -> _Compiler:
        return self

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


# The steps a compiled program is interpreted as: each holds what its action needs resolved, and
# ``drop``, the slots released right after it.


@dataclasses.dataclass(slots=True)
class _Launch:
    """Launches a compiled program on ``args``, writing its results into ``results``.
    ``labels``: the pipeline actions it runs (``(label, microbatch)`` each), on ``rank``."""

    program: Any
    args: tuple[int, ...]
    results: tuple[int, ...]
    labels: tuple
    rank: str
    drop: tuple[int, ...] = ()


@dataclasses.dataclass(slots=True)
class _Move:
    """Moves the value in ``source`` into ``target``, laid out as ``sharding``: by ``mover``
    (decided at compile) where it is laid out as ``source_layout``, else decided once per pair
    of layouts."""

    source: int
    target: int
    sharding: Any
    mover: Callable[[Any], Any] | None
    source_layout: Any
    drop: tuple[int, ...] = ()


@dataclasses.dataclass(slots=True)
class _Put:
    """Puts a step input (the same on every process) onto ``sharding``, a layout spanning
    processes: each process keeps its part."""

    source: int
    target: int
    sharding: Any
    drop: tuple[int, ...] = ()


@dataclasses.dataclass(slots=True)
class _Cross:
    """This process's end of a move between processes (``route``), through the step's peers."""

    route: RoutePlan
    source: int
    target: int
    drop: tuple[int, ...] = ()


_Step = _Launch | _Move | _Put | _Cross


class Executable:
    """A step's plan, compiled on first use: call it with the flat input leaves; it returns the
    flat outputs. ``plan`` is available before anything is compiled; :attr:`compiled_plan`,
    once it is, adds what only compiling tells (the layouts the compiler chose for transfers,
    programs loaded rather than compiled).

    With several processes, ``plan.program`` is this process's share (``localize``): it
    compiles and runs only those actions, and ``peers`` (a function of no arguments returning
    the step's :class:`~mmnnx.mpmd.peers.Peers`, called when it compiles) carries layouts and
    arrays between processes. ``name``: the step's, for messages.
    """

    def __init__(
        self,
        graph: Graph,
        plan: Plan,
        *,
        name: str = "the step",
        peers: Callable[[], Peers] | None = None,
    ):
        self.graph = graph
        self.plan = plan
        self.program: StepProgram = plan.program
        self.tasks = plan.tasks
        self.owned_devices = {d for t in self.tasks for d in t.jax_mesh.devices.flat}
        self.may_fail = any(op.may_fail for op in graph.ops)
        self.name = name
        self.compiled_plan: Plan | None = None
        self._make_peers = peers
        self._peers: Peers | None = None
        self._steps: list[_Step] | None = None
        self._same_layout: dict[tuple, bool] = {}

    def compile(self) -> Plan:
        """Compiles every distinct program of the step (once, side by side on threads) and
        resolves every transfer; returns :attr:`compiled_plan`."""
        if self._steps is None:
            if self.program.process is not None:
                if self._make_peers is None:
                    raise ValueError("a program localized to one process needs its peers")
                self._peers = self._make_peers()
            with _Compiler() as compiler, cyclic_gc_paused():
                self._build(compiler)
        return self.compiled_plan

    def _build(self, compiler: _Compiler) -> None:
        program, peers = self.program, self._peers
        sharding_of = list(program.shardings)
        compiled_of: dict[tuple, Any] = {}
        constants: list[tuple[int, Any]] = []
        resolved: dict[tuple, Any] = {}
        fragment_programs: list[Any] = []  # lowered, to count those loaded
        steps: list[_Step] = []
        actions = program.actions
        position = 0
        while position < len(actions):
            action = actions[position]
            position += 1
            if isinstance(action, Run):
                runs = [action]
                while runs[-1].fused:
                    runs.append(actions[position])
                    position += 1
                # A program per layout of its arguments: a value made by a fused pair may be
                # laid out otherwise than the same value made by its fragment alone.
                key = tuple(
                    (
                        *run.variant,
                        run.donate,
                        run.packing.layout if run.packing else None,
                        tuple(sharding_of[s] for s in run.args),
                    )
                    for run in runs
                )
                if key not in compiled_of:
                    lowered = lower_fragments(
                        self.graph, runs, [[sharding_of[s] for s in run.args] for run in runs]
                    )
                    compiling = compiler.submit(lowered)
                    fragment_programs.append(lowered)
                    compiled_of[key] = (compiling, compiler.output_shardings(lowered, compiling))
                compiled, output_shardings = compiled_of[key]
                results = tuple(s for run in runs for s in run.results)
                for s, sharding in zip(results, output_shardings, strict=True):
                    sharding_of[s] = sharding
                labels = tuple((run.label, run.microbatch) for run in runs)
                args = tuple(s for run in runs for s in run.args)
                steps.append(_Launch(compiled, args, results, labels, _rank(action.task)))
            elif isinstance(action, Recv | Route):
                source_layout = sharding_of[action.from_slot]
                sharding = action.sharding
                if sharding is None and source_layout is not None:
                    sharding = compatible(source_layout, action.target)
                    resolved.setdefault((action.value, action.source, action.target), sharding)
                sharding_of[action.slot] = sharding
                if isinstance(action, Recv):
                    move = self._mover(source_layout, sharding, action.value)
                    steps.append(
                        _Move(action.from_slot, action.slot, sharding, move, source_layout)
                    )
                elif action.source is None:
                    steps.append(_Put(action.from_slot, action.slot, sharding))
                else:
                    shape, dtype = self.graph.shapes[action.value], self.graph.dtypes[action.value]
                    route = RoutePlan.plan(shape, dtype, source_layout, sharding, program.process)
                    steps.append(_Cross(route, action.from_slot, action.slot))
            elif isinstance(action, Zeros):
                zeros = compiler.submit(lower_zeros(action.shapes, action.dtypes, action.shardings))
                steps.append(_Launch(zeros, (), action.slots, (), _rank(action.task)))
            elif isinstance(action, PackWeights):
                members = action.members
                shardings = [sharding_of[m] for m in members]
                packs = compiler.submit(lower_packing(action.buffers, shardings, action.task))
                made = tuple(b.slot for b in action.buffers)
                steps.append(_Launch(packs, members, made, (), _rank(action.task)))
            elif isinstance(action, Constant):
                sharding_of[action.slot] = action.task.sharding()
                constants.append(
                    (action.slot, put(jnp.int32(action.value), action.task.sharding()))
                )
            elif isinstance(action, PublishLayout):
                peers.publish_layout(action.slot, action.task, sharding_of[action.slot])
            elif isinstance(action, AwaitLayout):
                sharding_of[action.slot] = peers.layout(action.slot, action.task)
            elif isinstance(action, Release):
                if steps:  # dropped after the previous step
                    steps[-1].drop = (*steps[-1].drop, *action.slots)
            elif not isinstance(action, Send):  # a Send is its Recv's transfer here
                raise TypeError(f"unknown action {action!r}")
        self._constants = constants
        self._outputs = []
        self._rewrap = []
        for i, out in enumerate(program.outputs):
            if isinstance(out, ConstantOutput):
                value = out.value if out.home is None else put(out.value, out.home)
                self._outputs.append((None, value))
            elif out.here:
                self._outputs.append((out.slot, None))
                layout = sharding_of[out.slot]
                if (
                    program.process is not None
                    and out.task is not None
                    and isinstance(layout, SingleDeviceSharding)
                ):  # presented on its task, as other processes' placeholders of it are
                    self._rewrap.append((i, out.task.sharding()))
            else:
                shape, dtype = self.graph.shapes[out.value], self.graph.dtypes[out.value]
                self._outputs.append((None, placeholder(shape, dtype, sharding_of[out.slot])))
        self._inputs = program.inputs
        self._num_slots = len(sharding_of)
        for step in steps:
            if isinstance(step, _Launch):
                step.program = step.program.result()
        self._steps = steps
        donated = {
            slot
            for step in steps
            if isinstance(step, _Launch)
            for slot, arg in zip(step.args, jax.tree.leaves(step.program.args_info), strict=True)
            if arg.donated
        }
        self._consumed = [  # programs whose every result a later one may donate
            i
            for i, step in enumerate(steps)
            if isinstance(step, _Launch)
            and step.results
            and all(s in donated for s in step.results)
        ]
        self._witness_of: dict[int, Callable] | None = None
        self._direct = [
            DirectLaunch.of(step.program) if isinstance(step, _Launch) else None for step in steps
        ]
        self._checked_layouts: tuple | None = None
        loaded = compiler.shared.loaded_lowered
        transfers = [
            t
            if t.sharding is not None
            else dataclasses.replace(t, sharding=resolved.get((t.value, t.source, t.target)))
            for t in self.plan.transfers
        ]
        self.compiled_plan = dataclasses.replace(
            self.plan,
            transfers=transfers,
            num_loaded=sum(id(lowered) in loaded for lowered in fragment_programs),
        )

    def _witnesses(self) -> dict[int, Callable]:
        """Per program whose every result a later one may donate, its :func:`witness_for`
        (compiled on first use, one per layout)."""
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
        """Runs the step. ``timer``: told of every program launched and value moved (see
        :mod:`~mmnnx.mpmd.timing`). ``memory``: a dict to fill with each task's peak live
        per-microbatch bytes and microbatch count (``{task: (bytes, microbatches)}``)."""
        if self._steps is None:
            self.compile()
        env: list[Any] = [None] * self._num_slots
        for slot, i in self._inputs:
            env[slot] = leaves[i]
        for slot, value in self._constants:
            env[slot] = value
        witnesses = self._witnesses() if timer is not None and timer.wants_witnesses else {}
        direct = self._direct if self._laid_out_as_checked(leaves) else None
        checking = direct is None
        peers = self._peers
        if timer is not None:
            timer.begin()
        for i, step in enumerate(self._steps):
            kind = type(step)
            if kind is _Launch:
                began = time.perf_counter() if timer is not None else 0.0
                launch = direct[i] if direct is not None else None
                if launch is not None:
                    slots = (
                        step.args if launch.kept is None else [step.args[k] for k in launch.kept]
                    )
                    outs = launch.launch([env[s] for s in slots])
                else:
                    args = [env[s] for s in step.args]
                    if checking and self._direct[i] is not None:
                        self._check_layouts(i, args)
                    outs = step.program(*args)
                if timer is not None:
                    witness = witnesses.get(i)
                    timer.launched(
                        step.rank, step.labels, step.args, step.results, outs, began, witness
                    )
                for s, o in zip(step.results, outs, strict=True):
                    env[s] = o
            elif kind is _Move:
                value = env[step.source]
                if (
                    step.mover is not None
                    and getattr(value, "sharding", None) == step.source_layout
                ):
                    value = step.mover(value)  # laid out as planned: the move decided at compile
                elif not self._laid_out_as(value, step.sharding):
                    value = move_to(value, step.sharding)
                env[step.target] = value
                if timer is not None:
                    timer.moved(step.source, step.target)
            elif kind is _Put:
                env[step.target] = put(env[step.source], step.sharding)
            else:  # _Cross: a transfer involving another process
                value = step.route(env[step.source], peers)
                if value is not None:
                    # Wait for what another process sends before launching what reads it: a
                    # process running ahead fills its devices' bounded queues of launched
                    # programs (and the transfer server's of copies) with work waiting on the
                    # others, who may need a slot of the same queues first (docs/distributed.md).
                    value.block_until_ready()
                    env[step.target] = value
            if memory is not None:
                self._record(env, memory)
            for s in step.drop:
                env[s] = None
        if checking:
            self._checked_layouts = self._input_layouts(leaves)
        outputs = [env[s] if s is not None else const for s, const in self._outputs]
        for i, layout in self._rewrap:
            outputs[i] = jax.make_array_from_single_device_arrays(
                outputs[i].shape, layout, [outputs[i]]
            )
        return outputs

    def _input_layouts(self, leaves: Sequence[Any]) -> tuple | None:
        """The layout of each input, or ``None`` if one is not a plain ``jax.Array``."""
        layouts = []
        for _, i in self._inputs:
            if not is_plain_array(leaves[i]):
                return None
            layouts.append(leaves[i].sharding)
        return tuple(layouts)

    def _laid_out_as_checked(self, leaves: Sequence[Any]) -> bool:
        """Whether this call may launch programs directly
        (:class:`~mmnnx._jax.launch.DirectLaunch`): its inputs are live plain arrays laid out as
        on the last checked call, so every value of the step is laid out as it was then (layouts
        follow from the inputs' alone), when each directly launched program's arguments were
        found as it expects. A deleted input is left to JAX's checked call, which refuses it
        before the program runs."""
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

    def _check_layouts(self, i: int, args: list) -> None:
        """On a checked call: step ``i``'s program is launched directly from now on only if
        each argument it reads is a plain array laid out as it expects."""
        direct = self._direct[i]
        kept = args if direct.kept is None else [args[k] for k in direct.kept]
        if not all(launchable_as(a, want) for a, want in zip(kept, direct.shardings, strict=True)):
            self._direct[i] = None

    def _mover(self, source: Any, target: Any, value: int) -> Callable[[Any], Any] | None:
        """How a value laid out as ``source`` reaches ``target``: kept as it is (the same
        devices and slices), one runtime copy, or ``None`` (``jax.device_put`` decides)."""
        if source is None or target is None:
            return None
        ndim = len(self.graph.shapes[value])
        if self._equivalent(source, target, ndim):
            return _unchanged
        return copier(source, target, ndim, self.graph.dtypes[value])

    def _laid_out_as(self, value: Any, sharding: Any) -> bool:
        """Whether ``value`` is an array already laid out as ``sharding`` (the same devices and
        slices under another name, e.g. a one-device array for a one-device task): moving it
        would only copy it. Decided once per pair of layouts."""
        have = getattr(value, "sharding", None)
        return have is not None and self._equivalent(have, sharding, value.ndim)

    def _equivalent(self, have: Any, want: Any, ndim: int) -> bool:
        """Whether layouts ``have`` and ``want`` put the same slices on the same devices, decided
        once per pair."""
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
