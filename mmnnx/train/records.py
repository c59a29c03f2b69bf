"""Instruction, chat and text records as people keep them (JSON Lines, JSON, Parquet, CSV,
read with Hugging Face ``datasets``), turned into token ids and the tokens the loss counts."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import pathlib
import re
from collections.abc import Iterator

import numpy as np

from mmnnx.train.chat_template import ROLES, ChatTemplate, ChatTemplateError

FORMATS = ("text", "completion", "chat")
TRAIN_ON = ("completions", "all")
READERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


class DataError(ValueError):
    """A record that cannot be trained on; the message names its file, line (or row) and field."""


@dataclasses.dataclass(frozen=True)
class Fields:
    """Which field of a record holds what, per ``--data-format``."""

    text: str = "text"
    prompt: str = "prompt"
    completion: str = "completion"
    messages: str = "messages"


@dataclasses.dataclass(frozen=True)
class PairFields:
    """Which field of a preference record holds what, for ``mmnnx train --dpo``."""

    prompt: str = "prompt"
    chosen: str = "chosen"
    rejected: str = "rejected"


@dataclasses.dataclass(frozen=True)
class Example:
    """One record's token ids and, per token, whether the loss counts it as a target (the
    model predicting it from the tokens before it)."""

    ids: np.ndarray
    targets: np.ndarray
    where: str = ""


def read_records(path: str | pathlib.Path, cache_dir: str | None = None) -> Iterator[tuple]:
    """``(where, record)`` for every record of a file, of every data file in a directory (in
    name order), or of a Hugging Face Hub dataset id (where a network exists), read with
    ``datasets``; ``where`` is ``"file:line N"`` for JSON Lines, ``"file:row N"`` otherwise.

    Raises:
        DataError: no such path (and not a dataset id), or a directory with no data file.

    Example:
        >>> import tempfile
        >>> p = pathlib.Path(tempfile.mkdtemp(), "d.jsonl")
        >>> _ = p.write_text('{"text": "a"}\\n{"text": "b"}\\n')
        >>> [(w.split("/")[-1], r) for w, r in read_records(p)]
        [('d.jsonl:line 1', {'text': 'a'}), ('d.jsonl:line 2', {'text': 'b'})]
    """
    import datasets  # noqa: PLC0415  (heavy: pandas and pyarrow)

    datasets.disable_progress_bars()
    files = data_files(path)
    if files is None:
        try:
            hub = datasets.load_dataset(str(path), split="train", cache_dir=cache_dir)
        except Exception as e:  # offline, unknown name, gated: the library's own exceptions
            raise DataError(f"{path}: no such path, and no Hub dataset loads: {e}") from None
        for i, record in enumerate(hub):
            yield f"{path}:row {i + 1}", record
        return
    for file in files:
        unit, reader = "line" if file.suffix == ".jsonl" else "row", READERS[file.suffix]
        try:
            with _datasets_quiet():  # its reader logs each failure on stderr; ours is one line
                rows = datasets.load_dataset(
                    reader, data_files=str(file), split="train", cache_dir=cache_dir
                )
        except Exception as e:  # the readers raise their own types (pyarrow, json, pandas)
            if unit != "line":
                raise DataError(f"{file}: not a readable {reader} file: {e}") from None
            if bad := _bad_json_line(file):
                raise DataError(bad) from None
            # JSON objects whose fields differ in type from line to line (a content of 3, or of
            # parts; Arrow fails on the whole file, naming no line): each record checked itself
            yield from ((f"{file}:line {n}", json.loads(line)) for n, line in _record_lines(file))
            continue
        numbers = (n for n, _ in _record_lines(file)) if unit == "line" else None
        for i, record in enumerate(rows):  # the reader skips blank lines: count the file's
            yield f"{file}:{unit} {next(numbers) if numbers else i + 1}", record


@contextlib.contextmanager
def _datasets_quiet() -> Iterator[None]:
    """``datasets``' loggers silenced for the block (its level restored after)."""
    logger = logging.getLogger("datasets")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _record_lines(file: pathlib.Path) -> Iterator[tuple[int, str]]:
    """The line number and text of each of a JSON Lines file's records, its blank lines passed
    over."""
    with open(file, encoding="utf-8", errors="replace") as lines:
        yield from ((n, line) for n, line in enumerate(lines, 1) if line.strip())


def _bad_json_line(file: pathlib.Path) -> str | None:
    """``FILE:line N: not a JSON object (...)`` for the first line of a JSON Lines file that is
    not one, or ``None`` (the reader's own message then says what is wrong)."""
    for n, line in _record_lines(file):
        try:
            record = json.loads(line)
        except ValueError as e:
            return f"{file}:line {n}: not a JSON object ({e})"
        if not isinstance(record, dict):
            return f"{file}:line {n}: not a JSON object (a {type(record).__name__})"
    return None


def data_files(path: str | pathlib.Path) -> list[pathlib.Path] | None:
    """The data files :func:`read_records` reads for ``path``: the file, or a directory's data
    files in name order; None for a Hugging Face Hub dataset id.

    Raises:
        DataError: no such path (and not a dataset id), a file of an unknown type, or a
            directory with no data file.

    Example:
        >>> data_files("someone/some-dataset") is None
        True
    """
    path = pathlib.Path(path)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in READERS and p.is_file())
        if not files:
            raise DataError(f"{path}: no data files ({', '.join(READERS)}) in this directory")
        return files
    if path.is_file():
        if path.suffix not in READERS:
            raise DataError(f"{path}: unknown data file type; expected one of {', '.join(READERS)}")
        return [path]
    if re.fullmatch(r"[\w.-]+/[\w.-]+", str(path)):
        return None
    raise DataError(f"{path}: no such data file or directory")


