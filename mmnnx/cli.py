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


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--lr must be a number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"--lr must be a finite number > 0, got {text!r}")
    return value


def _positive_number(name: str):
    """An argparse type: a finite float > 0, with a one-line reason naming ``name``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {text!r}") from None
        if not math.isfinite(value) or value <= 0:
            raise argparse.ArgumentTypeError(f"{name} must be a finite number > 0, got {text!r}")
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
        help="tokens (bytes) per sequence (64)",
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
    run.add_argument("--lr", type=_positive_float, default=3e-3, help="peak learning rate (3e-3)")
    run.add_argument(
        "--eval-every",
        type=_positive("--eval-every"),
        default=50,
        help="steps between evaluations (50)",
    )
    run.add_argument(
        "--seed", type=_integer("--seed", 0), default=0, help="initialisation and data seed (0)"
    )
    run.add_argument(
        "--text",
        nargs="+",
        default=None,
        metavar="PATH",
        help="your own UTF-8 text files or directories (default: embedded text)",
    )
    logs = train.add_argument_group("precision and logging")
    logs.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="compute dtype of activations and matmuls; parameters and optimizer state stay "
        "float32 (float32)",
    )
    logs.add_argument(
        "--clip-grad-norm",
        type=_positive_number("--clip-grad-norm"),
        default=None,
        metavar="NORM",
        help="scale the gradients down to this global norm, over every stage's (default: none)",
    )
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


def run_launch(args: argparse.Namespace) -> int:
    from mmnnx.distributed.launch import LaunchError, launch  # noqa: PLC0415

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
    from mmnnx.models import GPT, GPTConfig  # noqa: PLC0415
    from mmnnx.models.stages import stage_rules  # noqa: PLC0415
    from mmnnx.train.data import TextDataset, embedded_text, load_text  # noqa: PLC0415
    from mmnnx.train.loop import TrainConfig, fit  # noqa: PLC0415
    from mmnnx.train.tokenizers import ByteTokenizer  # noqa: PLC0415

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
    tokenizer = ByteTokenizer()
    try:
        text = load_text(args.text) if args.text else embedded_text()
        dataset = TextDataset(
            tokenizer.encode(text), seq_len=args.seq_len, batch_size=args.batch_size, seed=args.seed
        )
    except (OSError, ValueError) as e:
        print(f"mmnnx train: error: {e}", file=sys.stderr)
        return 2
    mesh = mm.MultiMesh(
        axis_sizes=(args.stages, args.data_axis, args.model_axis),
        axis_names=("stage", "data", "model"),
        devices=range(args.stages * args.data_axis * args.model_axis),
    )
    rules = mm.logical_rules(
        batch="data", mlp="model", heads="model", vocab="model", embed=None, seq=None
    )
    tasks = [
        mm.Task(f"stage{i}", mesh=mesh.task_mesh(stage=i), logical_axes=rules)
        for i in range(args.stages)
    ]
    config = GPTConfig(
        vocab_size=tokenizer.vocab_size,
        dim=args.dim,
        depth=args.depth,
        num_heads=args.heads,
        max_seq_len=args.seq_len,
        scan_layers=args.scan_layers,
        dtype=args.dtype,
    )

    def factory():
        return GPT(config, rngs=nnx.Rngs(args.seed))

    if jax.process_index() == 0:
        tokenizer.save(pathlib.Path(args.output_dir, "tokenizer"))
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
                microbatches=args.microbatches,
                schedule=args.schedule,
                eval_every=args.eval_every,
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
                log_every=args.log_every,
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
    return 0 if math.isfinite(result.final_eval) else 1


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


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``mmnnx`` console script.

    Example (the reason goes to stderr; bad flags exit with status 2):
        >>> main(["train", "--stages", "3", "--devices", "4"])
        2
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "train":
        problem = _check(args)
        if problem:
            print(f"mmnnx train: error: {problem}", file=sys.stderr)
            return 2
        return _failed_now(train(args))
    if args.command == "launch":
        return run_launch(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
