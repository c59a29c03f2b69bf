"""Training text: a byte-level tokenizer, the embedded public-domain text, and a deterministic,
resumable batch iterator whose position is part of a checkpoint."""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Iterator, Sequence

import numpy as np

from mmnnx.train.tokenizers import ByteTokenizer

TEXTS = pathlib.Path(__file__).parent / "texts"
EMBEDDED = TEXTS / "kjv_genesis_exodus.txt"


def embedded_text() -> str:
    """The text shipped with mmnnx: Genesis and Exodus (King James Version, public domain).

    Example:
        >>> embedded_text().startswith("In the beginning")
        True
    """
    return EMBEDDED.read_text(encoding="utf-8")


def load_text(paths: str | pathlib.Path | Sequence[str | pathlib.Path]) -> str:
    """Reads and joins UTF-8 text files: a path, a directory of ``*.txt`` files, or a list.

    Example:
        >>> import tempfile, os
        >>> d = tempfile.mkdtemp(); p = os.path.join(d, "a.txt")
        >>> _ = open(p, "w").write("abc")
        >>> load_text(d)
        'abc'
    """
    if isinstance(paths, str | pathlib.Path):
        paths = [paths]
    files: list[pathlib.Path] = []
    for p in map(pathlib.Path, paths):
        if p.is_dir():
            found = sorted(p.glob("*.txt"))
            if not found:
                raise FileNotFoundError(f"no *.txt files in directory {p}")
            files += found
        elif p.is_file():
            files.append(p)
        else:
            raise FileNotFoundError(f"text file {p} does not exist")
    texts = []
    for f in files:
        data = f.read_bytes()
        try:
            texts.append(data.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise ValueError(
                f"text file {f} is not UTF-8: byte {e.start} is {data[e.start : e.start + 1]!r} "
                f"({e.reason}); convert it to UTF-8"
            ) from None
    return "\n".join(texts)


@dataclasses.dataclass
class TextDataset:
    """Fixed-length windows of a token stream, served in batches of shape ``(batch, seq_len + 1)``.

    The last ``eval_fraction`` of the tokens is held out for evaluation. Training batches walk a
    seeded permutation of non-overlapping windows, a fresh one per epoch; the iterator's position
    (``state()``) is one integer, so a run restored from a checkpoint continues with exactly the
    batches it would have seen.

    Example:
        >>> ds = TextDataset(np.arange(1000), seq_len=7, batch_size=4)
        >>> next(ds).shape
        (4, 8)
        >>> ds.state()
        {'position': 1}
    """

    tokens: np.ndarray
    seq_len: int
    batch_size: int
    seed: int = 0
    eval_fraction: float = 0.05
    position: int = 0

    def __post_init__(self):
        tokens = np.asarray(self.tokens, dtype=np.int32)
        if self.seq_len < 1 or self.batch_size < 1:
            raise ValueError("seq_len and batch_size must be >= 1")
        if not 0 < self.eval_fraction < 1:
            raise ValueError(f"eval_fraction must be in (0, 1), got {self.eval_fraction}")
        window = self.seq_len + 1
        split = int(len(tokens) * (1 - self.eval_fraction))
        self._train, self._eval = tokens[:split], tokens[split:]
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
        self.tokens = tokens

    @classmethod
    def from_text(cls, text: str, **kwargs) -> TextDataset:
        """A dataset of ``text`` encoded with :class:`ByteTokenizer`."""
        return cls(ByteTokenizer().encode(text), **kwargs)

    @property
    def batches_per_epoch(self) -> int:
        return self._windows // self.batch_size

    def _batch(self, position: int) -> np.ndarray:
        epoch, index = divmod(position, self.batches_per_epoch)
        order = np.random.default_rng([self.seed, epoch]).permutation(self._windows)
        starts = order[index * self.batch_size : (index + 1) * self.batch_size]
        window = self.seq_len + 1
        return np.stack([self._train[s * window : (s + 1) * window] for s in starts])

    def __iter__(self) -> Iterator[np.ndarray]:
        return self

    def __next__(self) -> np.ndarray:
        batch = self._batch(self.position)
        self.position += 1
        return batch

    def state(self) -> dict:
        """The iterator's position, to store in a checkpoint."""
        return {"position": self.position}

    def restore(self, state: dict) -> None:
        """Continues from a position returned by :meth:`state`."""
        self.position = int(state["position"])

    def eval_batches(self, count: int) -> list[np.ndarray]:
        """``count`` fixed batches from the held-out text (the same every time)."""
        window = self.seq_len + 1
        n = len(self._eval) // window
        rows = [self._eval[(i % n) * window : (i % n + 1) * window] for i in range(n)]
        batches = []
        for b in range(count):
            picks = [rows[(b * self.batch_size + j) % n] for j in range(self.batch_size)]
            batches.append(np.stack(picks))
        return batches
