"""A run's model out as a Hugging Face checkpoint (LoRA adapters merged) or as its LoRA
adapters alone in PEFT's layout, rebuilt from the run's ``config.toml`` and a checkpoint."""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
from typing import Any

import jax

from mmnnx.models import save_adapter, save_pretrained
from mmnnx.models.pretrained.families import FAMILIES
from mmnnx.train.generation import RunError, load_run, read_run

SCRATCH_ARCHITECTURE = "LlamaForCausalLM"
"""What a run trained from scratch (no ``--init-from``) is written as, when its GPT is one."""

SPECIAL_NAMES = {
    "bos": ("<|begin_of_text|>", "<s>", "<bos>"),
    "eos": ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>"),
}
"""The special tokens of a ``tokenizer.json`` read as its beginning and end of text, by name
(Llama 3's, SentencePiece's, Gemma's; GPT-2's ``<|endoftext|>`` ends text)."""


@dataclasses.dataclass(frozen=True)
class Exported:
    """What :func:`export_run` wrote (``step``: restored from; ``adapter``: the adapters alone)."""

    directory: pathlib.Path
    architecture: str
    step: int
    adapter: bool


def export_run(
    run_dir: str | pathlib.Path,
    output: str | pathlib.Path,
    *,
    adapter: bool = False,
    dtype: Any = None,
    quantized: bool = False,
    step: int | None = None,
    overwrite: bool = False,
) -> Exported:
    """Writes the model of the run ``mmnnx train`` wrote into ``run_dir``, restored from its
    newest readable checkpoint (or ``step``) onto the run's own tasks, into ``output``.

    A Hugging Face checkpoint with the run's tokenizer, LoRA adapters merged (``mmnnx export``'s
    ``--help`` says more; ``quantized``: as ``save_pretrained``'s, in the format of the
    ``--init-from`` checkpoint), or with ``adapter`` the adapters alone in PEFT's layout; a run from
    scratch is written as the first family that holds it, with :func:`transformers_files`.
    Every process calls it, each writing the tensors its devices hold. A :class:`RunError` for
    what cannot be exported so comes before anything is restored or written.

    Example (after ``mmnnx train --init-from hf/tiny-llama --lora-rank 8 --output-dir r``)::

        export_run("r", "r-merged")                  # a LlamaForCausalLM checkpoint
        export_run("r", "r-adapter", adapter=True)   # PEFT's adapter_model.safetensors
    """
    spec = read_run(run_dir)
    if adapter and not spec.run.model.lora_rank:
        raise RunError(
            f"--adapter: the run in {run_dir} has no LoRA adapters (it was not trained with "
            "--lora-rank); export the whole model instead"
        )
    architecture = None
    if spec.run.model.init_from is None:
        architecture = _scratch_architecture(spec.config, run_dir)
    output = pathlib.Path(output)
    _check_not_a_run(output, run_dir, spec)
    if output.exists() and not overwrite:
        raise RunError(f"{output} exists; pass --overwrite to replace it")
    loaded = load_run(spec, layout="run", step=step)
    save = save_adapter if adapter else functools.partial(save_pretrained, quantized=quantized)
    written = save(
        loaded.model, output, dtype=dtype, architecture=architecture, overwrite=overwrite
    )
    to_str = getattr(spec.tokenizer, "to_str", None)
    own = not (output / "tokenizer.json").exists()
    if not adapter and own and callable(to_str) and jax.process_index() == 0:
        (written / "tokenizer.json").write_text(to_str())  # the run's BPE, a tokenizers file
    if not adapter and architecture is not None and jax.process_index() == 0:
        tokenizer = written / "tokenizer.json"
        files = transformers_files(tokenizer.read_text() if tokenizer.exists() else None)
        for name, content in files.items():  # the base's are carried by a fine-tuning run
            (written / name).write_text(json.dumps(content, indent=2) + "\n")
    architecture = architecture or loaded.model.pretrained.architecture
    return Exported(directory=written, architecture=architecture, step=loaded.step, adapter=adapter)


