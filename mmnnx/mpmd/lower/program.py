"""Typed per-task programs: what each task does in one step, as data (no JAX calls).

Lowering (``lower.py``) turns a plan into one :class:`StepProgram`: a global list of actions in
dispatch order, each owned by one task. Passes then rewrite it, each a function from program to
program (``passes.py``): ``pack`` (values travelling as flat buffers), ``localize`` (one
process's share, cross-process moves as :class:`Route` actions) and ``add_releases``. The runner
(``runner.py``) compiles the fragments the actions name and executes them; what ``step.plan()``
prints is the program it runs.

Values live in numbered *slots*. A value moved between tasks is a :class:`Send` in the source
task's program followed by a :class:`Recv` in the target's; in one process the pair is one
``jax.device_put``. A value that enters the step on no task (a batch) has a :class:`Recv` whose
source is ``None``.

Example:
    >>> from mmnnx.mpmd.lower.program import Release
    >>> str(Release(None, (3, 4)))
    'release s3 s4'
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import numpy as np
from jax.sharding import NamedSharding

from mmnnx.mpmd.plan.cut import Fragment
from mmnnx.sharding import Task


def _slots(slots: tuple[int | None, ...]) -> str:
    return ", ".join("-" if s is None else f"s{s}" for s in slots)


def _mb(microbatch: int | None) -> str:
    return "" if microbatch is None else f" @mb{microbatch}"


@dataclasses.dataclass(frozen=True)
class Member:
    """One value in a packed buffer: its slot before packing, its offset (elements), its shape."""

    slot: int
    offset: int
    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class Buffer:
    """A flat buffer in ``slot`` holding ``members`` one after the other, all of ``dtype``.
    ``positions``: which of one run's results it holds (empty for sums and weights). ``fixed``:
    sliced at offsets fixed in its readers' programs (a block's weights), else at offsets passed as
    arguments: each member at its block's base (``bases``; a member before the first is its own)
    plus a distance fixed in the program, shared by blocks laid out alike."""

    slot: int
    dtype: np.dtype
    members: tuple[Member, ...]
    positions: tuple[int, ...] = ()
    fixed: bool = False
    bases: tuple[int, ...] = ()

    @property
    def size(self) -> int:
        return sum(m.size for m in self.members)

    def base_of(self, offset: int) -> int:
        """The base a reader slices the member at ``offset`` from (see ``bases``).

        Example:
            >>> members = (Member(1, 0, (2,)), Member(2, 2, (3,)), Member(3, 5, (1,)))
            >>> buffer = Buffer(9, "float32", members, bases=(2,))
            >>> buffer.base_of(0), buffer.base_of(5)
            (0, 2)
        """
        below = [b for b in self.bases if b <= offset]
        return below[-1] if below else offset

    @functools.cached_property
    def member_of(self) -> dict[int, Member]:
        return {m.slot: m for m in self.members}

    @property
    def layout(self) -> tuple:
        """What a program reading or making this buffer depends on (not the slots)."""
        return (
            str(self.dtype),
            self.fixed,
            self.bases,
            self.positions,
            tuple((m.offset, m.shape) for m in self.members),
        )

    def __str__(self) -> str:
        return f"s{self.slot}[{_slots(tuple(m.slot for m in self.members))}]"


@dataclasses.dataclass(frozen=True)
class InputRead:
    """Where a fragment input is among its program's arguments: argument ``arg``, or a slice
    (``member``) of the packed buffer there."""

    arg: int
    member: Member | None = None


@dataclasses.dataclass(frozen=True)
class SumArg:
    """A running sum a program takes and returns updated (a buffer of several, or one);
    ``positions``: the program's results added to it."""

    slot: int
    positions: tuple[int, ...]
    buffer: Buffer | None = None


