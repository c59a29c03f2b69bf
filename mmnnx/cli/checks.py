"""``mmnnx train``'s checks of its flags taken together, before any model is built: the first
inconsistency as one line (exit status 2), or ``None``."""

from __future__ import annotations

import argparse
import pathlib

from mmnnx.mpmd.schedules import get
from mmnnx.mpmd.schedules.registry import Placement, registered
from mmnnx.tuning import parse_bytes


def check(args: argparse.Namespace) -> str | None:
    """The first inconsistency among the flags, or None.

    Example:
        >>> from mmnnx.cli import parse_args
        >>> check(parse_args(["train", "--depth", "1"]))
        '--depth 1 gives fewer blocks than --stages 2'
    """
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


def stage_order(schedule: str) -> str:
    """``stage_rules``' ``order`` for ``schedule``: ``"v"`` for the V-shaped ones."""

    if schedule != "auto" and registered(schedule).placement is Placement.V_SHAPED:
        return "v"
    return "loop"


def _check_virtual_stages(args: argparse.Namespace) -> str | None:
    """What ``--schedule`` needs of ``--virtual-stages`` and the model, unless given."""

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
