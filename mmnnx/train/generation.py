"""Text from a trained run: the model ``mmnnx train`` wrote into a run directory, rebuilt from
its ``config.toml``, restored from its newest checkpoint and continued with its tokenizer."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from collections.abc import Sequence

import jax
import numpy as np

from mmnnx.models import GPT, GPTConfig
from mmnnx.models.pretrained import CheckpointError
from mmnnx.sharding import MultiMesh, Task, logical_rules
from mmnnx.train.checkpoint import Checkpointer, Skipped
from mmnnx.train.config import RunConfig
from mmnnx.train.run_config import CONFIG_FILE, ConfigError, read_config
from mmnnx.train.run_model import build_model, model_config, objective, run_placement
from mmnnx.train.run_record import Saved, saved_record
from mmnnx.train.tokenizers import Tokenizer, fingerprint, load_tokenizer

Eos = str | int | Sequence[str | int] | None
"""Where generation stops: a token (its text, an id of the tokenizer's), an id, or several (the
first of any; :func:`stop_tokens` reads a checkpoint's ids); ``None`` or ``()``: nowhere."""

LAYOUTS = ("one-device", "run")
"""Where :func:`load_run` puts the model: on the default device, or on the run's own tasks
(``--stages`` x ``--data-axis`` x ``--model-axis``, each stage's blocks on their submesh)."""


class RunError(ValueError):
    """A run directory that cannot be generated from (no config, tokenizer or checkpoint); the
    message is one line naming the path."""


@dataclasses.dataclass
class LoadedRun:
    """A trained run ready to generate: its model (restored), tokenizer, checkpoint step and
    options (its ``config.toml``), the newer steps passed over as unreadable, and the eos tokens
    generation stops at (:attr:`RunSpec.eos`)."""

    model: GPT
    tokenizer: Tokenizer
    step: int
    run: RunConfig
    skipped: list[Skipped] = dataclasses.field(default_factory=list)
    eos: tuple[int, ...] = ()


def read_run_config(run_dir: str | pathlib.Path) -> RunConfig:
    """The options a run recorded in ``run_dir/config.toml``, parsed as its flags would be
    (``lora_targets = "q,v"`` is ``("q", "v")``).

    Example:
        >>> import tempfile, pathlib
        >>> run = pathlib.Path(tempfile.mkdtemp())
        >>> _ = (run / "config.toml").write_text("[model]\\ndim = 32\\n[layout]\\nstages = 3\\n")
        >>> config = read_run_config(run)
        >>> config.model.dim, config.layout.stages
        (32, 3)
    """
    path = pathlib.Path(run_dir, CONFIG_FILE)
    if not path.is_file():
        raise RunError(f"{path}: no such file; is {run_dir} a directory `mmnnx train` wrote?")
    try:
        return RunConfig.of(read_config(path))
    except ConfigError as e:
        raise RunError(str(e)) from None


def run_tasks(
    stages: int, data_axis: int, model_axis: int, expert_axis: int = 1, *, fsdp_axis: int = 1
) -> list[Task]:
    """One task per stage over ``stages x data_axis x expert_axis x model_axis`` devices, with
    the logical axis rules of ``mmnnx train``. With ``fsdp_axis`` N > 1 the data axis is cut
    into ``data`` (``data_axis / N``) and ``fsdp`` (N) axes, the batch split over both
    (``mm.fsdp_rules`` then shards the parameters over ``fsdp``).

    Example:
        >>> [t.name for t in run_tasks(2, 1, 1)]
        ['stage0', 'stage1']
        >>> task = run_tasks(2, 2, 1, expert_axis=2)[1]
        >>> dict(task.jax_mesh.shape), task.spec(("batch",)), task.spec(("expert", "embed", "mlp"))
        ({'data': 2, 'expert': 2, 'model': 1}, P(('data', 'expert'),), P('expert', None, 'model'))
        >>> task = run_tasks(2, 4, 1, fsdp_axis=2)[0]
        >>> dict(task.jax_mesh.shape), task.spec(("batch",))
        ({'data': 2, 'fsdp': 2, 'model': 1}, P(('data', 'fsdp'),))
    """
    if fsdp_axis < 1 or data_axis % fsdp_axis:
        raise ValueError(f"--fsdp-axis {fsdp_axis} does not divide --data-axis {data_axis}")
    sizes = {"stage": stages, "data": data_axis // fsdp_axis, "fsdp": fsdp_axis}
    sizes |= {"expert": expert_axis, "model": model_axis}
    sizes = {a: n for a, n in sizes.items() if n > 1 or a not in ("fsdp", "expert")}
    batch = tuple(a for a in ("data", "fsdp", "expert") if a in sizes)
    mesh = MultiMesh(
        axis_sizes=tuple(sizes.values()),
        axis_names=tuple(sizes),
        devices=range(math.prod(sizes.values())),
    )
    experts = {"expert": "expert"} if expert_axis > 1 else {}
    rules = logical_rules(
        batch=batch if len(batch) > 1 else "data",
        **experts,
        mlp="model",
        heads="model",
        vocab="model",
        embed=None,
        seq=None,
    )
    return [
        Task(f"stage{i}", mesh=mesh.task_mesh(stage=i), logical_axes=rules) for i in range(stages)
    ]


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """What a run directory says of its model, before anything is built; ``eos``: the tokens
    generation stops at, its ``--init-from`` checkpoint's (:func:`stop_tokens`; none for a run
    trained from scratch)."""

    directory: pathlib.Path
    run: RunConfig
    tokenizer: Tokenizer
    config: GPTConfig
    checkpoints: pathlib.Path
    eos: tuple[int, ...] = ()


def read_run(run_dir: str | pathlib.Path) -> RunSpec:
    """The :class:`RunSpec` of the run in ``run_dir``, or a :class:`RunError` naming the fault."""
    run = read_run_config(run_dir)
    try:
        tokenizer = load_tokenizer(pathlib.Path(run_dir, "tokenizer"))
    except (OSError, ValueError) as e:
        raise RunError(str(e)) from None
    checkpoints = run.outputs.checkpoints(run_dir)
    if not checkpoints.is_dir():
        raise RunError(f"no checkpoint in {run_dir}: {checkpoints} does not exist")
    try:
        config = model_config(run, tokenizer.vocab_size)
    except CheckpointError as e:
        raise RunError(f"the run's --init-from: {e}") from None
    base = run.model.init_from
    try:
        eos = stop_tokens(base) if base else ()
    except ValueError as e:
        raise RunError(str(e)) from None
    return RunSpec(
        directory=pathlib.Path(run_dir),
        run=run,
        tokenizer=tokenizer,
        config=config,
        checkpoints=checkpoints,
        eos=eos,
    )


def stop_tokens(folder: str | pathlib.Path) -> tuple[int, ...]:
    """The token ids transformers' ``generate`` stops at after a prompt to the checkpoint in
    ``folder`` (its default generation config, as ``from_pretrained`` loads it): the
    ``eos_token_id`` of its ``generation_config.json`` (an id or a list of ids: Llama 3
    Instruct's ``[128001, 128008, 128009]``, its turns ending at ``<|eot_id|>``); none where
    that file has no ``eos_token_id``. Without the file, transformers builds the config from
    ``config.json`` (``GenerationConfig.from_model_config``): its ``eos_token_id``, else (absent
    or null) that of its first ``decoder``, ``generator`` or ``text_config`` (a multimodal
    Gemma 3's eos ids are in its ``text_config``). Never the ``eos_token`` of
    ``tokenizer_config.json``: transformers does not stop there (lm-eval's ``hf`` model does,
    through its stop strings: ``mmnnx.train.evaluation``). A ``ValueError`` naming the file
    for one that is not a JSON object or an ``eos_token_id`` that is not an id or a list of
    them.

    Example:
        >>> import tempfile, pathlib
        >>> base = pathlib.Path(tempfile.mkdtemp())
        >>> _ = (base / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
        >>> _ = (base / "config.json").write_text('{"text_config": {"eos_token_id": [1, 106]}}')
        >>> stop_tokens(base)  # no generation_config.json: config.json's
        (1, 106)
        >>> _ = (base / "generation_config.json").write_text('{"eos_token_id": [1, 8, 9]}')
        >>> stop_tokens(base)
        (1, 8, 9)
        >>> _ = (base / "generation_config.json").write_text('{"bos_token_id": 2}')
        >>> stop_tokens(base)  # a generation config without eos ids: nowhere
        ()
    """
    path = pathlib.Path(folder, "generation_config.json")
    if path.is_file():
        return _eos_ids(path, _json_object(path).get("eos_token_id"))
    path = pathlib.Path(folder, "config.json")
    if not path.is_file():
        return ()
    config = _json_object(path)
    ids = config.get("eos_token_id")
    if ids is None:  # from_model_config: the first of these sub-configs present, if any
        names = ("decoder", "generator", "text_config")
        inner = next((config[k] for k in names if config.get(k)), {})
        ids = inner.get("eos_token_id") if isinstance(inner, dict) else None
    return _eos_ids(path, ids)


def _json_object(path: pathlib.Path) -> dict:
    """The JSON object in ``path``; a ``ValueError`` naming it if it holds none."""
    try:
        value = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: not a JSON object")
    return value


def _eos_ids(path: pathlib.Path, ids: object) -> tuple[int, ...]:
    """``eos_token_id`` (``None``, an id or a list of ids, read from ``path``) as a tuple."""
    if ids is None:
        return ()
    ids = ids if isinstance(ids, list) else [ids]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"{path}: eos_token_id {ids} is not a token id or a list of them")
    return tuple(ids)


def load_run(
    run_dir: str | pathlib.Path | RunSpec, *, layout: str = "one-device", step: int | None = None
) -> LoadedRun:
    """The model of the run ``mmnnx train`` wrote into ``run_dir`` (or of a :class:`RunSpec`
    read from it), restored from its newest readable checkpoint (the newer steps passed over
    are in ``skipped``) or from ``step``, on one device or on the run's own tasks (``layout``,
    one of :data:`LAYOUTS`); checkpoints restore across layouts. A fine-tuning run's model is
    rebuilt from its ``--init-from`` config (not its weights: the checkpoint holds them) with
    its LoRA adapters.

    Raises:
        RunError: no ``config.toml``, tokenizer or checkpoint in the run (or no ``step``), too
            few devices for the run's layout, or a ``config.toml`` option or tokenizer that is
            not what the checkpoint records the run was trained with (``run_record``).
        CheckpointMismatchError: the checkpoint holds another model than the config says.

    Example (after ``mmnnx train --output-dir runs/demo``)::

        run = load_run("runs/demo")
        print(continue_text(run.model, run.tokenizer, "In the beginning", 40, eos=run.eos))
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    spec = run_dir if isinstance(run_dir, RunSpec) else read_run(run_dir)
    placement = None
    if layout == "run":
        lay = spec.run.layout
        stages, data, expert = lay.stages, lay.data_axis, lay.expert_axis
        model_axis = lay.model_axis
        needed = stages * data * expert * model_axis
        if needed > len(jax.devices()):
            sizes = f"{data} x {expert} x {model_axis}" if expert > 1 else f"{data} x {model_axis}"
            raise RunError(
                f"the run's layout ({stages} stages x {sizes}) needs {needed} devices; "
                f"{len(jax.devices())} are available"
            )
        tasks = run_tasks(stages, data, model_axis, expert, fsdp_axis=lay.fsdp_axis)
        placement = run_placement(spec.config, tasks)
    with Checkpointer(spec.checkpoints) as ckpt:
        if step is not None and step not in ckpt.all_steps():
            raise RunError(
                f"no checkpoint of step {step} in {spec.checkpoints} (steps saved: "
                f"{', '.join(map(str, ckpt.all_steps())) or 'none'})"
            )
        _check_record(spec, saved_record(ckpt, step))
        model = build_model(spec.run, spec.config, placement, weights=False)
        saved = objective(spec.run, model)  # with --dpo, the policy beside its reference
        skipped: list[Skipped] = []
        if step is not None:
            ckpt.restore(step, model=saved)
        else:
            try:
                resumed = ckpt.restore_newest_readable(model=saved)
            except FileNotFoundError:
                raise RunError(f"no checkpoint in {spec.checkpoints}") from None
            step, skipped = resumed.step, resumed.skipped
    return LoadedRun(
        model=model,
        tokenizer=spec.tokenizer,
        step=step,
        run=spec.run,
        skipped=skipped,
        eos=spec.eos,
    )


def _check_record(spec: RunSpec, saved: Saved | None) -> None:
    """A :class:`RunError` naming what differs from the checkpoint's record, if any."""
    if saved is None or saved.record is None:
        return
    mismatch = saved.record.mismatch(spec.run.options())
    if mismatch is not None:
        have, had = mismatch.as_keys()
        raise RunError(
            f"{spec.directory / CONFIG_FILE} has {have}, but checkpoint step {saved.step} of the "
            f"run was trained with {had}: config.toml no longer describes the run (edited since?)"
        )
    if saved.record.tokenizer != fingerprint(spec.tokenizer):
        raise RunError(
            f"{spec.directory / 'tokenizer'} holds a tokenizer that is not the one checkpoint "
            f"step {saved.step} of the run was trained with: were its files replaced?"
        )
    if problem := saved.record.base_problem(spec.run.model.init_from, saved.step):
        raise RunError(problem)


def continue_text(
    model: GPT,
    tokenizer: Tokenizer,
    prompt: str,
    max_new_tokens: int,
    *,
    eos: Eos = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    seed: int = 0,
) -> str:
    """``prompt`` followed by the ``max_new_tokens`` tokens ``model`` continues it with
    (``GPT.generate``), up to the first of the ``eos`` tokens (:data:`Eos`, as transformers'
    ``generate`` stops), decoded with ``tokenizer``.

    Example:
        >>> from flax import nnx
        >>> from mmnnx.models import GPTConfig
        >>> from mmnnx.train.tokenizers import ByteTokenizer
        >>> with nnx.use_eager_sharding(False):
        ...     model = GPT(GPTConfig(dim=32, depth=1, max_seq_len=16), rngs=nnx.Rngs(0))
        >>> text = continue_text(model, ByteTokenizer(), "abc", 5)
        >>> text.startswith("abc")
        True
    """
    ids, new = _new_tokens(model, tokenizer, prompt, max_new_tokens, eos, temperature, top_k, seed)
    return tokenizer.decode(np.concatenate([ids, new]))


def _new_tokens(
    model: GPT,
    tokenizer: Tokenizer,
    prompt: str,
    max_new_tokens: int,
    eos: Eos,
    temperature: float,
    top_k: int | None,
    seed: int,
) -> tuple[np.ndarray, np.ndarray]:
    """``prompt``'s ids and the new ones up to the first ``eos`` token of ``tokenizer``'s."""
    ids = np.asarray(tokenizer.encode(prompt))
    stops = stop_ids(tokenizer, eos)
    key = jax.random.key(seed)
    new = model.generate(
        ids, max_new_tokens, temperature=temperature, top_k=top_k, rng=key, stop=stops
    )
    return ids, until_eos(np.asarray(new)[0], tokenizer, stops)


def until_eos(new: np.ndarray, tokenizer: Tokenizer, eos: Eos) -> np.ndarray:
    """``new`` (ids a model generated) up to the first of the ``eos`` tokens (:data:`Eos`: ids
    as they are, texts as ``tokenizer``'s ids; one it has no id for stops nothing here).

    Example:
        >>> from mmnnx.train.tokenizers import ByteTokenizer
        >>> until_eos(np.array([5, 9, 7, 9]), ByteTokenizer(), (7, 9)).tolist()
        [5]
    """
    stops = stop_ids(tokenizer, eos)
    ends = [i for i, t in enumerate(np.asarray(new).tolist()) if t in stops]
    return new[: ends[0]] if ends else new


def stop_ids(tokenizer: Tokenizer, eos: Eos) -> tuple[int, ...]:
    """The ids of the ``eos`` tokens (:data:`Eos`: ids as they are, texts as ``tokenizer``'s
    ids; one it has no id for left out), each once, in order.

    Example:
        >>> from mmnnx.train.tokenizers import ByteTokenizer
        >>> stop_ids(ByteTokenizer(), [9, 7, 9, "</s>"])  # bytes: no token is named
        (9, 7)
    """
    token_id = getattr(tokenizer, "token_id", None)  # a ByteTokenizer has none: ids alone
    ids = [t if isinstance(t, int) else token_id(t) if token_id else None for t in _eos_tuple(eos)]
    return tuple(dict.fromkeys(i for i in ids if i is not None))


def _eos_tuple(eos: Eos) -> tuple[int | str, ...]:
    return (eos,) if isinstance(eos, (str, int)) else tuple(eos or ())


def reply_text(
    model: GPT,
    tokenizer: Tokenizer,
    prompt: str,
    max_new_tokens: int,
    *,
    eos: Eos = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    seed: int = 0,
) -> str:
    """The reply ``model`` gives to ``prompt`` (a conversation a chat template rendered, up to
    the assistant's turn): its new tokens alone, decoded, up to the first of the ``eos`` tokens
    (:data:`Eos`; a text among them also where it is in the decoded reply). Not sliced from the
    whole text decoded: a tokenizer whose decoding of the prompt is not the prompt (a Metaspace
    one, Mistral's and Llama 2's, writes ``<s>[INST]`` back as ``<s> [INST]``) would cut the
    reply elsewhere.

    Example:
        >>> from flax import nnx
        >>> from mmnnx.models import GPTConfig
        >>> from mmnnx.train.tokenizers import ByteTokenizer
        >>> with nnx.use_eager_sharding(False):
        ...     model = GPT(GPTConfig(dim=32, depth=1, max_seq_len=16), rngs=nnx.Rngs(0))
        >>> len(reply_text(model, ByteTokenizer(), "<user>hi<bot>", 3)) <= 3  # 3 bytes
        True
    """
    new = _new_tokens(model, tokenizer, prompt, max_new_tokens, eos, temperature, top_k, seed)[1]
    text = tokenizer.decode(new)
    cuts = [text.index(t) for t in _eos_tuple(eos) if isinstance(t, str) and t and t in text]
    return text[: min(cuts)] if cuts else text
