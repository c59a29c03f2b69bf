"""``mmnnx eval``: lm-eval's tasks on the model of a run ``mmnnx train`` wrote."""

from __future__ import annotations

import argparse
import dataclasses
import functools
from typing import Any

from mmnnx.cli import prologue
from mmnnx.cli.flags import add_fields, typed
from mmnnx.train.options import option, positive


@dataclasses.dataclass
class Options:
    run: str = option(dataclasses.MISSING, "the run's --output-dir", metavar="DIR")
    tasks: str = option(dataclasses.MISSING, "lm-eval task names, comma-separated", metavar="NAMES")
    include_path: str | None = option(
        None, "a directory of your own lm-eval task YAML files", metavar="DIR"
    )
    limit: int | None = option(None, "at most N documents of each task", positive, metavar="N")
    layout: str = option(
        "one-device",
        "one-device (default), or run: the model on the run's own tasks (mm.jit)",
        choices=("one-device", "run"),
    )


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "eval",
        help="score a run's model on lm-eval tasks",
        description="Rebuild the model of run directory DIR, restore its newest checkpoint, "
        "and run lm-eval's tasks on it (log-likelihoods, rolling log-likelihoods and greedy "
        "generation as lm-eval's hf model computes them), printing lm-eval's table. Needs "
        "lm-eval: pip install mmnnx[eval]. Example: mmnnx eval --run runs/sft --tasks "
        "hellaswag --limit 100",
    )
    add_fields(parser, dataclasses.fields(Options))


def run(args: argparse.Namespace) -> int:
    """``mmnnx eval``: lm-eval's results table on stdout; a missing lm-eval, run or task
    exits 2 in one line."""
    options = typed(Options, args)
    error = functools.partial(prologue.error, "eval")
    try:
        import lm_eval  # noqa: PLC0415
        from lm_eval.tasks import TaskManager  # noqa: PLC0415
    except ImportError:
        return error("needs lm-eval: pip install 'mmnnx[eval]'")
    from mmnnx.train.generation import RunError, read_run  # noqa: PLC0415

    try:
        spec = read_run(options.run)
    except RunError as e:
        return error(f"--run: {e}")
    prologue.start(spec.run.layout.devices, distributed=False)
    from mmnnx.train.evaluation import MmnnxLM  # noqa: PLC0415

    manager = TaskManager(include_path=options.include_path)
    names = options.tasks.split(",")
    unknown = [n for n in names if n not in manager.all_tasks]
    if unknown:
        return error(f"--tasks: no lm-eval task {', '.join(unknown)} (see lm_eval ls tasks)")
    model = MmnnxLM(run=options.run, layout=options.layout)
    results = lm_eval.simple_evaluate(
        model=model, tasks=names, task_manager=manager, limit=options.limit
    )
    print(lm_eval.utils.make_table(results))
    return 0
