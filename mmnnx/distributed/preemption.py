"""``mm.distributed.Preemption``: a preemption notice (``SIGTERM``, as schedulers send before
they take the machines back) turned into one step at which every process of the job stops, so
that all save the same step.

With several processes it is JAX's preemption service (``jax.distributed`` catches ``SIGTERM``
in every process; when any process gets one, the processes agree in the background on the step
after the largest any of them had reached). In one process it is a ``SIGTERM`` handler, held
while the ``with`` block runs; the stop is at the step under way.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

from mmnnx._jax import runtime
from mmnnx.distributed import exits
from mmnnx.distributed.initialize import is_distributed


class Preemption:
    """Whether a preemption notice (``SIGTERM``) asks this job to stop, and at which step: every
    process calls :meth:`reached` after every step; all get ``True`` at the same step, then save it
    and end with :attr:`STATUS` (143), a normal end that waits for the others. In one process,
    entering installs a ``SIGTERM`` handler (main thread only) that leaving puts back.

    Example:
        >>> import mmnnx as mm
        >>> with mm.distributed.Preemption() as preemption:
        ...     for step in range(1, 4):
        ...         pass  # the step
        ...         if preemption.reached(step):
        ...             break  # save this step, then end
        >>> step
        3
    """

    STATUS = 128 + signal.SIGTERM
    """The exit status of a process stopped by a preemption notice, after saving."""

    def __init__(self) -> None:
        self._received = False
        self._before: Any = None
        self._installed = False

    def __enter__(self) -> Preemption:
        alone = not is_distributed()  # with several, JAX's own handler has SIGTERM
        if alone and threading.current_thread() is threading.main_thread():
            self._before = signal.signal(signal.SIGTERM, self._on_notice)
            self._installed = True
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._installed and signal.getsignal(signal.SIGTERM) == self._on_notice:
            self._put_back()
        self._installed = False

    def _on_notice(self, signum: int, frame: FrameType | None) -> None:
        self._received = True
        self._put_back()

    def _put_back(self) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if self._before is None else self._before)

    def reached(self, step: int) -> bool:
        """Whether every process stops after ``step`` (just finished) for a preemption notice."""
        if not is_distributed():
            return self._received
        if not runtime.reached_preemption_sync_point(step):
            return False
        exits.ending_together(self.STATUS)
        return True
