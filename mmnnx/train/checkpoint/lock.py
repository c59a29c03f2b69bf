"""One writer per checkpoint directory: :class:`WriterLock`, an ``flock`` naming its holder."""

from __future__ import annotations

import contextlib
import fcntl
import gc
import json
import os
import socket
import time
import warnings
from typing import Any

from etils import epath

from mmnnx.train.checkpoint.layout import is_local

_WRITER_LOCK = ".mmnnx-writer.lock"


class CheckpointDirectoryBusyError(RuntimeError):
    """Another writer (a ``Checkpointer`` in this or another process) holds the checkpoint
    directory; the message names it (host, process id, since when)."""


class WriterLock:
    """An ``flock`` on ``.mmnnx-writer.lock`` naming its holder in the file, held until the
    ``Checkpointer`` closes; a dead holder's is taken over (saying so). While it is held, a
    temporary directory belongs to no save in progress. Remote directories have none."""

    def __init__(self, directory: epath.Path):
        self._directory = directory
        self._fd: int | None = None

    def hold(self) -> None:
        """Takes the lock unless held already (else ``CheckpointDirectoryBusyError``)."""
        if self._fd is not None or not is_local(self._directory):
            return
        self._directory.mkdir(parents=True, exist_ok=True)
        path = os.path.join(os.fspath(self._directory), _WRITER_LOCK)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        taken = _flock(fd)
        if not taken and _holder_pid(fd) == os.getpid():
            gc.collect()  # held here: maybe by a Checkpointer dropped unclosed, not yet collected
            taken = _flock(fd)
        if not taken:
            holder = _holder(fd)
            os.close(fd)
            raise CheckpointDirectoryBusyError(
                f"{self._directory} is being written by another Checkpointer "
                f"({holder or 'its holder did not say who it is'}); one writer per checkpoint "
                "directory: stop that one, or write to another directory"
            ) from None
        left = _holder(fd)
        since = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        me = {"host": socket.gethostname(), "pid": os.getpid(), "since": since}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        os.fsync(fd)
        self._fd = fd
        if left:
            warnings.warn(
                f"took over the writer lock of {self._directory} from {left}, which ended "
                "without closing its Checkpointer",
                stacklevel=4,
            )

    def release(self) -> None:
        if getattr(self, "_fd", None) is not None:
            fd, self._fd = self._fd, None
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)  # a clean end: the next holder takes over from no one
            os.close(fd)  # releases the lock

    def __del__(self) -> None:
        # a Checkpointer dropped without close() (a notebook cell run again) must not keep the
        # directory locked for the rest of the process: nothing could release it any more
        # not contextlib.suppress: at interpreter exit, modules may be gone
        try:  # noqa: SIM105
            self.release()
        except Exception:
            pass


def _flock(fd: int) -> bool:
    """Whether the exclusive ``flock`` on ``fd`` was taken (without waiting)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _said(fd: int) -> dict[str, Any]:
    """What the lock file says of its holder (``host``, ``pid``, ``since``); ``{}`` if nothing
    readable."""
    try:
        said = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}
    return said if isinstance(said, dict) else {}


def _holder_pid(fd: int) -> int | None:
    """The process id the lock file names, if it names one on this host."""
    said = _said(fd)
    return said.get("pid") if said.get("host") == socket.gethostname() else None


def _holder(fd: int) -> str:
    said = _said(fd)
    if not {"pid", "host", "since"} <= said.keys():
        return ""
    return f"process {said['pid']} on host {said['host']}, since {said['since']}"
