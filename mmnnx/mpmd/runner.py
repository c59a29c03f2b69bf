"""The runner: compiles the fragments a :class:`StepProgram` names, then executes its actions.

Compiling walks the actions once in dispatch order (a fragment's input layouts are those of the
values it reads, so they are known by the time it is reached) and turns them into a flat list of
pre-resolved calls. Per call, the host work is one loop over that list: no tracing, no graph
walks. Dispatch is asynchronous, so fragments on different submeshes overlap. In one process a
Send/Recv pair is one ``jax.device_put``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from mmnnx._jax.arrays import checks_special_values, copier, is_plain_array, launchable_as, move_to
from mmnnx._jax.compile import SharedCompiles
from mmnnx._jax.launch import DirectLaunch
from mmnnx.mpmd.evaluate import run_ops
from mmnnx.mpmd.ir import Graph
from mmnnx.mpmd.lower import compatible, constraint_layout
from mmnnx.mpmd.mesh_context import explicit_twin
from mmnnx.mpmd.packing import (
    Packed,
    no_packing,
    plan_packing,
    slice_offsets,
    unpacked_outputs,
)
from mmnnx.mpmd.plan import Plan
from mmnnx.mpmd.primitives import constraint_layouts
from mmnnx.mpmd.program import Constant, Recv, Release, Run, Send, StepProgram, Zeros
from mmnnx.mpmd.timing import Timer, witness_for

_RUN, _PUT, _CALL = 0, 1, 2


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


def _part(
    graph: Graph,
    run: Run,
    in_shardings: Sequence[Any],
    unpack: tuple | None = None,
    packs: Sequence[Packed] = (),
    packed_args: dict[int, Packed] | None = None,
    sums: Sequence[tuple[Packed | None, tuple[int, ...]]] | None = None,
) -> _Part:
    """``run``'s share of a program. ``unpack``: where each of the fragment's inputs is among
    the arguments (see :meth:`Packing.inputs`), with ``packed_args`` the packed buffers among
    them; ``packs``: the results it returns concatenated, one buffer each; ``sums``: per running
    sum it takes, its packed buffer or ``None`` and the results added to it (see
    :meth:`Packing.sums`; default: one sum per position of ``run.summed``).

    A packed argument's members are sliced at offsets the program takes as arguments (after the
    sums; :func:`slice_offsets`), not as constants: XLA then compiles one kernel for the members
    of equal shape (a block's residuals, layer after layer) where constant offsets would make
    each slice-reading kernel distinct (about 10 ms of compile each on XLA:CPU). A block's
    members are sliced at its base plus their distance from it, both arguments: blocks laid out
    alike share the distances, so a stage takes one offset per block and per distance, not one
    per member."""
    frag = run.fragment
    n = len(frag.in_ids) if unpack is None else 1 + max(k for k, _, _ in unpack)
    summed = run.summed
    sums = [(None, (i,)) for i in summed] if sums is None else sums
    total_shardings = list(in_shardings[n : n + len(sums)])
    packed_args = packed_args or {}
    offset_arg = {at: n + len(sums) + j for j, at in enumerate(slice_offsets(unpack, packed_args))}
    fixed = {k for k, packed in packed_args.items() if packed.fixed}
    returned = unpacked_outputs(run, packs)

    def inputs(args: Sequence[Any]) -> list:
        if unpack is None:
            return list(args[:n])

        def member(k: int, at: int, shape: tuple[int, ...]) -> Any:
            size = math.prod(shape)
            if k in fixed:  # at the same offset in every block: the blocks' kernels stay alike
                return jax.lax.slice(args[k], (at,), (at + size,)).reshape(shape)
            base = packed_args[k].base_of(at)
            start = args[offset_arg[base]]
            if at != base:
                start = start + args[offset_arg[at - base]]
            return jax.lax.dynamic_slice(args[k], (start,), (size,)).reshape(shape)

        return [args[k] if at is None else member(k, at, shape) for k, at, shape in unpack]

    def body(*args):
        outs = run_ops(frag.ops, frag.in_ids, frag.out_ids, inputs(args))

        def flat(positions: Sequence[int]) -> Any:
            return jnp.concatenate([jnp.ravel(outs[p]) for p in positions])

        totals = [
            total + (outs[at[0]] if pk is None else flat(at))
            for total, (pk, at) in zip(args[n : n + len(sums)], sums, strict=True)
        ]
        return [*(outs[i] for i in returned), *(flat(pk.positions) for pk in packs), *totals]

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
        in_shardings += [typed(frag.out_ids[i]) for i in summed]
        total_shardings = list(in_shardings[n:])
        out_shardings = [typed(frag.out_ids[i]) for i in returned] + total_shardings
    if unpack is None:
        avals = [
            jax.ShapeDtypeStruct(graph.shapes[v], graph.dtypes[v], sharding=s)
            for v, s in zip(frag.in_ids, in_shardings[:n], strict=True)
        ]
    else:
        first = {}
        for j, (k, _, _) in enumerate(unpack):
            first.setdefault(k, j)
        avals = [
            jax.ShapeDtypeStruct((pk.size,), pk.dtype, sharding=in_shardings[k])
            if (pk := packed_args.get(k)) is not None
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
        if pk is None
        else jax.ShapeDtypeStruct((pk.size,), pk.dtype, sharding=s)
        for (pk, at), s in zip(sums, total_shardings, strict=True)
    ]
    avals += [
        jax.ShapeDtypeStruct((), jnp.int32, sharding=in_shardings[i]) for i in offset_arg.values()
    ]
    donate = (*_donated_args(run.donate, unpack), *range(n, n + len(total_shardings)))
    return _Part(body, list(in_shardings), out_shardings, donate, avals, explicit)


def _donated_args(donate: Sequence[int], unpack: tuple | None) -> list[int]:
    """The arguments a program donates for its fragment's donated inputs ``donate``: where
    inputs are packed (``unpack``, :meth:`Packing.inputs`), the argument each unpacked one is
    passed as; a packed member is not donated (its buffer holds other members too).

    Example:
        >>> _donated_args((0, 2), ((0, None, ()), (1, 0, (2,)), (2, None, ())))
        [0, 2]
        >>> _donated_args((1, 2), ((1, 0, (2,)), (1, 2, (2,)), (0, None, ())))
        [0]
    """
    if unpack is None:
        return list(donate)
    return sorted({unpack[p][0] for p in donate if unpack[p][1] is None})


def lower_fragments(
    graph: Graph,
    runs: Sequence[Run],
    in_shardings: Sequence[Sequence[Any]],
    packing: Sequence[tuple] = (),
) -> Any:
    """Lowers the fragments of ``runs`` (on one task; the ``in_shardings`` of each) as one
    program taking their arguments one run after the other and returning their results in the
    same order: one fragment's program, or an overlapped pair as one launch that the compiler
    may interleave. A run with ``sums`` also takes the running sums of its summed outputs and
    returns them updated (donating the old ones). ``packing``: per run, ``(unpack, packs,
    packed_args, sums)`` for :func:`_part` (its results, arguments and running sums packed into
    flat buffers)."""
    packing = packing or [(None, (), {})] * len(runs)
    parts = [
        _part(graph, run, s, *how) for run, s, how in zip(runs, in_shardings, packing, strict=True)
    ]
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


def lower_packing(buffers: Sequence[Packed], shardings: Sequence[Any], task: Any) -> Any:
    """One program concatenating step inputs (laid out as ``shardings``, one argument per
    member, buffer after buffer) into each of ``buffers``, flat on ``task``, lowered."""
    layouts = iter(shardings)
    avals = [
        jax.ShapeDtypeStruct(shape, packed.dtype, sharding=next(layouts))
        for packed in buffers
        for _, _, shape in packed.members
    ]

    def pack(*members):
        out, at = [], 0
        for packed in buffers:
            taken = members[at : at + len(packed.members)]
            out.append(jnp.concatenate([jnp.ravel(m) for m in taken]))
            at += len(packed.members)
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
        return self._pool.submit(self.shared.compile, lowered)

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


class _LocalView:
    """What one process does with each action: in a single process, everything."""

    @staticmethod
    def make(executable: Executable) -> Any:
        if jax.process_count() == 1:
            return _LocalView()
        if executable.process_view is None:
            raise RuntimeError(f"{executable.name} runs on several processes: pass process_view")
        return executable.process_view(executable)

    def runs(self, task: Any) -> bool:
        return True

    def skipped(self, run: Run, sharding_of: list[Any]) -> None:
        raise AssertionError("a single process runs every action")

    def elsewhere(self, slots: Sequence[int], task: Any) -> None:
        raise AssertionError("a single process runs every action")

    def without_sent_donations(self, run: Run) -> Run:
        return run

    def made(self, slots: Sequence[int], task: Any) -> None:
        pass

    def source_layout(self, recv: Recv, sharding_of: list[Any]) -> Any:
        return sharding_of[recv.from_slot]

    def receive(self, recv: Recv, sharding: Any, source_layout: Any) -> Callable | bool | None:
        """How this process takes part in ``recv``: ``True``, a ``device_put`` here; a callable,
        which moves the value (returning it where it lands here); ``None``, not at all."""
        return True

    def put(self, value: Any, sharding: Any) -> jax.Array:
        return jax.device_put(value, sharding)

    def holds(self, slot: int) -> bool:
        return True

    def placeholder(self, slot: int, sharding_of: list[Any]) -> jax.Array:
        raise AssertionError("a single process holds every value")

    def output_layout(self, slot: int, sharding_of: list[Any]) -> Any:
        return None


class Executable:
    """A step's plan, compiled on first use: call it with the flat input leaves; it returns the
    flat outputs. ``plan`` is available before anything is compiled.

    With several processes (``jax.distributed``), each process compiles and runs only the
    actions of tasks holding its devices; a value moving between processes takes a
    :class:`~mmnnx.distributed.routes.Route`, and results this process does not hold are
    placeholders (arrays on other processes' devices). ``fingerprint``: makes the lines
    describing the step that processes compare before the first compile; ``name``: the step's,
    for messages; ``pack_residuals`` / ``pack_weights``: the largest residual / weight packed,
    in bytes (``mm.jit``, :mod:`~mmnnx.mpmd.packing`); ``input_names``: the inputs' paths
    (weights are packed by the block their path names); ``process_view``: with several
    processes, makes the view of this process's share of the step from the executable
    (``mm.jit`` passes :class:`~mmnnx.distributed.view.ProcessView`).
    """

    def __init__(
        self,
        graph: Graph,
        plan: Plan,
        *,
        name: str = "the step",
        fingerprint: Callable[[], list[str]] = list,
        pack_residuals: int = 0,
        pack_weights: int = 0,
        input_names: Sequence[str] = (),
        process_view: Callable[[Executable], Any] | None = None,
    ):
        self.graph = graph
        self.plan = plan
        self.program: StepProgram = plan.program
        self.tasks = plan.tasks
        self.owned_devices = {d for t in self.tasks for d in t.jax_mesh.devices.flat}
        self.may_fail = any(op.may_fail for op in graph.ops)
        self.name = name
        self.fingerprint = fingerprint
        self.pack_residuals = pack_residuals
        self.pack_weights = pack_weights
        self.input_names = list(input_names)
        self.process_view = process_view
        self._steps: list[tuple] | None = None
        self._same_layout: dict[tuple, bool] = {}
        self._fragment_programs: list[Any] = []  # lowered while compiling, to count the loaded

    def compile(self) -> None:
        """Compiles every distinct program of the step (once, side by side on threads) and
        resolves every transfer."""
        if self._steps is not None:
            return
        with _Compiler() as compiler:
            self._build(compiler)
        loaded = compiler.shared.loaded_lowered
        self.plan.num_loaded = sum(id(lowered) in loaded for lowered in self._fragment_programs)
        self._fragment_programs = []

    def _build(self, compiler: _Compiler) -> None:
        program = self.program
        local = _LocalView.make(self)
        packing = (
            no_packing(program)
            if self.graph.specs  # sharding in types: every program keeps the types
            else plan_packing(
                program,
                self.graph,
                residual_bytes=self.pack_residuals,
                weight_bytes=self.pack_weights,
                input_names=self.input_names,
            )
        )
        remaining = {p.slot: len(p.members) for p in packing.buffers}
        sharding_of = [*program.shardings, *[None] * (packing.num_slots - program.num_slots)]
        compiled_of: dict[tuple, Any] = {}
        constants: list[tuple[int, Any]] = []
        offset_slots: dict[tuple, int] = {}
        steps: list[list] = []
        for task, buffers in packing.weights.items():  # made first: no run reads them before
            members = [m for packed in buffers for m, _, _ in packed.members]
            made = [packed.slot for packed in buffers]
            for slot in made:
                sharding_of[slot] = task.sharding()
            if local.runs(task):
                shardings = [sharding_of[m] for m in members]
                packs = compiler.submit(lower_packing(buffers, shardings, task))
                local.made(made, task)
                steps.append([_RUN, packs, members, made, (), _rank(task), ()])
            else:
                local.elsewhere(made, task)

        def offset_slot(task: Any, offset: int) -> int:
            """The slot of the int32 ``offset`` on ``task`` (put there once)."""
            slot = offset_slots.get((task, offset))
            if slot is None:
                slot = offset_slots[(task, offset)] = len(sharding_of)
                sharding_of.append(task.sharding())
                constants.append((slot, local.put(jnp.int32(offset), task.sharding())))
                local.made([slot], task)
            return slot

        resolved: dict[tuple, Any] = {}
        actions = program.actions
        position = 0
        while position < len(actions):
            action = actions[position]
            position += 1
            if isinstance(action, Run):
                if not local.runs(action.task):
                    local.skipped(action, sharding_of)
                    continue
                runs = [local.without_sent_donations(action)]
                indices = [position - 1]
                later: list[int] = []  # released between a fused pair's two runs
                while runs[-1].fused:
                    while isinstance(actions[position], Release):
                        later += packing.released(actions[position].slots, remaining)
                        position += 1
                    runs.append(local.without_sent_donations(actions[position]))
                    indices.append(position)
                    position += 1
                how, reads, ins, outs = [], [], [], []
                for run, index in zip(runs, indices, strict=True):
                    args, unpack, packed_args = packing.inputs(run)
                    packs = packing.by_run.get(index, ())
                    sum_slots, sums = packing.sums(run)
                    how.append((unpack, packs, packed_args, sums))
                    offsets = [
                        offset_slot(run.task, at) for at in slice_offsets(unpack, packed_args)
                    ]
                    reads.append([*args, *sum_slots, *offsets])
                    ins += reads[-1]
                    outs += [run.outs[p] for p in unpacked_outputs(run, packs)]
                    outs += [pk.slot for pk in packs]
                    outs += sum_slots
                # A program per layout of its arguments: a value made by a fused pair may be
                # laid out otherwise than the same value made by its fragment alone.
                key = tuple(
                    (
                        *run.variant,
                        run.donate,
                        unpack,
                        tuple(pk.positions for pk in packs),
                        tuple((pk is not None, at) for pk, at in sums),
                        tuple(sharding_of[s] for s in slots),
                    )
                    for run, (unpack, packs, _, sums), slots in zip(runs, how, reads, strict=True)
                )
                if key not in compiled_of:
                    lowered = lower_fragments(
                        self.graph,
                        runs,
                        [[sharding_of[s] for s in slots] for slots in reads],
                        how,
                    )
                    compiling = compiler.submit(lowered)
                    self._fragment_programs.append(lowered)
                    compiled_of[key] = (compiling, compiler.output_shardings(lowered, compiling))
                compiled, output_shardings = compiled_of[key]
                for s, sharding in zip(outs, output_shardings, strict=True):
                    sharding_of[s] = sharding
                local.made(outs, runs[0].task)
                labels = tuple((run.label, run.microbatch) for run in runs)
                rank = _rank(runs[0].task)
                steps.append([_RUN, compiled, ins, outs, labels, rank, tuple(later)])
            elif isinstance(action, Recv):
                sharding = action.sharding
                source_layout = local.source_layout(action, sharding_of)
                if sharding is None and source_layout is not None:
                    sharding = compatible(source_layout, action.target)
                    resolved.setdefault((action.value, action.source, action.target), sharding)
                sharding_of[action.slot] = sharding
                how = local.receive(action, sharding, source_layout)
                if how is True:
                    move = self._mover(source_layout, sharding, action.value)
                    steps.append(
                        [_PUT, action.from_slot, action.slot, sharding, move, source_layout, ()]
                    )
                elif how is not None:  # a transfer that involves another process
                    steps.append([_CALL, how, action.from_slot, action.slot, ()])
            elif isinstance(action, Zeros):
                slots, shapes, dtypes, shardings = packing.zeros(position - 1, action)
                for s, sharding in zip(slots, shardings, strict=True):
                    sharding_of[s] = sharding
                if local.runs(action.task):
                    local.made(slots, action.task)
                    zeros = compiler.submit(lower_zeros(shapes, dtypes, shardings))
                    steps.append([_RUN, zeros, (), slots, (), _rank(action.task), ()])
                else:
                    local.elsewhere(action.slots, action.task)
            elif isinstance(action, Constant):
                sharding_of[action.slot] = action.task.sharding()
                if local.runs(action.task):
                    value = local.put(jax.numpy.int32(action.value), sharding_of[action.slot])
                    constants.append((action.slot, value))
                    local.made([action.slot], action.task)
            elif isinstance(action, Release) and steps:  # dropped after the previous step
                steps[-1][-1] = (*steps[-1][-1], *packing.released(action.slots, remaining))
            elif not isinstance(action, Send | Release):  # a Send is its Recv's transfer here
                raise TypeError(f"unknown action {action!r}")
        self.plan.transfers[:] = [
            t
            if t.sharding is not None
            else dataclasses.replace(t, sharding=resolved.get((t.value, t.source, t.target)))
            for t in self.plan.transfers
        ]
        self._constants = constants
        self._outputs = [
            (slot, None)
            if slot is not None and local.holds(slot)
            else (None, local.placeholder(slot, sharding_of))
            if slot is not None
            else (None, const if home is None else local.put(const, home))
            for slot, const, home in program.outputs
        ]
        self._rewrap = [
            (i, layout)
            for i, (slot, _) in enumerate(self._outputs)
            if slot is not None and (layout := local.output_layout(slot, sharding_of)) is not None
        ]
        self._inputs = program.inputs
        self._region_slots = {
            **program.activations,
            **{
                pk.slot: program.activations[pk.members[0][0]]
                for pk in packing.buffers
                if pk.members[0][0] in program.activations
            },
        }
        self._num_slots = len(sharding_of)
        self._steps = [(_RUN, s[1].result(), *s[2:]) if s[0] == _RUN else tuple(s) for s in steps]
        donated = {
            slot
            for step in self._steps
            if step[0] == _RUN
            for slot, arg in zip(step[2], jax.tree.leaves(step[1].args_info), strict=True)
            if arg.donated
        }
        self._consumed = [  # programs whose every result a later one may donate
            i
            for i, step in enumerate(self._steps)
            if step[0] == _RUN and step[3] and all(s in donated for s in step[3])
        ]
        self._witness_of: dict[int, Callable] | None = None
        self._direct = [
            DirectLaunch.of(step[1]) if step[0] == _RUN else None for step in self._steps
        ]
        self._checked_layouts: tuple | None = None

    def _witnesses(self) -> dict[int, Callable]:
        """Per program whose every result a later one may donate, its :func:`witness_for`
        (compiled on first use, one per layout)."""
        if self._witness_of is None:
            by_layout: dict[Any, Callable] = {}
            self._witness_of = {}
            for i in self._consumed:
                first = jax.tree.leaves(self._steps[i][1].out_info)[0]
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
        if timer is not None:
            timer.begin()
        for i, step in enumerate(self._steps):
            if step[0] == _RUN:
                began = time.perf_counter() if timer is not None else 0.0
                launch = direct[i] if direct is not None else None
                if launch is not None:
                    slots = step[2] if launch.kept is None else [step[2][k] for k in launch.kept]
                    outs = launch.launch([env[s] for s in slots])
                else:
                    args = [env[s] for s in step[2]]
                    if checking and self._direct[i] is not None:
                        self._check_layouts(i, args)
                    outs = step[1](*args)
                if timer is not None:
                    witness = witnesses.get(i)
                    timer.launched(step[5], step[4], step[2], step[3], outs, began, witness)
                for s, o in zip(step[3], outs, strict=True):
                    env[s] = o
            elif step[0] == _PUT:
                value = env[step[1]]
                if step[4] is not None and getattr(value, "sharding", None) == step[5]:
                    value = step[4](value)  # laid out as planned: the move decided at compile
                elif not self._laid_out_as(value, step[3]):
                    value = move_to(value, step[3])
                env[step[2]] = value
                if timer is not None:
                    timer.moved(step[1], step[2])
            else:  # a transfer involving another process: ``step[1]`` moves it
                value = step[1](env[step[2]])
                if value is not None:
                    env[step[3]] = value
            if memory is not None:
                self._record(env, memory)
            for s in step[-1]:
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
        for slot, (task, m) in self._region_slots.items():
            if env[slot] is not None:
                total, microbatches = live.get(task, (0, set()))
                microbatches.add(m)
                live[task] = (total + env[slot].nbytes, microbatches)
        for name, (total, microbatches) in live.items():
            peak_bytes, peak_count = memory.get(name, (0, 0))
            memory[name] = (max(peak_bytes, total), max(peak_count, len(microbatches)))