@dataclasses.dataclass(frozen=True)
class RunPacking:
    """How a :class:`Run`'s program takes and returns packed buffers: ``args``, the slots passed (a
    buffer once); ``reads``, where each fragment input is among them; ``buffers``, the packed ones
    by position; ``packs``, buffers it returns; ``sums``; ``offsets``, the ``(slot, value)`` of each
    int32 offset it takes (arguments, not constants, so that alike members share kernels)."""

    args: tuple[int, ...]
    reads: tuple[InputRead, ...]
    buffers: tuple[tuple[int, Buffer], ...] = ()
    packs: tuple[Buffer, ...] = ()
    sums: tuple[SumArg, ...] = ()
    offsets: tuple[tuple[int, int], ...] = ()

    @property
    def layout(self) -> tuple:
        """What the compiled program depends on (no slots)."""
        return (
            tuple((r.arg, r.member and (r.member.offset, r.member.shape)) for r in self.reads),
            tuple((k, b.layout) for k, b in self.buffers),
            tuple(b.layout for b in self.packs),
            tuple((s.positions, s.buffer.layout if s.buffer else None) for s in self.sums),
            tuple(value for _, value in self.offsets),
        )


@dataclasses.dataclass(frozen=True)
class Run:
    """Runs ``fragment`` on the values in ``ins``, writing its results into ``outs``.

    ``sums``: running microbatch sums (slots) that the program reads and returns updated with
    its results at positions ``summed`` (a :class:`Zeros` action starts them). An ``outs`` entry
    of ``None``: a result only added to its sum, which the program does not return. ``donate``:
    positions in ``ins`` whose buffers the program may reuse. ``out_shardings``: the sharding
    each result is pinned to, ``None`` where the compiler chooses. ``label``: ``(task, kind,
    stage, part)`` of a pipeline stage (``part``: which of its programs, for a stage fragment
    cut around a core, else 0), for timelines. ``fused``: this action and the next Run (on the
    same task, reading none of this one's results) run as one compiled program: an overlapped
    pair of the schedule. ``packing``: how its arguments and results travel packed into flat
    buffers (``None``: each value as its own array); :attr:`args` and :attr:`results` are the
    slots the program really reads and writes.
    """

    fragment: Fragment
    ins: tuple[int, ...]
    outs: tuple[int | None, ...]
    microbatch: int | None = None
    sums: tuple[int, ...] = ()
    summed: tuple[int, ...] = ()
    donate: tuple[int, ...] = ()
    out_shardings: tuple[NamedSharding | None, ...] = ()
    label: tuple[str, str, int, int] | None = None
    fused: bool = False
    packing: RunPacking | None = None

    @property
    def task(self) -> Task:
        return self.fragment.task

    @property
    def variant(self) -> tuple[int, bool]:
        """The compiled program this action runs: one per fragment, plus its accumulating form."""
        return id(self.fragment), bool(self.sums)

    @property
    def returned(self) -> tuple[int, ...]:
        """Positions of the results the program returns as they are (not only added to a sum,
        not packed into a buffer)."""
        packed = {p for b in self.packing.packs for p in b.positions} if self.packing else ()
        return tuple(i for i, s in enumerate(self.outs) if s is not None and i not in packed)

    @property
    def args(self) -> tuple[int, ...]:
        """The slots the program takes, in order: inputs, running sums, offsets."""
        if self.packing is None:
            return (*self.ins, *self.sums)
        p = self.packing
        return (*p.args, *(s.slot for s in p.sums), *(slot for slot, _ in p.offsets))

    @property
    def results(self) -> tuple[int, ...]:
        """The slots the program writes, in order: returned results, packed buffers, sums."""
        outs = tuple(self.outs[i] for i in self.returned)
        if self.packing is None:
            return (*outs, *self.sums)
        p = self.packing
        return (*outs, *(b.slot for b in p.packs), *(s.slot for s in p.sums))

    def __str__(self) -> str:
        fused = " + next" if self.fused else ""
        if self.packing is None:
            sums = f" sums ({_slots(self.sums)})" if self.sums else ""
            return (
                f"run {self.fragment.name}{_mb(self.microbatch)} ({_slots(self.ins)}) -> "
                f"({_slots(self.outs)}){sums}{fused}"
            )
        p = self.packing
        buffers = dict(p.buffers)
        ins = ", ".join(str(buffers[k]) if k in buffers else f"s{s}" for k, s in enumerate(p.args))
        outs = [f"s{self.outs[i]}" for i in self.returned] + [str(b) for b in p.packs]
        sums = [str(s.buffer) if s.buffer else f"s{s.slot}" for s in p.sums]
        offsets = f" at ({_slots(tuple(slot for slot, _ in p.offsets))})" if p.offsets else ""
        summed = f" sums ({', '.join(sums)})" if sums else ""
        return (
            f"run {self.fragment.name}{_mb(self.microbatch)} ({ins}){offsets} -> "
            f"({', '.join(outs)}){summed}{fused}"
        )


