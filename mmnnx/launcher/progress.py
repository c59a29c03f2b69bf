"""What each process of ``mmnnx launch`` last said it was doing, and ``--step-timeout``'s watchdog.

:func:`write` replaces the JSON record ``rank-<i>`` in the launcher's ``MMNNX_PROGRESS_DIR``
whole (``os.replace``), so the file's modification time is when the process last reported: the
:class:`Watchdog` needs one ``stat`` per process and poll. A process that reported dumps its
Python stacks to standard error on :data:`DUMP_SIGNAL` (``faulthandler``), which the launcher
sends to the process it names before stopping the job.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading
import time
from collections.abc import Collection

DUMP_SIGNAL = signal.SIGUSR1
"""The signal on which a process that reported dumps its Python stacks."""


@dataclasses.dataclass(frozen=True)
class Record:
    """What a process said it was doing: ``phase`` (e.g. ``"loading batch"``) of ``step``."""

    phase: str
    step: int | None = None
    finished: bool = False  # it makes no more steps: no longer watched

    def __str__(self) -> str:
        return self.phase if self.step is None else f"{self.phase} (step {self.step})"


def path(directory: str, rank: int) -> str:
    """The file of process ``rank``'s record."""
    return os.path.join(directory, f"rank-{rank}")


def write(directory: str, rank: int, record: Record) -> None:
    """Replaces process ``rank``'s record in ``directory`` by ``record`` (from any thread)."""
    target = path(directory, rank)
    temporary = f"{target}.{os.getpid()}.{threading.get_ident()}.tmp"
    with open(temporary, "w") as f:
        f.write(json.dumps(dataclasses.asdict(record)))
    os.replace(temporary, target)


def read(directory: str, rank: int) -> Record | None:
    """Process ``rank``'s last record, or ``None`` (none readable)."""
    try:
        with open(path(directory, rank)) as f:
            fields = json.loads(f.read())
        return Record(str(fields["phase"]), fields.get("step"), bool(fields.get("finished")))
    except (OSError, ValueError, KeyError, TypeError):
        return None


@dataclasses.dataclass(frozen=True)
class Stale:
    """A process that made no progress for ``seconds``; ``last``: its last record."""

    rank: int
    seconds: float
    last: Record | None

    def __str__(self) -> str:
        last = "unknown" if self.last is None else str(self.last)
        return f"rank {self.rank} made no progress for {self.seconds:.0f} s; last: {last}"


class Watchdog:
    """Finds the process whose last report in ``directory`` is the oldest, once ``timeout_s``
    old."""

    def __init__(self, directory: str, count: int, timeout_s: float):
        self.directory, self.count, self.timeout_s = directory, count, timeout_s

    def stale(self, ended: Collection[int] = ()) -> Stale | None:
        """The watched process (not ``ended``) silent the longest, if ``timeout_s`` or more."""
        now, ages = time.time(), {}
        for rank in range(self.count):
            if rank in ended:
                continue
            try:
                ages[rank] = now - os.stat(path(self.directory, rank)).st_mtime
            except OSError:
                continue  # not reported yet
        for rank in sorted(ages, key=ages.get, reverse=True):
            if ages[rank] < self.timeout_s:
                return None
            last = read(self.directory, rank)
            if last is None or not last.finished:
                return Stale(rank, ages[rank], last)
        return None
