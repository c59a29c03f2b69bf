"""What the runner needs of the other processes of a step: :class:`Peers`.

``mmnnx.distributed`` provides them (``jax.distributed``'s coordination service for layouts, a
transfer server for arrays); in one process a step has none.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import jax

from mmnnx.sharding import Task


class Peers(Protocol):
    """The other processes running one compiled step with this one.

    Layouts go by slot: every process lowers the same program, so a slot names one value
    everywhere. Arrays go by order: the n-th :meth:`send` to a peer is its n-th
    :meth:`receive` from this process.
    """

    def publish_layout(self, slot: int, task: Task, sharding: Any) -> None:
        """Makes the layout of the value in ``slot`` (on ``task``) readable by every process."""

    def layout(self, slot: int, task: Task) -> Any:
        """The layout on ``task`` that its first process published for ``slot``."""

    def send(self, peer: int, arrays: Sequence[jax.Array]) -> None:
        """Offers single-device ``arrays`` to process ``peer``, which receives them."""

    def receive(self, peer: int, specs: Sequence[jax.ShapeDtypeStruct]) -> list[jax.Array]:
        """The arrays ``peer`` sends next, laid out as ``specs`` (single-device shardings)."""
