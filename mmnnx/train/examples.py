"""Examples (instruction, chat or text records already tokenized) laid out in rows of one
sequence length, one per row or packed several to a row, and served in batches by Grain."""

from __future__ import annotations

import bisect
import dataclasses

import numpy as np

from mmnnx.train.records import DataError, Example


@dataclasses.dataclass(frozen=True)
class Rows:
    """Examples laid out in rows of ``length`` tokens: ``tokens``, ``targets`` (the loss counts
    the token: :attr:`Example.targets`), ``segments`` (1, 2, ... per example in its row, 0 for
    padding) and ``positions`` (restarting at 0 in each example); ``truncated`` counts the
    examples cut to ``length``.

    Example:
        >>> ex = [Example(np.arange(1, 4), np.ones(3, bool)), Example(np.arange(5, 7),
        ...       np.ones(2, bool))]
        >>> r = Rows.of(ex, length=6, pack=True)
        >>> r.tokens.tolist(), r.segments.tolist(), r.positions.tolist()
        ([[1, 2, 3, 5, 6, 0]], [[1, 1, 1, 2, 2, 0]], [[0, 1, 2, 0, 1, 0]])
        >>> Rows.of(ex, length=6).padding_fraction
        0.5833333333333334
    """

    tokens: np.ndarray
    targets: np.ndarray
    segments: np.ndarray
    positions: np.ndarray
    truncated: int = 0

    @classmethod
    def of(
        cls,
        examples: list[Example],
        length: int,
        pack: bool = False,
        truncate: bool = True,
        pad_id: int = 0,
    ) -> Rows:
        """Lays ``examples`` out: each in a row of its own, or (``pack``) several to a row,
        longest first, each into the fullest row it fits (best-fit decreasing).

        Raises:
            DataError: ``truncate=False`` and an example is longer than ``length``, naming it.
        """
        truncated = sum(len(e.ids) > length for e in examples)
        if truncated and not truncate:
            e = next(e for e in examples if len(e.ids) > length)
            raise DataError(
                f"{e.where}: {len(e.ids)} tokens, more than the {length} a sequence holds "
                "(--seq-len + 1); drop --no-truncate to cut such examples"
            )
        cut = [(e.ids[:length], e.targets[:length]) for e in examples]
        layout = (
            _best_fit([len(ids) for ids, _ in cut], length)
            if pack
            else [[i] for i in range(len(cut))]
        )
        shape = (len(layout), length)
        tokens = np.full(shape, pad_id, np.int32)
        targets = np.zeros(shape, bool)
        segments = np.zeros(shape, np.int32)
        positions = np.zeros(shape, np.int32)
        for r, members in enumerate(layout):
            at = 0
            for s, i in enumerate(members, 1):
                ids, marks = cut[i]
                span = slice(at, at + len(ids))
                tokens[r, span], targets[r, span], segments[r, span] = ids, marks, s
                positions[r, span] = np.arange(len(ids))
                at += len(ids)
        return cls(tokens, targets, segments, positions, truncated)

    @property
    def padding_fraction(self) -> float:
        """The share of the rows' tokens that are padding."""
        return float((self.segments == 0).mean()) if self.segments.size else 0.0

    def batch(self, rows) -> dict[str, np.ndarray]:
        """Rows ``rows`` as a training batch: ``tokens``, ``segments`` and ``positions``
        (``(b, length)``) and ``mask`` (``(b, length - 1)``: the loss counts the prediction
        of token ``j + 1`` from position ``j``, a target of the same example)."""
        seg = self.segments[rows]
        mask = self.targets[rows][:, 1:] & (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)
        return {
            "tokens": self.tokens[rows],
            "segments": seg,
            "positions": self.positions[rows],
            "mask": mask,
        }


def _best_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, row), sorted
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        at = bisect.bisect_left(free, (lengths[i], -1))
        if at == len(free):
            rows.append([])
            room, row = capacity, len(rows) - 1
        else:
            room, row = free.pop(at)
        rows[row].append(i)
        if room - lengths[i] > 0:
            bisect.insort(free, (room - lengths[i], row))
    return rows