@dataclasses.dataclass(frozen=True)
class Send:
    """Offers the value in ``slot`` (of ``source``) to task ``target``; pairs with a Recv."""

    value: int
    slot: int
    source: Task
    target: Task
    microbatch: int | None = None

    @property
    def task(self) -> Task:
        return self.source

    def __str__(self) -> str:
        return f"send v{self.value}{_mb(self.microbatch)} s{self.slot} -> {self.target.name!r}"


@dataclasses.dataclass(frozen=True)
class Recv:
    """Receives value ``value`` into ``slot`` on ``target``, from ``source``'s ``from_slot``
    (``source`` is ``None`` for a step input on no task).

    ``sharding``: the layout on ``target``; ``None`` means the source's layout carried over to
    the target's mesh, known once the source's program is compiled.
    """

    value: int
    slot: int
    source: Task | None
    target: Task
    from_slot: int
    sharding: NamedSharding | None = None
    microbatch: int | None = None

    @property
    def task(self) -> Task:
        return self.target

    def __str__(self) -> str:
        src = "(input)" if self.source is None else repr(self.source.name)
        layout = "" if self.sharding is None else f" {getattr(self.sharding, 'spec', '')}"
        return f"recv v{self.value}{_mb(self.microbatch)} s{self.slot} <- {src}{layout}"


@dataclasses.dataclass(frozen=True)
class Route:
    """A :class:`Send`/:class:`Recv` pair spanning processes, from one process's side: it ``sends``
    where it holds part of the source, ``receives`` where it holds part of the target (``source``
    ``None``: a step input put onto a target spanning processes)."""

    value: int
    from_slot: int
    slot: int
    source: Task | None
    target: Task
    sharding: NamedSharding | None = None
    sends: bool = False
    receives: bool = False
    microbatch: int | None = None

    @property
    def task(self) -> Task:
        return self.target

    def __str__(self) -> str:
        src = "(input)" if self.source is None else repr(self.source.name)
        ends = " and ".join(w for w, on in (("send", self.sends), ("receive", self.receives)) if on)
        return (
            f"route v{self.value}{_mb(self.microbatch)} s{self.from_slot} {src} -> "
            f"s{self.slot} {self.target.name!r} ({ends or 'put'})"
        )


@dataclasses.dataclass(frozen=True)
class Constant:
    """Puts a constant (a microbatch index, a packed buffer's offset) into ``slot`` on ``task``."""

    slot: int
    task: Task
    value: int

    def __str__(self) -> str:
        return f"const s{self.slot} = {self.value!r}"


@dataclasses.dataclass(frozen=True)
class Zeros:
    """Puts zero-filled arrays into ``slots`` on ``task``, fresh every step: the running sums a
    fragment's first microbatch adds to, so that every microbatch runs one compiled program."""

    task: Task
    slots: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[np.dtype, ...]
    shardings: tuple[NamedSharding, ...]
    members = ()  # the slots it reads: none (not a field)

    @property
    def made(self) -> tuple[int, ...]:
        return self.slots

    def __str__(self) -> str:
        return f"zeros {_slots(self.slots)}"


