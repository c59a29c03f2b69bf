"""The ``mmnnx`` command line: ``mmnnx train`` trains the reference GPT on the embedded text (or
your own), pipelined over simulated CPU devices or real accelerators."""

from __future__ import annotations

import argparse
import math
import os
import pathlib
import sys
from collections.abc import Sequence
from typing import Any


def _schedule_names() -> tuple[str, ...]:
    from mmnnx.mpmd.schedules import names  # noqa: PLC0415

    return names()


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit status 2
        self.exit(2, f"{self.prog}: error: {message}\n")


def _integer(name: str, minimum: int, maximum: int | None = None):
    """An argparse type: an int of at least ``minimum`` (and at most ``maximum``), with a
    one-line reason otherwise."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{name} must be >= {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"{name} must be <= {maximum}, got {value}")
        return value

    return parse


def _positive(name: str):
    return _integer(name, 1)


def _finite_float(name: str, *, positive: bool):
    """An argparse type: a finite float, > 0 if ``positive`` else >= 0, with a one-line reason
    naming ``name`` otherwise."""
    bound = "> 0" if positive else ">= 0"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {text!r}") from None
        if not math.isfinite(value) or value < 0 or (positive and value == 0):
            raise argparse.ArgumentTypeError(
                f"{name} must be a finite number {bound}, got {text!r}"
            )
        return value

    return parse


def _step_range(text: str) -> tuple[int, int]:
    """``A:B`` as ``(A, B)``, steps with ``1 <= A <= B`` (``--profile-steps``)."""
    first, colon, last = text.partition(":")
    try:
        steps = (int(first), int(last)) if colon else (int(first), int(first))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--profile-steps must be FIRST:LAST steps, e.g. 10:12, got {text!r}"
        ) from None
    if not 1 <= steps[0] <= steps[1]:
        raise argparse.ArgumentTypeError(f"--profile-steps needs 1 <= FIRST <= LAST, got {text!r}")
    return steps


def _schedule_help() -> str:
    """``--schedule``'s help: each choice with what it needs of ``--virtual-stages``."""
    from mmnnx.mpmd.schedules.registry import Placement, registered  # noqa: PLC0415

    needs = {
        Placement.ONE_PER_RANK: "one stage per task",
        Placement.INTERLEAVED: "--virtual-stages 2 or more",
        Placement.V_SHAPED: "--virtual-stages 2",
        Placement.BUILDER_DECIDES: "as registered",
    }
    groups: dict[str, list[str]] = {}
    for name in _schedule_names():
        groups.setdefault(needs[registered(name).placement], []).append(name)
    choices = "; ".join(f"{', '.join(names)}: {need}" for need, names in groups.items())
    return (
        f"pipeline schedule (1f1b). {choices}. 'auto' (one stage per task) measures a step "
        "once and picks the fastest schedule that fits --memory-budget (mm.schedules.tune), "
        "printing its choice"
    )


