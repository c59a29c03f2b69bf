"""Examples (instruction, chat or text records already tokenized) laid out in rows of one
sequence length, one per row or packed several to a row, and served in batches by Grain."""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mmnnx.train.data import GrainBatches, grain_batches
from mmnnx.train.example_store import ExampleStore
from mmnnx.train.records import DataError, Example, held_out


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rows:
    """Examples laid out in rows of ``length`` tokens, one a row or packed several to a row:
    the layout (row ``r`` holds examples ``members[starts[r]:starts[r + 1]]`` of
    ``examples``, in that order) is computed from the examples' lengths alone, and a row's
    arrays are read from ``examples`` when asked for (:meth:`batch`, :meth:`arrays`), so a
    batch costs memory for its rows, not the dataset's. ``tokens``, ``targets`` (the loss
    counts the token: :attr:`Example.targets`), ``segments`` (1, 2, ... per example in its
    row, 0 for padding) and ``positions`` (restarting at 0 in each example) give every row;
    ``truncated`` counts the examples cut to ``length``.

    Example:
        >>> ex = [Example(np.arange(1, 4), np.ones(3, bool)), Example(np.arange(5, 7),
        ...       np.ones(2, bool))]
        >>> r = Rows.of(ex, length=6, pack=True)
        >>> r.tokens.tolist(), r.segments.tolist(), r.positions.tolist()
        ([[1, 2, 3, 5, 6, 0]], [[1, 1, 1, 2, 2, 0]], [[0, 1, 2, 0, 1, 0]])
        >>> Rows.of(ex, length=6).padding_fraction
        0.5833333333333334
    """

    examples: ExampleStore
    members: np.ndarray
    starts: np.ndarray
    length: int
    truncated: int = 0
    packed: bool = False
    pad_id: int = 0

    @classmethod
    def of(
        cls,
        examples: Sequence[Example] | ExampleStore,
        length: int,
        pack: bool = False,
        truncate: bool = True,
        pad_id: int = 0,
    ) -> Rows:
        """Lays ``examples`` (a list, or an :class:`ExampleStore` on disk) out: each in a row
        of its own, or (``pack``) several to a row, longest first, each into the fullest row
        it fits (best-fit decreasing).

        Raises:
            DataError: ``truncate=False`` and an example is longer than ``length``, naming it.
        """
        if not isinstance(examples, ExampleStore):
            examples = ExampleStore.of(examples)
        lengths = examples.lengths
        long = np.flatnonzero(lengths > length)
        if len(long) and not truncate:
            raise DataError(
                f"{examples.where(int(long[0]))}: {lengths[long[0]]} tokens, more than the "
                f"{length} a sequence holds (--seq-len + 1); drop --no-truncate to cut such "
                "examples"
            )
        if pack:
            layout = _best_fit(np.minimum(lengths, length).tolist(), length)
            members = np.fromiter((i for row in layout for i in row), np.int64)
            sizes = np.fromiter((len(row) for row in layout), np.int64, len(layout))
        else:
            members, sizes = np.arange(len(lengths)), np.ones(len(lengths), np.int64)
        return cls(
            examples=examples,
            members=members,
            starts=np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
            length=length,
            truncated=len(long),
            packed=pack,
            pad_id=pad_id,
        )

    def __len__(self) -> int:
        return len(self.starts) - 1

    def arrays(self, rows=slice(None)) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(tokens, targets, segments, positions)`` of rows ``rows``, each ``(rows,
        length)``, read from the examples."""
        picked = range(len(self))[rows] if isinstance(rows, slice) else np.asarray(rows)
        shape = (len(picked), self.length)
        tokens = np.full(shape, self.pad_id, np.int32)
        targets = np.zeros(shape, bool)
        segments = np.zeros(shape, np.int32)
        positions = np.zeros(shape, np.int32)
        for r, row in enumerate(picked):
            at = 0
            for s, i in enumerate(self.members[self.starts[row] : self.starts[row + 1]], 1):
                ids, marks = self.examples.read(int(i), self.length)
                span = slice(at, at + len(ids))
                tokens[r, span], targets[r, span], segments[r, span] = ids, marks, s
                positions[r, span] = np.arange(len(ids))
                at += len(ids)
        return tokens, targets, segments, positions

    @property
    def tokens(self) -> np.ndarray:
        """Every row's tokens (all rows read: for small data and tests)."""
        return self.arrays()[0]

    @property
    def targets(self) -> np.ndarray:
        """Every row's targets."""
        return self.arrays()[1]

    @property
    def segments(self) -> np.ndarray:
        """Every row's segments."""
        return self.arrays()[2]

    @property
    def positions(self) -> np.ndarray:
        """Every row's positions."""
        return self.arrays()[3]

    @property
    def padding_fraction(self) -> float:
        """The share of the rows' tokens that are padding."""
        size = len(self) * self.length
        used = int(np.minimum(self.examples.lengths, self.length).sum())
        return (size - used) / size if size else 0.0

    def mask(self, rows=slice(None)) -> np.ndarray:
        """Which predictions of rows ``rows`` the loss counts: of token ``j + 1`` from position
        ``j``, a target of the same example, ``(rows, length - 1)``."""
        _, targets, seg, _ = self.arrays(rows)
        return _mask(targets, seg)

    def batch(self, rows) -> dict[str, np.ndarray]:
        """Rows ``rows`` (a whole global batch) as a training batch for ``GPT.loss``:
        ``tokens`` ``(b, length)``, ``weights`` ``(b, length - 1)`` (the prediction of token
        ``j + 1`` from position ``j`` counts if it is a target of the same example; weighted
        ``b / count`` so that the mean over rows of each row's weighted sum is the mean over
        the ``count`` targets) and, packed, ``segments`` and ``positions``.

        Example:
            >>> r = Rows.of([Example(np.arange(1, 4), np.array([0, 1, 1], bool))], 4)
            >>> r.batch([0])["weights"].tolist()
            [[0.5, 0.5, 0.0]]
        """
        tokens, targets, seg, positions = self.arrays(rows)
        mask = _mask(targets, seg)
        count = mask.sum()
        weights = mask * np.float32(len(seg) / count) if count else np.zeros(mask.shape)
        batch = {"tokens": tokens, "weights": weights.astype(np.float32)}
        if self.packed:
            batch.update(segments=seg, positions=positions)
        return batch

    def has_targets(self) -> bool:
        """Whether any row has a prediction the loss counts (from the examples' first
        targets, reading no row)."""
        cut = np.minimum(self.examples.lengths, self.length)
        return bool((self.examples.firsts < cut).any())