@dataclasses.dataclass(frozen=True)
class PackWeights:
    """Concatenates step inputs (a block's weights) into ``buffers`` on ``task`` at the step's
    start; ``zeros``: the task's running sums, made by the same program (``fold``)."""

    task: Task
    buffers: tuple[Buffer, ...]
    zeros: Zeros | None = None

    @property
    def members(self) -> tuple[int, ...]:
        return tuple(m.slot for b in self.buffers for m in b.members)

    @property
    def made(self) -> tuple[int, ...]:
        """The slots it writes: its buffers, then its zeros."""
        zeros = self.zeros.slots if self.zeros is not None else ()
        return (*(b.slot for b in self.buffers), *zeros)

    def __str__(self) -> str:
        zeros = f"; {self.zeros}" if self.zeros is not None else ""
        return f"pack {', '.join(str(b) for b in self.buffers)}{zeros}"


@dataclasses.dataclass(frozen=True)
class PublishLayout:
    """Tells the other processes the layout the compiler chose for ``slot`` on ``task`` (once, at
    compile)."""

    slot: int
    task: Task

    def __str__(self) -> str:
        return f"publish layout of s{self.slot}"


@dataclasses.dataclass(frozen=True)
class AwaitLayout:
    """Reads the layout another process published for ``slot`` on ``task`` (once, at compile)."""

    slot: int
    task: Task

    def __str__(self) -> str:
        return f"await layout of s{self.slot}"


@dataclasses.dataclass(frozen=True)
class Release:
    """Drops values no later action reads, so their memory is freed during the step."""

    task: Task | None
    slots: tuple[int, ...]

    def __str__(self) -> str:
        return f"release {' '.join(f's{s}' for s in self.slots)}"


Action = (
    Run
    | Send
    | Recv
    | Route
    | Constant
    | Zeros
    | PackWeights
    | PublishLayout
    | AwaitLayout
    | Release
)


@dataclasses.dataclass(frozen=True)
class Output:
    """A step output: the value in ``slot``, made on ``task`` (``None``: a step input); ``here``:
    this process holds (part of) it, else the runner hands back a placeholder."""

    slot: int
    value: int
    task: Task | None
    here: bool = True


@dataclasses.dataclass(frozen=True)
class ConstantOutput:
    """A step output that is a constant, put on ``home`` (``None``: returned as it is)."""

    value: Any
    home: Any = None


@dataclasses.dataclass(frozen=True)
class StepProgram:
    """One step as typed actions: the global dispatch order and each task's part of it.

    ``inputs``: ``(slot, leaf index)`` of the step's input leaves. ``outputs``: one
    :class:`Output` or :class:`ConstantOutput` per output. ``shardings``: each slot's layout
    where lowering knows it (``None``: the compiler's choice). ``activations``: slots that hold
    a microbatch's value, with their task name and microbatch (for memory profiles).
    ``process``: the process whose share this is (``None``: every process's, before
    ``localize``).
    """

    tasks: tuple[Task, ...]
    actions: tuple[Action, ...]
    inputs: tuple[tuple[int, int], ...]
    outputs: tuple[Output | ConstantOutput, ...]
    shardings: tuple[NamedSharding | None, ...]
    activations: dict[int, tuple[str, int]]
    process: int | None = None

    @property
    def num_slots(self) -> int:
        return len(self.shardings)

    def program(self, task: Task | str) -> list[Action]:
        """The actions ``task`` runs, in order."""
        name = task if isinstance(task, str) else task.name
        return [a for a in self.actions if a.task is not None and a.task.name == name]

    @property
    def num_programs(self) -> int:
        """How many distinct compiled programs the actions run."""
        return len({a.variant for a in self.actions if isinstance(a, Run)})

    def replace(self, **changes: Any) -> StepProgram:
        return dataclasses.replace(self, **changes)

    def __str__(self) -> str:
        lines = []
        if self.process is not None:
            lines.append(f"  process {self.process}'s share:")
        for task in self.tasks:
            actions = self.program(task)
            if self.process is not None and not actions:
                continue
            lines.append(f"  program of {task.name!r} ({len(actions)} actions):")
            lines += [f"    {a}" for a in actions]
        return "\n".join(lines)
