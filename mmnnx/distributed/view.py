"""One process's share of a step when tasks belong to several processes.

Every process walks the same :class:`~mmnnx.mpmd.program.StepProgram` in the same global order.
It compiles and runs the actions of tasks holding its devices and skips the rest; each transfer
that crosses processes becomes a :class:`~mmnnx.distributed.routes.Route`, run by the processes
at both ends. A layout only the compiler knows (a result whose sharding XLA chose) is published
through the coordination service by the first process of the task that made it.
"""

from __future__ import annotations

import dataclasses
import functools
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from mmnnx._jax import runtime
from mmnnx.distributed.agree import check_same_everywhere
from mmnnx.distributed.routes import Route
from mmnnx.errors import MPMDError
from mmnnx.mpmd.program import Recv, Run
from mmnnx.sharding.arrays import placeholder, processes_of, put

_LAYOUT_KEY = "mmnnx/layout/{}/{}"
_OUTPUT_KEY = "mmnnx/output-layout/{}/{}"
_LAYOUT_WAIT_S = 600.0


def _spec_of(sharding: Any, task: Any) -> PartitionSpec:
    if isinstance(sharding, NamedSharding):
        return sharding.spec
    if isinstance(sharding, SingleDeviceSharding) and sharding.device_set == set(
        task.jax_mesh.devices.flat
    ):  # the one device of a one-device task
        return PartitionSpec()
    raise MPMDError(
        f"mm.jit: a result on task {task.name!r} has layout {sharding}, which cannot be sent to "
        "another process; pin it with mm.with_sharding_constraint"
    )


def _publish(key: str, layout: Any, task: Any) -> None:
    """Makes ``layout`` (of a value on ``task``) readable by every process under ``key``."""
    runtime.key_value_set(key, pickle.dumps(_spec_of(layout, task)))


class ProcessView:
    """The runner's per-action decisions for this process (see ``runner._LocalView``)."""

    def __init__(self, executable: Any):
        self.me = jax.process_index()
        self.graph = executable.graph
        self.round = check_same_everywhere(
            f"mm.jit: the plan of {executable.name}", executable.fingerprint()
        )
        self._processes: dict[Any, frozenset[int]] = {}
        self._here = {slot for slot, _ in executable.program.inputs}
        self._sent: set[int] = set()
        self._value_of: dict[int, tuple[int, Any]] = {}
        self._published_keys: set[str] = set()

    def processes(self, task: Any) -> frozenset[int]:
        found = self._processes.get(task)
        if found is None:
            found = self._processes[task] = processes_of(task.sharding())
        return found

    def runs(self, task: Any) -> bool:
        return self.me in self.processes(task)

    def skipped(self, run: Run, sharding_of: list[Any]) -> None:
        for slot, value, sharding in zip(
            run.outs, run.fragment.out_ids, run.out_shardings, strict=True
        ):
            if slot is None:  # only added to its sum, not returned
                continue
            sharding_of[slot] = sharding
            self._value_of[slot] = (value, run.task)

    def elsewhere(self, slots: Sequence[int], task: Any) -> None:
        """Values another process makes on ``task`` (a skipped action's), known by slot."""
        for slot in slots:
            self._value_of[slot] = (None, task)

    def without_sent_donations(self, run: Run) -> Run:
        donate = tuple(i for i in run.donate if run.ins[i] not in self._sent)
        return run if donate == run.donate else dataclasses.replace(run, donate=donate)

    def made(self, slots: Sequence[int], task: Any) -> None:
        self._here.update(slots)
        for slot in slots:
            self._value_of.setdefault(slot, (None, task))

    def source_layout(self, recv: Recv, sharding_of: list[Any]) -> Any:
        """The layout of the value ``recv`` moves, where this process takes part in moving it;
        read from the coordination service if only the source's processes compiled it."""
        layout = sharding_of[recv.from_slot]
        if recv.source is None:
            return layout
        source, target = self.processes(recv.source), self.processes(recv.target)
        key = _LAYOUT_KEY.format(self.round, recv.from_slot)
        if layout is not None:
            if self.me == min(source) and target - source and key not in self._published_keys:
                _publish(key, layout, recv.source)  # once, however many tasks it is sent to
                self._published_keys.add(key)
            return layout
        if self.me not in target:
            return None
        layout = sharding_of[recv.from_slot] = self._published(key, recv.source, "a value")
        return layout

    def receive(self, recv: Recv, sharding: Any, source_layout: Any) -> Callable | bool | None:
        target = self.processes(recv.target)
        self._value_of[recv.slot] = (recv.value, recv.target)
        if recv.source is None:
            if self.me not in target:
                return None
            self._here.add(recv.slot)
            # a step input, the same on every process, onto a layout spanning processes
            return True if target == {self.me} else functools.partial(put, sharding=sharding)
        source = self.processes(recv.source)
        if self.me not in source | target:
            return None
        if self.me in target:
            self._here.add(recv.slot)
        if source == target == {self.me}:
            return True
        if self.me in source:
            self._sent.add(recv.from_slot)
        shape, dtype = self.graph.shapes[recv.value], self.graph.dtypes[recv.value]
        return Route.plan(shape, dtype, source_layout, sharding)

    def put(self, value: Any, sharding: Any) -> jax.Array:
        return put(value, sharding)

    def holds(self, slot: int) -> bool:
        return slot in self._here

    def placeholder(self, slot: int, sharding_of: list[Any]) -> jax.Array:
        """A result of another process's task, laid out as it is there (a layout the compiler
        chose is read from the coordination service, where its first process publishes it)."""
        value, task = self._value_of[slot]
        sharding = sharding_of[slot]
        if sharding is None:
            sharding = self._published(_OUTPUT_KEY.format(self.round, slot), task, "a result")
        return placeholder(self.graph.shapes[value], self.graph.dtypes[value], sharding)

    def output_layout(self, slot: int, sharding_of: list[Any]) -> Any:
        """The task layout to present a result in where the compiler gave it one device's layout:
        other processes' placeholders of it are laid out on the task, and ``fetch`` tells a
        task's value from a process's own by that."""
        layout = sharding_of[slot]
        _, task = self._value_of.get(slot, (None, None))
        if slot not in self._here or task is None:
            return None
        processes = self.processes(task)
        if self.me == min(processes) and len(processes) < jax.process_count():
            _publish(_OUTPUT_KEY.format(self.round, slot), layout, task)
        return task.sharding() if isinstance(layout, SingleDeviceSharding) else None

    def _published(self, key: str, task: Any, what: str) -> NamedSharding:
        """The layout on ``task`` that its first process published under ``key``."""
        try:
            spec = pickle.loads(runtime.key_value_get(key, _LAYOUT_WAIT_S))
        except jax.errors.JaxRuntimeError as e:
            raise MPMDError(
                f"mm.jit: process {min(self.processes(task))} did not publish the layout of "
                f"{what} of task {task.name!r} within {_LAYOUT_WAIT_S:.0f} s"
            ) from e
        return task.sharding(spec)
