"""``mmnnx train``: its flags are the options of ``mmnnx.train.config``, checked together by
``mmnnx.train.validate``."""

from __future__ import annotations

import argparse
import math
import pathlib
from collections.abc import Set
from typing import TYPE_CHECKING, Any

from mmnnx.cli import prologue
from mmnnx.cli.flags import add_options
from mmnnx.train.config import UNRECORDED, RunConfig
from mmnnx.train.run_config import CONFIG_FILE, resolved_config, write_config

if TYPE_CHECKING:  # for annotations only: run() imports what it uses
    from mmnnx.train.checkpoint import Checkpointer
    from mmnnx.train.tokenizers import Tokenizer

SAMPLE_PROMPT = "In the beginning"  # of the greedy sample printed at the end of a run


def add_parser(commands: Any) -> argparse.ArgumentParser:
    train = commands.add_parser(
        "train",
        help="train the reference GPT, pipelined over several submeshes",
        description="Train the reference GPT (byte-level) on the embedded public-domain text or "
        "your own files, as stages x (data x model) submeshes, pipelined with a schedule.",
    )
    train.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="a TOML file of these flags, one table per group below ([model], [layout], "
        "[training], [outputs]; keys as the flags: seq_len = 64); flags given here override it. "
        "Every run writes its resolved flags to OUTPUT_DIR/config.toml, which --resume reads",
    )
    train.add_argument(
        "--layout-from",
        default=None,
        metavar="PLAN",
        help="run the layout of PLAN, a file of mmnnx plan --json (e.g. mmnnx plan --run "
        "OUTPUT_DIR --json > plan.json): its stages, axes, schedule, microbatches and remat set "
        "those flags (over --config and the run's config.toml); with --resume, a run continues "
        "under the plan's layout",
    )
    add_options(train, RunConfig)
    return train


def holds_steps(checkpoints: pathlib.Path) -> bool:
    """Whether ``checkpoints`` holds a step directory (complete or not)."""
    return checkpoints.is_dir() and any(p.name.isdigit() for p in checkpoints.iterdir())


def error(message: str) -> int:
    """``message`` as ``mmnnx train``'s one line on stderr; exit status 2."""
    return prologue.error("train", message)


def run(config: RunConfig, given: Set[str] = frozenset(), *, pretrained: Any = None) -> int:
    """``mmnnx train`` with the checked options ``config``: 0 when trained, 1 when the loss is
    no longer finite, 2 for an input error found only now, 143 when preempted after saving.
    Nothing is written before a resumed run is checked and the writer lock is held."""
    prologue.start(config.layout.devices)
    import jax  # noqa: PLC0415  (after XLA_FLAGS)

    import mmnnx as mm  # noqa: PLC0415
    from mmnnx.cli.replan import data_axis as fitted_data_axis  # noqa: PLC0415
    from mmnnx.train import checkpoint as ck  # noqa: PLC0415
    from mmnnx.train.data import EMBEDDED  # noqa: PLC0415
    from mmnnx.train.run_model import model_config  # noqa: PLC0415
    from mmnnx.train.run_resume import (  # noqa: PLC0415
        ResumeCheck,
        resumed,
        run_tokenizer,
        tokenizer_problem,
    )
    from mmnnx.train.validate import memory_problem  # noqa: PLC0415

    outputs = config.outputs
    checkpoints = outputs.checkpoints()
    if not outputs.resume and holds_steps(checkpoints):
        return error(
            f"{checkpoints} already holds checkpoints; pass --resume to continue from them, or "
            "choose another --output-dir or --checkpoint-dir"
        )
    try:
        data_axis = fitted_data_axis(config, len(jax.devices()))
    except ValueError as e:
        return error(str(e))
    found = resumed(config, given, checkpoints) if outputs.resume else ResumeCheck()
    if found.problem:
        return error(found.problem)
    sources = config.training.text or [EMBEDDED]
    try:
        tokenizer = run_tokenizer(config, sources)
    except (OSError, ValueError) as e:
        return error(str(e))
    problem = tokenizer_problem(config, tokenizer, found.saved)
    if problem:
        return error(problem)
    gpt_config = pretrained or model_config(config, tokenizer.vocab_size)
    # predicted before anything compiles or is written (the checkpoint directory's lock, the
    # token file); more stages suggested only as many as the devices hold
    problem = memory_problem(config, gpt_config, data_axis, len(jax.devices()))
    if problem:
        return error(problem)
    with ck.Checkpointer(checkpoints) as checkpointer:
        try:
            checkpointer.claim()  # before the first byte written: one writer per run
        except ck.CheckpointDirectoryBusyError as e:
            return error(str(e))
        weights = not found.has_steps  # a resumed run's come from its checkpoint
        trained = _train(
            config,
            tokenizer,
            sources,
            checkpointer,
            data_axis=data_axis,
            weights=weights,
            config=gpt_config,
        )
    if isinstance(trained, int):
        return trained
    model, result = trained
    if result.preempted:  # saved; exits with 128 + SIGTERM
        return mm.distributed.Preemption.STATUS
    if not math.isfinite(result.final_eval):
        return 1
    if jax.process_count() > 1:  # a multi-process job's tasks span processes: see generate
        return 0
    return _sample(model, tokenizer, config)


