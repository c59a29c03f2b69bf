"""``Packing``: where each example of a packed sequence starts, for attention and RoPE."""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import struct

from mmnnx.modules.masks import causal_mask


@struct.dataclass
class Packing:
    """Several examples in one row: ``segments`` ``(batch, seq)`` numbers them (0: padding) and
    ``positions`` restarts at 0 in each, so each example is computed as if alone in its row.

    Example:
        >>> p = Packing(jnp.array([[1, 1, 2]]), jnp.array([[0, 1, 0]]))
        >>> p.visible().astype(int)[0, 0].tolist()
        [[1, 0, 0], [1, 1, 0], [0, 0, 1]]
    """

    segments: jax.Array
    positions: jax.Array

    @classmethod
    def of(cls, batch: Mapping[str, jax.Array]) -> Packing | None:
        """The packing of a batch dict's inputs (the first ``T`` of ``T + 1`` columns of its
        ``segments`` and ``positions``; ``None`` without them).

        Example:
            >>> Packing.of({"tokens": jnp.zeros((1, 3))}) is None
            True
        """
        if "segments" not in batch:
            return None
        return cls(batch["segments"][:, :-1], batch["positions"][:, :-1])

    def visible(self, sliding_window: int | None = None) -> jax.Array:
        """Causal and same-example, ``(batch, 1, seq, seq)``, within ``sliding_window`` when given.

        Example:
            >>> p = Packing(jnp.array([[1, 1, 1, 2, 2]]), jnp.array([[0, 1, 2, 0, 1]]))
            >>> p.visible(sliding_window=2).astype(int)[0, 0].tolist()
            [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 1, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]]
        """
        seq = self.segments.shape[-1]
        same = self.segments[:, None, :, None] == self.segments[:, None, None, :]
        visible = same & jnp.tril(jnp.ones((seq, seq), bool))
        if sliding_window is None:
            return visible
        return visible & causal_mask(self.positions, self.positions, sliding_window)[:, None]