def build_parser() -> argparse.ArgumentParser:
    from mmnnx.mpmd.pack import PACK_RESIDUAL_BYTES, PACK_WEIGHT_BYTES  # noqa: PLC0415

    parser = _Parser(prog="mmnnx", description="mmnnx: MPMD training for Flax NNX")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
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
    model = train.add_argument_group("model")
    model.add_argument("--dim", type=_positive("--dim"), default=128, help="model width (128)")
    model.add_argument(
        "--depth", type=_positive("--depth"), default=4, help="number of transformer blocks (4)"
    )
    model.add_argument("--heads", type=_positive("--heads"), default=4, help="attention heads (4)")
    model.add_argument(
        "--scan-layers",
        action="store_true",
        help="stack the blocks and run them with nnx.scan, each stage scanning its own chunk "
        "(--depth must be a multiple of --stages); traced once whatever the depth: use it for "
        "deep models (more than 32 blocks unrolled warn)",
    )
    model.add_argument(
        "--seq-len",
        type=_positive("--seq-len"),
        default=64,
        help="tokens per sequence (64)",
    )
    layout = train.add_argument_group("layout")
    layout.add_argument(
        "--stages", type=_positive("--stages"), default=2, help="pipeline stages, one task each (2)"
    )
    layout.add_argument(
        "--data-axis",
        type=_positive("--data-axis"),
        default=2,
        help="data-parallel size inside each stage (2)",
    )
    layout.add_argument(
        "--model-axis",
        type=_positive("--model-axis"),
        default=2,
        help="tensor-parallel size inside each stage (2)",
    )
    layout.add_argument(
        "--virtual-stages",
        type=_positive("--virtual-stages"),
        default=1,
        metavar="V",
        help="model stages per task (1): the blocks are cut into --stages x V stages, looped "
        "over the tasks for the interleaved schedules, down and back up (a V, the embedding "
        "and head on the first task) for zero-bubble-v and dualpipev",
    )
    layout.add_argument(
        "--devices",
        type=_positive("--devices"),
        default=8,
        help="simulated CPU devices when no accelerator is used (8)",
    )
    run = train.add_argument_group("training")
    run.add_argument(
        "--batch-size", type=_positive("--batch-size"), default=16, help="sequences per step (16)"
    )
    run.add_argument(
        "--microbatches",
        type=_positive("--microbatches"),
        default=4,
        help="microbatches per step (4)",
    )
    run.add_argument(
        "--schedule",
        choices=(*_schedule_names(), "auto"),
        default="1f1b",
        help=_schedule_help(),
    )
    run.add_argument(
        "--memory-budget",
        default=None,
        help="with --schedule auto: bytes per device the schedule may use (e.g. 2GiB)",
    )
    run.add_argument(
        "--pack-residuals",
        dest="pack_residuals",
        action="store_const",
        const=True,
        default=PACK_RESIDUAL_BYTES,
        help="return all of each forward's residuals as one buffer (mm.jit(pack_residuals=True)); "
        f"by default those of at most {PACK_RESIDUAL_BYTES // 1024} KiB are",
    )
    run.add_argument(
        "--no-pack-residuals",
        dest="pack_residuals",
        action="store_const",
        const=False,
        help="return each residual as an array of its own (mm.jit(pack_residuals=False))",
    )
    run.add_argument(
        "--no-pack-weights",
        dest="pack_weights",
        action="store_false",
        default=True,
        help="pass each block weight to the pipelined programs as an array of its own "
        "(mm.jit(pack_weights=False)); by default each block's weights of at most "
        f"{PACK_WEIGHT_BYTES // 1024} KiB travel as one buffer",
    )
    run.add_argument(
        "--steps", type=_positive("--steps"), default=300, help="optimizer steps (300)"
    )
    run.add_argument(
        "--schedule-steps",
        type=_positive("--schedule-steps"),
        default=None,
        help="horizon of the learning-rate schedule, warm-up + cosine decay (default: --steps; "
        "with --resume, the horizon saved with the checkpoint)",
    )
    run.add_argument(
        "--lr",
        type=_finite_float("--lr", positive=True),
        default=3e-3,
        help="peak learning rate (3e-3)",
    )
    run.add_argument(
        "--warmup-steps",
        type=_integer("--warmup-steps", 0),
        default=20,
        help="steps of linear learning-rate warm-up from 0 (20)",
    )
    run.add_argument(
        "--weight-decay",
        type=_finite_float("--weight-decay", positive=False),
        default=0.01,
        help="AdamW's decoupled weight decay (0.01)",
    )
    run.add_argument(
        "--eval-every",
        type=_positive("--eval-every"),
        default=50,
        help="steps between evaluations (50)",
    )
    run.add_argument(
        "--eval-batches",
        type=_positive("--eval-batches"),
        default=4,
        help="held-out batches each evaluation averages (4)",
    )
    run.add_argument(
        "--timeline-step",
        type=_integer("--timeline-step", 0),
        default=3,
        help="the step whose pipeline timeline is measured and drawn (3; 0: none)",
    )
    run.add_argument(
        "--seed", type=_integer("--seed", 0), default=0, help="initialisation and data seed (0)"
    )
    run.add_argument(
        "--text",
        nargs="+",
        default=None,
        metavar="PATH",
        help="your own UTF-8 text files or directories (default: embedded text); tokenized a "
        "chunk at a time into OUTPUT_DIR/data/tokens.bin, read from disk as training goes",
    )
    run.add_argument(
        "--tokenizer",
        choices=("bytes", "bpe"),
        default="bytes",
        help="bytes (256 tokens) or a byte-level BPE trained on the text (saved with the run "
        "under OUTPUT_DIR/tokenizer; --resume reuses it) (bytes)",
    )
    run.add_argument(
        "--vocab-size",
        type=_integer("--vocab-size", 256),
        default=None,
        help="with --tokenizer bpe: tokens of the BPE, at least 256; fewer if the text has "
        "fewer pairs to merge; --resume keeps the saved tokenizer's (1024)",
    )
    precision = train.add_argument_group("precision")
    precision.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="compute dtype of activations and matmuls; parameters and optimizer state stay "
        "float32 (float32)",
    )
    precision.add_argument(
        "--clip-grad-norm",
        type=_finite_float("--clip-grad-norm", positive=True),
        default=None,
        metavar="NORM",
        help="scale the gradients down to this global norm, over every stage's (default: none)",
    )
    logs = train.add_argument_group("logging")
    logs.add_argument(
        "--log-every",
        type=_positive("--log-every"),
        default=10,
        help="steps between logged metrics; without a terminal, one line each (10)",
    )
    logs.add_argument(
        "--no-tensorboard",
        dest="tensorboard",
        action="store_false",
        help="write no TensorBoard event files (by default under OUTPUT_DIR/tensorboard)",
    )
    logs.add_argument(
        "--profile-steps",
        type=_step_range,
        default=None,
        metavar="A:B",
        help="trace steps A to B with jax.profiler into OUTPUT_DIR/profile",
    )
    io = train.add_argument_group("outputs")
    io.add_argument(
        "--output-dir",
        default="runs/latest",
        help="metrics, loss curve and timeline go here (runs/latest)",
    )
    io.add_argument(
        "--checkpoint-dir", default=None, help="checkpoints (default: OUTPUT_DIR/checkpoints)"
    )
    io.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    io.add_argument(
        "--checkpoint-every",
        type=_positive("--checkpoint-every"),
        default=100,
        help="save a checkpoint every this many steps, and at the end (100)",
    )
    _add_launch(commands)
    _add_generate(commands)
    return parser


