"""The ``mmnnx`` command line's parser of every command, and the dispatch to each command's
module (``mmnnx launch`` reaches :mod:`~mmnnx.cli.launch` without it: see :mod:`mmnnx.cli`)."""

from __future__ import annotations

import argparse
import pathlib
from collections.abc import Sequence

from mmnnx.cli import eval as evaluate
from mmnnx.cli import export, generate, launch, plan, train
from mmnnx.cli.flags import GIVEN, Parser, given
from mmnnx.cli.layout_from import read_plan
from mmnnx.train import validate
from mmnnx.train.config import FIELDS, RunConfig
from mmnnx.train.options import spec
from mmnnx.train.run_config import CONFIG_FILE, ConfigError, read_config


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The ``mmnnx`` command line ``argv`` parsed; for ``mmnnx train``, the flags not given taken
    from ``--config FILE`` then, with ``--resume``, the run's ``config.toml`` (a bad file, or
    none where there are checkpoints: ``ConfigError``); ``given(args)`` names those set on the
    command line or in ``--config``.

    Example:
        >>> parse_args(["train", "--dim", "64"]).dim
        64
    """
    parser = Parser(prog="mmnnx", description="mmnnx: MPMD training for Flax NNX")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    train_parser = train.add_parser(commands)
    for command in (launch, generate, export, evaluate, plan):
        command.add_parser(commands)
    args = parser.parse_args(argv)
    if args.command != "train":
        return args
    planned = read_plan(args.layout_from) if args.layout_from else None
    if planned:
        conflict = planned.conflict(vars(args), given(args))  # only the command line's yet
        if conflict:
            raise ConfigError(f"--layout-from: {conflict}")
    given_in_file = read_config(args.config) if args.config else {}
    given_in_file |= planned.options if planned else {}
    if given_in_file:
        train_parser.set_defaults(**given_in_file)
        args = parser.parse_args(argv)
    saved_file = pathlib.Path(args.output_dir, CONFIG_FILE)
    checkpoints = RunConfig.of(vars(args)).outputs.checkpoints()
    if args.resume and not saved_file.is_file() and train.holds_steps(checkpoints):
        raise ConfigError(
            f"--resume: {saved_file} is missing; a resumed run takes the options it is not "
            "given from the config.toml its run wrote"
        )
    if args.resume and saved_file.is_file():
        saved = read_config(saved_file)
        for name in (name for name, f in FIELDS.items() if not spec(f).from_run):
            saved.pop(name, None)
        train_parser.set_defaults(**{**saved, **given_in_file})
        args = parser.parse_args(argv)
        print(f"mmnnx train: --resume: flags not given default to the run's {saved_file}")
    setattr(args, GIVEN, given(args) | set(given_in_file))
    problem = planned and planned.workload_problem(args.batch_size, args.seq_len)
    if problem:
        raise ConfigError(problem)
    if planned:
        print(f"mmnnx train: --layout-from {planned.path}: {planned.flags()}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command ``argv`` names (``mmnnx.cli.main`` without its shortcut for launch).

    Example (the reason goes to stderr; bad flags exit with status 2):
        >>> main(["train", "--stages", "3", "--devices", "4"])
        2
    """
    try:
        args = parse_args(argv)
    except ConfigError as e:
        return train.error(str(e))
    others = {m.__name__.rsplit(".", 1)[1]: m for m in (launch, generate, export, evaluate, plan)}
    if args.command in others:  # each module is named as its command
        return others[args.command].run(args)
    config, given_options = RunConfig.of(vars(args)), given(args)
    checked = validate.check(config, given_options)
    if checked.problem:
        return train.error(checked.problem)
    status = train.run(config, given_options, pretrained=checked.pretrained)
    from mmnnx.distributed import fail, is_distributed  # noqa: PLC0415

    if status != 0 and is_distributed():  # one process failing ends all at once, telling them
        fail(status)
    return status
