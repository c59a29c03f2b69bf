"""The model a run's options describe (``mmnnx train``, ``generate``, ``export``): its
``GPTConfig``, its stages on the run's tasks, and the model itself with its LoRA adapters."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from flax import nnx

from mmnnx.models import GPT, GPTConfig, from_pretrained, pretrained_config
from mmnnx.models.pretrained import Pretrained
from mmnnx.models.stages import split_rules, stage_rules
from mmnnx.modules import Linear
from mmnnx.modules.lora import MOE_TARGETS, TARGETS, add_lora
from mmnnx.mpmd.schedules.registry import registered
from mmnnx.sharding import Task, fsdp_rules, init
from mmnnx.train.config import RunConfig, gpt_config
from mmnnx.train.preference import TRAINED, PreferenceModel


def model_config(run: RunConfig, vocab_size: int) -> GPTConfig:
    """The ``GPTConfig`` of a run: ``gpt_config``'s, or ``--init-from``'s with the run's
    precision, layers and ``seq_len`` (a ``CheckpointError`` where mmnnx cannot build it).

    Example:
        >>> model_config(RunConfig.of({"dim": 64, "depth": 2, "model_axis": 1}), 256).depth
        2
    """
    init_from = run.model.init_from
    if init_from is None:
        return gpt_config(run, vocab_size)
    return pretrained_config(
        init_from,
        dtype=run.precision.dtype,
        param_dtype=run.precision.param_dtype,
        scan_layers=run.model.scan_layers,
        max_seq_len=run.model.seq_len,
        remat=run.model.remat,
        router_bias_rate=run.training.router_bias_rate,
    )


def linear_names(config: GPTConfig) -> tuple[str, ...]:
    """The ``Linear`` layers of ``GPT(config)`` LoRA may adapt, in ``add_lora``'s order.

    Example:
        >>> linear_names(GPTConfig()), linear_names(GPTConfig(gated_mlp=True, experts=4))
        (('q', 'k', 'v', 'out', 'up', 'down'), ('q', 'k', 'v', 'out', 'router'))
    """
    abstract = _abstract_gpt(config)
    have = {str(path[-1]) for path, node in nnx.iter_graph(abstract) if isinstance(node, Linear)}
    return tuple(t for t in (*TARGETS, *MOE_TARGETS) if t in have)


def _abstract_gpt(config: GPTConfig) -> GPT:
    with nnx.use_eager_sharding(False):
        return nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0)))


def run_placement(
    config: GPTConfig,
    tasks: Sequence[Task],
    *,
    virtual_stages: int = 1,
    schedule: Any = None,
    report: bool = False,
    sizes: Sequence[int] | None = None,
) -> list[tuple[str, Task]]:
    """``stage_rules`` of ``GPT(config)`` over ``tasks``, in the order ``schedule`` places
    stages (looped by default); with ``sizes``, ``split_rules`` of those blocks per stage.

    Example:
        >>> from mmnnx.sharding import TaskMesh
        >>> tasks = [Task(f"s{i}", mesh=TaskMesh(devices=[i])) for i in range(2)]
        >>> [r for r, _ in run_placement(GPTConfig(depth=2), tasks)]
        ['^embed/|^blocks/0/', '^blocks/1/|^head/|^norm/']
    """
    named = isinstance(schedule, str) and schedule != "auto"
    order = (named and registered(schedule).placement.order(virtual_stages)) or "loop"
    abstract = _abstract_gpt(config)
    if sizes is not None:
        return split_rules(abstract, tasks, sizes, virtual_stages=virtual_stages, order=order)
    return stage_rules(abstract, tasks, virtual_stages=virtual_stages, order=order, report=report)


def fsdp_placement(placement: Sequence[tuple]) -> list[tuple]:
    """``placement`` with ``fsdp_rules`` over the ``fsdp`` mesh axis when its tasks have one.

    Example:
        >>> from mmnnx.train.generation import run_tasks
        >>> tasks = run_tasks(2, 2, 1, fsdp_axis=2)
        >>> [type(r[-1]).__name__ for r in fsdp_placement(run_placement(GPTConfig(depth=2), tasks))]
        ['ShardLargest', 'ShardLargest']
    """
    tasks = jax.tree.leaves([rule[1] for rule in placement])  # a rule's task, or its tasks
    if not any(FSDP_AXIS in t.axis_names for t in tasks):
        return list(placement)
    return fsdp_rules(placement, FSDP_AXIS)


FSDP_AXIS = "fsdp"
"""The mesh axis ``run_tasks`` carves out of the data axis for ``--fsdp-axis``."""


def abstract_model(run: RunConfig, config: GPTConfig) -> GPT:
    """The model :func:`build_model` makes, every Variable abstract: nothing allocated.

    Example:
        >>> run = RunConfig.of(_LORA)
        >>> abstract_model(run, model_config(run, 64)).blocks[0].attn.q.lora.a.shape
        (32, 2)
    """
    with nnx.use_eager_sharding(False):
        return nnx.eval_shape(lambda: build_model(run, config, weights=False, read=False))


def build_model(
    run: RunConfig,
    config: GPTConfig,
    placement: Sequence[tuple] | None = None,
    *,
    weights: bool = True,
    read: bool = True,
) -> GPT:
    """The model of a run on ``placement`` (``None``: one device), with its LoRA adapters:
    read from ``--init-from`` with ``weights``, else initialised from ``--seed``.

    Example:
        >>> run = RunConfig.of(_LORA)
        >>> model = build_model(run, model_config(run, 64))
        >>> model.blocks[0].attn.q.lora.a.shape
        (32, 2)
    """
    init_from, seed, lora = run.model.init_from, run.training.seed, run.model
    placement = None if placement is None else fsdp_placement(placement)
    if init_from is not None and weights:
        model = from_pretrained(
            init_from,
            rules=placement,
            dtype=config.dtype,
            param_dtype=config.param_dtype,
            scan_layers=config.scan_layers,
            max_seq_len=config.max_seq_len,
            remat=config.remat,
            router_bias_rate=config.router_bias_rate,
        )
    else:
        factory = lambda: GPT(config, rngs=nnx.Rngs(seed))  # noqa: E731
        if placement is None:
            with nnx.use_eager_sharding(False):
                model = factory()
        else:
            model = init(factory, placement)
        if init_from is not None and read:
            model.pretrained = Pretrained.read(init_from)
    if lora.lora_rank:
        targets = lora.lora_targets or None
        add_lora(model, rank=lora.lora_rank, alpha=lora.lora_alpha, targets=targets, seed=seed)
    return model


def trainable(run: RunConfig) -> Any:
    """The Variables a run trains: the adapters with ``--lora-rank``, else every ``nnx.Param``;
    with ``--dpo``, the policy's of those (:func:`objective`).

    Example:
        >>> trainable(RunConfig.of({"lora_rank": 8})).__name__, trainable(RunConfig()).__name__
        ('LoRAParam', 'Param')
    """
    kind = nnx.LoRAParam if run.model.lora_rank else nnx.Param
    return nnx.All(kind, TRAINED) if run.preference.dpo else kind


def objective(run: RunConfig, model: GPT) -> nnx.Module:
    """What a run trains and checkpoints: ``model``, or with ``--dpo`` its ``PreferenceModel``
    (the reference a frozen copy, or with ``--lora-rank`` the base, adapters off).

    Example:
        >>> run = RunConfig.of({**_LORA, "dpo": True, "data": "pairs.jsonl"})
        >>> type(objective(run, build_model(run, model_config(run, 64)))).__name__
        'PreferenceModel'
        >>> run = RunConfig.of({**run.options(), "lora_rank": None, "lora_targets": None})
        >>> model = build_model(run, model_config(run, 64))
        >>> kernel, copy = model.head.kernel, objective(run, model).reference.head.kernel
        >>> copy is kernel, copy[...] is kernel[...]  # its own Variables, the arrays shared
        (False, True)
    """
    if not run.preference.dpo:
        return model
    reference = None if run.model.lora_rank else nnx.clone(model)
    return PreferenceModel(model, beta=run.preference.dpo_beta, reference=reference)


_LORA = {"dim": 32, "depth": 1, "heads": 2, "lora_rank": 2, "lora_targets": ("q",)}  # examples