def _add_launch(commands: Any) -> None:
    launch = commands.add_parser(
        "launch",
        help="run a command as several local processes joined by mm.distributed.initialize",
        description="Run COMMAND as N processes on this machine (coordinator on 127.0.0.1), "
        "each output line prefixed with its rank. When one process fails (or stops "
        "responding) the others are stopped at once, the one that failed first is named, and "
        "the exit status is its own; with --max-restarts, all are then started again. Example: "
        "mmnnx launch -n 2 --devices-per-process 4 -- python train.py",
    )
    launch.add_argument("-n", "--nprocs", type=_positive("-n"), required=True, metavar="N")
    launch.add_argument(
        "--devices-per-process",
        type=_positive("--devices-per-process"),
        default=None,
        metavar="K",
        help="simulated CPU devices per process when JAX_PLATFORMS names no accelerator "
        "(default 1)",
    )
    launch.add_argument(
        "--port",
        type=_integer("--port", 1, 65535),
        default=None,
        help="coordinator port (default: a free one, a fresh one for each restart)",
    )
    launch.add_argument(
        "--collectives",
        choices=("none", "gloo", "mpi"),
        default=None,
        help="collectives between processes on CPU, needed only by tasks whose devices belong to "
        "several processes (default none: they slow down every collective)",
    )
    launch.add_argument(
        "--verbose",
        action="store_true",
        help="also print gloo's connection lines and JAX's C++ information logs "
        "(TF_CPP_MIN_LOG_LEVEL=0), left out by default; warnings and errors always show",
    )
    launch.add_argument(
        "--max-restarts",
        type=_integer("--max-restarts", 0),
        default=0,
        metavar="N",
        help="when a process fails, stop all and start all again, up to N times, one line each; "
        "the exit status is the last attempt's. Each process sees the attempt's number in "
        "MMNNX_RESTART_COUNT; `mmnnx train --resume` continues from the newest checkpoint (0)",
    )
    launch.add_argument(
        "--heartbeat-timeout",
        type=_positive("--heartbeat-timeout"),
        default=None,
        metavar="S",
        help="a process silent this long has stopped responding: JAX's heartbeat timeout in "
        "every process (MMNNX_HEARTBEAT_TIMEOUT), and how long the launcher lets a process "
        "stay stopped (SIGSTOP) before it names it and ends the job (default 20)",
    )
    launch.add_argument(
        "argv", nargs=argparse.REMAINDER, metavar="-- COMMAND", help="the command and its arguments"
    )


