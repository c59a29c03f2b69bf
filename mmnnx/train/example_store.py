"""Tokenized examples kept on disk as flat arrays, written as records stream from their reader
and read back an example at a time, so a dataset larger than memory is never held whole: only
each example's length (and first trained position) stays in memory.

Example:
    >>> import tempfile
    >>> ex = [Example(np.arange(1, 4), np.array([0, 1, 1], bool), "f:line 1"),
    ...       Example(np.arange(5, 7), np.ones(2, bool), "f:line 2")]
    >>> store = write_examples(iter(ex), tempfile.mkdtemp(), key="k")
    >>> len(store), store.lengths.tolist(), store[1].ids.tolist(), store.where(1)
    (2, [3, 2], [5, 6], 'f:line 2')
"""

from __future__ import annotations

import array
import copy
import json
import os
import pathlib
from collections.abc import Iterable, Sequence

import numpy as np

from mmnnx.train.records import Example

FILES = ("ids.bin", "targets.bin", "offsets.npy", "firsts.npy", "wheres.jsonl")
"""The files of a store's folder; ``examples.json`` (its key and sizes) is written last."""


class ExampleStore:
    """Examples end to end: ``ids`` (int32) and ``targets`` (bool) of all of them, example ``i``
    at ``offsets[i]:offsets[i + 1]`` (memmaps of a folder's files, :func:`write_examples`, or
    arrays in memory, :meth:`of`); ``firsts[i]`` is example ``i``'s first position from 1 the
    loss counts (its length if none). Slicing gives a view of a range of the examples; an
    integer index reads one :class:`Example`.

    Example:
        >>> store = ExampleStore.of([Example(np.arange(3), np.array([1, 0, 1], bool), "a")])
        >>> store.lengths.tolist(), store.firsts.tolist(), store[0].targets.tolist()
        ([3], [2], [True, False, True])
    """

    def __init__(
        self,
        *,
        ids: np.ndarray,
        targets: np.ndarray,
        offsets: np.ndarray,
        firsts: np.ndarray,
        wheres: Sequence[str] | pathlib.Path,
        start: int = 0,
        stop: int | None = None,
    ):
        self._ids, self._targets, self._offsets, self._firsts = ids, targets, offsets, firsts
        self._wheres, self._start = wheres, start
        self._stop = len(offsets) - 1 if stop is None else stop

    @classmethod
    def of(cls, examples: Sequence[Example]) -> ExampleStore:
        """``examples`` in memory (what tests and small datasets use)."""
        lengths = [len(e.ids) for e in examples]

        def joined(arrays, dtype):
            return np.concatenate([np.zeros(0, dtype), *arrays], dtype=dtype, casting="unsafe")

        return cls(
            ids=joined((e.ids for e in examples), np.int32),
            targets=joined((e.targets for e in examples), bool),
            offsets=np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64),
            firsts=np.array([_first(e.targets) for e in examples], np.int64),
            wheres=[e.where for e in examples],
        )

    def __len__(self) -> int:
        return self._stop - self._start

    def __getitem__(self, i):
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            if step != 1:
                raise ValueError(f"an ExampleStore slices by ranges, not steps of {step}")
            view = copy.copy(self)
            view._start, view._stop = self._start + start, self._start + max(start, stop)
            return view
        ids, targets = self.read(i)
        return Example(ids, targets, self.where(i))

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    @property
    def lengths(self) -> np.ndarray:
        """Each example's token count."""
        return np.diff(self._offsets[self._start : self._stop + 1])

    @property
    def firsts(self) -> np.ndarray:
        """Each example's first position from 1 that is a target, else its length."""
        return self._firsts[self._start : self._stop]

    def read(self, i: int, length: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Example ``i``'s ids and targets, its first ``length`` tokens if given."""
        if not 0 <= i < len(self):
            raise IndexError(f"example {i} of {len(self)}")
        at, end = self._offsets[self._start + i], self._offsets[self._start + i + 1]
        if length is not None:
            end = min(end, at + length)
        return np.asarray(self._ids[at:end]), np.asarray(self._targets[at:end])

    def where(self, i: int) -> str:
        """Where example ``i`` comes from (file and line), read from disk when kept there."""
        if isinstance(self._wheres, pathlib.Path):
            with self._wheres.open() as f:
                for n, line in enumerate(f):
                    if n == self._start + i:
                        return json.loads(line)
            raise IndexError(f"{self._wheres}: no line for example {self._start + i}")
        return self._wheres[self._start + i]


def write_examples(
    examples: Iterable[Example], folder: str | pathlib.Path, key: str | None
) -> ExampleStore:
    """The :class:`ExampleStore` of ``examples`` (an iterator: each is written as it comes and
    dropped) in files of ``folder``, memory-mapped. A folder already holding whole files written
    with the same ``key`` is reused without reading ``examples``; ``key=None`` always writes.
    Files are written under temporary names and renamed, their description last, so an error
    from ``examples`` (a bad record) leaves what was there before.
    """
    folder = pathlib.Path(folder)
    meta = folder / "examples.json"
    if key is not None and (store := _cached(folder, meta, key)) is not None:
        return store
    folder.mkdir(parents=True, exist_ok=True)
    temporary = {name: folder / f".{name}.{os.getpid()}.tmp" for name in FILES}
    offsets, firsts = array.array("q", [0]), array.array("q")
    with (
        temporary["ids.bin"].open("wb") as ids,
        temporary["targets.bin"].open("wb") as targets,
        temporary["wheres.jsonl"].open("w") as wheres,
    ):
        for e in examples:
            ids.write(np.asarray(e.ids, np.int32).tobytes())
            targets.write(np.asarray(e.targets, bool).tobytes())
            wheres.write(json.dumps(e.where) + "\n")
            offsets.append(offsets[-1] + len(e.ids))
            firsts.append(_first(e.targets))
    for name, values in (("offsets.npy", offsets), ("firsts.npy", firsts)):
        with temporary[name].open("wb") as f:
            np.save(f, np.frombuffer(values, np.int64))
    for name in FILES:
        os.replace(temporary[name], folder / name)
    described = {"key": key, "examples": len(firsts), "tokens": offsets[-1]}
    meta_temporary = folder / f".examples.{os.getpid()}.json.tmp"
    meta_temporary.write_text(json.dumps(described) + "\n")
    os.replace(meta_temporary, meta)
    return _opened(folder, len(firsts), offsets[-1])


def _first(targets: np.ndarray) -> int:
    later = np.flatnonzero(np.asarray(targets[1:], bool))
    return int(later[0]) + 1 if len(later) else len(targets)


def _cached(folder: pathlib.Path, meta: pathlib.Path, key: str) -> ExampleStore | None:
    """The store of ``folder`` if its files are whole and were written with ``key``."""
    try:
        saved = json.loads(meta.read_text())
        sizes = {name: (folder / name).stat().st_size for name in FILES}
    except (OSError, ValueError):
        return None
    if not isinstance(saved, dict) or saved.get("key") != key:
        return None
    count, tokens = saved.get("examples"), saved.get("tokens")
    if not isinstance(count, int) or not isinstance(tokens, int):
        return None
    if sizes["ids.bin"] != 4 * tokens or sizes["targets.bin"] != tokens:
        return None
    try:
        return _opened(folder, count, tokens)
    except (OSError, ValueError):
        return None


def _opened(folder: pathlib.Path, count: int, tokens: int) -> ExampleStore:
    def mapped(name, dtype):  # a file of no bytes cannot be mapped
        return np.memmap(folder / name, dtype, "r", shape=(tokens,)) if tokens else np.zeros(0)

    offsets, firsts = (np.load(folder / n) for n in ("offsets.npy", "firsts.npy"))
    if len(offsets) != count + 1 or len(firsts) != count:
        raise ValueError(f"{folder}: offsets.npy or firsts.npy do not hold {count} examples")
    return ExampleStore(
        ids=mapped("ids.bin", np.int32),
        targets=mapped("targets.bin", bool),
        offsets=offsets,
        firsts=firsts,
        wheres=folder / "wheres.jsonl",
    )