def _sample(model: Any, tokenizer: Tokenizer, config: RunConfig) -> int:
    """Prints a greedy continuation of :data:`SAMPLE_PROMPT` by the trained ``model``, up to
    the first eos token of its ``--init-from`` checkpoint (where ``mmnnx generate`` stops)."""
    from mmnnx.train.generation import continue_text, stop_tokens  # noqa: PLC0415

    room = model.config.max_seq_len - len(tokenizer.encode(SAMPLE_PROMPT))
    if room < 1:
        seq_len = config.model.seq_len
        print(f"sample: none (--seq-len {seq_len} leaves no room after {SAMPLE_PROMPT!r})")
        return 0
    base = config.model.init_from
    try:
        eos = stop_tokens(base) if base else ()
    except ValueError as e:  # the run is saved: its sample alone is left out
        print(f"sample: none (--init-from: {e})")
        return 0
    text = continue_text(model, tokenizer, SAMPLE_PROMPT, min(48, room), eos=eos)
    print(f'sample (greedy; more: mmnnx generate --run {config.outputs.output_dir} --prompt "...")')
    print(text)
    return 0


def _train(
    run: RunConfig,
    tokenizer: Tokenizer,
    sources: list,
    checkpointer: Checkpointer,
    *,
    data_axis: int,
    weights: bool,
    config: Any,
) -> int | tuple[Any, Any]:
    """The run itself: the model and ``FitResult``, or an exit status."""
    import jax  # noqa: PLC0415

    import mmnnx as mm  # noqa: PLC0415
    from mmnnx.cli.partition import stages  # noqa: PLC0415
    from mmnnx.errors import NoCandidateError  # noqa: PLC0415
    from mmnnx.models import CheckpointError  # noqa: PLC0415
    from mmnnx.train import checkpoint as ck  # noqa: PLC0415
    from mmnnx.train.config import train_config  # noqa: PLC0415
    from mmnnx.train.data import DataStateError  # noqa: PLC0415
    from mmnnx.train.generation import run_tasks  # noqa: PLC0415
    from mmnnx.train.loop import fit  # noqa: PLC0415
    from mmnnx.train.run_data import run_dataset  # noqa: PLC0415
    from mmnnx.train.run_model import (  # noqa: PLC0415
        build_model,
        objective,
        trainable,
    )
    from mmnnx.train.run_record import RunRecord, saved_record  # noqa: PLC0415
    from mmnnx.train.wandb_writer import WandbStartError  # noqa: PLC0415

    out = pathlib.Path(run.outputs.output_dir)
    try:
        dataset = run_dataset(run, tokenizer, sources, out / "data")
    except (OSError, ValueError) as e:
        return error(str(e))
    if hasattr(dataset, "summary") and jax.process_index() == 0:
        print(dataset.summary())
    lay = run.layout  # a --resume narrowing the data axis narrows FSDP within it
    fsdp_axis = math.gcd(lay.fsdp_axis, data_axis)
    tasks = run_tasks(lay.stages, data_axis, lay.model_axis, lay.expert_axis, fsdp_axis=fsdp_axis)
    saved = saved_record(checkpointer) if run.outputs.resume else None
    extra = saved and saved.extra
    try:
        placed = stages(run, config, tasks, dataset.eval_batches(1)[0], extra, data_axis=data_axis)
    except (ValueError, NoCandidateError) as e:
        return error(f"--partition {run.layout.partition}: {e}")
    try:
        model = build_model(run, config, placed.rules, weights=weights)
    except CheckpointError as e:
        return error(f"--init-from: {e}")
    recorded = resolved_config({k: v for k, v in run.options().items() if k not in UNRECORDED})
    if jax.process_index() == 0:
        tokenizer.save(out / "tokenizer")
        write_config(out / CONFIG_FILE, recorded)
    sample = dataset.eval_batches(1)[0]
    tokens = sample["tokens"] if isinstance(sample, dict) else sample
    table = mm.tabulate(model, tokens[:, :-1], depth=2)
    if jax.process_index() == 0:
        print(table)
    try:
        result = fit(
            objective(run, model),
            dataset,
            placed.train_config(train_config(run)),
            trainable=trainable(run),
            wandb_config=recorded,
            checkpointer=checkpointer,
            checkpoint_extra={**RunRecord.of(run.options(), tokenizer).extra(), **placed.extra()},
        )
    except (*prologue.unrestorable(), DataStateError) as e:
        return error(f"--resume: {e}")
    except NoCandidateError as e:
        return error(f"--schedule auto: {e}")
    except (ck.CheckpointDirectoryBusyError, WandbStartError) as e:
        return error(str(e))
    return model, result
