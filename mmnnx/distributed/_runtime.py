"""The one place mmnnx reaches into JAX's distributed runtime.

JAX exports ``jax.distributed.initialize`` and ``jax.experimental.transfer``, but not the
coordination service's client (its key-value store), which is reached here only.
"""

from __future__ import annotations

from typing import Any

import jax


def client() -> Any:
    """The coordination-service client of this process (``None`` before initialization)."""
    from jax._src import distributed

    return distributed.global_state.client


def coordinator_address() -> str | None:
    """The coordinator's host:port as JAX resolved it (given, or detected on a cluster)."""
    from jax._src import distributed

    return distributed.global_state.coordinator_address


def is_initialized() -> bool:
    return client() is not None


def key_value_set(key: str, value: bytes) -> None:
    client().key_value_set_bytes(key, value)


def key_value_get(key: str, timeout_s: float) -> bytes:
    """Waits up to ``timeout_s`` for ``key``; raises ``jax.errors.JaxRuntimeError`` after."""
    return client().blocking_key_value_get_bytes(key, int(timeout_s * 1000))


def key_value_delete(key: str) -> None:
    client().key_value_delete(key)


def start_transfer_server(address: str) -> Any:
    """A ``jax.experimental.transfer`` server on this process's devices, listening on
    ``address`` (host:0 picks a free port)."""
    from jax.experimental import transfer

    backend = jax.local_devices()[0].client
    return transfer.start_transfer_server(backend, address, [address])


def barrier(name: str, timeout_s: float) -> None:
    """Waits until every process reaches barrier ``name``."""
    client().wait_at_barrier(name, int(timeout_s * 1000))
