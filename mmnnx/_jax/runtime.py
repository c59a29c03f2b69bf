"""JAX's runtime beyond its public API: the distributed coordination service's client (its
key-value store and barriers), a transfer server on this process's devices, whether JAX's
backends have started, and the size of the CPU client's thread pool.

JAX exports ``jax.distributed.initialize`` and ``jax.experimental.transfer``, but not the
coordination service's client, nor whether its backends (and so its devices) exist yet.
"""

from __future__ import annotations

import os
import re
from typing import Any

import jax
from jax._src import distributed, xla_bridge


def backends_started() -> bool:
    """Whether JAX's backends have started, after which ``XLA_FLAGS`` and ``jax_platforms``
    no longer take effect (``mm.distributed.backends_started``).

    Example:
        >>> import mmnnx as mm
        >>> _ = jax.devices()
        >>> mm.distributed.backends_started()
        True
    """
    return xla_bridge.backends_are_initialized()


_POOL_SIZES = ("PJRT_NPROC", "NPROC")  # what XLA's DefaultThreadPoolSize() reads, in order
_DEVICE_COUNT = re.compile(r"--xla_force_host_platform_device_count=(\d+)")


def cpu_pool_size() -> int:
    """The threads the CPU client will run programs and transfers on: ``PJRT_NPROC``, else
    ``NPROC``, else the cores this process may run on (XLA's ``DefaultThreadPoolSize``)."""
    for name in _POOL_SIZES:
        text = os.environ.get(name, "")
        if text.strip().lstrip("-").isdigit():
            return max(0, int(text))
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def local_cpu_devices() -> int:
    """The CPU devices this process's CPU client will make: ``jax_num_cpu_devices``, else
    ``--xla_force_host_platform_device_count`` in ``XLA_FLAGS``, else 1."""
    configured = getattr(jax.config, "jax_num_cpu_devices", None)
    if configured is not None and configured > 0:
        return configured
    found = _DEVICE_COUNT.findall(os.environ.get("XLA_FLAGS", ""))
    return int(found[-1]) if found else 1


def reserve_cpu_threads(devices: int) -> int | None:
    """Makes the CPU client's thread pool larger than ``devices`` (by 2), unless it is already or
    the backends have started (the pool is sized once, when the client is made): the new size,
    else ``None``.

    A CPU program with a collective between processes holds one pool thread per local device
    while it waits for the other processes to reach it; with no thread left, nothing else runs in
    this process meanwhile, not even the transfer server handing a value it offered to a peer,
    which that peer may need first (measured: 2 processes x 2 devices, a pool of 2 threads)."""
    wanted = devices + 2
    if backends_started() or cpu_pool_size() >= wanted:
        return None
    os.environ["PJRT_NPROC"] = str(wanted)
    return wanted


def client() -> Any:
    """The coordination-service client of this process (``None`` before initialization)."""
    return distributed.global_state.client


def coordinator_address() -> str | None:
    """The coordinator's host:port as JAX resolved it (given, or detected on a cluster)."""
    return distributed.global_state.coordinator_address


def is_initialized() -> bool:
    """Whether ``jax.distributed.initialize`` has connected this process."""
    return client() is not None


def key_value_set(key: str, value: bytes) -> None:
    client().key_value_set_bytes(key, value)


def key_value_get(key: str, timeout_s: float) -> bytes:
    """Waits up to ``timeout_s`` for ``key``; raises ``jax.errors.JaxRuntimeError`` after."""
    return client().blocking_key_value_get_bytes(key, int(timeout_s * 1000))


def key_value_try_get(key: str) -> bytes | None:
    """The value of ``key`` now, or ``None`` when it is not set."""
    try:
        return client().key_value_try_get_bytes(key)
    except jax.errors.JaxRuntimeError as e:
        if "NOT_FOUND" in str(e):
            return None
        raise


def key_value_dir_get(prefix: str) -> dict[str, bytes]:
    """Every key under ``prefix`` (ending in ``/``) with its value, now."""
    return dict(client().key_value_dir_get_bytes(prefix))


def is_timeout(error: Exception) -> bool:
    """Whether ``error`` (from :func:`key_value_get` or :func:`barrier`) is a timeout."""
    return "DEADLINE_EXCEEDED" in str(error)


def key_value_delete(key: str) -> None:
    client().key_value_delete(key)


def start_transfer_server(address: str) -> Any:
    """A ``jax.experimental.transfer`` server on this process's devices, listening on
    ``address`` (host:0 picks a free port)."""
    from jax.experimental import transfer  # noqa: PLC0415  (only with several processes)

    backend = jax.local_devices()[0].client
    return transfer.start_transfer_server(backend, address, [address])


def barrier(name: str, timeout_s: float) -> None:
    """Waits until every process reaches barrier ``name``."""
    client().wait_at_barrier(name, int(timeout_s * 1000))


def reached_preemption_sync_point(step: int) -> bool:
    """Whether every process has reached the step at which a preemption notice makes them all stop
    (JAX's preemption service; ``False`` when it is off); called by every process every step."""
    manager = distributed.global_state.preemption_sync_manager
    return manager is not None and manager.reached_sync_point(step)
