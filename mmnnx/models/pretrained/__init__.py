"""Hugging Face checkpoints in and out: ``from_pretrained`` builds a ``GPT`` for a checkpoint's
architecture and fills it straight onto its tasks, ``save_pretrained`` writes it back in the
same layout; ``load_tensors``/``save_tensors`` do the same for model code of your own, through
``TensorRule`` name maps.

Example:
    >>> import tempfile
    >>> from flax import nnx
    >>> from mmnnx.models import GPT, GPTConfig
    >>> config = GPTConfig(dim=32, depth=2, vocab_size=64, gated_mlp=True, mlp_bias=False)
    >>> with nnx.use_eager_sharding(False):
    ...     model = GPT(config, rngs=nnx.Rngs(0))
    >>> path = save_pretrained(model, tempfile.mkdtemp() + "/tiny", architecture="LlamaForCausalLM")
    >>> again = from_pretrained(path)
    >>> bool((again.blocks[1].mlp.up.kernel[...] == model.blocks[1].mlp.up.kernel[...]).all())
    True
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import jax.numpy as jnp
import numpy as np
from flax import nnx

from mmnnx.models.gpt import GPT, GPTConfig
from mmnnx.models.pretrained.adapters import merged_kernels
from mmnnx.models.pretrained.adapters import save_adapter as _save_adapter
from mmnnx.models.pretrained.families import FAMILIES, PretrainedFamily, family_of
from mmnnx.models.pretrained.families.base import norm_epsilons
from mmnnx.models.pretrained.files import (
    CARRIED,
    CONFIG,
    TOKENIZER,
    TORCH_DTYPES,
    CheckpointError,
    CheckpointFiles,
    read_json,
)
from mmnnx.models.pretrained.hf_config import written
from mmnnx.models.pretrained.load import load_into, sources_as_read
from mmnnx.models.pretrained.names import Part, TensorRule
from mmnnx.models.pretrained.quantized import quantizing
from mmnnx.models.pretrained.save import (
    MAX_SHARD_BYTES,
    model_values,
    torch_dtype_of,
    write_checkpoint,
)
from mmnnx.models.stages import stage_rules
from mmnnx.sharding.task import Task

M = TypeVar("M")

__all__ = [
    "FAMILIES",
    "CheckpointError",
    "Pretrained",
    "Part",
    "TensorRule",
    "check_tensors",
    "check_tokenizer",
    "from_pretrained",
    "load_tensors",
    "pretrained_config",
    "save_adapter",
    "save_pretrained",
    "save_tensors",
]


@dataclasses.dataclass(frozen=True)
class Pretrained:
    """Where a model came from: its checkpoint's architecture and ``config.json`` (as text),
    kept on the model (``model.pretrained``) so ``save_pretrained`` writes them back."""

    architecture: str
    config_json: str
    directory: str

    @property
    def config(self) -> dict[str, Any]:
        return json.loads(self.config_json)

    @classmethod
    def read(cls, path: str | os.PathLike) -> Pretrained:
        """The origin record of the checkpoint at ``path``, from its ``config.json`` alone;
        ``CheckpointError``: no such directory, no ``config.json``, an architecture not in
        :data:`FAMILIES`.

        Example:
            >>> import tempfile
            >>> path = pathlib.Path(tempfile.mkdtemp())
            >>> _ = (path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
            >>> Pretrained.read(path).architecture
            'LlamaForCausalLM'
        """
        directory = pathlib.Path(path)
        if not directory.is_dir():
            raise CheckpointError(f"{directory}: no such checkpoint directory")
        file = directory / CONFIG
        hf = read_json(file) if file.exists() else None
        return cls(family_of(hf, directory).architecture, json.dumps(hf), str(directory))


def pretrained_config(
    path: str | os.PathLike,
    *,
    param_dtype: Any = jnp.float32,
    dtype: Any = jnp.float32,
    scan_layers: bool = False,
    max_seq_len: int | None = None,
    remat: str = "none",
    router_bias_rate: float = 0.0,
) -> GPTConfig:
    """The ``GPTConfig`` :func:`from_pretrained` builds for the checkpoint at ``path`` (its
    arguments as there), from ``config.json`` alone; ``CheckpointError`` as
    :meth:`Pretrained.read`, or for a setting the family's GPT cannot reproduce.

    Example:
        >>> import tempfile
        >>> with nnx.use_eager_sharding(False):
        ...     model = GPT(GPTConfig(dim=32, depth=3, vocab_size=64, gated_mlp=True,
        ...                           mlp_bias=False), rngs=nnx.Rngs(0))
        >>> path = save_pretrained(model, tempfile.mkdtemp() + "/m",
        ...                        architecture="LlamaForCausalLM")
        >>> config = pretrained_config(path, max_seq_len=16)
        >>> config.depth, config.max_seq_len, config.block_configs[0].feed_forward.gated
        (3, 16, True)
    """
    origin = Pretrained.read(path)
    return FAMILIES[origin.architecture].gpt_config(
        origin.config,
        origin.directory,
        param_dtype=np.dtype(param_dtype).name,
        dtype=np.dtype(dtype).name,
        scan_layers=scan_layers,
        max_seq_len=max_seq_len,
        remat=remat,
        router_bias_rate=router_bias_rate,
    )


def from_pretrained(
    path: str | os.PathLike,
    *,
    tasks: Sequence[Task] | None = None,
    rules: Sequence[tuple] | Mapping | None = None,
    param_dtype: Any = jnp.float32,
    dtype: Any = jnp.float32,
    scan_layers: bool = False,
    max_seq_len: int | None = None,
    remat: str = "none",
    router_bias_rate: float = 0.0,
) -> GPT:
    """The ``GPT`` of the Hugging Face checkpoint at ``path``, its Variables read from the
    safetensors files straight onto their devices.

    ``config.json``'s ``architectures`` picks the family (:data:`FAMILIES`) and its sizes the
    ``GPTConfig``; FP8 and MXFP4 weights are dequantized as they are read. The model is built
    abstractly and placed first: ``tasks`` cuts its layers into stages as ``mm.stage_rules``
    does, ``rules`` (``mm.place``'s, matched first) places by path; with neither, it lands on
    one device. Each process then reads only the slices its devices hold (experts per expert,
    so an expert-parallel device reads only its own). ``param_dtype`` (float32 by default, as
    transformers loads), ``dtype``, ``remat`` and ``router_bias_rate`` as ``GPTConfig``'s;
    ``max_seq_len`` defaults to ``max_position_embeddings``. The model keeps its origin in
    ``model.pretrained``. ``CheckpointError`` (before anything is placed): an unsupported
    architecture (naming those that are), a missing or extra tensor, a shape that does not fit
    the config, no directory or safetensors, a tokenizer larger than the vocabulary.

    Example:
        >>> import tempfile
        >>> with nnx.use_eager_sharding(False):
        ...     model = GPT(GPTConfig(dim=32, depth=2, vocab_size=64, gated_mlp=True,
        ...                           mlp_bias=False, qk_norm=True), rngs=nnx.Rngs(0))
        >>> path = save_pretrained(model, tempfile.mkdtemp() + "/qwen",
        ...                        architecture="Qwen3ForCausalLM")
        >>> from_pretrained(path, max_seq_len=16)(jnp.zeros((1, 4), jnp.int32)).shape
        (1, 4, 64)
    """
    files = CheckpointFiles(path)
    family = family_of(files.config, files.directory)
    options = dict(scan_layers=scan_layers, max_seq_len=max_seq_len, remat=remat)
    config = pretrained_config(
        path, param_dtype=param_dtype, dtype=dtype, router_bias_rate=router_bias_rate, **options
    )
    check_tokenizer(files.directory, config.vocab_size)
    _check_tied_head(files, config)
    model = _abstract(lambda: GPT(config, rngs=nnx.Rngs(0)))
    placement = list(rules or [])
    if tasks is not None:
        placement += stage_rules(model, tasks, report=False)
    load_into(model, files, family.tensor_rules(config), placement or None)
    model.pretrained = Pretrained(
        family.architecture, json.dumps(files.config), str(files.directory)
    )
    return model


def save_pretrained(
    model: GPT,
    path: str | os.PathLike,
    *,
    dtype: Any = None,
    architecture: str | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    overwrite: bool = False,
    values: Mapping[str, Any] | None = None,
    quantized: bool | Mapping[str, Any] = False,
) -> pathlib.Path:
    """Writes ``model`` (a ``GPT``) as a Hugging Face checkpoint directory at ``path``:
    ``config.json``, safetensors shards of at most ``max_shard_bytes`` with their index, and
    the files of :data:`~mmnnx.models.pretrained.files.CARRIED` (tokenizer, chat template,
    ...) the directory it was loaded from has. Returns the directory.

    ``dtype`` defaults to the checkpoint's ``dtype`` (float32 for a model from none);
    ``architecture`` names the family of a model not made by ``from_pretrained``. Every
    process calls it, each writing what its devices hold; nothing replaces ``path`` until
    every file is written (``overwrite=True`` to replace one). LoRA adapters are merged
    (``W + B A * alpha / r``; :func:`save_adapter` writes them alone); ``values`` overrides
    Variables' values by path. A model read quantized is written in ``dtype`` without
    ``quantization_config``, unless ``quantized``: ``True`` writes it in the format it was
    read from (``quantization_config`` kept), a ``quantization_config`` in that one: FP8
    blocks (``{"quant_method": "fp8", "weight_block_size": [128, 128]}``, DeepSeek-V3's
    projections) or MXFP4 experts (``{"quant_method": "mxfp4"}``, gpt-oss's), the rest in
    ``dtype``. ``CheckpointError`` before anything is written: a bad ``dtype``, an existing
    ``path``, a model the family cannot hold (its ``cannot_hold``), ``quantized=True`` for a
    model read from no quantized checkpoint.

    Example:
        >>> import tempfile
        >>> with nnx.use_eager_sharding(False):
        ...     model = GPT(GPTConfig(dim=32, depth=1, vocab_size=64, gated_mlp=True,
        ...                           mlp_bias=False), rngs=nnx.Rngs(0))
        >>> out = save_pretrained(model, tempfile.mkdtemp() + "/m", dtype=jnp.bfloat16,
        ...                       architecture="LlamaForCausalLM")
        >>> sorted(p.name for p in out.iterdir())
        ['config.json', 'model.safetensors', 'model.safetensors.index.json']
    """
    pretrained, family, dtype = _origin(model, path, architecture, dtype)
    hf = pretrained.config if pretrained else {}
    config = written(family.hf_config(model.config, torch_dtype_of(dtype), hf), hf)
    quant = _quantization(quantized, hf, path)
    if quant is not None:
        config["quantization_config"] = quant
    origin = pathlib.Path(pretrained.directory) if pretrained else None
    extra = [origin / name for name in CARRIED if origin and (origin / name).is_file()]
    values = {**model_values(model), **merged_kernels(model), **(values or {})}
    return write_checkpoint(
        {k: v for k, v in values.items() if "/lora/" not in k},
        path,
        family.tensor_rules(model.config),
        config=config,
        dtype=dtype,
        extra_files=extra,
        max_shard_bytes=max_shard_bytes,
        overwrite=overwrite,
        quantize=None if quant is None else quantizing(quant, pathlib.Path(path) / CONFIG),
    )


def _quantization(quantized: Any, loaded: Mapping[str, Any], path: Any) -> Any:
    """The ``quantization_config`` ``save_pretrained(quantized=...)`` writes in, or ``None``."""
    if quantized is False:
        return None
    if quantized is not True:
        return dict(quantized)
    if "quantization_config" not in loaded:
        raise CheckpointError(
            f"{path}: quantized=True, but the model was read from no quantized checkpoint (its "
            'config.json has no quantization_config); pass quantized={"quant_method": "fp8", '
            '"weight_block_size": [128, 128]} (FP8 blocks, as DeepSeek-V3) or '
            '{"quant_method": "mxfp4"} (gpt-oss\'s experts), or leave it out to write dtype'
        )
    return loaded["quantization_config"]


def save_adapter(
    model: GPT,
    path: str | os.PathLike,
    *,
    dtype: Any = None,
    architecture: str | None = None,
    overwrite: bool = False,
) -> pathlib.Path:
    """Writes the LoRA adapters of ``model`` (``mmnnx.modules.add_lora``) alone, in PEFT's
    layout: ``adapter_model.safetensors`` (``base_model.model.<name>.lora_A.weight``
    ``(r, in)`` and ``lora_B.weight`` ``(out, r)``) and ``adapter_config.json`` (``r``,
    ``lora_alpha``, ``target_modules`` (and ``target_parameters``: ``adapters.peft_targets``),
    ``base_model_name_or_path``: the directory the model was loaded from). ``dtype`` and
    ``architecture`` as :func:`save_pretrained`.

    Example:
        >>> import tempfile
        >>> from mmnnx.modules import add_lora
        >>> with nnx.use_eager_sharding(False):
        ...     model = GPT(GPTConfig(dim=32, depth=1, vocab_size=64, gated_mlp=True,
        ...                           mlp_bias=False), rngs=nnx.Rngs(0))
        >>> model = add_lora(model, rank=2, targets=("q", "v"))
        >>> target = pathlib.Path(tempfile.mkdtemp()) / "a"
        >>> out = save_adapter(model, target, architecture="LlamaForCausalLM")
        >>> out == target, json.loads((out / "adapter_config.json").read_text())["target_modules"]
        (True, ['q_proj', 'v_proj'])
    """
    pretrained, family, dtype = _origin(model, path, architecture, dtype)
    return _save_adapter(
        model,
        path,
        family.tensor_rules(model.config),
        base_model=pretrained.directory if pretrained else "",
        dtype=dtype,
        overwrite=overwrite,
    )


def _origin(
    model: GPT, path: Any, architecture: str | None, dtype: Any
) -> tuple[Pretrained | None, PretrainedFamily, np.dtype]:
    pretrained: Pretrained | None = getattr(model, "pretrained", None)
    name = architecture or (pretrained.architecture if pretrained else None)
    if name is None:
        raise CheckpointError(
            f"{path}: name the model's architecture (architecture=, one of "
            f"{', '.join(FAMILIES)}); it was not loaded by from_pretrained"
        )
    family = family_of({"architectures": [name]}, path)
    blockers = family.cannot_hold(model.config)
    if len(eps := norm_epsilons(model.config)) > 1:
        blockers.append(f"norms of different epsilons {sorted(eps)} (one rms_norm_eps)")
    if blockers:
        raise CheckpointError(f"{path}: a {name} checkpoint cannot hold {' and '.join(blockers)}")
    if dtype is None:
        hf = pretrained.config if pretrained else {}
        dtype = hf.get("dtype", hf.get("torch_dtype", "float32"))
        dtype = dtype if dtype in TORCH_DTYPES else "float32"
    try:
        return pretrained, family, np.dtype(jnp.dtype(dtype))
    except TypeError:
        raise CheckpointError(
            f"{path}: dtype {dtype!r} is not a dtype; Hugging Face checkpoints are written "
            f"in {', '.join(TORCH_DTYPES)}"
        ) from None


def load_tensors(
    model: M | Callable[[], M],
    path: str | os.PathLike,
    tensor_rules: Sequence[TensorRule],
    *,
    rules: Sequence[tuple] | Mapping | None = None,
) -> M:
    """Fills model code of your own from a safetensors checkpoint, each Variable through the
    ``TensorRule`` whose tensor-name template matches its tensors.

    ``model`` is a factory (built abstractly here with ``nnx.eval_shape``, never on one
    host) or a model already built abstractly. With ``rules`` (as ``mm.place`` takes) every
    Variable is read straight onto its task's devices; each process reads only its slices.
    Every tensor must fill a Variable and every Variable have its tensors, with shapes that
    fit; all checked before anything is read.

    Example:
        >>> import tempfile
        >>> from mmnnx.models.pretrained.files import write_shards
        >>> d = tempfile.mkdtemp()
        >>> write_shards(d, {"proj.weight": np.ones((3, 2), np.float32),
        ...                  "proj.bias": np.zeros(3, np.float32)})
        >>> layer = load_tensors(lambda: nnx.Linear(2, 3, rngs=nnx.Rngs(0)), d,
        ...                      [TensorRule("proj.weight", "kernel", transpose=(1, 0)),
        ...                       TensorRule("proj.bias", "bias")])
        >>> layer.kernel.shape
        (2, 3)
    """
    abstract = _abstract(model) if callable(model) and not isinstance(model, nnx.Module) else model
    return load_into(abstract, CheckpointFiles(path), tensor_rules, rules)


def save_tensors(
    model: Any,
    path: str | os.PathLike,
    tensor_rules: Sequence[TensorRule],
    *,
    dtype: Any = jnp.float32,
    config: dict[str, Any] | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> pathlib.Path:
    """Writes model code of your own as safetensors shards with an index (and ``config``
    as ``config.json``), each Variable through the ``TensorRule`` whose Variable template
    matches its path; the inverse of :func:`load_tensors`.

    Example:
        >>> import tempfile
        >>> layer = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
        >>> rules = [TensorRule("proj.weight", "kernel", transpose=(1, 0)),
        ...          TensorRule("proj.bias", "bias")]
        >>> out = save_tensors(layer, tempfile.mkdtemp() + "/x", rules)
        >>> load_tensors(lambda: nnx.Linear(2, 3, rngs=nnx.Rngs(1)), out, rules).kernel.shape
        (2, 3)
    """
    return write_checkpoint(
        model_values(model),
        path,
        tensor_rules,
        config=config,
        dtype=jnp.dtype(dtype),
        max_shard_bytes=max_shard_bytes,
        overwrite=overwrite,
    )


def _abstract(factory: Callable[[], M]) -> M:
    with nnx.use_eager_sharding(False):
        return nnx.eval_shape(factory)


def _check_tied_head(files: CheckpointFiles, config: GPTConfig) -> None:
    """Raises where ``config`` ties the head but the files also store ``lm_head.weight`` with
    other values than the embedding's: transformers 5 then unties them and computes with the
    stored head (a warning says so), where the tied model would silently give other logits.
    Compared in blocks of rows (16 MiB a block), only for such a checkpoint."""
    head, embed = "lm_head.weight", "model.embed_tokens.weight"
    if not config.tie_embeddings or head not in files.tensors or embed not in files.tensors:
        return
    shape = files.tensors[embed].shape
    same = files.tensors[head].shape == shape
    rows = max(1, (16 << 20) // max(1, 4 * int(np.prod(shape[1:]))))
    for start in range(0, shape[0] if same else 0, rows):
        part = (slice(start, start + rows),)
        theirs, ours = files.read(head, part), files.read(embed, part)
        if not np.array_equal(theirs.astype(np.float32), ours.astype(np.float32)):
            same = False
            break
    if not same:
        raise CheckpointError(
            f"{files.directory}: config.json ties the head to the embedding "
            f"(tie_word_embeddings: true), but tensor {head!r} is stored with other values "
            f"than {embed!r}; transformers then unties them and uses {head!r}: set "
            "tie_word_embeddings to false to read it as a head of its own"
        )


def check_tensors(path: str | os.PathLike, config: GPTConfig) -> None:
    """Raises ``CheckpointError`` when the safetensors files at ``path`` do not fill the
    ``GPT`` of ``config`` (a tensor missing or left over, a shape or dtype that does not fit),
    as ``from_pretrained`` would, from the files' headers alone: no data read, nothing built.

    Example:
        >>> import tempfile
        >>> config = GPTConfig(dim=32, depth=2, vocab_size=64, gated_mlp=True, mlp_bias=False)
        >>> with nnx.use_eager_sharding(False):
        ...     path = save_pretrained(GPT(config, rngs=nnx.Rngs(0)), tempfile.mkdtemp() + "/m",
        ...                            architecture="LlamaForCausalLM")
        >>> check_tensors(path, config)
        >>> check_tensors(path, dataclasses.replace(config, depth=3))
        Traceback (most recent call last):
        mmnnx.models.pretrained.files.CheckpointError: ...: missing tensor 'model.layers.2...
    """
    files = CheckpointFiles(path)
    family = family_of(files.config, files.directory)
    model = _abstract(lambda: GPT(config, rngs=nnx.Rngs(0)))
    sources_as_read(model, files, family.tensor_rules(config))


def check_tokenizer(directory: str | os.PathLike, vocab_size: int) -> None:
    """Raises ``CheckpointError`` when ``directory``'s ``tokenizer.json`` (if any) cannot be
    read or has more tokens than ``vocab_size``: its ids would fall outside the embedding table.

    Example:
        >>> import tempfile
        >>> check_tokenizer(tempfile.mkdtemp(), 64)  # no tokenizer.json: nothing to check
    """
    tokenizer = pathlib.Path(directory) / TOKENIZER
    if not tokenizer.exists():
        return
    from tokenizers import Tokenizer  # noqa: PLC0415  (only for checkpoints that have one)

    try:
        size = Tokenizer.from_file(str(tokenizer)).get_vocab_size(with_added_tokens=True)
    except Exception as e:  # the library raises its own exception type
        raise CheckpointError(f"{tokenizer}: the tokenizers library cannot read it: {e}") from None
    if size > vocab_size:
        raise CheckpointError(
            f"{tokenizer}: the tokenizer's vocabulary has {size} tokens, more than the "
            f"model's vocab_size {vocab_size} (config.json): its ids would fall outside "
            "the embedding table"
        )