def _mask(targets: np.ndarray, seg: np.ndarray) -> np.ndarray:
    return targets[:, 1:] & (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)


class ExampleDataset(GrainBatches):
    """Batches of ``batch_size`` rows of :class:`Rows` of ``seq_len + 1`` tokens, from a
    seeded shuffle (a fresh one per epoch) by Grain, its state part of a checkpoint as
    :class:`mmnnx.train.data.TextDataset`'s; :meth:`Rows.batch` dicts, this shard's rows of
    each global batch (weighted over the whole of it), each batch reading only its rows of
    ``examples`` (a list, or an :class:`~mmnnx.train.example_store.ExampleStore` on disk). A
    batch with no target is skipped and counted (``skipped``). ``eval_rows`` (else the last
    ``eval_fraction`` of the examples) give :meth:`eval_batches`.

    Example:
        >>> ex = [Example(np.arange(1, 6), np.ones(5, bool)) for _ in range(40)]
        >>> ds = ExampleDataset(ex, seq_len=7, batch_size=4)
        >>> b = next(ds)
        >>> b["tokens"].shape, b["weights"].shape, float(b["weights"].sum(-1).mean())
        ((4, 8), (4, 7), 1.0)
    """

    def __init__(
        self,
        examples: Sequence[Example] | ExampleStore,
        seq_len: int,
        batch_size: int,
        *,
        seed: int = 0,
        pack: bool = False,
        truncate: bool = True,
        eval_examples: Sequence[Example] | ExampleStore | None = None,
        eval_fraction: float = 0.05,
        shard_index: int = 0,
        shard_count: int = 1,
        pad_id: int = 0,
    ):
        examples, eval_examples = held_out(examples, eval_examples, eval_fraction)
        layout = dict(length=seq_len + 1, pack=pack, truncate=truncate, pad_id=pad_id)
        self.rows, self.eval_rows = Rows.of(examples, **layout), Rows.of(eval_examples, **layout)
        if len(self.rows) < batch_size:
            raise DataError(
                f"the data gives {len(self.rows)} training rows, fewer than one batch of "
                f"{batch_size}; use more data or a smaller --batch-size"
            )
        for rows, which, other in (
            (self.rows, "training example keeps a token to train on", ""),
            (
                self.eval_rows,
                "held-out example keeps a token to evaluate on",
                ", other --eval-data",
            ),
        ):
            if not rows.has_targets():
                raise DataError(
                    f"no {which} within {seq_len + 1} tokens (--seq-len + 1): the completions or "
                    f"assistant turns are cut off; use a larger --seq-len{other} or --train-on all"
                )
        if batch_size % shard_count:
            raise ValueError(f"batch_size {batch_size} is not divisible by {shard_count} shards")
        self.batch_size, self.seq_len, self.skipped = batch_size, seq_len, 0
        self.examples = len(examples)
        lengths = np.minimum(self.rows.examples.lengths, seq_len + 1)
        self.unpacked_padding = 1 - lengths.sum() / (len(examples) * (seq_len + 1))
        self._mine = slice(shard_index, None, shard_count)
        self._iterator, self._batches = grain_batches(np.arange(len(self.rows)), batch_size, seed)

    def __next__(self) -> dict[str, np.ndarray]:
        while True:
            batch = self.rows.batch(next(self._iterator))
            if batch["weights"].any():
                return {k: v[self._mine] for k, v in batch.items()}
            self.skipped += 1

    def summary(self) -> str:
        """One line: the examples, rows, those cut to length and the padding, packed and not."""
        rows, truncated = len(self.rows), self.rows.truncated
        padding = f"padding {self.unpacked_padding:.1%} one example a row"
        if self.rows.packed:
            padding += f", {self.rows.padding_fraction:.1%} packed"
        return (
            f"data: {self.examples} examples in {rows} rows of {self.seq_len + 1} tokens, "
            f"{truncated} cut to length; {padding}"
        )

    def eval_batches(self, count: int) -> list[dict[str, np.ndarray]]:
        """``count`` fixed batches of the held-out rows (the same every time; this shard's
        rows of them), or as many as the rows fill when they are fewer."""
        picks = self._eval_picks(count, len(self.eval_rows))
        return [{k: v[self._mine] for k, v in self.eval_rows.batch(p).items()} for p in picks]


def weighted_loss(logits: jax.Array, batch: dict) -> jax.Array:
    """A model's loss on a :meth:`Rows.batch` of one example a row, ``GPT.loss``'s for a
    model of one's own: ``logits`` ``(B, T, V)`` of ``batch["tokens"][:, :-1]``; the mean over
    rows of each row's ``weights``-weighted sum of next-token negative log-likelihoods (the
    mean over the whole global batch's trained tokens, whatever the microbatches).

    Example:
        >>> r = Rows.of([Example(np.arange(1, 4), np.array([0, 1, 1], bool))], 4)
        >>> float(weighted_loss(jnp.zeros((1, 3, 8)), r.batch([0])))  # uniform over 8: log 8
        2.079441547393799
    """
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, batch["tokens"][:, 1:, None], axis=-1)[..., 0]
    return jnp.mean(jnp.sum(batch["weights"] * nll, axis=-1))


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
