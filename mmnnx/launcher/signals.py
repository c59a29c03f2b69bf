"""The signals ``mmnnx launch`` takes, and what each asks of its processes.

``SIGINT`` (Ctrl-C) stops every process at once. ``SIGTERM`` is a scheduler's preemption
notice: it is forwarded to every process, which then ends as it sees fit (``mmnnx train`` saves
its step first); a second ``SIGTERM``, or a ``SIGINT`` after it, stops them at once.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType


class Interrupts:
    """The signals received so far, as two events the launcher's watch looks at."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.received: list[int] = []
        self.stop = threading.Event()  # stop every process now: SIGINT, or a second SIGTERM
        self.notice = threading.Event()  # forward SIGTERM to every process, let them end

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGTERM and not self.notice.is_set():
            self.notice.set()
            return
        self.received.append(signum)
        self.stop.set()