def _add_generate(commands: Any) -> None:
    generate = commands.add_parser(
        "generate",
        help="continue a prompt with the model of a run `mmnnx train` wrote",
        description="Rebuild the model of run directory DIR from DIR/config.toml, restore its "
        "newest checkpoint, and print PROMPT followed by its continuation (decoded with "
        "DIR/tokenizer). Each token is one step of a compiled decoder with a key/value cache; "
        "greedy unless --temperature is given. Example: mmnnx generate --run runs/demo "
        '--prompt "In the beginning"',
    )
    generate.add_argument("--run", required=True, metavar="DIR", help="the run's --output-dir")
    generate.add_argument("--prompt", required=True, metavar="TEXT", help="the text to continue")
    generate.add_argument(
        "--max-new-tokens",
        type=_positive("--max-new-tokens"),
        default=None,
        metavar="N",
        help="tokens to add (default: as many as the model's context, --seq-len, has room for)",
    )
    generate.add_argument(
        "--temperature",
        type=_finite_float("--temperature", positive=False),
        default=0.0,
        metavar="T",
        help="0 picks the likeliest token (greedy, the default); above 0, sample from the "
        "logits divided by T",
    )
    generate.add_argument(
        "--top-k",
        type=_positive("--top-k"),
        default=None,
        metavar="K",
        help="with --temperature, sample among the K likeliest tokens only",
    )
    generate.add_argument(
        "--seed", type=_integer("--seed", 0), default=0, help="sampling seed (0)", metavar="S"
    )
    generate.add_argument(
        "--layout",
        choices=("one-device", "run"),
        default="one-device",
        help="one-device (default), or run: the run's own --stages x --data-axis x "
        "--model-axis tasks, each stage's blocks and their cache on its submesh (mm.jit)",
    )


def run_generate(args: argparse.Namespace) -> int:
    """``mmnnx generate``: the prompt and its continuation on stdout, one line about the run
    on stderr; a run without config, tokenizer or checkpoint, or a prompt the model has no
    room for, exits 2 in one line."""

    def error(message: str) -> int:
        print(f"mmnnx generate: error: {message}", file=sys.stderr)
        return 2

    if not args.prompt:
        return error("--prompt is empty; give some text to continue")
    from mmnnx.train.generation import RunError, read_run_flags  # noqa: PLC0415

    try:
        flags = read_run_flags(args.run)
    except RunError as e:
        return error(f"--run: {e}")
    xla = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in xla:
        devices = flags.get("devices", 8)
        os.environ["XLA_FLAGS"] = f"{xla} --xla_force_host_platform_device_count={devices}"
    from mmnnx.train.checkpoint import (  # noqa: PLC0415
        CheckpointCorruptError,
        CheckpointMismatchError,
        NoReadableCheckpointError,
    )
    from mmnnx.train.generation import continue_text, load_run  # noqa: PLC0415

    try:
        run = load_run(args.run, layout=args.layout)
    except (
        RunError,
        CheckpointMismatchError,
        CheckpointCorruptError,
        NoReadableCheckpointError,
    ) as e:
        return error(f"--run: {e}")
    prompt_tokens = len(run.tokenizer.encode(args.prompt))
    room = run.model.config.max_seq_len - prompt_tokens
    if room < 1:
        return error(
            f"--prompt is {prompt_tokens} tokens; the model reads at most "
            f"{run.model.config.max_seq_len} (its --seq-len), leaving no room to continue"
        )
    if args.max_new_tokens is not None and args.max_new_tokens > room:
        return error(
            f"--max-new-tokens {args.max_new_tokens} exceeds the {room} tokens the model's "
            f"--seq-len {run.model.config.max_seq_len} leaves after a {prompt_tokens}-token prompt"
        )
    print(f"mmnnx generate: {args.run}, step {run.step}, layout {args.layout}", file=sys.stderr)
    text = continue_text(
        run.model,
        run.tokenizer,
        args.prompt,
        args.max_new_tokens or room,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
    )
    print(text)
    return 0


