"""``Packing``: where each example of a packed sequence starts, for attention and RoPE."""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import struct

from mmnnx.modules.masks import causal_mask


@struct.dataclass
class Packing:
    """Several examples in one row: ``segments`` ``(batch, seq)`` numbers them (1, 2, ...; 0
    is padding) and ``positions`` restarts at 0 in each. Attention sees only the keys of its
    own example (:meth:`visible`) and RoPE rotates by ``positions``: each example is computed
    as if it were alone in its row.

    Example:
        >>> p = Packing(jnp.array([[1, 1, 2]]), jnp.array([[0, 1, 0]]))
        >>> p.visible().astype(int)[0, 0].tolist()
        [[1, 0, 0], [1, 1, 0], [0, 0, 1]]
    """

    segments: jax.Array
    positions: jax.Array

    @classmethod
    def of(cls, batch: Mapping[str, jax.Array]) -> Packing | None:
        """The packing of the inputs of a batch dict with ``segments`` and ``positions`` of
        its ``(B, T + 1)`` tokens (``None`` without them): their first ``T`` columns.

        Example:
            >>> Packing.of({"tokens": jnp.zeros((1, 3))}) is None
            True
        """
        if "segments" not in batch:
            return None
        return cls(batch["segments"][:, :-1], batch["positions"][:, :-1])

    def visible(self, sliding_window: int | None = None) -> jax.Array:
        """Causal and same-example: ``(batch, 1, seq, seq)``, broadcast over heads; with a
        ``sliding_window`` ``w``, a query sees only the keys less than ``w`` positions before
        its own within its example (``causal_mask``).

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
