"""Typed per-task programs: what each task does in one step, as data (no JAX calls).

Lowering (``lower.py``) turns a plan into one :class:`StepProgram`: a global list of actions in
dispatch order, each owned by one task. ``program(task)`` is that task's own list, which is all a
process owning only that task needs to run. The runner (``runner.py``) compiles the fragments the
actions name and executes them.

Values live in numbered *slots*. A value moved between tasks is a :class:`Send` in the source
task's program followed by a :class:`Recv` in the target's; in one process the pair is one
``jax.device_put``. A value that enters the step on no task (a batch) has a :class:`Recv` whose
source is ``None``.

Example:
    >>> from mmnnx.mpmd.program import Release
    >>> str(Release(None, (3, 4)))
    'release s3 s4'
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mmnnx.mpmd.plan import Fragment
from mmnnx.sharding import Task


def _slots(slots: tuple[int | None, ...]) -> str:
    return ", ".join("-" if s is None else f"s{s}" for s in slots)


def _mb(microbatch: int | None) -> str:
    return "" if microbatch is None else f" @mb{microbatch}"


@dataclasses.dataclass(frozen=True)
class Run:
    """Runs ``fragment`` on the values in ``ins``, writing its results into ``outs``.

    ``sums``: running microbatch sums (slots) that the program reads and returns updated with
    its results at positions ``summed`` (a :class:`Zeros` action starts them). An ``outs`` entry
    of ``None``: a result only added to its sum, which the program does not return. ``donate``:
    positions in ``ins`` whose buffers the program may reuse. ``out_shardings``: the sharding
    each result is pinned to, ``None`` where the compiler chooses. ``label``: ``(task, kind,
    stage)`` of a pipeline stage, for timelines. ``fused``: this action and the next Run (on the
    same task, reading none of this one's results) run as one compiled program: an overlapped
    pair of the schedule.
    """

    fragment: Fragment
    ins: tuple[int, ...]
    outs: tuple[int | None, ...]
    microbatch: int | None = None
    sums: tuple[int, ...] = ()
    summed: tuple[int, ...] = ()
    donate: tuple[int, ...] = ()
    out_shardings: tuple[Any, ...] = ()
    label: tuple[str, str, int] | None = None
    fused: bool = False

    @property
    def task(self) -> Task:
        return self.fragment.task

    @property
    def variant(self) -> tuple[int, bool]:
        """The compiled program this action runs: one per fragment, plus its accumulating form."""
        return id(self.fragment), bool(self.sums)

    def __str__(self) -> str:
        sums = f" sums ({_slots(self.sums)})" if self.sums else ""
        fused = " + next" if self.fused else ""
        return (
            f"run {self.fragment.name}{_mb(self.microbatch)} ({_slots(self.ins)}) -> "
            f"({_slots(self.outs)}){sums}{fused}"
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
    sharding: Any = None
    microbatch: int | None = None

    @property
    def task(self) -> Task:
        return self.target

    def __str__(self) -> str:
        src = "(input)" if self.source is None else repr(self.source.name)
        layout = "" if self.sharding is None else f" {getattr(self.sharding, 'spec', '')}"
        return f"recv v{self.value}{_mb(self.microbatch)} s{self.slot} <- {src}{layout}"


@dataclasses.dataclass(frozen=True)
class Constant:
    """Puts a constant (a microbatch index) into ``slot`` on ``task``."""

    slot: int
    task: Task
    value: Any

    def __str__(self) -> str:
        return f"const s{self.slot} = {self.value!r}"


@dataclasses.dataclass(frozen=True)
class Zeros:
    """Puts zero-filled arrays into ``slots`` on ``task``, fresh every step: the running sums a
    fragment's first microbatch adds to, so that every microbatch runs one compiled program."""

    task: Task
    slots: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[Any, ...]
    shardings: tuple[Any, ...]

    def __str__(self) -> str:
        return f"zeros {_slots(self.slots)}"


@dataclasses.dataclass(frozen=True)
class Release:
    """Drops values no later action reads, so their memory is freed during the step."""

    task: Task | None
    slots: tuple[int, ...]

    def __str__(self) -> str:
        return f"release {' '.join(f's{s}' for s in self.slots)}"


Action = Run | Send | Recv | Constant | Zeros | Release


@dataclasses.dataclass
class StepProgram:
    """One step as typed actions: the global dispatch order and each task's part of it.

    ``inputs``: ``(slot, leaf index)`` of the step's input leaves. ``outputs``: per output, its
    slot, or ``None`` with a constant and the sharding it goes to. ``activations``: slots that
    hold a microbatch's value, with their task name and microbatch (for memory profiles).
    ``shardings``: each slot's layout where lowering knows it (``None``: the compiler's choice).
    """

    tasks: list[Task]
    actions: list[Action]
    inputs: list[tuple[int, int]]
    outputs: list[tuple[int | None, Any, Any]]
    shardings: list[Any]
    activations: dict[int, tuple[str, int]]

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

    def __str__(self) -> str:
        lines = []
        for task in self.tasks:
            actions = self.program(task)
            lines.append(f"  program of {task.name!r} ({len(actions)} actions):")
            lines += [f"    {a}" for a in actions]
        return "\n".join(lines)
