"""Tokenizers a run trains with, and how a run directory keeps its own.

A tokenizer has ``name``, ``vocab_size``, ``encode(text) -> int32 array``,
``decode(ids) -> str`` and ``save(directory)``; :func:`load_tokenizer` reads back whatever
:meth:`save` wrote, so a run's ``tokenizer/`` folder turns its checkpoints back into text.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
from collections.abc import Callable, Iterable, Sequence
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


def _not_utf8(text: str, tokenizer: str, error: Exception) -> Exception:
    """A ``ValueError`` naming the byte offset of ``text``'s first lone surrogate (a
    command-line byte that was not UTF-8); ``error`` itself when ``text`` holds none."""
    if not isinstance(text, str):
        return error
    i = next((i for i, c in enumerate(text) if "\ud800" <= c <= "\udfff"), None)
    if i is None:
        return error
    offset, code = len(text[:i].encode("utf-8")), ord(text[i])
    what = (
        f"is {bytes([code - 0xDC00])!r}" if code >= 0xDC80 else f"is a lone surrogate U+{code:04X}"
    )
    return ValueError(
        f"not UTF-8: byte {offset} {what} (the {tokenizer} tokenizer reads UTF-8 text only)"
    )


class ByteTokenizer:
    """Bytes as tokens: a vocabulary of 256, no training, lossless on any UTF-8 text and on
    the bytes of a command line that is not UTF-8 (decoded by Python with ``surrogateescape``:
    ``b'\\xff'`` is token 255).

    Example:
        >>> tok = ByteTokenizer()
        >>> tok.encode("hi").tolist(), tok.decode([104, 105]), tok.encode("\\udcff").tolist()
        ([104, 105], 'hi', [255])
    """

    name = "bytes"
    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        try:
            data = text.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError as e:  # a lone surrogate not from a byte
            raise _not_utf8(text, self.name, e) from None
        return np.frombuffer(data, dtype=np.uint8).astype(np.int32)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return bytes(np.asarray(ids, dtype=np.uint8).tolist()).decode("utf-8", errors="replace")

    def save(self, directory: str | pathlib.Path) -> None:
        write_meta(directory, self.name)

    @classmethod
    def load(cls, directory: str | pathlib.Path) -> ByteTokenizer:
        return cls()


class _Library:
    """A ``tokenizers.Tokenizer`` saved as ``_FILE`` beside ``tokenizer.json``; ``_SPECIAL``:
    whether special tokens are added on encoding and skipped on decoding."""

    name: str
    _FILE: str
    _FOLDER: str  # the kind, in the message of a folder without ``_FILE``
    _SPECIAL = True

    def __init__(self, model: object):
        self._model = model  # a tokenizers.Tokenizer
        self.vocab_size: int = model.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> np.ndarray:
        try:
            ids = self._model.encode(text, add_special_tokens=self._SPECIAL).ids
        except TypeError as e:  # the library takes no lone surrogate (a non-UTF-8 byte of argv)
            raise _not_utf8(text, self.name, e) from None
        return np.asarray(ids, dtype=np.int32)

    def decode(self, ids: Sequence[int] | np.ndarray, skip_special_tokens: bool | None = None):
        ids = np.asarray(ids, dtype=np.int64).tolist()
        skip = self._SPECIAL if skip_special_tokens is None else skip_special_tokens
        return self._model.decode(ids, skip_special_tokens=skip)

    def encoding(self, text: str, add_special_tokens: bool = False):
        """The ``tokenizers.Encoding`` of ``text``: ``ids`` and each token's ``offsets``."""
        return self._model.encode(text, add_special_tokens=add_special_tokens)

    def token_id(self, token: str) -> int | None:
        """The id of ``token`` (a special token's text), or None."""
        return self._model.token_to_id(token)

    def to_str(self) -> str:
        """The whole tokenizer as one JSON string, what :meth:`from_str` reads."""
        return self._model.to_str()

    @classmethod
    def from_str(cls, serialized: str) -> _Library:
        from tokenizers import Tokenizer as Model  # noqa: PLC0415  (a Rust extension)

        return cls(Model.from_str(serialized))

    def save(self, directory: str | pathlib.Path) -> None:
        folder = write_meta(directory, self.name, vocab_size=self.vocab_size)
        (folder / self._FILE).write_text(self.to_str())

    @classmethod
    def load(cls, directory: str | pathlib.Path) -> _Library:
        """The tokenizer :meth:`save` wrote into ``directory``."""
        path = pathlib.Path(directory) / cls._FILE
        if not path.is_file():
            raise FileNotFoundError(f"{cls._FOLDER} folder {directory} has no {cls._FILE}")
        return cls._read(path)

    @classmethod
    def _read(cls, path: pathlib.Path) -> _Library:
        """The tokenizer of file ``path``; a ``ValueError`` naming it if unreadable."""
        try:
            return cls.from_str(path.read_text())
        except Exception as e:  # the library raises its own exception type
            raise ValueError(
                f"{path}: not a tokenizer file the tokenizers library reads: {e}"
            ) from None


