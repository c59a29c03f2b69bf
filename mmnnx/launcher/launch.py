"""``mmnnx launch``: N local processes of one command, joined by ``mm.distributed.initialize``.

Like ``torchrun`` on one machine: a coordinator on 127.0.0.1 with a free port, each process told
its rank through the environment, each output line prefixed with its rank; when one process
fails or stops responding the others are stopped at once (:mod:`~mmnnx.launcher.ranks`) and,
with ``max_restarts``, all of them are started again, or all but one that keeps failing, down to
``min_processes`` (:mod:`~mmnnx.launcher.membership`); none outlives the launcher (Ctrl-C
included).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import sys
import threading
from collections.abc import Sequence

from mmnnx._env import (
    COLLECTIVES,
    ENV_COLLECTIVES,
    ENV_COORDINATOR,
    ENV_HEARTBEAT,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    ENV_RESTART_COUNT,
)
from mmnnx.launcher.chatter import is_chatter
from mmnnx.launcher.membership import Membership
from mmnnx.launcher.ranks import Outcome, Ranks

_DEVICE_COUNT = re.compile(r"--xla_force_host_platform_device_count=\S+")
_DEFAULT_HEARTBEAT_S = 20


class LaunchError(RuntimeError):
    """The launcher could not start (bad arguments, a port in use, a command that does not
    exist)."""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _check_port(port: int) -> None:
    with socket.socket() as probe:
        # as the coordinator binds: a port left in TIME_WAIT by a previous attempt is free
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError as e:
            raise LaunchError(
                f"mmnnx launch: port {port} on 127.0.0.1 is in use ({e.strerror})"
            ) from None


def process_env(
    base: dict[str, str],
    rank: int,
    count: int,
    port: int,
    devices_per_process: int | None,
    collectives: str | None = None,
) -> dict[str, str]:
    """The environment of process ``rank``: where the coordinator is, who it is, (unless
    ``JAX_PLATFORMS`` names an accelerator) ``devices_per_process`` simulated CPU devices, and
    the ``collectives`` between processes (``mm.distributed.initialize``).

    Example:
        >>> env = process_env({}, 1, 2, 1234, 4)
        >>> env["MMNNX_PROCESS_ID"], env["XLA_FLAGS"], env["JAX_PLATFORMS"]
        ('1', '--xla_force_host_platform_device_count=4', 'cpu')
    """
    env = dict(base)
    env[ENV_COORDINATOR] = f"127.0.0.1:{port}"
    env[ENV_NUM_PROCESSES] = str(count)
    env[ENV_PROCESS_ID] = str(rank)
    if collectives is not None:
        env[ENV_COLLECTIVES] = collectives
    env["PYTHONUNBUFFERED"] = "1"
    if env.get("JAX_PLATFORMS", "cpu") in ("", "cpu"):
        flags = _DEVICE_COUNT.sub("", env.get("XLA_FLAGS", "")).strip()
        count_flag = f"--xla_force_host_platform_device_count={devices_per_process or 1}"
        env["XLA_FLAGS"] = f"{flags} {count_flag}".strip()
        env["JAX_PLATFORMS"] = "cpu"
    return env


def _check(
    command: Sequence[str],
    num_processes: int,
    devices_per_process: int | None,
    port: int | None,
    collectives: str | None,
    max_restarts: int,
    heartbeat_timeout_s: int | None,
) -> None:
    """Raises :class:`LaunchError` with one line for the first bad argument."""
    if num_processes < 1:
        raise LaunchError(f"mmnnx launch: -n must be at least 1, got {num_processes}")
    if devices_per_process is not None and devices_per_process < 1:
        raise LaunchError(
            f"mmnnx launch: --devices-per-process must be at least 1, got {devices_per_process}"
        )
    if port is not None and not 1 <= port <= 65535:
        raise LaunchError(f"mmnnx launch: --port must be in 1..65535, got {port}")
    if max_restarts < 0:
        raise LaunchError(f"mmnnx launch: --max-restarts must be at least 0, got {max_restarts}")
    if heartbeat_timeout_s is not None and heartbeat_timeout_s < 1:
        raise LaunchError(
            f"mmnnx launch: --heartbeat-timeout must be at least 1, got {heartbeat_timeout_s}"
        )
    if collectives is not None and collectives not in COLLECTIVES:
        raise LaunchError(
            f"mmnnx launch: --collectives must be one of {', '.join(COLLECTIVES)}, "
            f"got {collectives!r}"
        )
    if not command:
        raise LaunchError("mmnnx launch: give the command to run after --")
    if shutil.which(command[0]) is None:
        why = "not an executable file" if os.sep in command[0] else "no such command"
        raise LaunchError(f"mmnnx launch: cannot run {command[0]!r}: {why}")


def _check_min_processes(min_processes: int | None, num_processes: int, max_restarts: int) -> None:
    """Raises :class:`LaunchError` for a ``min_processes`` that cannot be: outside 1..N, or
    below N with too few restarts to ever drop a rank (two failures in a row, then a restart).

    Example:
        >>> _check_min_processes(3, 2, max_restarts=2)
        Traceback (most recent call last):
        ...
        mmnnx.launcher.launch.LaunchError: mmnnx launch: --min-processes must be in 1..2 (-n), got 3
    """
    if min_processes is None:
        return
    if not 1 <= min_processes <= num_processes:
        raise LaunchError(
            f"mmnnx launch: --min-processes must be in 1..{num_processes} (-n), got {min_processes}"
        )
    if min_processes < num_processes and max_restarts < 2:
        raise LaunchError(
            f"mmnnx launch: --min-processes {min_processes} drops a rank that fails first in two "
            f"attempts in a row, then restarts: it needs --max-restarts 2 or more, got "
            f"{max_restarts}"
        )


def launch(
    command: Sequence[str],
    num_processes: int,
    *,
    devices_per_process: int | None = None,
    port: int | None = None,
    collectives: str | None = None,
    max_restarts: int = 0,
    min_processes: int | None = None,
    heartbeat_timeout_s: int | None = None,
    verbose: bool = False,
) -> int:
    """Runs ``command`` as ``num_processes`` processes and returns the exit status: 0 when all
    succeed, else that of the first process to fail (1 for one that stopped responding); the
    others are stopped at once.

    A process stopped by a signal for ``heartbeat_timeout_s`` (default ``MMNNX_HEARTBEAT_TIMEOUT``
    or 20, also JAX's heartbeat timeout in the processes) has stopped responding. With
    ``max_restarts`` = N, a failed attempt is followed by a fresh one of all processes (a new
    coordinator port unless ``port`` is given), up to N times, one line each; the status is
    the last attempt's. Each process sees the attempt's number in ``MMNNX_RESTART_COUNT``.
    With ``min_processes`` = K below ``num_processes``, a rank that fails first in two attempts
    in a row is dropped, one line naming it, while more than K processes are left: the next
    attempts run one process fewer (ranks above it one lower), with its devices fewer.

    ``verbose``: print gloo's connection lines too, which are left out otherwise, and JAX's
    C++ information logs (``TF_CPP_MIN_LOG_LEVEL=0``; see ``chatter.py``).

    Raises:
        LaunchError: a bad argument, a port in use, or a command that cannot be run.

    Example:
        >>> import sys
        >>> launch([sys.executable, "-c", "pass"], 2)
        0
    """
    _check(
        command,
        num_processes,
        devices_per_process,
        port,
        collectives,
        max_restarts,
        heartbeat_timeout_s,
    )
    _check_min_processes(min_processes, num_processes, max_restarts)
    job = Membership(num_processes, num_processes if min_processes is None else min_processes)
    interrupted: list[int] = []
    wake = threading.Event()

    def on_signal(signum, frame):
        interrupted.append(signum)
        wake.set()

    base = dict(os.environ)
    if heartbeat_timeout_s is not None:
        base[ENV_HEARTBEAT] = str(heartbeat_timeout_s)
    heartbeat = int(base.get(ENV_HEARTBEAT, _DEFAULT_HEARTBEAT_S))
    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for attempt in range(max_restarts + 1):
            if port is None:
                now = free_port()  # a fresh one each attempt
            else:
                _check_port(now := port)
            count = job.count
            envs = [
                process_env(base, rank, count, now, devices_per_process, collectives)
                | {ENV_RESTART_COUNT: str(attempt)}
                | ({"TF_CPP_MIN_LOG_LEVEL": "0"} if verbose else {})
                for rank in range(count)
            ]
            outcome = _attempt(command, envs, heartbeat, wake, verbose)
            if outcome is None:
                name = signal.Signals(interrupted[0]).name
                sys.stderr.write(f"mmnnx launch: {name} received; stopped all {count} processes\n")
                return 128 + interrupted[0]
            if outcome.failure is None:
                return 0
            if attempt == max_restarts:
                sys.stderr.write(
                    f"mmnnx launch: {outcome.failure}; stopped the other {count - 1} process(es)\n"
                )
                return outcome.status
            sys.stderr.write(_restarting(outcome, job, attempt + 1, max_restarts))
            sys.stderr.flush()
        raise AssertionError("unreachable")
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _restarting(outcome: Outcome, job: Membership, restart: int, max_restarts: int) -> str:
    """The line saying that ``job`` restarts after the failed ``outcome``: with all its
    processes, or without the rank that failed first, when ``job`` drops it."""
    if not job.failed(outcome.rank):
        return (
            f"mmnnx launch: {outcome.failure}; restarting all {job.count} processes "
            f"(restart {restart} of {max_restarts})\n"
        )
    lower = ", the ranks above it one lower" if outcome.rank < job.count else ""
    return (
        f"mmnnx launch: {outcome.failure}, as in the attempt before: dropped rank "
        f"{outcome.rank}; restarting the other {job.count} process(es){lower} "
        f"(restart {restart} of {max_restarts})\n"
    )


def _attempt(
    command: Sequence[str],
    envs: list[dict[str, str]],
    heartbeat: int,
    wake: threading.Event,
    verbose: bool,
) -> Outcome | None:
    """One attempt: a process per environment, watched until it ends (``None``: interrupted)."""
    try:
        ranks = Ranks(command, envs, leave_out=None if verbose else is_chatter)
    except OSError as e:
        raise LaunchError(f"mmnnx launch: cannot run {command[0]!r}: {e.strerror}") from None
    try:
        return ranks.watch(heartbeat, wake)
    finally:
        ranks.stop()
