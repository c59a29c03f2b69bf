"""Leaving a run of several processes: a failing process ends within seconds, a finishing one
waits for the others, and a process waiting for one that has left says so and ends instead of
hanging.

Each process publishes how it leaves under ``mmnnx/exit/<process>`` in the coordination
service's key-value store: ``failed`` (an uncaught exception, ``sys.exit`` with a failing status,
or :func:`fail`) or ``leaving``, with how many messages it offered each process
(``leaving {"0": 17}``). A failing process waits at JAX's shutdown barrier 5 s at most (not
300 s), and only for peers that fail or leave with it; ``mmnnx launch`` then stops the others,
else each fails when it next waits for it. Python 3.11 keeps a ``sys.exit`` status nowhere an
exit handler can read it, hence the wrapped ``sys.exit`` (docs/distributed.md, "Failures", says
what was measured).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Sequence
from typing import NoReturn

import jax

from mmnnx._jax import runtime
from mmnnx.distributed.progress import progress
from mmnnx.errors import MPMDError

_PREFIX = "mmnnx/exit/"
FAILED = b"failed"
LEAVING = b"leaving"
_SLICE_S = 0.5  # how often a wait looks at whether the process it waits for has left
_EXIT_WAIT_S = 300.0  # how long a process ending normally waits for the others
_SAID_WAIT_S = 2.0  # how long a failing process waits for the others to say how they leave
_SHUTDOWN_WAIT_S = 5.0  # then how long it waits for them at JAX's shutdown barrier
_AFTER_S = 2.0  # then how long it stays, so that the process that left ends first


class PeerExitedError(MPMDError):
    """This process waited for process ``peer``, which had ended: ``failed`` (an uncaught
    exception, or :func:`fail`) or not (its script returned or called ``sys.exit(0)``)."""

    def __init__(self, what: str, peer: int, failed: bool):
        self.peer, self.failed = peer, failed
        super().__init__(
            f"{what}: process {peer} {_how(failed)} while this process waited for it; see its "
            "output (every process must make the same mm.jit and mm.distributed calls)"
        )


def _how(failed: bool) -> str:
    return "failed" if failed else "ended (its script returned or called sys.exit(0))"


def _key(process: int) -> str:
    return f"{_PREFIX}{process}"


def _left(process: int) -> tuple[bytes, dict[int, int]] | None:
    """How ``process`` left and the messages it offered each process; ``None`` while it runs."""
    value = runtime.key_value_try_get(_key(process))
    if value is None:
        return None
    how, _, offers = value.partition(b" ")
    return how, {int(p): n for p, n in json.loads(offers or b"{}").items()}


def wait_for(key: str, peer: int, timeout_s: float, what: str) -> bytes:
    """The value of ``key``, which process ``peer`` sets, as soon as it is set; raises
    :class:`PeerExitedError` once ``peer`` left without setting it, ``TimeoutError`` after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        slice_s = max(min(_SLICE_S, deadline - time.monotonic()), 0.001)
        try:
            return runtime.key_value_get(key, slice_s)
        except jax.errors.JaxRuntimeError as e:
            if not runtime.is_timeout(e):
                raise
        left = _left(peer)
        if left is not None:
            value = runtime.key_value_try_get(key)  # set just before it left
            if value is not None:
                return value
            raise PeerExitedError(what, peer, failed=left[0] == FAILED)
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what}: process {peer} did not answer within {timeout_s:.0f} s")


# Messages between processes (mmnnx.distributed.transport tells them), for the watch.
_lock = threading.Lock()
_offered: dict[int, int] = {}  # peer -> messages offered to it so far
_awaited: list[tuple[int, int, list[jax.Array]]] = []  # (peer, message, arrays) not yet ready
_lost: set[int] = set()  # peers a transfer from which failed


def offered(peer: int, count: int) -> None:
    """Notes that this process has offered ``count`` messages to ``peer`` so far."""
    with _lock:
        _offered[peer] = count


def lost(peer: int) -> None:
    """Notes that a transfer from ``peer`` failed: this process's failure then follows its."""
    with _lock:
        _lost.add(peer)


def _follows_another() -> bool:
    """Whether a transfer from another process failed, or another said it failed."""
    with _lock:
        if _lost:
            return True
    with contextlib.suppress(Exception):  # the coordination service may be gone already
        me = _key(jax.process_index())
        left = runtime.key_value_dir_get(_PREFIX)
        return any(how.startswith(FAILED) for key, how in left.items() if key != me)
    return False


def awaiting(peer: int, message: int, arrays: Sequence[jax.Array]) -> None:
    """Notes ``arrays`` as message ``message`` from ``peer``, watched until ready."""
    with _lock:
        _awaited[:] = [entry for entry in _awaited if _pending(entry[2])]
        _awaited.append((peer, message, list(arrays)))


def _pending(arrays: list[jax.Array]) -> bool:
    for array in arrays:
        with contextlib.suppress(Exception):  # deleted or donated: not waited for
            if not array.is_ready():
                return True
    return False


def _never_coming() -> tuple[int, int, bool] | None:
    """A message this process waits for from a process that failed, or left without offering it:
    the process, the message, and whether it failed."""
    with _lock:
        _awaited[:] = [entry for entry in _awaited if _pending(entry[2])]
        first = {}
        for peer, message, _ in _awaited:
            first[peer] = min(message, first.get(peer, message))
    me = jax.process_index()
    for peer, message in first.items():
        left = _left(peer)
        if left is not None and (left[0] == FAILED or message >= left[1].get(me, 0)):
            return peer, message, left[0] == FAILED
    return None


_watch_turn = threading.Lock()  # held while the watch looks; taken for good at exit
_watching = threading.Event()


