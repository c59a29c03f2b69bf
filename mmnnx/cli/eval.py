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
    _, problem = prologue.run_spec(options.run)
    if problem:
        return error(problem)
    from mmnnx.train.evaluation import MmnnxLM, UnscorableTaskError  # noqa: PLC0415

    if options.include_path and (problem := task_file_problem(options.include_path)):
        return error(f"--include-path: {problem}")
    manager = TaskManager(include_path=options.include_path)
    names = options.tasks.split(",")
    unknown = [n for n in names if n not in manager.all_tasks]
    if unknown:
        return error(f"--tasks: no lm-eval task {', '.join(unknown)} (see lm_eval ls tasks)")
    model = MmnnxLM(run=options.run, layout=options.layout)
    try:
        results = lm_eval.simple_evaluate(
            model=model, tasks=names, task_manager=manager, limit=options.limit
        )
    except UnscorableTaskError as e:
        return error(f"--tasks {options.tasks}: {e}")
    print(lm_eval.utils.make_table(results))
    return 0


def task_file_problem(folder: str) -> str | None:
    """The first task file under ``folder`` that does not parse as a YAML mapping, in a line
    naming it (lm-eval itself passes such a file over, and its task is then "unknown").

    Example:
        >>> import pathlib, tempfile
        >>> folder = pathlib.Path(tempfile.mkdtemp())
        >>> _ = (folder / "t.yaml").write_text("task: t\\ndoc_to_text: !function utils.text\\n")
        >>> task_file_problem(str(folder)) is None
        True
        >>> _ = (folder / "u.yaml").write_text("task: [u\\n")
        >>> print(task_file_problem(str(folder)).split(folder.name)[-1])  # doctest: +ELLIPSIS
        /u.yaml: line 2, column 1: expected ',' or ']', but got '<stream end>'
    """
    import pathlib  # noqa: PLC0415

    import yaml  # noqa: PLC0415  (lm-eval's own YAML reader)

    class Loader(yaml.SafeLoader):  # lm-eval's tags (!function) read as anything
        pass

    Loader.add_multi_constructor("!", lambda loader, suffix, node: None)
    root = pathlib.Path(folder)
    if not root.is_dir():
        return f"{folder}: no such directory"
    for path in sorted(root.rglob("*.yaml")):
        try:
            parsed = yaml.load(path.read_text(), Loader=Loader)  # noqa: S506
        except yaml.YAMLError as e:
            mark, problem = getattr(e, "problem_mark", None), getattr(e, "problem", None)
            where = f": line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            return f"{path}{where}: {problem or ' '.join(str(e).split())}"
        if not isinstance(parsed, dict):
            return f"{path}: a task file is a YAML mapping (task:, dataset_path:, ...)"
    return None