def transformers_files(tokenizer_json: str | None) -> dict[str, dict[str, Any]]:
    """The JSON files transformers reads beside a checkpoint trained from scratch, by name:
    ``generation_config.json`` (the tokenizer's :data:`SPECIAL_NAMES` ids) and, given
    ``tokenizer.json``'s text, ``tokenizer_config.json``; a ``ValueError`` for text not JSON.

    Example (a tokenizer with no special tokens, as a run's own BPE)::

        >>> files = transformers_files('{"added_tokens": []}')
        >>> files["generation_config.json"], files["tokenizer_config.json"]["tokenizer_class"]
        ({}, 'PreTrainedTokenizerFast')
        >>> transformers_files('{"added_tokens": [{"id": 7, "content": "</s>", "special": true}]}')
        ... # doctest: +NORMALIZE_WHITESPACE
        {'generation_config.json': {'eos_token_id': 7},
         'tokenizer_config.json': {'tokenizer_class': 'PreTrainedTokenizerFast',
                                   'clean_up_tokenization_spaces': False, 'eos_token': '</s>'}}
    """
    if tokenizer_json is None:
        return {"generation_config.json": {}}
    try:
        added = json.loads(tokenizer_json).get("added_tokens") or []
    except (json.JSONDecodeError, AttributeError) as e:
        raise ValueError(f"tokenizer.json is not a JSON object: {e}") from None
    special = {t["content"]: t["id"] for t in added if t.get("special")}
    found = {
        kind: name
        for kind, names in SPECIAL_NAMES.items()
        if (name := next((n for n in names if n in special), None)) is not None
    }
    tokenizer = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
    }
    return {
        "generation_config.json": {f"{k}_token_id": special[n] for k, n in found.items()},
        "tokenizer_config.json": tokenizer | {f"{k}_token": n for k, n in found.items()},
    }


def _check_not_a_run(output: pathlib.Path, run_dir: Any, spec: Any) -> None:
    """Refuses, even with ``overwrite``, an ``output`` that is, holds or lies inside what the
    run keeps, or that holds another run: writing there would delete them."""
    kept = [("the run", run_dir), ("the run's checkpoints", spec.run.outputs.checkpoints(run_dir))]
    if spec.run.model.init_from is not None:
        kept.append(("the run's --init-from checkpoint", spec.run.model.init_from))
    out, kept = output.resolve(), [(what, pathlib.Path(p).resolve()) for what, p in kept]
    within = [(what, p) for what, p in kept if out == p or p in out.parents]
    holding = [(what, p) for what, p in kept if out in p.parents]
    if within or holding:  # named: the innermost it lies in, else the outermost it holds
        depth = lambda named: len(named[1].parts)  # noqa: E731
        what, path = max(within, key=depth) if within else min(holding, key=depth)
        raise RunError(
            f"--output {output} would overwrite {what} ({path}); export somewhere else "
            "(--overwrite replaces only an earlier export)"
        )
    if _is_run(output):
        raise RunError(
            f"--output {output} holds a run (config.toml and checkpoints/); export somewhere "
            "else (--overwrite replaces only an earlier export)"
        )
    # another run's directory above OUT (OUT is, say, its checkpoints/), or one below it: both
    # would be deleted by the replacement of OUT
    above = output.resolve().parents
    run = next((p for p in above if _is_run(p)), None)
    if run is None and output.is_dir():
        run = next((p.parent for p in output.rglob("config.toml") if _is_run(p.parent)), None)
    if run is not None:
        where = "lies inside" if run in above else "holds"
        raise RunError(
            f"--output {output} {where} another run ({run}: config.toml and checkpoints/); "
            "export somewhere else (--overwrite replaces only an earlier export)"
        )


def _is_run(directory: pathlib.Path) -> bool:
    """Whether ``directory`` is what ``mmnnx train`` writes: ``config.toml`` and
    ``checkpoints/``."""
    return (directory / "config.toml").is_file() and (directory / "checkpoints").is_dir()


def _scratch_architecture(config: Any, run_dir: Any) -> str:
    """The first of :data:`FAMILIES` (Llama first) that can hold a GPT trained from scratch."""
    blockers = {name: family.cannot_hold(config) for name, family in FAMILIES.items()}
    order = [SCRATCH_ARCHITECTURE, *(n for n in FAMILIES if n != SCRATCH_ARCHITECTURE)]
    for name in order:
        if not blockers[name]:
            return name
    why = "; ".join(f"{name} cannot hold {' and '.join(blockers[name])}" for name in order)
    hint = " (train with --gated-mlp for a SiLU-gated MLP)" if not config.gated_mlp else ""
    raise RunError(
        f"the run in {run_dir} was trained from scratch into a GPT no Hugging Face family mmnnx "
        f"writes can hold: {why}{hint}; or fine-tune a checkpoint with --init-from"
    )
