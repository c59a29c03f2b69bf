"""Preference pairs as people keep them (``prompt``, ``chosen``, ``rejected`` records, text or
chat messages), tokenized as TRL's ``DPOTrainer`` does and served as :func:`pair_rows`
batches by Grain."""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from mmnnx.train.chat_template import ChatTemplate, ChatTemplateError
from mmnnx.train.data import GrainBatches, grain_batches
from mmnnx.train.preference import pair_rows
from mmnnx.train.records import DataError, PairFields, _field, _messages, held_out


@dataclasses.dataclass(frozen=True)
class Pair:
    """One record's prompt, chosen and rejected completion token ids."""

    prompt: list[int]
    chosen: list[int]
    rejected: list[int]
    where: str = ""


def encode_pair(
    where: str,
    record: dict,
    tokenizer,
    template: ChatTemplate | None = None,
    fields: PairFields | None = None,
    eos: str | None = None,
) -> Pair:
    """A record's :class:`Pair`, as TRL 1.16 tokenizes it: text fields with ``eos`` appended
    to each completion, or messages (the prompt a list of messages, each completion a list of
    assistant messages) rendered with ``template``, the prompt with the generation prompt;
    ``prompt + chosen`` and ``prompt + rejected`` tokenized whole, the prompt ending where
    either stops starting with the prompt's own tokens.

    Raises:
        DataError: a field missing or of the wrong kind, a template that fails, or a chosen
            completion identical to the rejected one, naming ``where`` and the field.

    Example:
        >>> from mmnnx.train.tokenizers import ByteTokenizer
        >>> pair = encode_pair("f:line 1", {"prompt": "1+1=", "chosen": "2", "rejected": "3"},
        ...                    ByteTokenizer())
        >>> pair.prompt, pair.chosen, pair.rejected
        ([49, 43, 49, 61], [50], [51])
    """
    fields = fields or PairFields()
    if isinstance(record.get(fields.prompt), list):
        if template is None:
            raise DataError(f"{where}: chat pairs need the tokenizer's chat template; none given")
        prompt = _messages(where, record, fields.prompt, assistant=False)
        try:
            texts = [template.text(prompt, add_generation_prompt=True)] + [
                template.text(prompt + _messages(where, record, f))
                for f in (fields.chosen, fields.rejected)
            ]
        except ChatTemplateError as e:
            raise DataError(f"{where}: {e}") from None
    else:
        prompt = _field(where, record, fields.prompt)
        answers = [_field(where, record, f) for f in (fields.chosen, fields.rejected)]
        if eos:
            answers = [a if a.endswith(eos) else a + eos for a in answers]
        texts = [prompt, *(prompt + a for a in answers)]
    prompt_ids, chosen, rejected = ([int(t) for t in tokenizer.encode(t)] for t in texts)
    if chosen == rejected:
        raise DataError(
            f"{where}: fields {fields.chosen!r} and {fields.rejected!r} are identical; a "
            "preference pair needs two different completions"
        )
    cut = len(os.path.commonprefix([prompt_ids, chosen, rejected]))
    return Pair(prompt=prompt_ids[:cut], chosen=chosen[cut:], rejected=rejected[cut:], where=where)


class PairDataset(GrainBatches):
    """Batches of ``batch_size`` :func:`pair_rows` rows of ``seq_len + 1`` tokens (laid out
    batch by batch: the pairs are held as token ids, never as rows of padding), each row a
    pair's ``prompt + chosen`` then ``prompt + rejected``, from a seeded shuffle (a fresh one
    per epoch) by Grain, its state part of a checkpoint. A pair longer than a row keeps the
    first ``(seq_len + 1) // 2`` tokens of each of its two sequences (TRL's ``max_length``
    with ``keep_start``), counted in ``truncated``; one whose prompt leaves no completion
    token in its half is dropped, counted in ``dropped``. ``eval_pairs`` (else the last
    ``eval_fraction`` of the pairs) give :meth:`eval_batches`.

    Example:
        >>> pairs = [Pair([1, 2], [3], [4, 5]) for _ in range(20)]
        >>> ds = PairDataset(pairs, seq_len=15, batch_size=4)
        >>> batch = next(ds)
        >>> batch["tokens"].shape, int(batch["chosen"][0].sum()), int(batch["rejected"][0].sum())
        ((4, 16), 1, 2)
    """

    def __init__(
        self,
        pairs: list[Pair],
        seq_len: int,
        batch_size: int,
        *,
        seed: int = 0,
        truncate: bool = True,
        eval_pairs: list[Pair] | None = None,
        eval_fraction: float = 0.05,
        pad_id: int = 0,
    ):
        pairs, eval_pairs = held_out(pairs, eval_pairs, eval_fraction)
        length = seq_len + 1
        self.truncated = self.dropped = 0
        kept = self._fitted(pairs, length, truncate)
        evaluated = self._fitted(eval_pairs, length, truncate)
        if len(kept) < batch_size or not evaluated:
            raise DataError(
                f"the data gives {len(kept)} training pairs and {len(evaluated)} held out that fit "
                f"--seq-len + 1 = {length} tokens, fewer than one batch of {batch_size} or none "
                "to evaluate on; use more data, a larger --seq-len or a smaller --batch-size"
            )
        self._kept, self._evaluated, self._row = kept, evaluated, (length, pad_id)
        self.batch_size, self.seq_len, self.pairs, self.skipped = batch_size, seq_len, len(kept), 0
        self._iterator, self._batches = grain_batches(np.arange(len(kept)), batch_size, seed)

    def _fitted(self, pairs: list[Pair], length: int, truncate: bool) -> list[Pair]:
        half, kept = length // 2, []
        for p in pairs:
            if len(p.prompt) + max(len(p.chosen), len(p.rejected)) <= half:
                kept.append(p)
                continue
            if not truncate:
                raise DataError(
                    f"{p.where}: prompt and completion of {len(p.prompt) + len(p.chosen)} and "
                    f"{len(p.prompt) + len(p.rejected)} tokens, more than the {half} each half "
                    "of a sequence holds ((--seq-len + 1) // 2); drop --no-truncate to cut them"
                )
            room = half - len(p.prompt)
            if room <= 0:
                self.dropped += 1
                continue
            self.truncated += 1
            kept.append(dataclasses.replace(p, chosen=p.chosen[:room], rejected=p.rejected[:room]))
        return kept

    def __next__(self) -> dict[str, np.ndarray]:
        return self._rows(self._kept, next(self._iterator))

    def _rows(self, pairs: list[Pair], picks) -> dict[str, np.ndarray]:
        """The rows of ``pairs[picks]``, laid out when asked: a batch's, not the dataset's."""
        chosen = [(pairs[i].prompt, pairs[i].chosen, pairs[i].rejected) for i in picks]
        return pair_rows(chosen, *self._row)

    def summary(self) -> str:
        """One line: the pairs, those cut to length and those dropped."""
        return (
            f"data: {self.pairs} preference pairs in rows of {self.seq_len + 1} tokens, "
            f"{self.truncated} cut to length, {self.dropped} dropped (prompt too long)"
        )

    def eval_batches(self, count: int) -> list[dict[str, np.ndarray]]:
        """``count`` fixed batches of the held-out pairs (the same every time), or as many as
        the pairs fill when they are fewer."""
        picks = self._eval_picks(count, len(self._evaluated))
        return [self._rows(self._evaluated, p) for p in picks]
