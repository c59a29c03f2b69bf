"""``mmnnx launch``: run a command as several local processes joined by
``mm.distributed.initialize``."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from collections.abc import Sequence
from typing import Any

from mmnnx.cli.flags import Parser, add_fields
from mmnnx.launcher.launch import STEP_TIMEOUT_S
from mmnnx.train.options import integer, option, positive, spec, switch


@dataclasses.dataclass
class Options:
    devices_per_process: int | None = option(
        None,
        "simulated CPU devices per process when JAX_PLATFORMS names no accelerator (default 1)",
        positive,
        metavar="K",
    )
    port: int | None = option(
        None,
        "coordinator port (default: a free one, a fresh one for each restart)",
        integer(1, 65535),
    )
    collectives: str | None = option(
        None,
        "collectives between processes on CPU, needed only by tasks whose devices belong to "
        "several processes (default none: they slow down every collective)",
        choices=("none", "gloo", "mpi"),
    )
    verbose: bool = switch(
        "--verbose",
        "also print gloo's connection lines and JAX's C++ information logs "
        "(TF_CPP_MIN_LOG_LEVEL=0), left out by default; warnings and errors always show",
    )
    max_restarts: int = option(
        0,
        "when a process fails, stop all and start all again, up to N times, one line each; "
        "the exit status is the last attempt's. Each process sees the attempt's number in "
        "MMNNX_RESTART_COUNT; `mmnnx train --resume` continues from the newest checkpoint (0)",
        integer(0),
        metavar="N",
    )
    min_processes: int | None = option(
        None,
        "with --max-restarts (2 or more), go on with fewer processes, down to K: a rank that "
        "fails first in two attempts in a row is dropped, one line naming it, and the job "
        "restarts without it (ranks above it one lower), with its devices fewer; `mmnnx train "
        "--resume` re-plans the stages onto the devices left (default -n: none dropped)",
        positive,
        metavar="K",
    )
    heartbeat_timeout: int | None = option(
        None,
        "a process silent this long has stopped responding: JAX's heartbeat timeout in "
        "every process (MMNNX_HEARTBEAT_TIMEOUT), and how long the launcher lets a process "
        "stay stopped (SIGSTOP) before it names it and ends the job (default 20)",
        positive,
        metavar="S",
        api="heartbeat_timeout_s",
    )
    step_timeout: int = option(
        STEP_TIMEOUT_S,
        "a process that reported progress (mm.distributed.progress; mmnnx train does at every "
        "phase of every step) and then reports nothing this long has stopped making progress "
        "(a loop in Python, a stuck data loader): it prints its Python stacks and the job ends, "
        "naming it and what it last reported. Larger than the longest phase: the first step's "
        "compilation, an evaluation, a checkpoint save (default %(default)s; 0: not watched; a "
        "process that never reports is never watched)",
        integer(0),
        metavar="S",
        api="step_timeout_s",
    )


_HELP = "run a command as several local processes joined by mm.distributed.initialize"
_DESCRIPTION = (
    "Run COMMAND as N processes on this machine (coordinator on 127.0.0.1), each output line "
    "prefixed with its rank. When one process fails (or stops responding, or makes no "
    "progress) the others are stopped at once, the one that failed first is named, and the "
    "exit status is its own; with --max-restarts, all are then started again. A SIGTERM is "
    "forwarded to every process (mmnnx train saves its step and exits with 143). Example: "
    "mmnnx launch -n 2 --devices-per-process 4 -- python train.py"
)


def add_parser(commands: Any) -> None:
    """``mmnnx launch``'s parser among ``mmnnx``'s commands (as ``mmnnx --help`` lists them)."""
    _add_arguments(commands.add_parser("launch", help=_HELP, description=_DESCRIPTION))


def main(argv: Sequence[str]) -> int:
    """``mmnnx launch ARGV``, parsed and run by this module alone (nothing of JAX imported).

    Example (a command that cannot be started: status 2, the reason on stderr):
        >>> main(["-n", "2", "--", "no-such-command"])
        2
    """
    parser = Parser(prog="mmnnx launch", description=_DESCRIPTION)
    _add_arguments(parser)
    return run(parser.parse_args(argv))


def _add_arguments(launch: argparse.ArgumentParser) -> None:
    nprocs = functools.partial(positive, "-n")
    launch.add_argument("-n", "--nprocs", type=nprocs, required=True, metavar="N")
    add_fields(launch, dataclasses.fields(Options))
    launch.add_argument(
        "argv", nargs=argparse.REMAINDER, metavar="-- COMMAND", help="the command and its arguments"
    )


def run(args: argparse.Namespace) -> int:
    from mmnnx.launcher.launch import LaunchError, launch  # noqa: PLC0415

    command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    options = {spec(f).api or f.name: getattr(args, f.name) for f in dataclasses.fields(Options)}
    try:
        return launch(command, args.nprocs, **options)
    except LaunchError as e:
        print(e, file=sys.stderr)
        return 2
