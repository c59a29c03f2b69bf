"""Training text: the embedded public-domain text, and a deterministic, shardable, resumable
batch iterator (a Grain pipeline) whose state is part of a checkpoint."""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Iterator

import numpy as np

from mmnnx.train.corpus import CHUNK_BYTES, Paths, text_chunks, token_file
from mmnnx.train.tokenizers import ByteTokenizer, Tokenizer

TEXTS = pathlib.Path(__file__).parent / "texts"
EMBEDDED = TEXTS / "kjv_genesis_exodus.txt"


def embedded_text() -> str:
    """The text shipped with mmnnx: Genesis and Exodus (King James Version, public domain).

    Example:
        >>> embedded_text().startswith("In the beginning")
        True
    """
    return EMBEDDED.read_text(encoding="utf-8")


def load_text(paths: Paths) -> str:
    """Reads and joins UTF-8 text files: a path, a directory of ``*.txt`` files, or a list
    (the whole text in memory; :func:`mmnnx.train.corpus.token_file` streams it instead).

    Example:
        >>> import tempfile, os
        >>> d = tempfile.mkdtemp(); p = os.path.join(d, "a.txt")
        >>> _ = open(p, "w").write("abc")
        >>> load_text(d)
        'abc'
    """
    return "".join(text_chunks(paths))


class DataStateError(ValueError):
    """A data state :meth:`TextDataset.restore` cannot continue from: not one
    :meth:`TextDataset.state` gives; the message is one line naming the field."""


class _Windows:
    """Window ``i`` of ``tokens`` as int32, read lazily (a Grain data source)."""

    def __init__(self, tokens: np.ndarray, window: int):
        self._tokens, self._window = tokens, window

    def __len__(self) -> int:
        return len(self._tokens) // self._window

    def __getitem__(self, i: int) -> np.ndarray:
        w = self._window
        return np.asarray(self._tokens[i * w : (i + 1) * w], dtype=np.int32)


