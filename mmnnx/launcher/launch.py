"""``mmnnx launch``: N local processes of one command, joined by ``mm.distributed.initialize``.

Like ``torchrun`` on one machine: a coordinator on 127.0.0.1 with a free port, each process told
its rank through the environment, each output line prefixed with its rank; one attempt is
:mod:`~mmnnx.launcher.ranks`, who restarts :mod:`~mmnnx.launcher.membership`, the signals
:mod:`~mmnnx.launcher.signals`. A Python command runs through
:mod:`~mmnnx.launcher.python_main`, so that ``raise SystemExit(n)`` is a failure too.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Sequence

from mmnnx._env import (
    COLLECTIVES,
    ENV_COLLECTIVES,
    ENV_COORDINATOR,
    ENV_HEARTBEAT,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    ENV_PROGRESS_DIR,
    ENV_RESTART_COUNT,
)
from mmnnx.launcher.chatter import is_chatter
from mmnnx.launcher.membership import Membership
from mmnnx.launcher.progress import Watchdog
from mmnnx.launcher.python_main import through_runner
from mmnnx.launcher.ranks import Outcome, Ranks
from mmnnx.launcher.signals import Interrupts

_DEVICE_COUNT = re.compile(r"--xla_force_host_platform_device_count=\S+")
_DEFAULT_HEARTBEAT_S = 20


class LaunchError(RuntimeError):
    """The launcher could not start (bad arguments, a port in use, no such command)."""


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
    """The environment of process ``rank``: coordinator, rank, simulated CPU devices,
    collectives."""
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


STEP_TIMEOUT_S = 3600
"""How long a process that reported progress may report nothing before the job ends: longer than
any one phase of a step (a first compile, an evaluation, a checkpoint save) is expected to take."""


def _least(bound: object, value: object) -> str:
    return f"must be at least {bound}, got {value}"


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
    step_timeout_s: int | None = STEP_TIMEOUT_S,
    verbose: bool = False,
) -> int:
    """Runs ``command`` as ``num_processes`` processes and returns the exit status: 0 when all
    succeed, else that of the first process to fail (1 for one that stopped responding); the
    others are stopped at once. The arguments are ``mmnnx launch``'s flags (its ``--help``
    says what each does); ``step_timeout_s`` 0 or ``None``: not watched. A ``SIGTERM`` is
    forwarded to every process, and the launcher waits for them to end on their own (the
    status is theirs); a second ``SIGTERM``, or ``SIGINT``, stops them at once (128 + the
    signal). A bad argument, a port in use or a command that cannot be run is a
    :class:`LaunchError`.

    Example:
        >>> import sys
        >>> launch([sys.executable, "-c", "pass"], 2)
        0
        >>> launch(["true"], 2, max_restarts=2, min_processes=3)
        Traceback (most recent call last):
        ...
        mmnnx.launcher.launch.LaunchError: mmnnx launch: --min-processes must be in 1..2 (-n), got 3
    """
    devices, beat, step = devices_per_process, heartbeat_timeout_s, step_timeout_s
    n, least = num_processes, num_processes if min_processes is None else min_processes
    program = command[0] if command else ""
    why = "not an executable file" if os.sep in program else "no such command"
    problems = (
        (n < 1, f"-n must be at least 1, got {n}"),
        (devices is not None and devices < 1, f"--devices-per-process {_least(1, devices)}"),
        (port is not None and not 1 <= port <= 65535, f"--port must be in 1..65535, got {port}"),
        (max_restarts < 0, f"--max-restarts {_least(0, max_restarts)}"),
        (beat is not None and beat < 1, f"--heartbeat-timeout {_least(1, beat)}"),
        (step is not None and step < 0, f"--step-timeout {_least('0 (0: not watched)', step)}"),
        (
            collectives is not None and collectives not in COLLECTIVES,
            f"--collectives must be one of {', '.join(COLLECTIVES)}, got {collectives!r}",
        ),
        (not command, "give the command to run after --"),
        (shutil.which(program) is None, f"cannot run {program!r}: {why}"),
        (not 1 <= least <= n, f"--min-processes must be in 1..{n} (-n), got {min_processes}"),
        (
            least < n and max_restarts < 2,
            f"--min-processes {min_processes} drops a rank that fails first in two attempts in "
            f"a row, then restarts: it needs --max-restarts 2 or more, got {max_restarts}",
        ),
    )
    for bad, problem in problems:  # the first bad argument, in one line
        if bad:
            raise LaunchError(f"mmnnx launch: {problem}")
    job = Membership(n, least)
    interrupts = Interrupts()
    base = dict(os.environ)
    if heartbeat_timeout_s is not None:
        base[ENV_HEARTBEAT] = str(heartbeat_timeout_s)
    heartbeat = int(base.get(ENV_HEARTBEAT, _DEFAULT_HEARTBEAT_S))
    previous = {s: signal.signal(s, interrupts.on_signal) for s in Interrupts.SIGNALS}
    progress = tempfile.mkdtemp(prefix="mmnnx-progress-") if step_timeout_s else None  # 0: off
    try:
        for attempt in range(max_restarts + 1):
            if port is None:
                now = free_port()  # a fresh one each attempt
            else:
                _check_port(now := port)
            count = job.count
            watchdog = None
            if progress is not None:  # a fresh folder each attempt
                directory = os.path.join(progress, f"attempt-{attempt}")
                os.mkdir(directory)
                watchdog = Watchdog(directory, count, step_timeout_s)
            envs = [
                process_env(base, rank, count, now, devices_per_process, collectives)
                | {ENV_RESTART_COUNT: str(attempt)}
                | ({"TF_CPP_MIN_LOG_LEVEL": "0"} if verbose else {})
                | ({ENV_PROGRESS_DIR: watchdog.directory} if watchdog else {})
                for rank in range(count)
            ]
            leave_out = None if verbose else is_chatter
            try:
                ranks = Ranks(through_runner(command), envs, leave_out=leave_out)
            except OSError as e:
                error = f"mmnnx launch: cannot run {command[0]!r}: {e.strerror}"
                raise LaunchError(error) from None
            try:
                outcome = ranks.watch(heartbeat, interrupts.stop, interrupts.notice, watchdog)
            finally:
                ranks.stop()
            status = _job_status(outcome, interrupts, count, attempt == max_restarts)
            if status is not None:
                return status
            sys.stderr.write(_restarting(outcome, job, attempt + 1, max_restarts))
            sys.stderr.flush()
        raise AssertionError("unreachable")
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if progress is not None:
            shutil.rmtree(progress, ignore_errors=True)


def _restarting(outcome: Outcome, job: Membership, restart: int, max_restarts: int) -> str:
    """The line saying that ``job`` restarts after the failed ``outcome`` (dropping a rank?)."""
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


def _job_status(
    outcome: Outcome | None, interrupts: Interrupts, count: int, last: bool
) -> int | None:
    """The exit status the job ends with after ``outcome`` (said), or ``None``: restart."""
    if outcome is None:  # stopped at once by a signal
        signum = interrupts.received[0]
        name = signal.Signals(signum).name
        sys.stderr.write(f"mmnnx launch: {name} received; stopped all {count} processes\n")
        return 128 + signum
    if interrupts.notice.is_set() and outcome.failure is None:
        sys.stderr.write(
            f"mmnnx launch: SIGTERM received; forwarded to all {count} processes, which ended "
            f"(exit status {outcome.status})\n"
        )
        return outcome.status
    if outcome.failure is None:
        return 0
    if last or interrupts.notice.is_set():  # no restart once preempted
        sys.stderr.write(
            f"mmnnx launch: {outcome.failure}; stopped the other {count - 1} process(es)\n"
        )
        return outcome.status
    return None