class BPETokenizer(_Library):
    """A byte-level BPE (Hugging Face ``tokenizers``) trained on your text: lossless on any
    UTF-8 text, with ``vocab_size`` tokens (the 256 bytes and the merges learnt on top).

    :meth:`train` is deterministic: the same texts and size give the same tokenizer.
    :meth:`to_str`/:meth:`from_str` carry it whole as one string (e.g. from process 0 to the
    others); :meth:`save` writes ``bpe.json`` (the ``tokenizers`` file) next to ``tokenizer.json``.

    Example:
        >>> tok = BPETokenizer.train(["the cat sat on the mat. " * 20], vocab_size=260)
        >>> tok.vocab_size, tok.decode(tok.encode("the mat")), len(tok.encode("the mat")) < 7
        (260, 'the mat', True)
    """

    name, _FILE, _FOLDER = "bpe", "bpe.json", "BPE tokenizer"

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int = 1024) -> BPETokenizer:
        """A BPE of ``vocab_size`` tokens learnt from ``texts`` (an iterable of strings, read
        once, so a corpus larger than memory can stream in); fewer when the texts have fewer
        distinct pairs to merge.

        Raises:
            ValueError: ``vocab_size`` is below 256 (every byte is a token).
        """
        from tokenizers import Tokenizer as Model  # noqa: PLC0415  (a Rust extension)
        from tokenizers import decoders, models, pre_tokenizers, trainers  # noqa: PLC0415

        if vocab_size < 256:
            raise ValueError(f"a byte-level BPE needs vocab_size >= 256, got {vocab_size}")
        model = Model(models.BPE())
        model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        model.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        model.train_from_iterator(texts, trainer)
        return cls(model)


class HFTokenizer(_Library):
    """A Hugging Face checkpoint's own tokenizer (its ``tokenizer.json``, read with the
    ``tokenizers`` library): what ``mmnnx train --init-from`` reads the text with.

    Text is encoded as it is, without the special tokens the tokenizer's post-processor would
    add (a Llama ``<|begin_of_text|>``): training windows are cut from one stream of tokens,
    and prompts are read the same way. ``decode`` keeps special tokens, so nothing the model
    generates is hidden. ``vocab_size`` counts the added tokens; it may be less than the
    model's embedding rows (checkpoints pad them). :meth:`save` copies the file beside
    ``tokenizer.json`` (mmnnx's own, naming the kind).

    Example:
        >>> import tempfile
        >>> bpe = BPETokenizer.train(["the cat sat on the mat. " * 20], vocab_size=260)
        >>> path = pathlib.Path(tempfile.mkdtemp(), "tokenizer.json")
        >>> _ = path.write_text(bpe.to_str())  # a tokenizer.json, as a checkpoint holds
        >>> tok = HFTokenizer.from_file(path)
        >>> tok.name, tok.vocab_size, tok.decode(tok.encode("the mat"))
        ('hf', 260, 'the mat')
    """

    name, _FILE, _FOLDER, _SPECIAL = "hf", "hf_tokenizer.json", "Hugging Face tokenizer", False

    @classmethod
    def from_file(cls, path: str | pathlib.Path) -> HFTokenizer:
        """The tokenizer of a Hugging Face ``tokenizer.json`` file.

        Raises:
            FileNotFoundError: no such file.
            ValueError: a file the ``tokenizers`` library cannot read, naming it.
        """
        path = pathlib.Path(path)
        if not path.is_file() and (hint := conversion_hint(path.parent)):
            raise ValueError(hint)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such tokenizer file")
        return cls._read(path)


TIKTOKEN = "tiktoken.model"
"""The tokenizer file of checkpoints with tiktoken's tokenizer and no ``tokenizer.json`` (Kimi)."""


