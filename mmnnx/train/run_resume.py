"""What ``mmnnx train --resume`` continues, found and checked before anything is written: the
run's checkpoints (their newest step's record against the run's options) and its tokenizer
(the one saved with the run, ``--init-from``'s, or a new one)."""

from __future__ import annotations

import dataclasses
import pathlib
import sys
from collections.abc import Set
from typing import Any

from mmnnx.train.config import RunConfig, flag
from mmnnx.train.run_config import CONFIG_FILE
from mmnnx.train.run_record import Saved


@dataclasses.dataclass(frozen=True)
class ResumeCheck:
    """What ``--resume`` found: any step, the newest readable one's record, the first problem."""

    has_steps: bool = False
    saved: Saved | None = None  # None: no step whose extra reads back
    problem: str | None = None


def resumed(run: RunConfig, given: Set[str], checkpoints: pathlib.Path) -> ResumeCheck:
    """The checkpoints ``--resume`` continues from, checked against ``run`` (``given``: set)."""
    import jax  # noqa: PLC0415

    from mmnnx.train import checkpoint as ck  # noqa: PLC0415
    from mmnnx.train.run_record import may_change, saved_record  # noqa: PLC0415

    found = checkpoints.is_dir()
    if found:
        with ck.Checkpointer(checkpoints) as ckpt:
            latest, saved = ckpt.latest_step(), saved_record(ckpt)
            found = bool(ckpt.all_steps() or ckpt.incomplete_steps())
    if not found:
        message = f"no checkpoint in {checkpoints}; starting from step 0"
        print(f"mmnnx train: --resume: {message}", file=sys.stderr)
        return ResumeCheck()
    steps, output_dir = run.training.steps, run.outputs.output_dir
    if latest is not None and latest >= steps:
        return ResumeCheck(
            problem=f"the latest checkpoint in {checkpoints} is step {latest}; "
            f"{flag('steps', steps)} trains nothing more (give {flag('steps')} above {latest})"
        )
    if saved is None:  # no step's extra reads back: the restore says why
        return ResumeCheck(True)
    if saved.record is None:
        if jax.process_index() == 0:
            print(
                f"mmnnx train: --resume: checkpoint step {saved.step} holds no run record (saved "
                "by an mmnnx that kept none): its options and tokenizer cannot be checked",
                file=sys.stderr,
            )
        return ResumeCheck(True, saved)
    mismatch = saved.record.mismatch(run.options())
    if mismatch is None:
        problem = saved.record.base_problem(run.model.init_from, saved.step)
        return ResumeCheck(True, saved, problem)
    if mismatch.name in given:
        have, had = mismatch.as_flags()
    else:  # from the run's config.toml, edited since
        have, had = mismatch.as_keys()
        have = f"{pathlib.Path(output_dir, CONFIG_FILE)} has {have}"
    return ResumeCheck(
        problem=f"{have}: the run in {output_dir} was trained with {had} (checkpoint "
        f"step {saved.step} records it); {may_change()}"
    )


def tokenizer_problem(run: RunConfig, tokenizer: Any, saved: Saved | None) -> str | None:
    """A resumed run's ``tokenizer`` that is not the one its record names, in one line."""
    from mmnnx.train.tokenizers import fingerprint  # noqa: PLC0415

    if saved is None or saved.record is None or saved.record.tokenizer == fingerprint(tokenizer):
        return None
    folder = pathlib.Path(run.outputs.output_dir, "tokenizer")
    what = f"{folder} holds a tokenizer that" if folder.is_dir() else f"{folder} is missing; one"
    return (
        f"--resume: {what} is not the one the run was trained with (checkpoint step "
        f"{saved.step} records another): were its files replaced?"
    )


def run_tokenizer(run: RunConfig, sources: list) -> Any:
    """The run's tokenizer: the one saved with the run, ``--init-from``'s, bytes, or a BPE each
    process trains on ``sources``, checked alike; a ``ValueError`` for a saved one of another
    kind than the options say."""
    from mmnnx.distributed.agree import check_same_everywhere  # noqa: PLC0415
    from mmnnx.train.corpus import text_chunks  # noqa: PLC0415
    from mmnnx.train.tokenizers import (  # noqa: PLC0415
        BPETokenizer,
        ByteTokenizer,
        HFTokenizer,
        fingerprint,
        load_tokenizer,
    )

    init_from, output_dir = run.model.init_from, run.outputs.output_dir
    kind = run.training.tokenizer
    saved = pathlib.Path(output_dir, "tokenizer")
    if run.outputs.resume and saved.is_dir():
        tokenizer = load_tokenizer(saved)
        scratch = init_from is None
        if tokenizer.name != (kind if scratch else HFTokenizer.name):
            given, how = (
                (flag("tokenizer", kind), "") if scratch else (flag("init_from"), " from scratch")
            )
            raise ValueError(
                f"{given}: the run in {output_dir} was trained{how} with "
                f"{flag('tokenizer', tokenizer.name)} (saved in {saved})"
            )
        return tokenizer
    if init_from is not None:
        return HFTokenizer.from_file(pathlib.Path(init_from, "tokenizer.json"))
    if kind == "bytes":
        return ByteTokenizer()
    import jax  # noqa: PLC0415

    tokenizer = BPETokenizer.train(text_chunks(sources), run.training.vocab_size or 1024)
    if jax.process_count() > 1:  # training is deterministic: each trains, all check
        digest = fingerprint(tokenizer)
        check_same_everywhere("--tokenizer bpe: the BPE each process trained", [digest])
    return tokenizer
