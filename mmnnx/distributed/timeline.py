"""A step's timeline across processes: every process's events, on one clock.

Each process times its programs against its own ``time.perf_counter()``. The processes pass
:data:`_ROUNDS` barriers of the coordination service together right before the step's first
program is launched, each noting when it left each; for each process, how its notes differ from
process 0's, round by round, gives its clock's shift (the median over the rounds: a process
descheduled as it left one barrier, on a busy host, notes that round late), and the gathered
events are shifted so that 0 is the earliest step start of any process. The error is the spread
of the barrier's reply (about 0.1 ms on loopback, a network round trip between machines).
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
import time
from collections.abc import Callable
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
_ROUNDS = 5
_FAILED = "failed"


def _merged(parts: list) -> list[Event]:
    failed = [p for p, part in enumerate(parts) if part == _FAILED]
    if failed:
        raise MPMDError(
            f"timeline: the timed step failed on process {failed[0]}, so there is no timeline "
            "of the whole job (that process raised the error)"
        )
    reference = parts[0]["offsets"]
    shifts = [
        statistics.median(o - r for o, r in zip(part["offsets"], reference, strict=True))
        for part in parts
    ]
    events = [
        dataclasses.replace(e, start=e.start + s, end=e.end + s, launched=e.launched + s)
        for part, shift in zip(parts, shifts, strict=True)
        for s, e in ((shift - min(shifts), Event(*fields)) for fields in part["events"])
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
    """Runs ``run(timer)`` once, timed (``overlapped``: as a call runs); every process's events."""
    timer = OverlapTimer() if overlapped else BlockingTimer()
    several, zero = jax.process_count() > 1, []
    if several:
        begin = timer.begin

        def begin_together() -> None:
            for _ in range(_ROUNDS):
                runtime.barrier(_BARRIER.format(next(_rounds)), _WAIT_S)
                zero.append(time.perf_counter())
            begin()

        timer.begin = begin_together
    try:
        try:
            run(timer)
        finally:
            timer.stop()
    except BaseException:
        if several:  # only written (``to`` another process): its gather raises, naming this
            gather(_FAILED, to=1 if jax.process_index() == 0 else 0, what="timeline")
        raise
    if not several:
        return list(timer.events())
    if not zero:
        raise MPMDError("timeline: the step's timer never began (the step launched nothing)")
    mine = timer.events()
    parts = gather(
        {
            "offsets": [timer.started - z for z in zero],
            "events": [dataclasses.astuple(e) for e in mine],
        },
        what="timeline: the events of each process",
    )
    return _merged(parts)