def tiktoken_refusal(directory: pathlib.Path) -> str:
    """Why a checkpoint whose tokenizer is only ``tiktoken.model`` is not read, and how to
    convert it (its split pattern lives in the checkpoint's own Python tokenizer class).

    Example:
        >>> tiktoken_refusal(pathlib.Path("kimi")).split(", which")[0]
        'kimi: its tokenizer is tiktoken.model, without a tokenizer.json'
    """
    return (
        f"{directory}: its tokenizer is {TIKTOKEN}, without a tokenizer.json, which mmnnx "
        "reads; write one once (with tiktoken and transformers installed): slow = "
        f"AutoTokenizer.from_pretrained('{directory}', trust_remote_code=True); "
        "transformers.convert_slow_tokenizer.TikTokenConverter(vocab_file="
        f"'{directory / TIKTOKEN}', pattern=slow.pat_str, extra_special_tokens="
        f"slow.special_tokens).converted().save('{directory / 'tokenizer.json'}')"
    )


SENTENCEPIECE = "tokenizer.model"
"""The tokenizer file of sentencepiece checkpoints without a ``tokenizer.json`` (Llama 2's)."""


def conversion_hint(directory: pathlib.Path) -> str | None:
    """How to write the ``tokenizer.json`` mmnnx reads for a checkpoint whose tokenizer is
    only tiktoken's (:func:`tiktoken_refusal`) or sentencepiece's file; ``None`` for neither.

    Example:
        >>> import tempfile
        >>> d = pathlib.Path(tempfile.mkdtemp())
        >>> conversion_hint(d) is None
        True
        >>> _ = (d / SENTENCEPIECE).write_bytes(b"")
        >>> conversion_hint(d).startswith(f"{d}: its tokenizer is tokenizer.model, without a")
        True
    """
    if (directory / TIKTOKEN).is_file():
        return tiktoken_refusal(directory)
    if not (directory / SENTENCEPIECE).is_file():
        return None
    return (
        f"{directory}: its tokenizer is {SENTENCEPIECE}, without a tokenizer.json, which mmnnx "
        "reads; write one once (with sentencepiece and transformers installed): "
        f"transformers.AutoTokenizer.from_pretrained('{directory}').save_pretrained('{directory}')"
    )


_LOADERS: dict[str, Callable[[pathlib.Path], Tokenizer]] = {
    "bytes": ByteTokenizer.load,
    "bpe": BPETokenizer.load,
    "hf": HFTokenizer.load,
}


def register_tokenizer(name: str, load: Callable[[pathlib.Path], Tokenizer]) -> None:
    """Makes :func:`load_tokenizer` able to read a tokenizer saved under ``name``."""
    _LOADERS[name] = load


def write_meta(directory: str | pathlib.Path, name: str, **fields) -> pathlib.Path:
    """Writes ``tokenizer.json`` (its name and settings) into ``directory``; returns the folder."""
    folder = pathlib.Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / _META).write_text(json.dumps({"name": name, **fields}, indent=2) + "\n")
    return folder


def fingerprint(tokenizer: Tokenizer) -> str:
    """A hash of what ``tokenizer`` maps text to: its name and its whole serialized form
    (``to_str()``, a BPE's merges and vocabulary) where it has one, else its name and
    vocabulary size. Two tokenizers with the same fingerprint encode alike; a tokenizer saved
    and loaded again keeps it.

    Example:
        >>> fingerprint(ByteTokenizer()) == fingerprint(ByteTokenizer())
        True
        >>> bpe = BPETokenizer.train(["the cat sat on the mat. " * 20], vocab_size=260)
        >>> fingerprint(bpe) == fingerprint(BPETokenizer.from_str(bpe.to_str()))
        True
    """
    to_str = getattr(tokenizer, "to_str", None)
    form = to_str() if callable(to_str) else str(tokenizer.vocab_size)
    return hashlib.blake2b(f"{tokenizer.name}\n{form}".encode(), digest_size=16).hexdigest()


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
    try:
        meta = json.loads(meta_file.read_bytes())
    except ValueError as e:  # a JSONDecodeError, or bytes that are no text
        raise ValueError(f"{meta_file}: not valid JSON ({e})") from None
    name = meta.get("name") if isinstance(meta, dict) else None
    if not isinstance(name, str):
        raise ValueError(
            f'{meta_file}: names no tokenizer (expected an object with a "name"), got '
            f"{json.dumps(meta)[:80]}"
        )
    if name not in _LOADERS:
        raise ValueError(
            f"{meta_file} names tokenizer {name!r}; known: {', '.join(sorted(_LOADERS))}"
        )
    return _LOADERS[name](folder)
