"""Tokenizers a run trains with, and how a run directory keeps its own.

A tokenizer has ``name``, ``vocab_size``, ``encode(text) -> int32 array``,
``decode(ids) -> str`` and ``save(directory)``; :func:`load_tokenizer` reads back whatever
:meth:`save` wrote, so a run's ``tokenizer/`` folder turns its checkpoints back into text.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

_META = "tokenizer.json"


class Tokenizer(Protocol):
    """What training and generation need of a tokenizer."""

    name: str
    vocab_size: int

    def encode(self, text: str) -> np.ndarray: ...

    def decode(self, ids: Sequence[int] | np.ndarray) -> str: ...

    def save(self, directory: str | pathlib.Path) -> None: ...


class ByteTokenizer:
    """Bytes as tokens: a vocabulary of 256, no training, lossless on any UTF-8 text.

    Example:
        >>> tok = ByteTokenizer()
        >>> tok.encode("hi").tolist(), tok.decode([104, 105])
        ([104, 105], 'hi')
    """

    name = "bytes"
    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return bytes(np.asarray(ids, dtype=np.uint8).tolist()).decode("utf-8", errors="replace")

    def save(self, directory: str | pathlib.Path) -> None:
        write_meta(directory, self.name)

    @classmethod
    def load(cls, directory: str | pathlib.Path) -> ByteTokenizer:
        return cls()


_LOADERS: dict[str, Callable[[pathlib.Path], Tokenizer]] = {"bytes": ByteTokenizer.load}


def register_tokenizer(name: str, load: Callable[[pathlib.Path], Tokenizer]) -> None:
    """Makes :func:`load_tokenizer` able to read a tokenizer saved under ``name``."""
    _LOADERS[name] = load


def write_meta(directory: str | pathlib.Path, name: str, **fields) -> pathlib.Path:
    """Writes ``tokenizer.json`` (its name and settings) into ``directory``; returns the folder."""
    folder = pathlib.Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / _META).write_text(json.dumps({"name": name, **fields}, indent=2) + "\n")
    return folder


def load_tokenizer(directory: str | pathlib.Path) -> Tokenizer:
    """The tokenizer a :meth:`Tokenizer.save` wrote into ``directory``.

    Example:
        >>> import tempfile
        >>> d = tempfile.mkdtemp(); ByteTokenizer().save(d)
        >>> load_tokenizer(d).name
        'bytes'
    """
    folder = pathlib.Path(directory)
    meta_file = folder / _META
    if not meta_file.is_file():
        raise FileNotFoundError(f"no saved tokenizer in {folder} (missing {_META})")
    name = json.loads(meta_file.read_text())["name"]
    if name not in _LOADERS:
        raise ValueError(
            f"{meta_file} names tokenizer {name!r}; known: {', '.join(sorted(_LOADERS))}"
        )
    return _LOADERS[name](folder)
