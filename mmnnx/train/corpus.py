"""Text corpora read in chunks: the files a run names, their text streamed a block at a time,
and the token file on disk (a ``np.memmap``) that training reads windows from, so a corpus
larger than memory is never held whole.

Example:
    >>> import tempfile, pathlib
    >>> from mmnnx.train.tokenizers import ByteTokenizer
    >>> d = pathlib.Path(tempfile.mkdtemp()); _ = (d / "a.txt").write_text("hello\\nworld\\n")
    >>> tokens = token_file([d], ByteTokenizer(), d / "cache")
    >>> ByteTokenizer().decode(tokens[:5])
    'hello'
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import pathlib
import warnings
import zlib
from collections.abc import Iterator, Sequence

import numpy as np

from mmnnx.train.tokenizers import Tokenizer, fingerprint

CHUNK_BYTES = 1 << 20
"""Bytes of text read, decoded and tokenized at a time."""

Paths = str | pathlib.Path | Sequence[str | pathlib.Path]


def text_files(paths: Paths) -> list[pathlib.Path]:
    """The files ``paths`` names: each file, and each directory's ``*.txt`` files, sorted.

    Example:
        >>> import tempfile, pathlib
        >>> d = pathlib.Path(tempfile.mkdtemp()); _ = (d / "b.txt").write_text("b")
        >>> [p.name for p in text_files(d)]
        ['b.txt']

    Raises:
        FileNotFoundError: a path does not exist, or a directory holds no ``*.txt`` file.
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
    return files


def text_chunks(paths: Paths, chunk_bytes: int = CHUNK_BYTES) -> Iterator[str]:
    """The UTF-8 text of ``paths`` (files joined by a newline), read ``chunk_bytes`` at a time
    and given in pieces of about that many characters, each ending at a line end: at most a
    piece and a line are in memory at once.

    Example:
        >>> import tempfile, pathlib
        >>> d = pathlib.Path(tempfile.mkdtemp()); _ = (d / "a.txt").write_text("ab\\ncd\\nef")
        >>> list(text_chunks(d, chunk_bytes=4))
        ['ab\\n', 'cd\\n', 'ef']

    Raises:
        FileNotFoundError: as :func:`text_files`.
        ValueError: a file is not UTF-8 (naming it and the byte's offset).
    """
    files = text_files(paths)
    pending = ""
    for number, path in enumerate(files):
        decoder = codecs.getincrementaldecoder("utf-8")()
        offset = 0  # of the next block in the file
        with path.open("rb") as f:
            while True:
                block = f.read(chunk_bytes)
                held = decoder.getstate()[0]  # bytes of a character the last block cut
                try:
                    pending += decoder.decode(block, final=not block)
                except UnicodeDecodeError as e:
                    data = held + block
                    raise ValueError(
                        f"text file {path} is not UTF-8: byte {offset - len(held) + e.start} is "
                        f"{data[e.start : e.start + 1]!r} ({e.reason}); convert it to UTF-8"
                    ) from None
                if not block:
                    break
                offset += len(block)
                while len(pending) >= chunk_bytes:
                    # the last line end in the first chunk_bytes characters, else the next one
                    cut = pending.rfind("\n", 0, chunk_bytes) + 1 or pending.find("\n") + 1
                    if not cut:
                        break  # a line longer than this: read on
                    yield pending[:cut]
                    pending = pending[cut:]
        if number < len(files) - 1:
            pending += "\n"
    if pending:
        yield pending


def token_file(
    paths: Paths,
    tokenizer: Tokenizer,
    directory: str | pathlib.Path,
    chunk_bytes: int = CHUNK_BYTES,
) -> np.ndarray:
    """The tokens of ``paths`` (``tokenizer`` applied to each :func:`text_chunks` piece), as a
    read-only ``np.memmap`` of a file in ``directory`` (an empty array for no text), ``uint16``
    when the vocabulary fits, else ``int32``. The file is reused while the files (paths, sizes,
    modification times) and the tokenizer are the same and its content still has the checksum
    it was written with (a file damaged since, e.g. zeroed by a crash, is made again, with a
    warning); it is written under a temporary name and renamed, so processes writing it at
    once each leave a whole file.

    Raises:
        FileNotFoundError, ValueError: as :func:`text_chunks`.
    """
    files = text_files(paths)
    dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.int32)
    key = _cache_key(files, tokenizer, dtype, chunk_bytes)
    folder = pathlib.Path(directory)
    data, meta = folder / "tokens.bin", folder / "tokens.json"
    count = _cached_count(data, meta, key, dtype)
    if count is None:
        folder.mkdir(parents=True, exist_ok=True)
        temporary = folder / f".tokens.{os.getpid()}.tmp"
        count, checksum = 0, 0
        with temporary.open("wb") as out:
            for piece in text_chunks(files, chunk_bytes):
                ids = tokenizer.encode(piece).astype(dtype).tobytes()
                out.write(ids)
                checksum = zlib.crc32(ids, checksum)
                count += len(ids) // dtype.itemsize
        os.replace(temporary, data)
        meta_temporary = folder / f".tokens.{os.getpid()}.json.tmp"
        described = {"key": key, "count": count, "crc32": checksum}
        meta_temporary.write_text(json.dumps(described, indent=1) + "\n")
        os.replace(meta_temporary, meta)
    if count == 0:  # a file of no bytes cannot be mapped
        return np.zeros(0, dtype)
    return np.memmap(data, dtype=dtype, mode="r", shape=(count,))


def _cache_key(files: list[pathlib.Path], tokenizer: Tokenizer, dtype: np.dtype, chunk: int) -> str:
    """What the token file depends on, hashed."""
    stats = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    described = json.dumps([stats, fingerprint(tokenizer), dtype.str, chunk])
    return hashlib.sha256(described.encode()).hexdigest()


def _cached_count(data: pathlib.Path, meta: pathlib.Path, key: str, dtype: np.dtype) -> int | None:
    """The token count of a whole token file made with ``key`` whose checksum holds, or None."""
    try:
        saved = json.loads(meta.read_text())
        size = data.stat().st_size
    except (OSError, ValueError):
        return None
    if not isinstance(saved, dict) or saved.get("key") != key:
        return None
    count, checksum = saved.get("count"), saved.get("crc32")
    if not isinstance(count, int) or size != count * dtype.itemsize or checksum is None:
        return None
    found = 0
    try:
        with data.open("rb") as f:
            while block := f.read(1 << 24):
                found = zlib.crc32(block, found)
    except OSError:
        return None
    if found != checksum:
        warnings.warn(
            f"{data} does not have the checksum it was written with (damaged since, e.g. by a "
            "crash); tokenizing the text again",
            stacklevel=3,
        )
        return None
    return count
