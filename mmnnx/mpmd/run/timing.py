"""Timing a step's actions: one at a time (``timeline``) or as they overlap
(``overlapped_timeline``).

The runner tells a timer of every program it launches, value it moves between tasks and value
it receives from another process; :meth:`Timer.events` returns one :class:`Event` per pipeline
action, and one per transfer of an action's result between two ranks' devices (kind ``"T"``).

- :class:`BlockingTimer` waits for each program's and transfer's results before the next:
  each runs alone, so its duration is its own work.
- :class:`OverlapTimer` waits for nothing; one watcher thread per rank (and per pair of ranks,
  for transfers) notes when each program has finished, in launch order. An action starts at the
  latest of its launch, the end of its rank's previous program and the ends of what made its
  inputs; a program ended no later than any program that read its results or ran after it on
  its rank (a watcher can note an end late). A value received from another process is
  transferred from when the runner began receiving it to its arrival. Events count from
  :attr:`Timer.started`.
"""

from __future__ import annotations

import dataclasses
import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax

from mmnnx.mpmd.schedules import TRANSFER


@dataclasses.dataclass(frozen=True)
class Event:
    """One executed action, timed in seconds since the step started. ``fused``: it ran in one
    program with the other actions of its overlapped pair. ``rank``: the task whose devices ran
    it. ``launched``: when the host launched its program. A transfer (``kind`` ``"T"``) is the
    result of action ``carries`` of ``stage`` crossing from task ``source``'s devices to
    ``rank``'s."""

    task: str
    kind: str
    stage: int
    microbatch: int
    start: float
    end: float
    fused: bool = False
    rank: str = ""
    source: str = ""
    carries: str = ""
    launched: float = 0.0


class Transfer(NamedTuple):
    """What a move between two ranks' devices carries: the result of action ``(kind, stage)`` on
    ``microbatch``, from task ``source``'s devices to ``rank``'s, for task ``task``."""

    task: str
    rank: str
    source: str
    kind: str
    stage: int
    microbatch: int

    def event(self, start: float, end: float) -> Event:
        """This transfer as a timed :class:`Event`."""
        return Event(
            task=self.task,
            kind=TRANSFER,
            stage=self.stage,
            microbatch=self.microbatch,
            start=start,
            end=end,
            rank=self.rank,
            source=self.source,
            carries=self.kind,
            launched=start,
        )


def _stages(labels: Sequence[tuple]) -> list[tuple]:
    return [(label, m) for label, m in labels if label is not None]


def _record(
    events: list[Event],
    labels: Sequence[tuple],
    start: float,
    end: float,
    rank: str,
    launched: float,
) -> None:
    """Adds one event per pipeline action of a program; a later part of an action (a stage cut
    around a core) extends that action's event to ``end`` instead."""
    stages = _stages(labels)
    for (task, kind, stage, part), m in stages:
        if part:
            k = next(
                k
                for k in range(len(events) - 1, -1, -1)
                if (events[k].task, events[k].kind, events[k].stage, events[k].microbatch)
                == (task, kind, stage, m or 0)
            )
            events[k] = dataclasses.replace(events[k], end=end)
            continue
        events.append(
            Event(
                task=task,
                kind=kind,
                stage=stage,
                microbatch=m or 0,
                start=start,
                end=end,
                fused=len(stages) > 1,
                rank=rank,
                launched=launched,
            )
        )


class Timer:
    """What the runner tells of a step as it runs it (the base: nothing is timed)."""

    wants_witnesses = False
    """Whether :meth:`launched` wants a ``witness`` for programs whose results a later one
    deletes."""

    _start = 0.0

    @property
    def started(self) -> float:
        """``time.perf_counter()`` when the step started: the events' times count from it."""
        return self._start

    def begin(self) -> None:
        """The step starts now."""

    def launched(
        self,
        rank: str,
        labels: Sequence[tuple],
        in_slots: Sequence[int],
        out_slots: Sequence[int],
        outs: Sequence[Any],
        at: float,
        witness: Callable[[Any], Any] | None = None,
    ) -> None:
        """A program was launched at ``at`` on ``rank``'s devices; ``labels``: the pipeline
        actions it runs, ``(label or None, microbatch)`` each. ``witness``: a
        :func:`witness_for` its first result, when a later program may donate all of them."""

    def moved(
        self,
        from_slot: int,
        to_slot: int,
        transfer: Transfer | None = None,
        value: Any = None,
        at: float = 0.0,
    ) -> None:
        """The value in ``from_slot`` was moved into ``to_slot``; ``transfer``: what it carries
        when it crossed between two ranks' devices (its copy issued at ``at``)."""

    def received(self, to_slot: int, transfer: Transfer | None, at: float, arrived: float) -> None:
        """A value from another process, received from ``at`` to ``arrived``, is in ``to_slot``."""

    def stop(self) -> None:
        """The step is over, or failed: let go of anything still watching it."""

    def events(self) -> list[Event]:
        """The timed actions, once the step is over."""
        return []


