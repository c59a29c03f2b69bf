"""What a run trains on: windows of text (``--text``, the embedded text) or records
(``--data``: completions, chats or texts, one example a sequence or packed)."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
import pathlib
from typing import Any

from mmnnx.train.chat_template import ChatTemplate, ChatTemplateError, special_tokens
from mmnnx.train.data import TextDataset
from mmnnx.train.example_store import write_examples
from mmnnx.train.examples import ExampleDataset
from mmnnx.train.pairs import PairDataset, encode_pair
from mmnnx.train.records import (
    DataError,
    Fields,
    PairFields,
    data_files,
    encode_record,
    read_records,
)
from mmnnx.train.tokenizers import fingerprint

STORE_VERSION = 2
"""Bumped when the examples' files change form or content, so older caches are made again
(2: a completion's targets start where the prompt's tokens stop being a prefix)."""


def run_dataset(run: Any, tokenizer: Any, sources: list, cache: pathlib.Path):
    """The dataset of a run's options: a :class:`TextDataset` of ``sources``, or with
    ``--data`` an :class:`ExampleDataset` (or DPO's ``PairDataset``) of its records, cached.

    Raises:
        DataError: a record, file or option that cannot be trained on, naming it.
    """
    shape = dict(seq_len=run.model.seq_len, batch_size=run.training.batch_size)
    data = run.dataset
    if data.data is None:
        return TextDataset.from_files(sources, tokenizer, cache, seed=run.training.seed, **shape)
    folder = run.model.init_from
    fields = Fields(
        text=data.text_field,
        prompt=data.prompt_field,
        completion=data.completion_field,
        messages=data.messages_field,
    )
    read = functools.partial(read_records, cache_dir=str(cache / "datasets"))
    records = read(data.data)
    first = next(records, None)
    if first is None:
        raise DataError(f"--data {data.data}: no records")
    records = itertools.chain([first], records)
    if run.preference.dpo:
        return _pairs(run, tokenizer, first, records, read)
    data_format = data.data_format
    if data_format == "auto":
        data_format = _format(*first, fields)
    template = None
    if data_format == "chat":
        if folder is None:
            raise DataError("--data-format chat needs --init-from: its tokenizer's chat template")
        try:
            template = ChatTemplate.from_checkpoint(folder)
        except ChatTemplateError as e:  # the data's format may be a guess (auto)
            raise ChatTemplateError(f"{e}, or use --data-format completion or text") from None
    tokens = template.tokens if template else special_tokens(folder) if folder else {}
    options = dict(
        data_format=data_format,
        tokenizer=tokenizer,
        template=template,
        fields=fields,
        train_on=data.train_on,
        eos=tokens.get("eos_token"),
    )

    def stored(path, records, name):
        """The examples of ``records`` tokenized into ``cache/name``, or read from there."""
        examples = (encode_record(where, record, **options) for where, record in records)
        return write_examples(examples, cache / name, examples_key(path, options))

    held_out = None
    if data.eval_data:
        held_out = stored(data.eval_data, read(data.eval_data), "eval_examples")
    return ExampleDataset(
        stored(data.data, records, "examples"),
        seed=run.training.seed,
        pack=data.pack,
        truncate=data.truncate,
        eval_examples=held_out,
        eval_fraction=data.eval_fraction,
        **shape,
    )


def examples_key(path: str | pathlib.Path, options: dict) -> str | None:
    """A hash of what the examples of ``path`` tokenized with ``options`` depend on (the
    files' paths, sizes and times, and ``options``); None for a Hub dataset id.

    Example:
        >>> import tempfile
        >>> from mmnnx.train.tokenizers import ByteTokenizer
        >>> p = pathlib.Path(tempfile.mkdtemp(), "d.jsonl"); _ = p.write_text("{}")
        >>> opts = dict(data_format="text", tokenizer=ByteTokenizer(), template=None)
        >>> examples_key(p, opts) == examples_key(p, opts | dict(data_format="chat"))
        False
    """
    files = data_files(path)
    if files is None:
        return None
    stats = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    described = {k: v for k, v in options.items() if k not in ("tokenizer", "template")}
    described = dict(described, fields=dataclasses.asdict(described.get("fields", Fields())))
    template = options.get("template")
    meaning = [
        STORE_VERSION,
        stats,
        fingerprint(options["tokenizer"]),
        template.source if template else None,
        described,
    ]
    return hashlib.sha256(json.dumps(meaning, sort_keys=True).encode()).hexdigest()


def _pairs(run: Any, tokenizer: Any, first: tuple, records: Any, read: Any) -> PairDataset:
    data, folder, preference = run.dataset, run.model.init_from, run.preference
    fields = PairFields(data.prompt_field, preference.chosen_field, preference.rejected_field)
    chat = isinstance(first[1].get(fields.prompt), list)
    if chat and folder is None:
        raise DataError(f"{first[0]}: chat pairs need --init-from: its chat template")
    template = ChatTemplate.from_checkpoint(folder) if chat else None
    eos = (special_tokens(folder) if folder else {}).get("eos_token")

    def encode(pairs):
        return [encode_pair(w, r, tokenizer, template, fields, eos=eos) for w, r in pairs]

    return PairDataset(
        encode(records),
        seq_len=run.model.seq_len,
        batch_size=run.training.batch_size,
        seed=run.training.seed,
        truncate=data.truncate,
        eval_pairs=encode(read(data.eval_data)) if data.eval_data else None,
        eval_fraction=data.eval_fraction,
    )


def _format(where: str, record: dict, fields: Fields) -> str:
    if fields.messages in record:
        return "chat"
    if fields.prompt in record and fields.completion in record:
        return "completion"
    if fields.text in record:
        return "text"
    raise DataError(
        f"{where}: no {fields.messages!r}, {fields.prompt!r} and {fields.completion!r}, or "
        f"{fields.text!r} field to tell the data's format by (fields: {', '.join(record)}); "
        "name them with --messages-field, --prompt-field, --completion-field or --text-field, "
        "or give --data-format"
    )
