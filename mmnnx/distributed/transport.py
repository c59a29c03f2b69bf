"""Moving shards between processes: one ``jax.experimental.transfer`` server per process.

A sender offers arrays under an id (``await_pull`` keeps them alive until pulled); the receiver
pulls them by the same id. Ids are per-pair sequence numbers: every process issues a step's
transfers in the same order, so the n-th message from ``a`` to ``b`` has the same id on both
sides (cross-process ``jax.device_put`` pairs by issue order instead).
"""

from __future__ import annotations

import collections
import socket
from collections.abc import Sequence
from typing import Any

import jax

from mmnnx._jax import runtime
from mmnnx.distributed import exits
from mmnnx.distributed.exits import wait_for

_ADDRESS_KEY = "mmnnx/transfer-server/{}"
_PEER_WAIT_S = 120.0


def _host_for(coordinator: str | None) -> str:
    """The local address peers can reach: loopback, or the interface routing to ``coordinator``."""
    if coordinator is None:
        return "127.0.0.1"
    host = coordinator.rsplit(":", 1)[0].strip("[]")
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))  # no packet is sent; this picks the outgoing interface
        return probe.getsockname()[0]


class Transport:
    """This process's end of every cross-process transfer (made by :func:`transport`)."""

    def __init__(self, coordinator: str | None):
        self.me = jax.process_index()
        self.server = runtime.start_transfer_server(f"{_host_for(coordinator)}:0")
        runtime.key_value_set(_ADDRESS_KEY.format(self.me), self.server.address().encode())
        self._connections: dict[int, Any] = {}
        self._sequence: collections.Counter = collections.Counter()

    def _next(self, source: int, target: int) -> int:
        """The number of the next message from ``source`` to ``target`` (0, 1, ...)."""
        n = self._sequence[(source, target)]
        self._sequence[(source, target)] = n + 1
        return n

    def _connection(self, peer: int) -> Any:
        conn = self._connections.get(peer)
        if conn is None:
            key, what = _ADDRESS_KEY.format(peer), f"a transfer from or to process {peer}"
            address = wait_for(key, peer, _PEER_WAIT_S, what).decode()
            conn = self._connections[peer] = self.server.connect(address)
        return conn

    def send(self, peer: int, arrays: Sequence[jax.Array]) -> None:
        """Offers single-device ``arrays`` to process ``peer`` (which calls :meth:`receive`)."""
        n = self._next(self.me, peer)
        self.server.await_pull(_message_id(n, self.me, peer), list(arrays))
        exits.offered(peer, n + 1)

    def receive(self, peer: int, specs: Sequence[jax.ShapeDtypeStruct]) -> list[jax.Array]:
        """The arrays ``peer`` sends next, laid out as ``specs`` (single-device shardings)."""
        n = self._next(peer, self.me)
        arrays = self._connection(peer).pull(_message_id(n, peer, self.me), list(specs))
        exits.awaiting(peer, n, arrays)
        return arrays


def _message_id(n: int, source: int, target: int) -> int:
    return (n << 24) | (source << 12) | target


_transport: Transport | None = None


def transport() -> Transport:
    """The process's transport, started on first use (every process starts its own)."""
    global _transport
    if _transport is None:
        _transport = Transport(runtime.coordinator_address())
    return _transport
