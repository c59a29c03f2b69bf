"""``mmnnx train``: its flags are the options of ``mmnnx.train.config``."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import pathlib
import sys
from typing import TYPE_CHECKING, Any

from mmnnx.cli.flags import add_options
from mmnnx.cli.partition import problem as partition_problem
from mmnnx.mpmd.schedules import get
from mmnnx.mpmd.schedules.registry import Placement, registered
from mmnnx.train.config import RunConfig
from mmnnx.train.run_config import CONFIG_FILE, resolved_config, write_config
from mmnnx.train.run_outputs import output_problem, run_outputs
from mmnnx.tuning import parse_bytes

if TYPE_CHECKING:  # for annotations only: run() imports what it uses
    from mmnnx.train.checkpoint import Checkpointer
    from mmnnx.train.run_record import Saved
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
    add_options(train, RunConfig)
    return train


def error(message: str) -> int:
    """``message`` as ``mmnnx train``'s one line on stderr; exit status 2."""
    print(f"mmnnx train: error: {message}", file=sys.stderr)
    return 2


def check(args: argparse.Namespace) -> str | None:
    """The first inconsistency among the flags taken together, or None.

    Example:
        >>> from mmnnx.cli import parse_args
        >>> check(parse_args(["train", "--depth", "1"]))
        '--depth 1 gives fewer blocks than --stages 2'
    """
    problem = _experts_problem(args)
    if problem:
        return problem
    used = _devices_needed(args)
    if used > args.devices:
        return f"{_layout(args)} needs {used} devices, but --devices is {args.devices}"
    problem = _lora_problem(args)
    if problem:
        return problem
    blocks, depth = args.depth, f"--depth {args.depth}"
    if args.init_from is not None:
        problem, pretrained = _pretrained(args)
        if problem:
            return problem
        blocks, depth = pretrained.depth, f"--init-from's num_hidden_layers {pretrained.depth}"
    else:
        problem = _heads_problem(args)
        if problem:
            return problem
    if blocks < args.stages:
        return f"{depth} gives fewer blocks than --stages {args.stages}"
    problem = partition_problem(args, blocks, depth)
    if problem:
        return problem
    v, name = args.virtual_stages, args.schedule
    placement = None if name == "auto" else registered(name).placement
    if placement is Placement.V_SHAPED and v != 2:
        return f"--schedule {name} needs --virtual-stages 2 (two stages per task, in a V)"
    if placement is Placement.INTERLEAVED and v < 2:
        return f"--schedule {name} needs --virtual-stages 2 or more (several stages per task)"
    if v > 1 and placement in (None, Placement.ONE_PER_RANK):
        return (
            f"--virtual-stages {v} needs a schedule that runs several stages per task "
            "(interleaved-*, zero-bubble-v, dualpipev); --schedule "
            f"{name} runs one"
        )
    if v > 1 and args.scan_layers:
        return f"--virtual-stages {v} needs the blocks as a list: leave out --scan-layers"
    if blocks < args.stages * v:
        return (
            f"{depth} gives fewer blocks than --stages {args.stages} x --virtual-stages {v} stages"
        )
    if args.scan_layers and blocks % args.stages:
        return (
            f"--scan-layers splits {depth} blocks into equal chunks, one per stage; "
            f"--stages {args.stages} does not divide it"
        )
    if args.batch_size % args.microbatches:
        return (
            f"--batch-size {args.batch_size} is not divisible by --microbatches {args.microbatches}"
        )
    rows, shards = args.batch_size // args.microbatches, args.data_axis * args.expert_axis
    if rows % shards:
        over = f"--data-axis {args.data_axis}"
        if args.expert_axis > 1:
            over += f" x --expert-axis {args.expert_axis} (the tokens are split over both)"
        return f"a microbatch of {rows} sequences is not divisible by {over}"
    problem = output_problem(
        run_outputs(
            args.output_dir,
            args.checkpoint_dir,
            timeline=bool(args.timeline_step),
            tensorboard=args.tensorboard,
            profile=args.profile_steps is not None,
            wandb=args.wandb is not None,
        )
    )
    if problem:
        return problem
    if args.memory_budget is not None:
        if args.schedule != "auto" and args.partition != "auto":
            return "--memory-budget needs --schedule auto or --partition auto"
        try:
            budget = parse_bytes(args.memory_budget)
        except ValueError as e:
            return f"--memory-budget: {e}"
        if budget <= 0:
            return f"--memory-budget must be positive, got {args.memory_budget}"
    if args.vocab_size is not None and args.tokenizer != "bpe" and not args.resume:
        return "--vocab-size needs --tokenizer bpe"
    if args.wandb_name is not None and args.wandb is None:
        return "--wandb-name needs --wandb PROJECT"
    if args.profile_steps is not None and args.profile_steps[0] > args.steps:
        return f"--profile-steps starts at step {args.profile_steps[0]}, after --steps {args.steps}"
    if args.schedule == "auto":
        return None
    try:
        get(args.schedule, args.stages * v, args.microbatches, v)
    except ValueError as e:
        with_v = f", --virtual-stages {v}" if v > 1 else ""
        return (
            f"--schedule {args.schedule} with --stages {args.stages}{with_v} and --microbatches "
            f"{args.microbatches}: {e}"
        )
    return None


