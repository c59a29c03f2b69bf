"""The paths a training run writes, and whether it can: checked before anything is built, so a
path in the way is one line at the start of a run instead of a traceback after training."""

from __future__ import annotations

import dataclasses
import os
import pathlib
from collections.abc import Iterable

from mmnnx.train.run_config import CONFIG_FILE


@dataclasses.dataclass(frozen=True)
class Output:
    """A path a run writes, and for messages the option placing it and how to do without."""

    path: pathlib.Path
    directory: bool
    what: str
    flag: str
    value: pathlib.Path
    off: str = ""


def run_outputs(
    output_dir: str | os.PathLike[str],
    checkpoint_dir: str | os.PathLike[str] | None = None,
    *,
    timeline: bool = True,
    tensorboard: bool = True,
    profile: bool = False,
    wandb: bool = False,
) -> list[Output]:
    """What ``mmnnx train`` writes under ``output_dir`` (and ``checkpoint_dir``), the optional
    outputs when asked for.

    Example:
        >>> [o.path.name for o in run_outputs("runs/x", tensorboard=False, timeline=False)][2:]
        ['config.toml', 'tokenizer', 'tokenizer.json', 'data', 'metrics.jsonl', 'loss.png']
    """
    out = pathlib.Path(output_dir)

    def under(name: str, what: str, *, directory: bool = False, off: str = "") -> Output:
        return Output(
            path=out / name, directory=directory, what=what, flag="--output-dir", value=out, off=off
        )

    if checkpoint_dir:
        ckpt = pathlib.Path(checkpoint_dir)
        checkpoints = Output(
            path=ckpt, directory=True, what="", flag="--checkpoint-dir", value=ckpt
        )
    else:
        checkpoints = under("checkpoints", "the checkpoints", directory=True)
    outputs = [
        Output(path=out, directory=True, what="", flag="--output-dir", value=out),
        checkpoints,
        under(CONFIG_FILE, "the run's flags"),
        under("tokenizer", "the run's tokenizer", directory=True),
        under("tokenizer/tokenizer.json", "the run's tokenizer"),
        under("data", "the text's tokens", directory=True),
        under("metrics.jsonl", "the metrics"),
        under("loss.png", "the loss curve"),
    ]
    if timeline:
        outputs += [
            under("timeline.png", "the pipeline timeline"),
            under("timeline.json", "the pipeline timeline's events"),
        ]
    if tensorboard:
        off = "pass --no-tensorboard"
        outputs.append(under("tensorboard", "the TensorBoard event files", directory=True, off=off))
    if profile:
        off = "leave out --profile-steps"
        outputs.append(under("profile", "the profiler trace", directory=True, off=off))
    if wandb:
        outputs += [
            under("wandb_run_id", "the wandb run's id", off="leave out --wandb"),
            under("wandb", "the wandb files", directory=True, off="leave out --wandb"),
        ]
    return outputs


def output_problem(outputs: Iterable[Output]) -> str | None:
    """The first of ``outputs`` a run could not write, as one line, or None.

    Example:
        >>> import tempfile
        >>> out = pathlib.Path(tempfile.mkdtemp())
        >>> (out / "loss.png").mkdir()
        >>> output_problem(run_outputs(out))  # doctest: +ELLIPSIS
        '--output-dir ...: .../loss.png is a directory, but the run writes the loss curve ...'
    """
    return next(filter(None, map(_problem, outputs)), None)


def _problem(output: Output) -> str | None:
    path, own = output.path, output.path == output.value
    where = f"{output.flag} {output.value}" + ("" if own else f": {path}")
    what = f" ({output.what})" if output.what else ""
    other = f"choose another {output.flag}" + (f" (or {output.off})" if output.off else "")
    if path.is_dir() and not output.directory:
        writes = f"the run writes {output.what} to a file there"
        return f"{where} is a directory, but {writes}; move it aside or {other}"
    if path.exists() and not path.is_dir() and output.directory:
        if own:
            return f"{where} is a file, not a directory; {other}"
        writes = f"the run writes {output.what} into a directory there"
        return f"{where} is a file, but {writes}; move it aside or {other}"
    if path.exists():
        if not os.access(path, os.W_OK | (os.X_OK if output.directory else 0)):
            return f"{where} is not writable{what}; make it writable or {other}"
        return None
    parent = next(p for p in path.parents if p.exists() or p == p.parent)
    if not parent.is_dir():
        return f"{where} cannot be made{what}: {parent} is a file, not a directory; {other}"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{where} cannot be made{what}: {parent} is not writable; {other}"
    return None
