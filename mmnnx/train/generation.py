"""Text from a trained run: the model ``mmnnx train`` wrote into a run directory, rebuilt from
its ``config.toml``, restored from its newest checkpoint and continued with its tokenizer."""

from __future__ import annotations

import dataclasses
import pathlib
import tomllib
from typing import Any

import jax
import numpy as np
from flax import nnx

from mmnnx.models import GPT
from mmnnx.models.stages import stage_rules
from mmnnx.sharding import MultiMesh, Task, init, logical_rules
from mmnnx.train.checkpoint import Checkpointer
from mmnnx.train.config import gpt_config
from mmnnx.train.run_config import CONFIG_FILE
from mmnnx.train.tokenizers import Tokenizer, load_tokenizer

LAYOUTS = ("one-device", "run")
"""Where :func:`load_run` puts the model: on the default device, or on the run's own tasks
(``--stages`` x ``--data-axis`` x ``--model-axis``, each stage's blocks on their submesh)."""


class RunError(ValueError):
    """A run directory that cannot be generated from (no config, tokenizer or checkpoint); the
    message is one line naming the path."""


@dataclasses.dataclass
class LoadedRun:
    """A trained run ready to generate: its model (restored), tokenizer, checkpoint step and
    flags (``config.toml``'s tables merged)."""

    model: GPT
    tokenizer: Tokenizer
    step: int
    flags: dict[str, Any]


def read_run_flags(run_dir: str | pathlib.Path) -> dict[str, Any]:
    """The flags a run recorded in ``run_dir/config.toml``, its tables merged into one dict.

    Example:
        >>> import tempfile, pathlib
        >>> run = pathlib.Path(tempfile.mkdtemp())
        >>> _ = (run / "config.toml").write_text("[model]\\ndim = 32\\n[layout]\\nstages = 2\\n")
        >>> read_run_flags(run)
        {'dim': 32, 'stages': 2}
    """
    path = pathlib.Path(run_dir, CONFIG_FILE)
    if not path.is_file():
        raise RunError(f"{path}: no such file; is {run_dir} a directory `mmnnx train` wrote?")
    try:
        tables = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise RunError(f"{path}: cannot be read: {e}") from None
    flags: dict[str, Any] = {}
    for table in tables.values():
        if isinstance(table, dict):
            flags.update(table)
    return flags


def run_tasks(stages: int, data_axis: int, model_axis: int) -> list[Task]:
    """One task per stage over ``stages x data_axis x model_axis`` devices, with the logical
    axis rules of ``mmnnx train`` (batch over ``data``; heads, MLP and vocabulary over
    ``model``).

    Example:
        >>> [t.name for t in run_tasks(2, 1, 1)]
        ['stage0', 'stage1']
    """
    mesh = MultiMesh(
        axis_sizes=(stages, data_axis, model_axis),
        axis_names=("stage", "data", "model"),
        devices=range(stages * data_axis * model_axis),
    )
    rules = logical_rules(
        batch="data", mlp="model", heads="model", vocab="model", embed=None, seq=None
    )
    return [
        Task(f"stage{i}", mesh=mesh.task_mesh(stage=i), logical_axes=rules) for i in range(stages)
    ]


def load_run(run_dir: str | pathlib.Path, *, layout: str = "one-device") -> LoadedRun:
    """The model of the run ``mmnnx train`` wrote into ``run_dir``, restored from its newest
    readable checkpoint, on one device or on the run's own tasks (``layout``, one of
    :data:`LAYOUTS`); checkpoints restore across layouts.

    Raises:
        RunError: no ``config.toml``, tokenizer or checkpoint in the run, or too few devices
            for the run's layout.
        CheckpointMismatchError: the newest checkpoint holds another model than the config says.

    Example (after ``mmnnx train --output-dir runs/demo``)::

        run = load_run("runs/demo")
        print(continue_text(run.model, run.tokenizer, "In the beginning", 40))
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    flags = read_run_flags(run_dir)
    try:
        tokenizer = load_tokenizer(pathlib.Path(run_dir, "tokenizer"))
    except (OSError, ValueError) as e:
        raise RunError(str(e)) from None
    checkpoints = pathlib.Path(flags.get("checkpoint_dir") or pathlib.Path(run_dir, "checkpoints"))
    if not checkpoints.is_dir():
        raise RunError(f"no checkpoint in {run_dir}: {checkpoints} does not exist")
    config = gpt_config(flags, tokenizer.vocab_size)

    def factory() -> GPT:
        return GPT(config, rngs=nnx.Rngs(0))

    if layout == "run":
        stages, data, model_axis = (flags.get(k, 1) for k in ("stages", "data_axis", "model_axis"))
        if stages * data * model_axis > len(jax.devices()):
            raise RunError(
                f"the run's layout ({stages} stages x {data} x {model_axis}) needs "
                f"{stages * data * model_axis} devices; {len(jax.devices())} are available"
            )
        tasks = run_tasks(stages, data, model_axis)
        with nnx.use_eager_sharding(False):
            placement = stage_rules(nnx.eval_shape(factory), tasks, report=False)
        model = init(factory, placement)
    else:
        with nnx.use_eager_sharding(False):
            model = factory()
    with Checkpointer(checkpoints) as ckpt:
        try:
            resumed = ckpt.restore_newest_readable(model=model)
        except FileNotFoundError:
            raise RunError(f"no checkpoint in {checkpoints}") from None
    return LoadedRun(model=model, tokenizer=tokenizer, step=resumed.step, flags=flags)


def continue_text(
    model: GPT,
    tokenizer: Tokenizer,
    prompt: str,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    seed: int = 0,
) -> str:
    """``prompt`` followed by the ``max_new_tokens`` tokens ``model`` continues it with
    (``GPT.generate``), decoded with ``tokenizer``.

    Example:
        >>> from mmnnx.models import GPTConfig
        >>> from mmnnx.train.tokenizers import ByteTokenizer
        >>> with nnx.use_eager_sharding(False):
        ...     model = GPT(GPTConfig(dim=32, depth=1, max_seq_len=16), rngs=nnx.Rngs(0))
        >>> text = continue_text(model, ByteTokenizer(), "abc", 5)
        >>> text.startswith("abc")
        True
    """
    ids = np.asarray(tokenizer.encode(prompt))
    new = model.generate(
        ids, max_new_tokens, temperature=temperature, top_k=top_k, rng=jax.random.key(seed)
    )
    return tokenizer.decode(np.concatenate([ids, np.asarray(new)[0]]))
