"""``mm.distributed.progress``: what this process is doing, for ``mmnnx launch --step-timeout``.

A process that reports nothing for the launcher's ``--step-timeout`` seconds ends the job, named
with its last report (:mod:`mmnnx.launcher.progress` holds the record and the watchdog). Without
``--step-timeout`` (``MMNNX_PROGRESS_DIR`` unset) a report costs one dictionary lookup.
"""

from __future__ import annotations

import contextlib
import faulthandler
import io
import os
import sys

from mmnnx._env import ENV_PROCESS_ID, ENV_PROGRESS_DIR
from mmnnx.launcher.progress import DUMP_SIGNAL, Record, write

_dumps: list[bool] = []  # whether this process set DUMP_SIGNAL up (once)


def progress(phase: str, step: int | None = None, *, finished: bool = False) -> None:
    """Reports that this process now does ``phase`` (of ``step``): under ``mmnnx launch
    --step-timeout S``, a process reporting nothing new for S seconds ends the job, named with its
    last report and its Python stacks. ``finished=True``: no more steps, no longer watched. Without
    ``--step-timeout``, nothing; raises ``OSError`` where the launcher's directory is unwritable.

    Example:
        >>> import mmnnx as mm
        >>> for step in range(1, 3):
        ...     mm.distributed.progress("loading batch", step)
        ...     mm.distributed.progress("running the step", step)
    """
    directory = os.environ.get(ENV_PROGRESS_DIR)
    if not directory:
        return
    if not _dumps:  # DUMP_SIGNAL prints every thread's Python stack on standard error
        with contextlib.suppress(AttributeError, ValueError, io.UnsupportedOperation):
            faulthandler.register(DUMP_SIGNAL, file=sys.stderr, all_threads=True)
        _dumps.append(True)
    write(directory, int(os.environ.get(ENV_PROCESS_ID, "0")), Record(phase, step, finished))