class GrainBatches:
    """Batches of a Grain iterator (``self._iterator`` of ``self._batches`` positions) whose
    state a checkpoint holds: what the datasets share."""

    def __iter__(self) -> Iterator:
        return self

    def __next__(self):
        return next(self._iterator)

    def state(self) -> dict:
        """The Grain iterator's state, to store in a checkpoint."""
        return self._iterator.get_state()

    def restore(self, state: dict) -> None:
        """Continues from a state returned by :meth:`state`, checked first: anything else leaves
        the iterator as it was.

        Raises:
            DataStateError: ``state`` is not one (e.g. a checkpoint of an mmnnx before Grain,
                or one edited by hand), naming the field at fault.

        Example:
            >>> ds = TextDataset(np.arange(1000), seq_len=7, batch_size=4)
            >>> ds.restore({"next_index": -5})  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            mmnnx.train.data.DataStateError: data state next_index -5 is not a position of the ...
        """
        if not isinstance(state, dict) or "next_index" not in state:
            raise DataStateError(
                f"data state {state!r} is not a Grain iterator's state (TextDataset.state() "
                "gives {'next_index': N}; an mmnnx before Grain saved others)"
            )
        index = state["next_index"]
        if not isinstance(index, int) or isinstance(index, bool):
            raise DataStateError(f"data state next_index {index!r} is not an integer")
        if not 0 <= index <= self._batches:
            raise DataStateError(
                f"data state next_index {index} is not a position of the batch stream "
                f"(0 to {self._batches})"
            )
        self._iterator.set_state(state)

    def _eval_picks(self, count: int, rows: int) -> list[np.ndarray]:
        """``count`` fixed batches of indices among ``rows`` held-out rows, the same each time,
        or as many as the rows fill when they are fewer: no row is evaluated twice, unless the
        rows fill less than one batch (which then takes them again in turn)."""
        size = self.batch_size
        whole = max(1, rows // size)
        return [np.arange(b * size, (b + 1) * size) % rows for b in range(min(count, whole))]


def grain_batches(source, rows: int, seed: int, shard_index: int = 0, shard_count: int = 1):
    """Batches of ``rows`` items of ``source``: a seeded shuffle, a fresh one per epoch, every
    ``shard_count``-th item from ``shard_index``; the iterator and how many positions it has."""
    import grain  # noqa: PLC0415  (imported with the first dataset)

    stream = grain.MapDataset.source(source).shuffle(seed=seed).repeat(None)
    mine = stream[shard_index::shard_count].batch(rows, drop_remainder=True)
    options = grain.ReadOptions(num_threads=1, prefetch_buffer_size=2)
    return iter(mine.to_iter_dataset(options)), len(mine)


@dataclasses.dataclass
class TextDataset(GrainBatches):
    """Fixed-length windows of a token stream, served in batches of shape ``(batch, seq_len + 1)``
    by a Grain pipeline.

    The last ``eval_fraction`` of the tokens is held out for evaluation. Training batches walk a
    seeded shuffle of the non-overlapping windows, a fresh one per epoch
    (``grain.MapDataset.source(...).shuffle(seed).repeat()``); ``state()`` is the Grain
    iterator's own state, so a run restored from a checkpoint continues with exactly the batches
    it would have seen. ``tokens`` may be a ``np.memmap`` (:func:`from_files`): windows are
    read from it as batches are made.

    Sharded (``shard_count > 1``), shard ``shard_index`` reads only its rows of each batch of
    ``batch_size``: rows ``shard_index::shard_count``, ``batch_size // shard_count`` of them,
    so the shards together give the one-shard batch; likewise for :meth:`eval_batches`.

    Example:
        >>> ds = TextDataset(np.arange(1000), seq_len=7, batch_size=4)
        >>> next(ds).shape
        (4, 8)
        >>> ds.state()
        {'next_index': 1}
        >>> next(TextDataset(np.arange(1000), seq_len=7, batch_size=4, shard_count=2)).shape
        (2, 8)
    """

    tokens: np.ndarray
    seq_len: int
    batch_size: int
    seed: int = 0
    eval_fraction: float = 0.05
    shard_index: int = 0
    shard_count: int = 1

    def __post_init__(self):
        if self.seq_len < 1 or self.batch_size < 1:
            raise ValueError("seq_len and batch_size must be >= 1")
        if not 0 < self.eval_fraction < 1:
            raise ValueError(f"eval_fraction must be in (0, 1), got {self.eval_fraction}")
        if not 0 <= self.shard_index < self.shard_count:
            raise ValueError(
                f"shard_index must be in [0, shard_count={self.shard_count}), "
                f"got {self.shard_index}"
            )
        if self.batch_size % self.shard_count:
            raise ValueError(
                f"batch_size {self.batch_size} is not divisible by shard_count {self.shard_count}"
            )
        if not isinstance(self.tokens, np.memmap):
            self.tokens = np.asarray(self.tokens, dtype=np.int32)
        window = self.seq_len + 1
        split = int(len(self.tokens) * (1 - self.eval_fraction))
        self._train, self._eval = self.tokens[:split], self.tokens[split:]
        self._windows = len(self._train) // window
        if self._windows < self.batch_size:
            raise ValueError(
                f"the text gives {self._windows} training windows of {window} tokens, fewer than "
                f"one batch of {self.batch_size}; use more text or a smaller seq_len/batch_size"
            )
        if len(self._eval) < window:
            raise ValueError(
                f"the held-out text ({len(self._eval)} tokens) is shorter than one window of "
                f"{window}; use more text or a larger eval_fraction"
            )
        self._iterator, self._batches = grain_batches(
            _Windows(self._train, window),
            self.batch_size // self.shard_count,
            self.seed,
            self.shard_index,
            self.shard_count,
        )

    @classmethod
    def from_text(cls, text: str, tokenizer: Tokenizer | None = None, **kwargs) -> TextDataset:
        """A dataset of ``text`` encoded with ``tokenizer`` (:class:`ByteTokenizer` if none)."""
        return cls((tokenizer or ByteTokenizer()).encode(text), **kwargs)

    @classmethod
    def from_files(
        cls,
        paths: Paths,
        tokenizer: Tokenizer,
        cache: str | pathlib.Path,
        chunk_bytes: int = CHUNK_BYTES,
        **kwargs,
    ) -> TextDataset:
        """A dataset of the text files ``paths``, tokenized a chunk at a time into a token file
        under ``cache`` and read from it as a ``np.memmap`` (:func:`mmnnx.train.corpus.token_file`):
        the whole text is never in memory.

        Example:
            >>> import tempfile, pathlib
            >>> d = pathlib.Path(tempfile.mkdtemp())
            >>> _ = (d / "a.txt").write_text("some text to train on\\n" * 50)
            >>> ds = TextDataset.from_files(d, ByteTokenizer(), d / "c", seq_len=7, batch_size=4)
            >>> type(ds.tokens).__name__, next(ds).shape
            ('memmap', (4, 8))
        """
        return cls(token_file(paths, tokenizer, cache, chunk_bytes), **kwargs)

    @property
    def batches_per_epoch(self) -> int:
        """Whole batches in one pass over the training windows."""
        return self._windows // self.batch_size

    def eval_batches(self, count: int) -> list[np.ndarray]:
        """``count`` fixed batches from the held-out text (the same every time; this shard's
        rows of them), or as many as its windows fill when they are fewer (``_eval_picks``).

        Example:
            >>> ds = TextDataset(np.arange(1000), seq_len=7, batch_size=4)  # 6 held-out windows
            >>> len(ds.eval_batches(3))
            1
        """
        windows = _Windows(self._eval, self.seq_len + 1)
        mine = slice(self.shard_index, None, self.shard_count)
        picks = self._eval_picks(count, len(windows))
        return [np.stack([windows[int(i)] for i in p])[mine] for p in picks]
