"""One attempt of ``mmnnx launch``: N processes of a command, watched until all succeed, one
fails or stops responding, or the launcher is interrupted; then none of them is left running.

A thread waits for each process, so the process that failed first is the first by time, not
the lowest rank found failed. A process stopped by a signal (state ``T`` in ``/proc``) for
``stopped_after_s``, or found stopped when another fails (JAX's coordination service ends the
others when a process misses its heartbeats), has stopped responding.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence

from mmnnx.launcher.progress import DUMP_SIGNAL, Watchdog

_GRACE_S = 3.0  # how long a process has to end after SIGTERM before SIGKILL
_POLL_S = 0.25  # how often the launcher looks for stopped processes
_DUMP_S = 0.5  # how long a process named by the watchdog has to print its stacks
_ON_NOTICE = (128 + signal.SIGTERM, -signal.SIGTERM)  # exit statuses of a process ending on it


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How an attempt ended."""

    status: int  # 0, or the failed process's (128 + signal; 1 for one that stopped responding)
    failure: str | None = None  # what failed, e.g. ``rank 1 failed first (exit code 3)``
    rank: int | None = None  # the rank that failed first or stopped responding


def describe(code: int) -> str:
    """A process's exit status in words."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _status(code: int) -> int:
    return code if code >= 0 else 128 - code


def _die_with_parent() -> None:  # runs in the child before exec
    os.setsid()
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: the launcher's own handlers still stop the children
        pass


def stopped_groups(groups: Sequence[int]) -> set[int]:
    """Those of the process groups ``groups`` with a process stopped by a signal (state ``T`` or
    ``t`` in ``/proc/<pid>/stat``); empty where there is no ``/proc``."""
    wanted, found = set(groups), set()
    try:
        pids = [name for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return found
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue  # ended meanwhile
        state, group = fields[0], int(fields[2])
        if group in wanted and state in (b"T", b"t"):
            found.add(group)
    return found


class Ranks:
    """The processes of one attempt, rank ``i`` run with environment ``envs[i]``; each output line
    is prefixed ``[rank i]`` unless ``leave_out`` is true of it. Raises ``OSError`` (after
    stopping those already started) when ``command`` cannot be started."""

    def __init__(
        self,
        command: Sequence[str],
        envs: Sequence[dict[str, str]],
        leave_out: Callable[[str], bool] | None = None,
    ):
        self._leave_out = leave_out
        self._lock = threading.Lock()
        self._changed = threading.Event()
        self._exits: list[tuple[float, int, int]] = []  # (time, rank, code), in order
        self.procs: list[subprocess.Popen] = []
        self._threads: list[threading.Thread] = []
        for rank, env in enumerate(envs):
            try:
                proc = subprocess.Popen(
                    list(command),
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    preexec_fn=_die_with_parent,
                )
            except OSError:
                self.stop()
                raise
            self.procs.append(proc)
            for target in (self._pump, self._wait):
                thread = threading.Thread(target=target, args=(rank, proc), daemon=True)
                thread.start()
                self._threads.append(thread)

    def _pump(self, rank: int, proc: subprocess.Popen) -> None:
        for raw in iter(proc.stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            if self._leave_out is not None and self._leave_out(line):
                continue
            with self._lock:
                sys.stdout.write(f"[rank {rank}] {line}\n")
                sys.stdout.flush()
        proc.stdout.close()

    def _wait(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        with self._lock:
            self._exits.append((time.monotonic(), rank, code))
        self._changed.set()

    def watch(
        self,
        stopped_after_s: float,
        interrupted: threading.Event,
        notice: threading.Event | None = None,
        watchdog: Watchdog | None = None,
    ) -> Outcome | None:
        """Waits until every process succeeds, one fails, stops responding or makes no progress, or
        ``interrupted`` is set (``None``); then stops the others. Once ``notice`` is set,
        ``SIGTERM`` is forwarded to every process, and ending on it is no failure."""
        stopped_since: dict[int, float] = {}
        forwarded = False
        while True:
            self._changed.wait(_POLL_S)
            self._changed.clear()
            if interrupted.is_set():
                self.stop()
                return None
            if notice is not None and notice.is_set() and not forwarded:
                self._signal_all(signal.SIGTERM)
                forwarded = True
            with self._lock:
                exits = list(self._exits)
            now = time.monotonic()
            stopped = stopped_groups([p.pid for p in self.procs])
            for rank, proc in enumerate(self.procs):
                if proc.pid in stopped:
                    stopped_since.setdefault(rank, now)
                else:
                    stopped_since.pop(rank, None)
            # ending on a forwarded SIGTERM is no failure
            noticed = _ON_NOTICE if forwarded else ()
            failed = next(((r, code) for _, r, code in exits if code not in (0, *noticed)), None)
            silent = min(stopped_since, key=stopped_since.get, default=None)
            outcome = None
            if silent is not None and (
                failed is not None or now - stopped_since[silent] >= stopped_after_s
            ):
                seconds = now - stopped_since[silent]
                outcome = Outcome(1, f"rank {silent} stopped responding (stopped by a signal "
                                     f"for {seconds:.0f} s)", silent)  # fmt: skip
                if failed is not None:
                    outcome = Outcome(1, f"{outcome.failure}; rank {failed[0]} then failed "
                                         f"({describe(failed[1])})", silent)  # fmt: skip
            elif failed is not None:
                rank, code = failed
                outcome = Outcome(
                    _status(code), f"rank {rank} failed first ({describe(code)})", rank
                )
            elif len(exits) == len(self.procs):
                outcome = Outcome(max((_status(code) for _, _, code in exits), default=0))
            elif watchdog is not None:
                outcome = self._stale(watchdog, {rank for _, rank, _ in exits})
            if outcome is not None:
                self.stop()
                return outcome

    def _stale(self, watchdog: Watchdog, ended: set[int]) -> Outcome | None:
        """The outcome when ``watchdog`` finds a process not ``ended`` stale, its stacks printed."""
        stale = watchdog.stale(ended)
        if stale is None:
            return None
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.procs[stale.rank].pid, DUMP_SIGNAL)
        time.sleep(_DUMP_S)
        return Outcome(1, str(stale), stale.rank)

    def _signal_all(self, signum: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signum)

    def stop(self) -> None:
        """Stops every process still running (SIGKILL after ``_GRACE_S``), waits for its output."""
        running = [p for p in self.procs if p.poll() is None]
        stopped = stopped_groups([p.pid for p in running])
        for p in running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL if p.pid in stopped else signal.SIGTERM)
        deadline = time.monotonic() + _GRACE_S
        for p in running:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for thread in self._threads:
            thread.join(timeout=_GRACE_S)
