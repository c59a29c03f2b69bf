"""The engine's records of a step's leaves: :class:`StepInput` per input leaf and
:class:`StepOutput` per output leaf, in order. Nothing here knows Flax NNX."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from jax.sharding import PartitionSpec

from mmnnx.errors import MPMDError
from mmnnx.sharding import Task, TaskStack


@dataclasses.dataclass(frozen=True)
class StepInput:
    """One input leaf of a step."""

    name: str  # its path, e.g. "arg0/blocks/0/attn/kernel"
    task: Task | None = None  # the task it is placed on; None: a batch, a counter
    stack: TaskStack | None = None  # the tasks its stacked layers are split over
    spec: PartitionSpec = PartitionSpec()  # its placement spec (a stacked Variable's)
    sharding: Any = None  # its layout (planned on where it is placed on a task)
    donated: bool = False  # the step may reuse its buffer
    shape: tuple[int, ...] = ()
    dtype: Any = None
    weak_type: bool = False  # a Python scalar (or weakly typed array): promotes as jax.jit's do

    @property
    def placed(self) -> bool:
        """Whether it is placed on a task or a stack (its layout is part of the plan)."""
        return self.task is not None or self.stack is not None

    @property
    def task_sharding(self) -> Any:
        """Its layout where it is placed on a task (the layout the plan keeps), else None."""
        return self.sharding if self.task is not None else None


@dataclasses.dataclass(frozen=True)
class StepOutput:
    """Where one output leaf of a step ends."""

    home: Task | TaskStack | None = None  # the task (or stack) of the Variable it belongs to
    spec: PartitionSpec = PartitionSpec()  # that Variable's placement spec
    sharding: Any = None  # the layout it must end in; None: wherever it is made

    @property
    def task(self) -> Task | None:
        return self.home if isinstance(self.home, Task) else None


def check_homes(inputs: Sequence[StepInput]) -> set:
    """Raises if a placed input's array lives elsewhere than its task (or stack) says; returns the
    devices the placed inputs' tasks own."""
    for item in inputs:
        devices = item.sharding.device_set if item.sharding is not None else None
        home = item.task or item.stack
        if home is not None and devices != set(home.jax_mesh.devices.flat):
            raise MPMDError(
                f"mm.jit: {item.name!r} is placed on task {home.name!r} but its array lives "
                f"on devices {sorted(d.id for d in devices)}; re-run mm.place after moving it"
            )
        if item.stack is not None and item.sharding != item.stack.sharding(item.spec):
            raise MPMDError(
                f"mm.jit: {item.name!r} is stacked over tasks {item.stack.name!r} but its "
                f"array is laid out as {item.sharding}; re-run mm.place after moving it"
            )
    owned: set = set()
    for home in dict.fromkeys(h for i in inputs for h in (i.task, i.stack) if h is not None):
        owned.update(home.jax_mesh.devices.flat)
    return owned