def encode_record(
    where: str,
    record: dict,
    data_format: str,
    tokenizer,
    template: ChatTemplate | None = None,
    fields: Fields = Fields(),
    train_on: str = "completions",
    eos: str | None = None,
) -> Example:
    """A record's :class:`Example`, its targets: every token (``text``, or ``train_on="all"``),
    the completion's and ``eos`` (``completion``, as TRL's ``SFTTrainer``), or the assistant's
    (``chat``, rendered with ``template``).

    Raises:
        DataError: a field missing or not text, a message without a known role, a template
            that fails on it, or a record with no token to train on (an empty text or
            completion), naming ``where`` and the field.

    Example:
        >>> from mmnnx.train.tokenizers import ByteTokenizer
        >>> ex = encode_record("f:line 1", {"prompt": "1+1=", "completion": "2"}, "completion",
        ...                    ByteTokenizer())
        >>> ex.ids.tolist(), ex.targets.tolist()
        ([49, 43, 49, 61, 50], [False, False, False, False, True])
    """
    if data_format == "text":
        ids = tokenizer.encode(_field(where, record, fields.text))
        targets = np.ones(len(ids), bool)
    elif data_format == "completion":
        prompt = _field(where, record, fields.prompt)
        completion = _field(where, record, fields.completion)
        if eos and not completion.endswith(eos):
            completion += eos
        ids = tokenizer.encode(prompt + completion)
        # the completion starts where the prompt's own tokens stop being a prefix (TRL's
        # common_prefix_length): a prompt ending in a space shares it with the next token
        prompt_ids = [int(t) for t in tokenizer.encode(prompt)]
        start = len(os.path.commonprefix([prompt_ids, [int(t) for t in ids]]))
        targets = np.arange(len(ids)) >= start
    elif data_format == "chat":
        if template is None:
            raise DataError(f"{where}: chat data needs the tokenizer's chat template; none given")
        try:
            text, spans = template.render(_messages(where, record, fields.messages))
        except ChatTemplateError as e:
            raise DataError(f"{where}: {e}") from None
        encoding = tokenizer.encoding(text)
        ids, targets = encoding.ids, _in_spans(encoding.offsets, spans)
    else:
        raise DataError(f"unknown data format {data_format!r}; expected one of {FORMATS}")
    if train_on == "all":
        targets = np.ones(len(ids), bool)
    if not np.any(targets):  # an empty text or completion
        named = {"text": fields.text, "completion": fields.completion}
        field = named.get(data_format, fields.messages)
        raise DataError(f"{where}: field {field!r} gives no token to train on (is it empty?)")
    return Example(np.asarray(ids, np.int32), np.asarray(targets, bool), where)


def _field(where: str, record: dict, field: str, kind: type = str):
    if field not in record:
        raise DataError(f"{where}: no field {field!r} (fields: {', '.join(record) or 'none'})")
    value = record[field]
    if value is None:  # datasets gives a field that other records have and this one lacks
        raise DataError(f"{where}: no field {field!r} (or it is null)")
    if not isinstance(value, kind) or not (value or kind is str):
        what = "text" if kind is str else "a non-empty list of messages"
        raise DataError(f"{where}: field {field!r} is {type(value).__name__}, not {what}")
    return value


def _messages(where: str, record: dict, field: str, assistant: bool = True) -> list[dict]:
    messages = _field(where, record, field, list)
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise DataError(
                f"{where}: {field}[{i}] is {type(m).__name__}, not a message (an object with "
                '"role" and "content")'
            )
        if m.get("role") not in ROLES:
            raise DataError(
                f"{where}: {field}[{i}] has role {m.get('role')!r}; expected one of "
                f"{', '.join(ROLES)}"
            )
        if not isinstance(m.get("content"), str):
            raise DataError(f"{where}: {field}[{i}].content is not text")
    if assistant and not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: {field} has no assistant message to train on")
    return [{k: v for k, v in m.items() if v is not None} for m in messages]


def _in_spans(offsets, spans) -> np.ndarray:
    """Tokens overlapping a span, as transformers' ``return_assistant_tokens_mask`` marks them."""
    mask = np.zeros(len(offsets), bool)
    s = 0
    for t, (start, end) in enumerate(offsets):
        while s < len(spans) and start >= spans[s][1]:
            s += 1
        if s == len(spans):
            break
        mask[t] = end > spans[s][0]
    return mask


def held_out(items: list, eval_items: list | None, eval_fraction: float) -> tuple[list, list]:
    """``(train, eval)``: ``items`` and ``eval_items``, or without these, ``items`` split with
    the last ``eval_fraction`` of them (at least one) held out.

    Example:
        >>> held_out(list(range(10)), None, 0.2)
        ([0, 1, 2, 3, 4, 5, 6, 7], [8, 9])
    """
    if eval_items is not None:
        return items, eval_items
    if not 0 < eval_fraction < 1:
        raise DataError(f"--eval-fraction must be in (0, 1), got {eval_fraction}")
    split = len(items) - max(1, int(len(items) * eval_fraction))
    return items[:split], items[split:]


def encode_records(records, *args, **kwargs) -> list[Example]:
    """:func:`encode_record` of each ``(where, record)`` of ``records``."""
    return [encode_record(where, record, *args, **kwargs) for where, record in records]