class BlockingTimer(Timer):
    """Times each action alone: waits for its results before the runner goes on."""

    def __init__(self) -> None:
        self._events: list[Event] = []

    def begin(self) -> None:
        self._start = time.perf_counter()

    def launched(self, rank, labels, in_slots, out_slots, outs, at, witness=None) -> None:
        if not _stages(labels):
            return
        jax.block_until_ready(outs)
        ended = time.perf_counter()
        start = at - self._start
        _record(self._events, labels, start, ended - self._start, rank, start)

    def moved(self, from_slot, to_slot, transfer=None, value=None, at=0.0) -> None:
        if transfer is None:
            return
        jax.block_until_ready(value)
        self._events.append(transfer.event(at - self._start, time.perf_counter() - self._start))

    def received(self, to_slot, transfer, at, arrived) -> None:
        if transfer is not None:
            self._events.append(transfer.event(at - self._start, arrived - self._start))

    def events(self) -> list[Event]:
        return self._events


@jax.jit
def _first_element(x: jax.Array) -> jax.Array:
    return x.reshape(-1)[:1]


def witness_for(result: Any) -> Callable[[jax.Array], jax.Array]:
    """A compiled one-element copy of a result laid out as ``result``: launched right after a
    program, it ends when the program has, and nothing later deletes its result."""
    compiled = _first_element.lower(result).compile()
    # run once, so that the timed step does not pay for a program's first run
    sample = jax.device_put(jax.numpy.zeros(result.shape, result.dtype), result.sharding)
    jax.block_until_ready(compiled(sample))
    return compiled


@dataclasses.dataclass
class _Launch:
    """A program launched, or (``transfer``) a value moved between two ranks' devices."""

    rank: str
    labels: Sequence[tuple]
    launched_at: float
    made_from: set[int]
    ended_at: float = 0.0
    transfer: Transfer | None = None
    seen: bool = True  # a transfer: its arrival was seen (not taken first by a donating reader)


def _wait_for_any(outs: Sequence[Any]) -> None:
    """Waits until a program has run: for the first of its results not yet donated (one donated
    was read by a later program of the same device, so this one has ended too)."""
    for out in outs:
        if out.is_deleted():
            continue
        try:
            out.block_until_ready()
            return
        except jax.errors.JaxRuntimeError:
            if not out.is_deleted():  # donated while we waited: try the next
                raise


def _arrived(value: Any) -> bool:
    """Waits until a moved value is on its devices; ``False`` when a program it was donated to
    took it first (its arrival is then not seen)."""
    if value.is_deleted():
        return False
    try:
        value.block_until_ready()
    except jax.errors.JaxRuntimeError:
        if value.is_deleted():
            return False
        raise
    return True