def _heads_problem(args: argparse.Namespace) -> str | None:
    """Heads ``--dim`` cannot be cut into, or ``--model-axis`` cannot shard, or None."""
    if args.dim % args.heads:
        return f"--dim {args.dim} is not divisible by --heads {args.heads}"
    if (args.dim // args.heads) % 2:
        return (
            f"--dim {args.dim} / --heads {args.heads} gives heads of {args.dim // args.heads} "
            "dimensions; rotary position embeddings need an even head size"
        )
    if args.heads % args.model_axis:
        return f"--heads {args.heads} is not divisible by --model-axis {args.model_axis}"
    return None


def _devices_needed(args: argparse.Namespace) -> int:
    """The devices the run's layout multiplies into (:func:`_layout` names them)."""
    return args.stages * args.data_axis * args.expert_axis * args.model_axis


def _layout(args: argparse.Namespace) -> str:
    """The flags that multiply into the devices a run needs, as one names them."""
    expert = f" x --expert-axis {args.expert_axis}" if args.expert_axis > 1 else ""
    return (
        f"--stages {args.stages} x --data-axis {args.data_axis}{expert} x --model-axis "
        f"{args.model_axis}"
    )


def _experts_problem(args: argparse.Namespace) -> str | None:
    """A mixture-of-experts option without ``--experts``, or experts the flags cannot route,
    split or stack; None when there is none."""
    from mmnnx.models.gpt import GPTConfig  # noqa: PLC0415
    from mmnnx.train.config import MOE  # noqa: PLC0415

    if args.experts is None:
        for name in MOE[1:]:
            if getattr(args, name) is not None:
                return f"--{name.replace('_', '-')} needs --experts E"
        if args.expert_axis > 1:
            return f"--expert-axis {args.expert_axis} needs --experts E"
        return None
    if args.init_from is not None:  # a conflict: the checkpoint says (see _pretrained)
        return None
    e, n = args.experts, args.expert_axis
    k = args.experts_per_token or GPTConfig.experts_per_token
    every = args.moe_every or GPTConfig.moe_every
    if k > e:
        return f"--experts-per-token {k} is more than --experts {e}: a token picks K of E experts"
    if args.capacity_factor is not None and args.capacity_factor > e:
        return (
            f"--capacity-factor {args.capacity_factor:g} is more than --experts {e}: from "
            f"{e / k:g} (E / K) on no expert drops a token; leave it out for dropless routing"
        )
    if e % n:
        return f"--experts {e} is not divisible by --expert-axis {n} (E / N experts per device)"
    if every > args.depth:
        return (
            f"--moe-every {every} leaves none of --depth {args.depth} blocks a mixture of experts"
        )
    if args.scan_layers and every > 1:
        return (
            f"--scan-layers stacks alike blocks, but --moe-every {every} leaves some dense; "
            "use --moe-every 1 with it"
        )
    hidden = args.expert_hidden or int(GPTConfig.mlp_ratio * args.dim)
    if hidden % args.model_axis:
        return (
            f"the experts' hidden size {hidden} (--expert-hidden) is not divisible by "
            f"--model-axis {args.model_axis}"
        )
    return None


def _lora_problem(args: argparse.Namespace) -> str | None:
    """A LoRA option given without ``--lora-rank``, or a target of ``--lora-targets`` a model
    trained from scratch would not have; None when there is none."""
    if args.lora_rank is None:
        options = (("--lora-alpha", args.lora_alpha), ("--lora-targets", args.lora_targets))
        for flag, value in options:
            if value is not None:
                return f"{flag} needs --lora-rank R"
    if args.init_from is None and args.lora_targets:  # --init-from's: see _pretrained
        from mmnnx.train.config import gpt_config  # noqa: PLC0415

        return _targets_problem(args.lora_targets, gpt_config(vars(args), 256), "the model")
    return None


def _targets_problem(targets: tuple[str, ...], config: Any, model: str) -> str | None:
    """The first of ``targets`` (``--lora-targets``) naming no Linear of ``GPT(config)``
    (``model``, in words), or None."""
    from mmnnx.train.run_model import linear_names  # noqa: PLC0415

    have = linear_names(config)
    missing = [t for t in targets if t not in have]
    if not missing:
        return None
    why = {
        "router": "no mixture of experts (--experts)",
        "gate": "no gated MLP (--gated-mlp)",
    }.get(missing[0], "no such projection")
    return (
        f"--lora-targets {missing[0]}: {model} has {why}; its projections are "
        f"{','.join(t for t in have)}"
    )


def _pretrained(args: argparse.Namespace) -> tuple[str | None, Any]:
    """The first problem of ``--init-from`` (an architecture flag given with it, a directory
    mmnnx cannot build, no tokenizer, sizes the layout cannot shard) and the ``GPTConfig``
    of its ``config.json``."""
    from mmnnx.cli.flags import given  # noqa: PLC0415
    from mmnnx.models import CheckpointError, pretrained_config  # noqa: PLC0415
    from mmnnx.models.pretrained import check_tokenizer  # noqa: PLC0415
    from mmnnx.models.pretrained.files import TOKENIZER  # noqa: PLC0415
    from mmnnx.train.config import ARCHITECTURE  # noqa: PLC0415

    conflicting = [name for name in ARCHITECTURE if name in given(args)]
    if conflicting:
        flag = "--" + conflicting[0].replace("_", "-")
        return (
            f"{flag} conflicts with --init-from: the architecture and tokenizer come from "
            f"{args.init_from}/config.json and tokenizer.json"
        ), None
    try:  # with the run's --scan-layers: a MoE whose layers are not all alike cannot stack
        config = pretrained_config(args.init_from, scan_layers=args.scan_layers)
    except CheckpointError as e:
        return f"--init-from: {e}", None
    tokenizer = pathlib.Path(args.init_from, TOKENIZER)
    if not tokenizer.is_file():
        return (
            f"--init-from: {tokenizer} does not exist; mmnnx train reads the text with the "
            "checkpoint's own tokenizer"
        ), None
    try:
        check_tokenizer(args.init_from, config.vocab_size)
    except CheckpointError as e:
        return f"--init-from: {e}", None
    problem = _targets_problem(args.lora_targets or (), config, f"{args.init_from}")
    if problem:
        return problem, None
    for name, size in (
        ("num_attention_heads", config.num_heads),
        ("num_key_value_heads", config.num_kv_heads or config.num_heads),
        ("vocab_size", config.vocab_size),
    ):
        if size % args.model_axis:
            return (
                f"--init-from's {name} {size} is not divisible by --model-axis {args.model_axis}"
            ), None
    return None, config


def run(args: argparse.Namespace) -> int:
    """``mmnnx train`` with the flags ``args`` (checked): 0 when trained, 1 when the loss is no
    longer finite, 2 for an input error found only now (one line on stderr), 143 (128 +
    ``SIGTERM``) when a preemption notice stopped it after saving (``--resume`` continues).

    Nothing is written into the run's directories before a resumed run's options and tokenizer
    are checked against the record its checkpoints hold (``run_record``), nor before the
    checkpoint directory's writer lock is held (``Checkpointer.claim``; with several processes,
    by process 0)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.devices}"
    import jax  # noqa: PLC0415  (after XLA_FLAGS)

    import mmnnx as mm  # noqa: PLC0415

    mm.distributed.initialize()  # under `mmnnx launch` or a cluster; a no-op alone
    from mmnnx.train import checkpoint as ck  # noqa: PLC0415
    from mmnnx.train.config import ARCHITECTURE  # noqa: PLC0415
    from mmnnx.train.data import EMBEDDED  # noqa: PLC0415

    checkpoints = pathlib.Path(args.checkpoint_dir or pathlib.Path(args.output_dir, "checkpoints"))
    fresh = not args.resume and checkpoints.is_dir()
    if fresh and any(p.name.isdigit() for p in checkpoints.iterdir()):
        return error(
            f"{checkpoints} already holds checkpoints; pass --resume to continue from them, or "
            "choose another --output-dir or --checkpoint-dir"
        )
    try:
        data_axis = _data_axis(args, len(jax.devices()))
    except ValueError as e:
        return error(str(e))
    options = vars(args)
    if args.init_from is not None:  # the checkpoint's architecture, not the flags' defaults
        options = {k: v for k, v in options.items() if k not in ARCHITECTURE}
    resumed = _resumed(args, options, checkpoints) if args.resume else _Resumed()
    if resumed.problem:
        return error(resumed.problem)
    sources = args.text or [EMBEDDED]
    try:
        tokenizer = _tokenizer(args, sources)
    except (OSError, ValueError) as e:
        return error(str(e))
    problem = _tokenizer_problem(args, tokenizer, resumed.saved)
    if problem:
        return error(problem)
    with ck.Checkpointer(checkpoints) as checkpointer:
        try:
            checkpointer.claim()  # before the first byte written: one writer per run
        except ck.CheckpointDirectoryBusyError as e:
            return error(str(e))
        weights = not resumed.has_steps  # a resumed run's come from its checkpoint
        trained = _train(
            args, options, tokenizer, sources, checkpointer, data_axis=data_axis, weights=weights
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
    from mmnnx.train.generation import continue_text  # noqa: PLC0415

    room = model.config.max_seq_len - len(tokenizer.encode(SAMPLE_PROMPT))
    if room < 1:
        print(f"sample: none (--seq-len {args.seq_len} leaves no room after {SAMPLE_PROMPT!r})")
        return 0
    text = continue_text(model, tokenizer, SAMPLE_PROMPT, min(48, room))
    print(f'sample (greedy; more: mmnnx generate --run {args.output_dir} --prompt "...")')
    print(text)
    return 0


@dataclasses.dataclass(frozen=True)
class _Resumed:
    """What ``--resume`` found before anything is written: whether there is any checkpoint step,
    the record the newest readable one holds, and the first problem (a line), if any."""

    has_steps: bool = False
    saved: Saved | None = None  # None: no step whose extra reads back
    problem: str | None = None


def _resumed(
    args: argparse.Namespace, options: dict[str, Any], checkpoints: pathlib.Path
) -> _Resumed:
    """The checkpoints ``--resume`` continues from, checked: ``--steps`` beyond the latest, and
    ``options`` as the newest step's record has them (a step without one is said to be
    unchecked, in one line)."""
    import jax  # noqa: PLC0415

    from mmnnx.cli.flags import given  # noqa: PLC0415
    from mmnnx.train import checkpoint as ck  # noqa: PLC0415
    from mmnnx.train.run_record import may_change, saved_record  # noqa: PLC0415

    if not checkpoints.is_dir():
        _say_no_checkpoint(checkpoints)
        return _Resumed()
    with ck.Checkpointer(checkpoints) as ckpt:
        latest = ckpt.latest_step()
        if not (ckpt.all_steps() or ckpt.incomplete_steps()):
            _say_no_checkpoint(checkpoints)
            return _Resumed()
        saved = saved_record(ckpt)
    if latest is not None and latest >= args.steps:
        return _Resumed(
            problem=f"the latest checkpoint in {checkpoints} is step {latest}; --steps "
            f"{args.steps} trains nothing more (give --steps above {latest})"
        )
    if saved is None:  # no step's extra reads back: the restore says why
        return _Resumed(True)
    if saved.record is None:
        if jax.process_index() == 0:
            print(
                f"mmnnx train: --resume: checkpoint step {saved.step} holds no run record (saved "
                "by an mmnnx that kept none): its options and tokenizer cannot be checked",
                file=sys.stderr,
            )
        return _Resumed(True, saved)
    mismatch = saved.record.mismatch(options)
    if mismatch is None:
        return _Resumed(True, saved)
    if mismatch.name in given(args):
        have, had = mismatch.as_flags()
    else:  # from the run's config.toml, edited since
        have, had = mismatch.as_keys()
        have = f"{pathlib.Path(args.output_dir, CONFIG_FILE)} has {have}"
    return _Resumed(
        problem=f"{have}: the run in {args.output_dir} was trained with {had} (checkpoint "
        f"step {saved.step} records it); {may_change()}"
    )


def _say_no_checkpoint(checkpoints: pathlib.Path) -> None:
    print(
        f"mmnnx train: --resume: no checkpoint in {checkpoints}; starting from step 0",
        file=sys.stderr,
    )


def _tokenizer_problem(
    args: argparse.Namespace, tokenizer: Tokenizer, saved: Saved | None
) -> str | None:
    """A resumed run's ``tokenizer`` that is not the one its record names, in one line; or
    None (also for no record)."""
    from mmnnx.train.tokenizers import fingerprint  # noqa: PLC0415

    if saved is None or saved.record is None or saved.record.tokenizer == fingerprint(tokenizer):
        return None
    folder = pathlib.Path(args.output_dir, "tokenizer")
    what = f"{folder} holds a tokenizer that" if folder.is_dir() else f"{folder} is missing; one"
    return (
        f"--resume: {what} is not the one the run was trained with (checkpoint step "
        f"{saved.step} records another): were its files replaced?"
    )


def _train(
    args: argparse.Namespace,
    options: dict[str, Any],
    tokenizer: Tokenizer,
    sources: list,
    checkpointer: Checkpointer,
    *,
    data_axis: int,
    weights: bool,
) -> int | tuple[Any, Any]:
    """The run itself, its ``checkpointer`` claimed: the token cache, model, tokenizer and
    ``config.toml`` written, then ``fit``; the model and ``FitResult``, or an exit status
    (an input error found only now, one line on stderr). ``weights``: read ``--init-from``'s
    (a run resumed from a checkpoint takes them from there); ``data_axis``: the layout's, as
    ``_data_axis`` fitted it to the devices."""
    import jax  # noqa: PLC0415

    import mmnnx as mm  # noqa: PLC0415
    from mmnnx.cli.partition import latest_extra, stages  # noqa: PLC0415
    from mmnnx.errors import NoCandidateError  # noqa: PLC0415
    from mmnnx.models import CheckpointError  # noqa: PLC0415
    from mmnnx.train import checkpoint as ck  # noqa: PLC0415
    from mmnnx.train.config import train_config  # noqa: PLC0415
    from mmnnx.train.data import DataStateError, TextDataset  # noqa: PLC0415
    from mmnnx.train.generation import run_tasks  # noqa: PLC0415
    from mmnnx.train.loop import fit  # noqa: PLC0415
    from mmnnx.train.run_model import build_model, model_config, trainable  # noqa: PLC0415
    from mmnnx.train.run_record import RunRecord  # noqa: PLC0415
    from mmnnx.train.wandb_writer import WandbStartError  # noqa: PLC0415

    try:
        dataset = TextDataset.from_files(
            sources,
            tokenizer,
            pathlib.Path(args.output_dir, "data"),
            seq_len=args.seq_len,
            batch_size=args.batch_size,
            seed=args.seed,
        )
    except (OSError, ValueError) as e:
        return error(str(e))
    tasks = run_tasks(args.stages, data_axis, args.model_axis, args.expert_axis)
    config = model_config(options, tokenizer.vocab_size)
    batch, extra = dataset.eval_batches(1)[0], latest_extra(checkpointer) if args.resume else None
    try:
        placed = stages(args, options, config, tasks, batch, extra, data_axis=data_axis)
    except (ValueError, NoCandidateError) as e:
        return error(f"--partition {args.partition}: {e}")
    try:
        model = build_model(options, config, placed.rules, weights=weights)
    except CheckpointError as e:
        return error(f"--init-from: {e}")
    recorded = resolved_config(options)
    if jax.process_index() == 0:
        tokenizer.save(pathlib.Path(args.output_dir, "tokenizer"))
        write_config(pathlib.Path(args.output_dir, CONFIG_FILE), recorded)
    table = mm.tabulate(model, dataset.eval_batches(1)[0][:, :-1], depth=2)
    if jax.process_index() == 0:
        print(table)
    try:
        result = fit(
            model,
            dataset,
            placed.train_config(train_config(options)),
            trainable=trainable(options),
            wandb_config=recorded,
            checkpointer=checkpointer,
            checkpoint_extra={**RunRecord.of(options, tokenizer).extra(), **placed.extra()},
        )
    except (
        ck.CheckpointMismatchError,
        ck.CheckpointCorruptError,
        ck.NoReadableCheckpointError,
        DataStateError,
    ) as e:
        return error(f"--resume: {e}")
    except NoCandidateError as e:
        return error(f"--schedule auto: {e}")
    except (ck.CheckpointDirectoryBusyError, WandbStartError) as e:
        return error(str(e))
    return model, result


def _data_axis(args: argparse.Namespace, devices: int) -> int:
    """The data axis the run's stages are laid out with on ``devices`` (all of
    ``jax.devices()``): ``--data-axis``, or with ``--resume`` a narrower one where the layout
    needs more devices than the job has (said in one line, :mod:`mmnnx.cli.replan`).

    Raises:
        ValueError: the layout does not fit, even narrowed; the message says why, in one line.
    """
    import jax  # noqa: PLC0415

    from mmnnx.cli.replan import narrowed_data_axis, replanned_line  # noqa: PLC0415

    needed = _devices_needed(args)
    if devices >= needed:
        return args.data_axis
    many = jax.process_count() > 1
    where = f" ({jax.process_count()} processes x {jax.local_device_count()})" if many else ""
    problem = f"only {devices} devices are available{where}; {_layout(args)} needs {needed}"
    if not args.resume:
        raise ValueError(problem)
    axes = (args.stages, args.data_axis, args.expert_axis, args.model_axis)
    narrowed = narrowed_data_axis(*axes, devices)
    if narrowed is None:
        least = needed // args.data_axis
        raise ValueError(
            f"{problem}; --resume narrows only --data-axis, and --data-axis 1 needs {least}"
        )
    per_stage = narrowed * args.expert_axis * args.model_axis
    if jax.process_index() == 0:
        line = replanned_line(_layout(args), needed, f"{devices}{where}", narrowed, per_stage)
        print(line, file=sys.stderr)
    return narrowed


def _tokenizer(args: argparse.Namespace, sources: list) -> Any:
    """The run's tokenizer: with --resume, the one saved under OUTPUT_DIR/tokenizer; with
    --init-from, the checkpoint's tokenizer.json; bytes; else a BPE trained on ``sources``
    (streamed) by every process, checked to be the same (no process waits for another's
    training, however long it takes)."""
    from mmnnx.distributed.agree import check_same_everywhere  # noqa: PLC0415
    from mmnnx.train.corpus import text_chunks  # noqa: PLC0415
    from mmnnx.train.tokenizers import (  # noqa: PLC0415
        BPETokenizer,
        ByteTokenizer,
        HFTokenizer,
        fingerprint,
        load_tokenizer,
    )

    saved = pathlib.Path(args.output_dir, "tokenizer")
    if args.resume and saved.is_dir():
        tokenizer = load_tokenizer(saved)
        if args.init_from is not None and tokenizer.name != HFTokenizer.name:
            raise ValueError(
                f"--init-from: the run in {args.output_dir} was trained from scratch with "
                f"--tokenizer {tokenizer.name} (saved in {saved})"
            )
        if args.init_from is None and tokenizer.name != args.tokenizer:
            raise ValueError(
                f"--tokenizer {args.tokenizer}: the run in {args.output_dir} was trained with "
                f"--tokenizer {tokenizer.name} (saved in {saved})"
            )
        return tokenizer
    if args.init_from is not None:
        return HFTokenizer.from_file(pathlib.Path(args.init_from, "tokenizer.json"))
    if args.tokenizer == "bytes":
        return ByteTokenizer()
    import jax  # noqa: PLC0415

    tokenizer = BPETokenizer.train(text_chunks(sources), args.vocab_size or 1024)
    if jax.process_count() > 1:  # training is deterministic: each trains, all check
        digest = fingerprint(tokenizer)
        check_same_everywhere("--tokenizer bpe: the BPE each process trained", [digest])
    return tokenizer