SAMPLE_PROMPT = "In the beginning"
"""The prompt of the greedy sample ``mmnnx train`` prints at the end of a run."""


def _print_sample(model: Any, tokenizer: Any, args: argparse.Namespace) -> None:
    """A greedy continuation of :data:`SAMPLE_PROMPT` by the trained ``model`` (on its own
    tasks), at most 48 tokens, as the run report's last lines."""
    from mmnnx.train.generation import continue_text  # noqa: PLC0415

    room = model.config.max_seq_len - len(tokenizer.encode(SAMPLE_PROMPT))
    if room < 1:
        print(f"sample: none (--seq-len {args.seq_len} leaves no room after {SAMPLE_PROMPT!r})")
        return
    text = continue_text(model, tokenizer, SAMPLE_PROMPT, min(48, room))
    print(f'sample (greedy; more: mmnnx generate --run {args.output_dir} --prompt "...")')
    print(text)


def run_launch(args: argparse.Namespace) -> int:
    from mmnnx.launcher.launch import LaunchError, launch  # noqa: PLC0415

    command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    try:
        return launch(
            command,
            args.nprocs,
            devices_per_process=args.devices_per_process,
            port=args.port,
            collectives=args.collectives,
            verbose=args.verbose,
            max_restarts=args.max_restarts,
            heartbeat_timeout_s=args.heartbeat_timeout,
        )
    except LaunchError as e:
        print(e, file=sys.stderr)
        return 2


