"""What the partition planner returns: the chosen split with its rules, schedule and
microbatch count, each stage's predicted time and memory, and the runners-up, drawn as the
table that says why."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from rich import box
from rich.table import Table

from mmnnx._tables import Tabulation, render
from mmnnx.mpmd import schedules as sched
from mmnnx.partition.memory import format_bytes


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """One stage as predicted: per microbatch, the seconds of its F, B, I, W and send; per
    device, the bytes of its Variables, their optimizer state and the activations it holds at
    most."""

    task: str
    first: int  # the first layer it holds
    last: int  # the last layer it holds
    groups: tuple[str, ...]  # "embedding" and/or "head + loss", when it holds them
    forward: float
    backward: float
    input_grad: float
    weight_grad: float
    transfer: float
    state_bytes: int
    optimizer_bytes: int
    activation_bytes: int

    @property
    def total_bytes(self) -> int:
        """Its Variables, optimizer state and activations held at once, per device."""
        return self.state_bytes + self.optimizer_bytes + self.activation_bytes

    @property
    def layers(self) -> str:
        """``"0-3 + embedding"``: the layers it holds and the groups with them."""
        span = str(self.first) if self.first == self.last else f"{self.first}-{self.last}"
        return " + ".join([span] * (self.last >= self.first) + list(self.groups))


@dataclasses.dataclass(frozen=True)
class Split:
    """One simulated candidate: ``sizes[j]`` layers on stage ``j`` under ``schedule``, with its
    predicted step time, peak bytes per device, why it was rejected (``""``: not) and ``table``,
    the schedule simulated (``mm.microbatch(schedule=split.table)`` runs it)."""

    sizes: tuple[int, ...]
    schedule: str
    num_microbatches: int
    virtual_stages: int
    predicted_seconds: float | None
    peak_bytes: int | None
    rejected: str = ""
    stages: tuple[StagePlan, ...] = dataclasses.field(default=(), compare=False, repr=False)
    table: sched.Schedule | None = dataclasses.field(default=None, compare=False, repr=False)


@dataclasses.dataclass
class PartitionResult:
    """The planned partition: ``rules`` for ``mm.init`` / ``mm.place``, ``best`` (the fastest
    :class:`Split` that fits), ``equal`` (the equal split under the same schedule; ``None`` when
    that is ``best``) and every ``candidates``, fastest first; ``str`` draws the table.

    Example (needs tasks on devices; see :func:`mmnnx.partition.partition`)::

        result = mm.schedules.partition(model, loss_fn, batch, tasks, optimizer=tx)
        model = mm.place(model, result.rules)
    """

    rules: list[tuple[str, Any]]
    best: Split
    equal: Split | None
    candidates: list[Split]
    layers: str  # where the layers are: "GPT.blocks"

    @property
    def sizes(self) -> tuple[int, ...]:
        """The number of layers on each stage."""
        return self.best.sizes

    @property
    def schedule(self) -> str:
        """The chosen schedule's name."""
        return self.best.schedule

    @property
    def num_microbatches(self) -> int:
        """The chosen microbatch count."""
        return self.best.num_microbatches

    @property
    def virtual_stages(self) -> int:
        """The chosen number of stages per task."""
        return self.best.virtual_stages

    @property
    def predicted_seconds(self) -> float:
        """The chosen split's predicted step time."""
        return self.best.predicted_seconds or 0.0

    @property
    def stages(self) -> tuple[StagePlan, ...]:
        """The chosen split's stages."""
        return self.best.stages

    def table(self, runners_up: int = 5) -> Tabulation:
        """The chosen split's stages, then ``runners_up`` other candidates and the equal split."""
        others = [c for c in self.candidates if c is not self.best][:runners_up]
        if self.equal is not None and self.equal not in others:
            others.append(self.equal)
        return render(
            _stages_table(self.best, self.layers),
            _candidates_table(self.best, others, self.equal),
        )

    def __str__(self) -> str:
        return str(self.table())

    def __repr__(self) -> str:
        best = self.best
        return (
            f"PartitionResult({self.layers} as {'/'.join(map(str, best.sizes))}, "
            f"{best.schedule}, M={best.num_microbatches}, V={best.virtual_stages}, predicted "
            f"{_ms(best.predicted_seconds)}; {len(self.candidates)} candidates)"
        )

    def _repr_html_(self) -> str:
        return self.table().html


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f} ms"


def _bytes(n: int | None) -> str:
    return "-" if n is None else format_bytes(n)


def _stages_table(best: Split, layers: str) -> Table:
    title = (
        f"mm.schedules.partition: {layers} as {'/'.join(map(str, best.sizes))} on "
        f"{len(best.sizes)} stages, {best.schedule}, M={best.num_microbatches}, predicted "
        f"{_ms(best.predicted_seconds)} per step (per microbatch below)"
    )
    table = Table(title=title, box=box.SQUARE)
    columns = ("stage", "task", "layers", "F", "B", "I", "W", "send")
    for name in (*columns, "params", "optimizer", "activations", "memory/device"):
        table.add_column(name, justify="left" if name in ("task", "layers") else "right")
    for s, stage in enumerate(best.stages):
        table.add_row(
            str(s),
            stage.task,
            stage.layers,
            *map(_ms, (stage.forward, stage.backward, stage.input_grad, stage.weight_grad)),
            _ms(stage.transfer) if s < len(best.stages) - 1 else "-",
            *map(_bytes, (stage.state_bytes, stage.optimizer_bytes)),
            *map(_bytes, (stage.activation_bytes, stage.total_bytes)),
        )
    return table


def _candidates_table(best: Split, others: Sequence[Split], equal: Split | None) -> Table:
    table = Table(title="runners-up", box=box.SQUARE)
    left = ("layers per stage", "schedule")
    for name in (*left, "M", "V", "predicted step", "peak memory/device"):
        table.add_column(name, justify="left" if name in left else "right")
    table.add_column("note")
    for c in (best, *others):
        note = "chosen" if c is best else c.rejected
        if c is equal:
            note = ", ".join(filter(None, ["equal split", note]))
        table.add_row(
            "/".join(map(str, c.sizes)),
            c.schedule,
            str(c.num_microbatches),
            str(c.virtual_stages),
            _ms(c.predicted_seconds),
            _bytes(c.peak_bytes),
            note,
        )
    return table
