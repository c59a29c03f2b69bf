"""A step's timeline across processes: every process's events, on one clock.

Each process times its programs against its own ``time.perf_counter()``. The processes start
the timed step together at a barrier of the coordination service, right before its first
program is launched; the moment each leaves it is the common zero, and the gathered events are
shifted so that 0 is the earliest step start of any process. The error is the spread of the
barrier's reply (about 0.1 ms on loopback, a network round trip between machines).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

import jax

from mmnnx._jax import runtime
from mmnnx.distributed.gather import gather
from mmnnx.errors import MPMDError
from mmnnx.mpmd.run.timing import BlockingTimer, Event, OverlapTimer, Timer
from mmnnx.mpmd.schedules import TRANSFER

_BARRIER = "mmnnx/timeline/{}"
_WAIT_S = 300.0
_rounds = itertools.count()
_FAILED = "failed"


class JobTimeline:
    """Times one step on every process on a common clock; with one process it changes nothing.

    A collective around the same timed step. Leaving with an exception before :meth:`events`
    tells the others, whose :meth:`events` then raise :class:`MPMDError` naming this process.
    """

    def __init__(self) -> None:
        self._several = jax.process_count() > 1
        self._round = next(_rounds) if self._several else 0
        self._timer: _StartTogether | None = None
        self._gathered = False

    def __enter__(self) -> JobTimeline:
        return self

    def timer(self, timer: Timer) -> Timer:
        """``timer``, starting the step on every process at once (with one process, itself)."""
        if not self._several:
            return timer
        self._timer = _StartTogether(timer, _BARRIER.format(self._round))
        return self._timer

    def events(self, mine: Sequence[Event]) -> list[Event]:
        """Every process's events (``mine``: this one's) since the step's earliest start."""
        if not self._several:
            return list(mine)
        if self._timer is None or self._timer.zero is None:
            raise MPMDError("timeline: the step's timer was not made by JobTimeline.timer")
        self._gathered = True
        offset = self._timer.started - self._timer.zero  # the step's start on the common clock
        parts = gather(
            {"offset": offset, "events": [dataclasses.astuple(e) for e in mine]},
            what="timeline: the events of each process",
        )
        return _merged(parts)

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._several and error is not None and not self._gathered:
            self._gathered = True
            # only written (``to`` another process): the others' gather raises, naming this
            # process, and this one does not wait for theirs; its own error goes on
            other = 1 if jax.process_index() == 0 else 0
            gather(_FAILED, to=other, what="timeline")


class _StartTogether(Timer):
    """``inner``, its step begun once every process reached the barrier ``name``."""

    def __init__(self, inner: Timer, name: str) -> None:
        self.inner = inner
        self.name = name
        self.zero: float | None = None
        self.wants_witnesses = inner.wants_witnesses

    @property
    def started(self) -> float:
        return self.inner.started

    def begin(self) -> None:
        runtime.barrier(self.name, _WAIT_S)
        self.zero = time.perf_counter()
        self.inner.begin()

    def launched(self, *args: Any, **kwargs: Any) -> None:
        self.inner.launched(*args, **kwargs)

    def moved(self, *args: Any, **kwargs: Any) -> None:
        self.inner.moved(*args, **kwargs)

    def received(self, *args: Any, **kwargs: Any) -> None:
        self.inner.received(*args, **kwargs)

    def stop(self) -> None:
        self.inner.stop()

    def events(self) -> list[Event]:
        return self.inner.events()


def _merged(parts: list) -> list[Event]:
    failed = [p for p, part in enumerate(parts) if part == _FAILED]
    if failed:
        raise MPMDError(
            f"timeline: the timed step failed on process {failed[0]}, so there is no timeline "
            "of the whole job (that process raised the error)"
        )
    first = min(part["offset"] for part in parts)
    events = [
        dataclasses.replace(e, start=e.start + s, end=e.end + s, launched=e.launched + s)
        for part in parts
        for s, e in ((part["offset"] - first, Event(*fields)) for fields in part["events"])
    ]
    return _after_producers(events)


def _after_producers(events: list[Event]) -> list[Event]:
    """A transfer received from another process starts no earlier than the action that made
    its value ended there: the receiving process began waiting for it at the start it noted,
    maybe long before the value could leave."""
    ends = {(e.rank, e.kind, e.stage, e.microbatch): e.end for e in events if e.kind != TRANSFER}
    out = []
    for e in events:
        made = ends.get((e.source, e.carries, e.stage, e.microbatch))
        if e.kind == TRANSFER and made is not None and made > e.start:
            e = dataclasses.replace(e, start=min(made, e.end))
        out.append(e)
    return out


def timed(run: Callable[[Timer], Any], *, overlapped: bool) -> list[Event]:
    """Runs ``run(timer)`` once, timed by a :class:`~mmnnx.mpmd.run.timing.BlockingTimer` (each
    action alone) or, ``overlapped``, an :class:`~mmnnx.mpmd.run.timing.OverlapTimer` (as a
    call runs), and returns every process's events on one clock (:class:`JobTimeline`).
    """
    with JobTimeline() as job:
        timer = job.timer(OverlapTimer() if overlapped else BlockingTimer())
        try:
            run(timer)
        finally:
            timer.stop()
        return job.events(timer.events())
