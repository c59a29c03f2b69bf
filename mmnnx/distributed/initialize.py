"""Joining a multi-process run: ``mm.distributed.initialize``. Every process runs the same
script and the parts of each step on its own devices (JAX's multi-controller model); mmnnx adds
a transfer server per process (``jax.experimental.transfer``) for values between them."""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Sequence
from typing import Any

import jax

from mmnnx._env import (
    COLLECTIVES,
    ENV_COLLECTIVES,
    ENV_COORDINATOR,
    ENV_HEARTBEAT,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
)
from mmnnx._jax import runtime
from mmnnx.distributed import exits
from mmnnx.errors import MPMDError

_CLUSTER_SIZES = ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")  # SLURM's and Open MPI's


def _in_cluster() -> bool:
    sizes = [os.environ.get(variable, "") for variable in _CLUSTER_SIZES]
    return "JAX_COORDINATOR_ADDRESS" in os.environ or any(s.isdigit() and int(s) > 1 for s in sizes)


def _env_int(name: str) -> int:
    text = os.environ[name]
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"mm.distributed.initialize: {name}={text!r} is not an integer") from None


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    heartbeat_timeout_s: int | None = None,
    collectives: str | None = None,
    **jax_kwargs: Any,
) -> bool:
    """Joins this process to a multi-process run; returns whether there is more than one process.

    Sources, in order: the arguments; ``mmnnx launch``'s environment (``MMNNX_COORDINATOR``,
    ``MMNNX_NUM_PROCESSES``, ``MMNNX_PROCESS_ID``); a cluster's that ``jax.distributed.initialize``
    detects (SLURM, Open MPI, ``JAX_COORDINATOR_ADDRESS``); with none, a no-op. Call it before
    anything touches a device. ``heartbeat_timeout_s`` (default 20, or ``MMNNX_HEARTBEAT_TIMEOUT``):
    how soon the others stop after a process dies. ``collectives`` (default ``"none"``, or
    ``MMNNX_COLLECTIVES``): on CPU, ``"gloo"`` or ``"mpi"`` collectives between processes, which
    only a task spanning processes needs (they slow every collective on CPU, so they are off unless
    asked for). Other keyword arguments go to ``jax.distributed.initialize``.

    Example:
        >>> import mmnnx as mm
        >>> mm.distributed.initialize()  # alone: nothing to join
        False
    """
    if runtime.is_initialized():
        return jax.process_count() > 1
    if coordinator_address is None and ENV_COORDINATOR in os.environ:
        coordinator_address = os.environ[ENV_COORDINATOR]
        num_processes = _env_int(ENV_NUM_PROCESSES) if num_processes is None else num_processes
        process_id = _env_int(ENV_PROCESS_ID) if process_id is None else process_id
    if heartbeat_timeout_s is None:
        heartbeat_timeout_s = _env_int(ENV_HEARTBEAT) if ENV_HEARTBEAT in os.environ else 20
    if collectives is None:
        collectives = os.environ.get(ENV_COLLECTIVES, "none")
    if collectives not in COLLECTIVES:
        raise ValueError(
            f"mm.distributed.initialize: collectives={collectives!r} is not one of "
            f"{', '.join(COLLECTIVES)}"
        )
    kwargs: dict[str, Any] = {"heartbeat_timeout_seconds": heartbeat_timeout_s, **jax_kwargs}
    if coordinator_address is not None:
        if num_processes is None or process_id is None:
            raise ValueError(
                "mm.distributed.initialize: with a coordinator_address, give num_processes and "
                "process_id too (or start the script with `mmnnx launch`)"
            )
        if not 0 <= process_id < num_processes:
            raise ValueError(
                f"mm.distributed.initialize: process_id {process_id} is not in [0, {num_processes})"
            )
        if num_processes == 1:
            return False
        kwargs.update(
            coordinator_address=coordinator_address,
            num_processes=num_processes,
            process_id=process_id,
        )
        if coordinator_address.split(":")[0] in ("127.0.0.1", "localhost"):
            kwargs.setdefault("coordinator_bind_address", coordinator_address)
    elif not _in_cluster():
        return False
    jax.config.update(
        "jax_cpu_collectives_implementation", None if collectives == "none" else collectives
    )
    if collectives != "none":  # a program waiting at a collective holds a thread per device
        runtime.reserve_cpu_threads(runtime.local_cpu_devices())
    bind = kwargs.get("coordinator_bind_address")
    if process_id == 0 and bind is not None:
        _check_coordinator_port(bind)  # JAX's own failure here crashes the process at exit
    try:
        jax.distributed.initialize(**kwargs)
    except jax.errors.JaxRuntimeError as e:
        if "Failed to start RPC server" not in str(e):
            raise
        raise _port_in_use(kwargs.get("coordinator_address")) from e
    if jax.process_count() > 1:
        exits.install()
    return jax.process_count() > 1


def check_collectives_for(tasks: Sequence[Any]) -> None:
    """Raises for the first task spanning processes on CPU when collectives between them are off."""
    if jax.config.jax_cpu_collectives_implementation is not None:
        return
    for task in tasks:
        devices = list(task.jax_mesh.devices.flat)
        processes = sorted({d.process_index for d in devices})
        if len(processes) > 1 and devices[0].platform == "cpu":
            raise MPMDError(
                f"mm.jit: task {task.name!r} runs on devices of processes {processes}, whose "
                "programs need collectives between processes, and this job started without "
                "them: start it with mm.distributed.initialize(collectives='gloo') (mmnnx "
                "launch --collectives gloo), or give each task devices of one process"
            )


def _port_in_use(address: str | None) -> RuntimeError:
    return RuntimeError(
        f"mm.distributed.initialize: process 0 cannot start the coordinator on {address}: the "
        "port is in use (another run, or a leftover process); choose another port (mmnnx launch "
        "picks a free one)"
    )


def _check_coordinator_port(address: str) -> None:
    host, port = address.rsplit(":", 1)
    with socket.socket() as probe:
        try:
            probe.bind((host, int(port)))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise _port_in_use(address) from None
            raise


def is_distributed() -> bool:
    """Whether this process is one of several (``jax.process_count() > 1``).

    Example:
        >>> import mmnnx as mm
        >>> mm.distributed.is_distributed()
        False
    """
    return runtime.is_initialized() and jax.process_count() > 1
