"""How many processes an ``mmnnx launch`` job goes on with after a failure (``--min-processes``).

The ranks of an attempt are always 0..n-1 (JAX numbers the processes so): after a drop, the
ranks above the dropped one go on one lower. On one machine a rank that keeps failing is what a
lost host is on a cluster (docs/distributed.md).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Membership:
    """``count`` processes, never fewer than ``minimum``."""

    count: int
    minimum: int
    last_failed: int | None = None

    def failed(self, rank: int | None) -> bool:
        """Records that ``rank`` (``None``: unknown) failed first in the attempt just ended; whether
        it is dropped (it did in the attempt before too, and more than ``minimum`` are left)."""
        again = rank is not None and rank == self.last_failed
        self.last_failed = rank
        if not again or self.count <= self.minimum:
            return False
        self.count -= 1
        self.last_failed = None
        return True
