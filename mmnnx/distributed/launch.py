"""``mmnnx launch``: N local processes of one command, joined by ``mm.distributed.initialize``.

Like ``torchrun`` on one machine: a coordinator on 127.0.0.1 with a free port, each process told
its rank through the environment, each output line prefixed with its rank; when one process
fails the others are stopped, and none outlives the launcher (Ctrl-C included).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from mmnnx.distributed.chatter import is_chatter
from mmnnx.distributed.initialize import (
    COLLECTIVES,
    ENV_COLLECTIVES,
    ENV_COORDINATOR,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
)

_DEVICE_COUNT = re.compile(r"--xla_force_host_platform_device_count=\S+")
_GRACE_S = 5.0


class LaunchError(RuntimeError):
    """The launcher could not start (a port in use, a command that does not exist)."""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _check_port(port: int) -> None:
    with socket.socket() as probe:
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


def _die_with_parent() -> None:  # runs in the child before exec
    os.setsid()
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: the launcher's own handlers still stop the children
        pass


def _pump(rank: int, stream, lock: threading.Lock, verbose: bool = False) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip("\n")
        if not verbose and is_chatter(line):  # gloo's connection lines (chatter.py)
            continue
        with lock:
            sys.stdout.write(f"[rank {rank}] {line}\n")
            sys.stdout.flush()
    stream.close()


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + _GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def launch(
    command: Sequence[str],
    num_processes: int,
    *,
    devices_per_process: int | None = None,
    port: int | None = None,
    collectives: str | None = None,
    verbose: bool = False,
) -> int:
    """Runs ``command`` as ``num_processes`` processes and returns the exit status: 0 when all
    succeed, else that of the first process to fail (the others are stopped).

    ``verbose``: print gloo's connection lines too, which are left out otherwise, and JAX's
    C++ information logs (``TF_CPP_MIN_LOG_LEVEL=0``; see ``chatter.py``).

    Example:
        >>> import sys
        >>> launch([sys.executable, "-c", "pass"], 2)
        0
    """
    if num_processes < 1:
        raise LaunchError(f"mmnnx launch: -n must be at least 1, got {num_processes}")
    if not command:
        raise LaunchError("mmnnx launch: give the command to run after --")
    if collectives is not None and collectives not in COLLECTIVES:
        raise LaunchError(
            f"mmnnx launch: --collectives must be one of {', '.join(COLLECTIVES)}, "
            f"got {collectives!r}"
        )
    if port is None:
        port = free_port()
    else:
        _check_port(port)
    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    interrupted: list[int] = []

    def on_signal(signum, frame):
        interrupted.append(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for rank in range(num_processes):
            env = process_env(
                dict(os.environ), rank, num_processes, port, devices_per_process, collectives
            )
            if verbose:  # (importing JAX here set it to 1 unless it was set)
                env["TF_CPP_MIN_LOG_LEVEL"] = "0"
            try:
                proc = subprocess.Popen(
                    list(command),
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    preexec_fn=_die_with_parent,
                )
            except OSError as e:
                _stop(procs)
                raise LaunchError(
                    f"mmnnx launch: cannot run {command[0]!r}: {e.strerror}"
                ) from None
            procs.append(proc)
            pump = threading.Thread(
                target=_pump, args=(rank, proc.stdout, lock, verbose), daemon=True
            )
            pump.start()
            pumps.append(pump)
        failed: tuple[int, int] | None = None
        while failed is None and not interrupted:
            codes = [p.poll() for p in procs]
            failed = next(((r, c) for r, c in enumerate(codes) if c is not None and c != 0), None)
            if all(c == 0 for c in codes):
                break
            time.sleep(0.05)
        if failed is not None or interrupted:
            _stop(procs)
        for pump in pumps:
            pump.join(timeout=_GRACE_S)
        if interrupted:
            name = signal.Signals(interrupted[0]).name
            sys.stderr.write(
                f"mmnnx launch: {name} received; stopped all {num_processes} processes\n"
            )
            return 128 + interrupted[0]
        if failed is not None:
            rank, code = failed
            sys.stderr.write(
                f"mmnnx launch: rank {rank} failed first ({_describe(code)}); stopped the "
                f"other {num_processes - 1} process(es)\n"
            )
            return code if code > 0 else 128 - code
        return 0
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        _stop(procs)