class OverlapTimer(Timer):
    """Times the actions of a step that runs as a call runs it (see the module docstring).

    Python hands the interpreter lock between threads every 5 ms by default, so watcher threads
    would note an end that late: the switch interval is ``switch_interval`` while a step runs.
    """

    wants_witnesses = True

    def __init__(self, switch_interval: float = 1e-4) -> None:
        self._switch_interval = switch_interval
        self._saved_interval = sys.getswitchinterval()
        self._launches: list[_Launch] = []
        self._made_by: dict[int, int] = {}
        self._watchers: dict[str, tuple[queue.SimpleQueue, threading.Thread]] = {}
        self._failure: BaseException | None = None

    def begin(self) -> None:
        sys.setswitchinterval(self._switch_interval)
        self._start = time.perf_counter()

    def launched(self, rank, labels, in_slots, out_slots, outs, at, witness=None) -> None:
        made_from = {self._made_by[s] for s in in_slots if s in self._made_by}
        index = len(self._launches)
        self._launches.append(
            _Launch(rank=rank, labels=labels, launched_at=at, made_from=made_from)
        )
        for s in out_slots:
            self._made_by[s] = index
        if witness is not None:  # a later program deletes them: wait for a copy made now
            outs = [witness(outs[0])]
        self._watcher(rank).put((index, list(outs)))

    def moved(self, from_slot, to_slot, transfer=None, value=None, at=0.0) -> None:
        producer = self._made_by.get(from_slot)
        if transfer is None:
            if producer is not None:
                self._made_by[to_slot] = producer
            return
        made_from = {producer} if producer is not None else set()
        index = self._transferred(to_slot, transfer, at, made_from, seen=False)
        # one watcher per pair of ranks: a copy ends whatever the reader's devices are running
        self._watcher(f"{transfer.source}->{transfer.rank}").put((index, value))

    def received(self, to_slot, transfer, at, arrived) -> None:
        if transfer is not None:
            self._transferred(to_slot, transfer, at, set(), ended_at=arrived)

    def _transferred(self, to_slot, transfer, at, made_from, **more: Any) -> int:
        """Notes a transfer into ``to_slot``; returns its index among the launches."""
        self._made_by[to_slot] = index = len(self._launches)
        launch = _Launch(transfer.rank, (), at, made_from=made_from, transfer=transfer, **more)
        self._launches.append(launch)
        return index

    def _watcher(self, lane: str) -> queue.SimpleQueue:
        if lane not in self._watchers:
            waiting: queue.SimpleQueue = queue.SimpleQueue()
            thread = threading.Thread(
                target=self._watch, args=(waiting,), name=f"mmnnx-timer-{lane}", daemon=True
            )
            thread.start()
            self._watchers[lane] = (waiting, thread)
        return self._watchers[lane][0]

    def _watch(self, waiting: queue.SimpleQueue) -> None:
        while (item := waiting.get()) is not None:
            index, outs = item
            launch = self._launches[index]
            try:
                if launch.transfer is None:
                    _wait_for_any(outs)
                else:
                    launch.seen = _arrived(outs)
            except Exception as e:  # noqa: BLE001  raised by events(), in the caller's thread
                self._failure = self._failure or e
            launch.ended_at = time.perf_counter()

    def stop(self) -> None:
        """Ends the watchers once they noted every launch; restores the switch interval."""
        try:
            for waiting, _ in self._watchers.values():
                waiting.put(None)
            for _, thread in self._watchers.values():
                thread.join()
        finally:
            self._watchers.clear()
            sys.setswitchinterval(self._saved_interval)

    def events(self) -> list[Event]:
        self.stop()
        if self._failure is not None:
            raise self._failure
        launches = self._launches
        # a transfer whose arrival was not seen is counted in its reader, from its producer
        made_from = [
            {q for p in launch.made_from for q in (
                [p] if launches[p].seen else launches[p].made_from)}
            for launch in launches
        ]  # fmt: skip
        # a watcher can note an end late: a program ended before its readers and the next
        # program on its rank did, a transfer before its reader did
        ended = [launch.ended_at for launch in launches]
        next_on_rank: dict[str, int] = {}
        for k in range(len(launches) - 1, -1, -1):
            launch = launches[k]
            if not launch.seen:
                continue
            if launch.transfer is None:
                later = next_on_rank.get(launch.rank)
                if later is not None:
                    ended[k] = min(ended[k], ended[later])
                next_on_rank[launch.rank] = k
            for p in made_from[k]:
                ended[p] = min(ended[p], ended[k])
        previous_end: dict[str, float] = {}
        events: list[Event] = []
        for k, launch in enumerate(launches):
            program = launch.transfer is None
            after = previous_end.get(launch.rank, 0.0) if program else 0.0
            started = max(launch.launched_at, after, *(ended[p] for p in made_from[k]))
            start, end = started - self._start, ended[k] - self._start
            if program:
                previous_end[launch.rank] = ended[k]
                launched = launch.launched_at - self._start
                _record(events, launch.labels, start, end, launch.rank, launched)
            elif launch.seen:
                events.append(launch.transfer.event(start, end))
        return events