def _watch() -> None:
    """Ends this process when it waits, inside the runtime, for a message a process that left never
    offered."""
    while True:
        time.sleep(_SLICE_S)
        with _watch_turn:
            if not _watching.is_set():
                return
            with contextlib.suppress(Exception):  # the coordination service may be gone
                stuck = _never_coming()
                if stuck is not None:
                    peer, message, failed = stuck
                    sys.stderr.write(
                        f"mmnnx: process {jax.process_index()} waits for a value from process "
                        f"{peer} (message {message}), which {_how(failed)} without sending it; "
                        "ending this process (every process must make the same mm.jit and "
                        "mm.distributed calls)\n"
                    )
                    _fail_after_peer()


_failure: list[BaseException] = []  # a failing status given to sys.exit
_together: list[int] = []  # the status every process ends with after a step they agreed on
_before: list[BaseException | None] = [None]  # sys.last_value at install: an earlier error


def install() -> None:
    """Makes this process leave the run as the module says (``initialize`` calls it)."""
    _before[0] = getattr(sys, "last_value", None)
    exit_ = sys.exit

    def exit_noting_status(status=None):
        if status not in (None, 0):
            _failure.append(SystemExit(status))
        exit_(status)

    sys.exit = exit_noting_status
    atexit.register(_at_exit)  # after JAX's own exit handler, so it runs before it
    _watching.set()
    threading.Thread(target=_watch, name="mmnnx-exits", daemon=True).start()


def fail(status: int = 1) -> NoReturn:
    """Ends this process with exit ``status``, telling the others it failed rather than waiting
    for them to finish, from any thread (as ``sys.exit(status)`` from the main thread); output is
    flushed, other exit handlers do not run. Where the others fail too, it waits up to 7 s for
    them to leave JAX's coordination service with it, and where its failure may follow another's,
    2 s more so that ``mmnnx launch`` names that one.

    Example::

        if not ok:
            mm.distributed.fail(3)
    """
    if runtime.is_initialized():
        _announce_failure()
    _end(status)


def ending_together(status: int) -> None:
    """Notes that every process ends now, at an agreed step: ending with ``status`` is a normal
    end."""
    _together.append(status)


def _at_exit() -> None:
    with _watch_turn:
        _watching.clear()
    # sys.last_value, set before exit handlers: the exception that ended the main thread
    last = getattr(sys, "last_value", None)
    failure = _failure[0] if _failure else (None if last is _before[0] else last)
    if isinstance(failure, SystemExit) and _status_of(failure) in _together:
        failure = None  # its status stays the one given to sys.exit
    if failure is None:  # the script ended, or called sys.exit(0)
        with contextlib.suppress(OSError):  # not stuck: --step-timeout stops watching it
            progress("ended, waiting for the other processes", finished=True)
        with _lock:
            offers = json.dumps({str(p): n for p, n in _offered.items()})
        _announce(LEAVING + b" " + offers.encode())
        _wait_for_everyone()
        return
    if isinstance(failure, PeerExitedError):
        _fail_after_peer()
    _announce_failure()
    _end(_status_of(failure))


def _announce_failure() -> None:
    _announce(FAILED)
    follows = _follows_another()
    _leave_the_service()
    if follows:
        time.sleep(_AFTER_S)  # so that the launcher finds the other first


def _leave_the_service() -> None:
    """Once every process has said how it leaves (within ``_SAID_WAIT_S``), waits at JAX's
    shutdown barrier, at most ``_SHUTDOWN_WAIT_S``, for them to leave the coordination service
    too: a process still connected when process 0, which holds the service, ends prints JAX's
    ``Check failure`` stack and aborts. Processes failing together (an error each finds, a peer's
    failure each notices) meet there; one failing alone does not wait for the others."""
    if jax.process_count() > 1 and _everyone_said(_SAID_WAIT_S):
        done = threading.Thread(target=_shutdown, daemon=True)
        done.start()
        done.join(_SHUTDOWN_WAIT_S)


def _everyone_said(timeout_s: float) -> bool:
    """Whether every process says how it leaves within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(Exception):  # the coordination service may be gone
            if len(runtime.key_value_dir_get(_PREFIX)) >= jax.process_count():
                return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(_SLICE_S / 5)


def _status_of(failure: BaseException) -> int:
    """The exit status Python gives an uncaught ``failure``."""
    code = failure.code if isinstance(failure, SystemExit) else 1
    return code if isinstance(code, int) else 1


def _fail_after_peer() -> NoReturn:
    _announce(FAILED)
    _leave_the_service()  # where a process that left, or failed, waits for this one
    time.sleep(_AFTER_S)
    _end(1)


def _announce(how: bytes) -> None:
    with contextlib.suppress(Exception):  # the coordination service may be gone already
        runtime.key_value_set(_key(jax.process_index()), how)


def _wait_for_everyone() -> None:
    count = jax.process_count()
    deadline = time.monotonic() + _EXIT_WAIT_S
    while time.monotonic() < deadline:
        try:
            left = runtime.key_value_dir_get(_PREFIX)
            if any(how.startswith(FAILED) for how in left.values()):
                return
            missing = [p for p in range(count) if _key(p) not in left]
            if not missing:
                return
            runtime.key_value_get(_key(missing[0]), _SLICE_S)
        except jax.errors.JaxRuntimeError as e:
            if not runtime.is_timeout(e):  # the coordination service is gone
                return


def _shutdown() -> None:
    with contextlib.suppress(Exception):
        jax.distributed.shutdown()


def _end(status: int) -> NoReturn:
    with contextlib.suppress(Exception):
        logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)