def _check(args: argparse.Namespace) -> str | None:
    """The first inconsistency among the flags, or None."""
    used = args.stages * args.data_axis * args.model_axis
    if used > args.devices:
        return (
            f"--stages {args.stages} x --data-axis {args.data_axis} x --model-axis "
            f"{args.model_axis} needs {used} devices, but --devices is {args.devices}"
        )
    if args.depth < args.stages:
        return f"--depth {args.depth} gives fewer blocks than --stages {args.stages}"
    problem = _check_virtual_stages(args)
    if problem:
        return problem
    if args.scan_layers and args.depth % args.stages:
        return (
            f"--scan-layers splits --depth {args.depth} blocks into equal chunks, one per stage; "
            f"--stages {args.stages} does not divide it"
        )
    if args.dim % args.heads:
        return f"--dim {args.dim} is not divisible by --heads {args.heads}"
    if (args.dim // args.heads) % 2:
        return (
            f"--dim {args.dim} / --heads {args.heads} gives heads of {args.dim // args.heads} "
            "dimensions; rotary position embeddings need an even head size"
        )
    if args.heads % args.model_axis:
        return f"--heads {args.heads} is not divisible by --model-axis {args.model_axis}"
    if args.batch_size % args.microbatches:
        return (
            f"--batch-size {args.batch_size} is not divisible by --microbatches {args.microbatches}"
        )
    if (args.batch_size // args.microbatches) % args.data_axis:
        return (
            f"a microbatch of {args.batch_size // args.microbatches} sequences is not "
            f"divisible by --data-axis {args.data_axis}"
        )
    for flag, path in (
        ("--output-dir", args.output_dir),
        ("--checkpoint-dir", args.checkpoint_dir),
    ):
        if path is not None and pathlib.Path(path).exists() and not pathlib.Path(path).is_dir():
            return f"{flag} {path} is a file, not a directory"
    from mmnnx.mpmd.schedules import get  # noqa: PLC0415
    from mmnnx.tuning import parse_bytes  # noqa: PLC0415

    if args.memory_budget is not None:
        if args.schedule != "auto":
            return "--memory-budget needs --schedule auto"
        try:
            budget = parse_bytes(args.memory_budget)
        except ValueError as e:
            return f"--memory-budget: {e}"
        if budget <= 0:
            return f"--memory-budget must be positive, got {args.memory_budget}"
    if args.vocab_size is not None and args.tokenizer != "bpe" and not args.resume:
        return "--vocab-size needs --tokenizer bpe"
    if args.profile_steps is not None and args.profile_steps[0] > args.steps:
        return f"--profile-steps starts at step {args.profile_steps[0]}, after --steps {args.steps}"
    if args.schedule == "auto":
        return None
    v = args.virtual_stages
    try:
        get(args.schedule, args.stages * v, args.microbatches, v)
    except ValueError as e:
        with_v = f", --virtual-stages {v}" if v > 1 else ""
        return (
            f"--schedule {args.schedule} with --stages {args.stages}{with_v} and --microbatches "
            f"{args.microbatches}: {e}"
        )
    return None


def _stage_order(schedule: str) -> str:
    """``stage_rules``' ``order`` for ``schedule``: ``"v"`` for the V-shaped ones."""
    from mmnnx.mpmd.schedules.registry import Placement, registered  # noqa: PLC0415

    if schedule != "auto" and registered(schedule).placement is Placement.V_SHAPED:
        return "v"
    return "loop"


def _check_virtual_stages(args: argparse.Namespace) -> str | None:
    """What ``--schedule`` needs of ``--virtual-stages`` and the model, unless given."""
    from mmnnx.mpmd.schedules.registry import Placement, registered  # noqa: PLC0415

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
    if args.depth < args.stages * v:
        return (
            f"--depth {args.depth} gives fewer blocks than --stages {args.stages} x "
            f"--virtual-stages {v} stages"
        )
    return None


def train(args: argparse.Namespace) -> int:
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.devices}"
    import jax  # noqa: PLC0415  (after XLA_FLAGS)
    from flax import nnx  # noqa: PLC0415

    import mmnnx as mm  # noqa: PLC0415

    mm.distributed.initialize()  # under `mmnnx launch` or a cluster; a no-op alone
    from mmnnx.models import GPT  # noqa: PLC0415
    from mmnnx.models.stages import stage_rules  # noqa: PLC0415
    from mmnnx.train.data import EMBEDDED, TextDataset  # noqa: PLC0415
    from mmnnx.train.generation import gpt_config, run_tasks  # noqa: PLC0415
    from mmnnx.train.loop import TrainConfig, fit  # noqa: PLC0415

    checkpoints = pathlib.Path(args.checkpoint_dir or pathlib.Path(args.output_dir, "checkpoints"))
    if (
        not args.resume
        and checkpoints.is_dir()
        and any(p.name.isdigit() for p in checkpoints.iterdir())
    ):
        print(
            f"mmnnx train: error: {checkpoints} already holds checkpoints; pass --resume to "
            "continue from them, or choose another --output-dir or --checkpoint-dir",
            file=sys.stderr,
        )
        return 2
    needed = args.stages * args.data_axis * args.model_axis
    if len(jax.devices()) < needed:
        where = (
            f" ({jax.process_count()} processes x {jax.local_device_count()})"
            if jax.process_count() > 1
            else ""
        )
        print(
            f"mmnnx train: error: only {len(jax.devices())} devices are available{where}; "
            f"--stages {args.stages} x --data-axis {args.data_axis} x --model-axis "
            f"{args.model_axis} needs {needed}",
            file=sys.stderr,
        )
        return 2
    if args.resume:
        latest, any_step = _latest_checkpoint(checkpoints)
        if not any_step:
            print(
                f"mmnnx train: --resume: no checkpoint in {checkpoints}; starting from step 0",
                file=sys.stderr,
            )
        elif latest is not None and latest >= args.steps:
            print(
                f"mmnnx train: error: the latest checkpoint in {checkpoints} is step {latest}; "
                f"--steps {args.steps} trains nothing more (give --steps above {latest})",
                file=sys.stderr,
            )
            return 2
    sources = args.text or [EMBEDDED]
    try:
        tokenizer = _tokenizer(args, sources)
        dataset = TextDataset.from_files(
            sources,
            tokenizer,
            pathlib.Path(args.output_dir, "data"),
            seq_len=args.seq_len,
            batch_size=args.batch_size,
            seed=args.seed,
        )
    except (OSError, ValueError) as e:
        print(f"mmnnx train: error: {e}", file=sys.stderr)
        return 2
    tasks = run_tasks(args.stages, args.data_axis, args.model_axis)
    config = gpt_config(vars(args), tokenizer.vocab_size)

    def factory():
        return GPT(config, rngs=nnx.Rngs(args.seed))

    if jax.process_index() == 0:
        tokenizer.save(pathlib.Path(args.output_dir, "tokenizer"))
        _write_run_config(args)
    with nnx.use_eager_sharding(False):
        placement = stage_rules(
            nnx.eval_shape(factory),
            tasks,
            virtual_stages=args.virtual_stages,
            order=_stage_order(args.schedule),
        )
    model = mm.init(factory, placement)
    table = mm.tabulate(model, dataset.eval_batches(1)[0][:, :-1], depth=2)
    if jax.process_index() == 0:
        print(table)
    from mmnnx.errors import NoCandidateError  # noqa: PLC0415
    from mmnnx.train.checkpoint import (  # noqa: PLC0415
        CheckpointCorruptError,
        CheckpointDirectoryBusyError,
        CheckpointMismatchError,
        NoReadableCheckpointError,
    )

    try:
        result = fit(
            model,
            dataset,
            TrainConfig(
                steps=args.steps,
                learning_rate=args.lr,
                warmup_steps=args.warmup_steps,
                weight_decay=args.weight_decay,
                microbatches=args.microbatches,
                schedule=args.schedule,
                eval_every=args.eval_every,
                eval_batches=args.eval_batches,
                log_every=args.log_every,
                timeline_step=args.timeline_step,
                checkpoint_every=args.checkpoint_every,
                output_dir=args.output_dir,
                checkpoint_dir=args.checkpoint_dir,
                resume=args.resume,
                schedule_steps=args.schedule_steps,
                memory_budget=args.memory_budget,
                pack_residuals=args.pack_residuals,
                **({} if args.pack_weights else {"pack_weights": False}),
                clip_grad_norm=args.clip_grad_norm,
                virtual_stages=args.virtual_stages,
                tensorboard=args.tensorboard,
                profile_steps=args.profile_steps,
            ),
        )
    except (CheckpointMismatchError, CheckpointCorruptError, NoReadableCheckpointError) as e:
        print(f"mmnnx train: error: --resume: {e}", file=sys.stderr)
        return 2
    except NoCandidateError as e:
        print(f"mmnnx train: error: --schedule auto: {e}", file=sys.stderr)
        return 2
    except CheckpointDirectoryBusyError as e:
        print(f"mmnnx train: error: {e}", file=sys.stderr)
        return 2
    if not math.isfinite(result.final_eval):
        return 1
    if jax.process_count() == 1:  # a multi-process job's tasks span processes: see generate
        _print_sample(model, tokenizer, args)
    return 0


def _write_run_config(args: argparse.Namespace) -> None:
    """Every flag of this run, resolved, in ``OUTPUT_DIR/config.toml`` (``--resume`` and
    ``mmnnx generate`` read it back)."""
    from mmnnx.train.run_config import CONFIG_FILE, resolved_config, write_config  # noqa: PLC0415

    train_parser = _subparser(build_parser(), "train")
    write_config(pathlib.Path(args.output_dir, CONFIG_FILE), resolved_config(args, train_parser))


def _tokenizer(args: argparse.Namespace, sources: list) -> Any:
    """The run's tokenizer: bytes; with --resume, the one saved under OUTPUT_DIR/tokenizer;
    else a BPE trained on ``sources`` (streamed) by every process, checked to be the same (no
    process waits for another's training, however long it takes)."""
    from mmnnx.distributed.agree import check_same_everywhere  # noqa: PLC0415
    from mmnnx.train.corpus import text_chunks  # noqa: PLC0415
    from mmnnx.train.tokenizers import BPETokenizer, ByteTokenizer, load_tokenizer  # noqa: PLC0415

    saved = pathlib.Path(args.output_dir, "tokenizer")
    if args.resume and saved.is_dir():
        tokenizer = load_tokenizer(saved)
        if tokenizer.name != args.tokenizer:
            raise ValueError(
                f"--tokenizer {args.tokenizer}: the run in {args.output_dir} was trained with "
                f"--tokenizer {tokenizer.name} (saved in {saved})"
            )
        return tokenizer
    if args.tokenizer == "bytes":
        return ByteTokenizer()
    import hashlib  # noqa: PLC0415

    import jax  # noqa: PLC0415

    tokenizer = BPETokenizer.train(text_chunks(sources), args.vocab_size or 1024)
    if jax.process_count() > 1:  # training is deterministic: each trains, all check
        digest = hashlib.sha256(tokenizer.to_str().encode()).hexdigest()
        check_same_everywhere("--tokenizer bpe: the BPE each process trained", [digest])
    return tokenizer


def _latest_checkpoint(directory: pathlib.Path) -> tuple[int | None, bool]:
    """The latest complete step in ``directory``, and whether it holds any step directory."""
    if not directory.is_dir():
        return None, False
    from mmnnx.train.checkpoint import Checkpointer  # noqa: PLC0415

    with Checkpointer(directory) as ckpt:
        return ckpt.latest_step(), bool(ckpt.all_steps() or ckpt.incomplete_steps())


def _failed_now(status: int) -> int:
    """``status``; a failure of one process of several ends it at once, telling the others
    (``mm.distributed.fail``), rather than waiting for them as at a normal end."""
    from mmnnx.distributed import fail, is_distributed  # noqa: PLC0415

    if status != 0 and is_distributed():
        fail(status)
    return status


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The parser of the subcommand ``name`` (``train``) of ``build_parser()``'s parser."""
    (commands,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
    return commands.choices[name]


def _with_config_files(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None, args: argparse.Namespace
) -> argparse.Namespace:
    """``mmnnx train``'s flags over the values of ``--config FILE``, over (with ``--resume``)
    those the run saved in ``OUTPUT_DIR/config.toml``, over the flags' defaults."""
    from mmnnx.train.run_config import CONFIG_FILE, read_config  # noqa: PLC0415

    train = _subparser(parser, "train")
    given = read_config(args.config, train) if args.config else {}
    if given:
        train.set_defaults(**given)
        args = parser.parse_args(argv)
    saved_file = pathlib.Path(args.output_dir, CONFIG_FILE)
    if args.resume and saved_file.is_file():
        saved = read_config(saved_file, train)
        for key in ("output_dir", "resume"):  # where the run is now, and what this call does
            saved.pop(key, None)
        train.set_defaults(**{**saved, **given})
        args = parser.parse_args(argv)
        print(f"mmnnx train: --resume: flags not given default to the run's {saved_file}")
    return args


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The ``mmnnx`` command line ``argv`` parsed; for ``mmnnx train``, with the flags not given
    taken from ``--config FILE`` and, with ``--resume``, from the run's saved
    ``OUTPUT_DIR/config.toml``, in that order, before the flags' defaults.

    Raises:
        ConfigError: a config file that is missing, not TOML, or holds a table, key or value
            ``mmnnx train`` does not take (one line naming the file and key).

    Example:
        >>> parse_args(["train", "--dim", "64"]).dim
        64
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "train":
        args = _with_config_files(parser, argv, args)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``mmnnx`` console script.

    Example (the reason goes to stderr; bad flags exit with status 2):
        >>> main(["train", "--stages", "3", "--devices", "4"])
        2
    """
    from mmnnx.train.run_config import ConfigError  # noqa: PLC0415

    try:
        args = parse_args(argv)
    except ConfigError as e:
        print(f"mmnnx train: error: {e}", file=sys.stderr)
        return 2
    if args.command == "train":
        problem = _check(args)
        if problem:
            print(f"mmnnx train: error: {problem}", file=sys.stderr)
            return 2
        return _failed_now(train(args))
    if args.command == "launch":
        return run_launch(args)
    if args.command == "generate":
        return run_generate(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
