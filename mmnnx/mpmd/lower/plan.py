"""The plan of one ``mm.jit`` step: what ``step.plan()`` returns and prints."""

from __future__ import annotations

import dataclasses

from mmnnx.mpmd.lower.program import StepProgram
from mmnnx.mpmd.plan.cut import Fragment, Transfer
from mmnnx.mpmd.plan.pipeline import Pipeline
from mmnnx.sharding import Task


@dataclasses.dataclass
class Plan:
    """What one mm.jit step runs: tasks, fragments in dispatch order, transfers, and the typed
    per-task programs (``program``, a ``StepProgram``) that the runner executes as they are.

    Building a plan compiles nothing. ``num_loaded``, on the plan a compiled step returns: how
    many of its programs were not compiled but loaded from an equal program compiled for other
    devices (equal pipeline stages compile once; the runner's own small programs, which fill
    running sums with zeros and pack block weights, are not counted); ``num_lowered``: how many
    of them were traced and lowered, the others reusing the lowering of an alike program on
    other devices, moved there (equal stages are lowered once); ``num_reused``: how many were
    taken as compiled by an earlier step of this process (the same program on the same
    devices: another ``mm.jit`` of the same model, a step traced again). ``inputs``: the value id
    of each input leaf, in the order mm.jit flattens the arguments (Variables first, then the
    other arrays), as ``Transfer.value`` names them.
    """

    tasks: list[Task]  # the tasks the step runs on
    fragments: list[Fragment]  # every fragment, in dispatch order of its first run
    transfers: list[Transfer]  # values moved between tasks (a microbatch's once)
    program: StepProgram  # what runs, after every pass: this process's share
    pipeline: Pipeline | None = None  # the pipelined plan of an mm.microbatch loop
    inputs: list[int] = dataclasses.field(default_factory=list)  # value id of each input leaf
    input_names: list[str] = dataclasses.field(default_factory=list)  # path of each input leaf
    unrolled: list[str] = dataclasses.field(default_factory=list)  # why a loop is not pipelined
    num_loaded: int | None = None  # once compiled: programs loaded, not compiled
    num_lowered: int | None = None  # once compiled: programs lowered, not moved from an alike one
    num_reused: int | None = None  # once compiled: programs an earlier step compiled

    @property
    def num_programs(self) -> int:
        """How many distinct compiled programs the step runs."""
        return self.program.num_programs

    def fragments_of(self, task: Task | str) -> list[Fragment]:
        name = task if isinstance(task, str) else task.name
        return [f for f in self.fragments if f.task.name == name]

    @property
    def transfer_bytes(self) -> int:
        return sum(t.nbytes for t in self.transfers)

    def __str__(self) -> str:
        lines = [
            f"Plan: {len(self.tasks)} task(s), {len(self.fragments)} fragment(s), "
            f"{len(self.transfers)} transfer(s), {self.transfer_bytes:,} B moved"
        ]
        lines += [f"  unrolled: {why}" for why in self.unrolled]
        for task in self.tasks:
            lines.append(f"  task {task.name!r}:")
            for f in self.fragments_of(task):
                lines.append(f"    {f.name}: {f.num_eqns} eqns [{', '.join(f.kinds)}]")
        if self.transfers:
            lines.append("  transfers:")
            for t in self.transfers:
                src = t.source.name if t.source is not None else "(input)"
                shape = ",".join(str(d) for d in t.shape)
                lines.append(f"    {src} -> {t.target.name}: {t.dtype}[{shape}] ({t.nbytes:,} B)")
        loaded = (
            f"; {self.num_loaded} loaded from an equal one compiled for other devices"
            if self.num_loaded
            else ""
        )
        lowered = f"; {self.num_lowered} lowered" if self.num_lowered is not None else ""
        reused = f"; {self.num_reused} compiled by an earlier step" if self.num_reused else ""
        lines.append(f"  programs ({self.num_programs} compiled{loaded}{lowered}{reused}):")
        lines.append(str(self.program))
        return "\n".join(lines)

    def __repr__(self) -> str:
        return str(self)
