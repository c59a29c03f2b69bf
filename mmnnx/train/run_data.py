"""What a run trains on: windows of text (``--text``, the embedded text) or records
(``--data``: completions, chats or texts, one example a sequence or packed)."""

from __future__ import annotations

import functools
import pathlib
from typing import Any

from mmnnx.train.chat_template import ChatTemplate, special_tokens
from mmnnx.train.data import TextDataset
from mmnnx.train.examples import ExampleDataset
from mmnnx.train.pairs import PairDataset, encode_pair
from mmnnx.train.records import DataError, Fields, PairFields, encode_records, read_records


def run_dataset(run: Any, tokenizer: Any, sources: list, cache: pathlib.Path):
    """The dataset of a run's options (a ``RunConfig``): a :class:`TextDataset` of ``sources``
    tokenized into ``cache``, or with ``--data`` an :class:`ExampleDataset` of its records
    (Hugging Face ``datasets``' own cache under ``cache/datasets``).

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
    records = list(read(data.data))
    if not records:
        raise DataError(f"--data {data.data}: no records")
    if run.preference.dpo:
        return _pairs(run, tokenizer, records, read)
    data_format = data.data_format
    if data_format == "auto":
        data_format = _format(*records[0], fields)
    template = None
    if data_format == "chat":
        if folder is None:
            raise DataError("--data-format chat needs --init-from: its tokenizer's chat template")
        template = ChatTemplate.from_checkpoint(folder)
    tokens = template.tokens if template else special_tokens(folder) if folder else {}
    encode = functools.partial(
        encode_records,
        data_format=data_format,
        tokenizer=tokenizer,
        template=template,
        fields=fields,
        train_on=data.train_on,
        eos=tokens.get("eos_token"),
    )
    held_out = encode(read(data.eval_data)) if data.eval_data else None
    return ExampleDataset(
        encode(records),
        seed=run.training.seed,
        pack=data.pack,
        truncate=data.truncate,
        eval_examples=held_out,
        eval_fraction=data.eval_fraction,
        **shape,
    )


def _pairs(run: Any, tokenizer: Any, records: list, read: Any) -> PairDataset:
    data, folder, preference = run.dataset, run.model.init_from, run.preference
    fields = PairFields(data.prompt_field, preference.chosen_field, preference.rejected_field)
    chat = isinstance(records[0][1].get(fields.prompt), list)
    if chat and folder is None:
        raise DataError(f"{records[0][0]}: chat pairs need --init-from: its chat template")
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
