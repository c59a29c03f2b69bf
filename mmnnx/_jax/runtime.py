"""JAX's runtime beyond its public API: the distributed coordination service's client (its
key-value store and barriers), a transfer server on this process's devices, and whether JAX's
backends have started.

JAX exports ``jax.distributed.initialize`` and ``jax.experimental.transfer``, but not the
coordination service's client, nor whether its backends (and so its devices) exist yet.
"""

from __future__ import annotations

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
