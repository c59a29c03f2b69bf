"""The checks of a :class:`~mmnnx.train.config.RunConfig` taken as a whole, before anything is
built: each finds the first inconsistency among the options of one concern and says it in one
line naming the flags (``--depth 1 gives fewer blocks than --stages 2``)."""

from __future__ import annotations

import pathlib
from collections.abc import Set
from typing import Any, NamedTuple

from mmnnx.mpmd.schedules import names as schedule_names
from mmnnx.mpmd.schedules.registry import Placement, registered
from mmnnx.partition.cluster import schedule_runs
from mmnnx.train.config import MOE, RunConfig, flag, gpt_config
from mmnnx.train.run_outputs import output_problem, run_outputs
from mmnnx.tuning import parse_bytes


class Checked(NamedTuple):
    """The first problem of the options, and ``--init-from``'s ``GPTConfig`` (read once)."""

    problem: str | None
    pretrained: Any = None


def check(run: RunConfig, given: Set[str] = frozenset()) -> Checked:
    """The first inconsistency among ``run``'s options (or None), and ``--init-from``'s
    ``GPTConfig``; ``given``: the options the user set.

    Example:
        >>> check(RunConfig.of({"depth": 1})).problem
        '--depth 1 gives fewer blocks than --stages 2'
    """
    found = _experts_problem(run) or _devices_problem(run) or _lora_problem(run)
    if found:
        return Checked(found)
    found, (blocks, depth), pretrained = _model_problem(run, given)
    if found:
        return Checked(found)
    found = (  # each is checked only when those before found nothing
        partition_problem(run, blocks, depth)
        or _schedule_problem(run, blocks, depth)
        or _batch_problem(run)
        or _outputs_problem(run)
        or _other_problem(run)
        or _steps_problem(run, pretrained is not None and pretrained.tie_embeddings)
    )
    return Checked(found, None if found else pretrained)


def devices_needed(run: RunConfig) -> int:
    """The devices the run's layout multiplies into (:func:`layout` names them)."""
    lay = run.layout
    return lay.stages * lay.data_axis * lay.expert_axis * lay.model_axis


def layout(run: RunConfig) -> str:
    """The flags that multiply into the devices a run needs, as one names them."""
    lay = run.layout
    expert = f" x {flag('expert_axis', lay.expert_axis)}" if lay.expert_axis > 1 else ""
    return (
        f"{flag('stages', lay.stages)} x {flag('data_axis', lay.data_axis)}{expert} x "
        f"{flag('model_axis', lay.model_axis)}"
    )


def _devices_problem(run: RunConfig) -> str | None:
    """Too few devices for the layout, or an FSDP axis not dividing the data axis."""
    lay, used = run.layout, devices_needed(run)
    if used > lay.devices:
        return f"{layout(run)} needs {used} devices, but {flag('devices')} is {lay.devices}"
    if lay.data_axis % lay.fsdp_axis:
        return (
            f"{flag('fsdp_axis', lay.fsdp_axis)} does not divide {flag('data_axis', lay.data_axis)}"
            " (parameters are sharded over N of each stage's data-parallel devices)"
        )
    return None


def _experts_problem(run: RunConfig) -> str | None:
    """A MoE option without ``--experts``, or experts ``--expert-axis`` cannot split."""
    model, n = run.model, run.layout.expert_axis
    if model.experts is None:
        for name in MOE[1:]:
            if getattr(model, name) is not None:
                return f"{flag(name)} needs {flag('experts', 'E')}"
        if n > 1:
            return f"{flag('expert_axis', n)} needs {flag('experts', 'E')}"
        return None
    if model.init_from is None and model.experts % n:
        return (
            f"{flag('experts', model.experts)} is not divisible by {flag('expert_axis', n)} "
            "(E / N experts per device)"
        )
    return None


def _lora_problem(run: RunConfig) -> str | None:
    """A LoRA option given without ``--lora-rank``, or None."""
    model = run.model
    if model.lora_rank is None:
        for name in ("lora_alpha", "lora_targets"):
            if getattr(model, name) is not None:
                return f"{flag(name)} needs {flag('lora_rank', 'R')}"
    return None


def _targets_problem(targets: tuple[str, ...], config: Any, model: str) -> str | None:
    """The first of ``targets`` naming no Linear of ``GPT(config)`` (``model``, in words)."""
    from mmnnx.train.run_model import linear_names  # noqa: PLC0415

    have = linear_names(config)
    missing = [t for t in targets if t not in have]
    if not missing:
        return None
    why = {
        "router": f"no mixture of experts ({flag('experts')})",
        "gate": f"no gated MLP ({flag('gated_mlp')})",
    }.get(missing[0], "no such projection")
    return f"{flag('lora_targets', missing[0])}: {model} has {why}; its projections are " + (
        ",".join(have)
    )


def _model_problem(run: RunConfig, given: Set[str]) -> tuple[str | None, tuple[int, str], Any]:
    """The model's problem; its blocks, as the flags name them; ``--init-from``'s config."""
    init_from = run.model.init_from
    if init_from is not None:
        found, config = _pretrained(run, given)
        if found:
            return found, (0, ""), None
        depth = config.depth
        return None, (depth, f"{flag('init_from')}'s num_hidden_layers {depth}"), config
    try:
        config = gpt_config(run, 256)
    except ValueError as e:
        return str(e), (0, ""), None
    blocks = (run.model.depth, flag("depth", run.model.depth))
    return _targets_problem(run.model.lora_targets or (), config, "the model"), blocks, None


def _pretrained(run: RunConfig, given: Set[str]) -> tuple[str | None, Any]:
    """The first problem of ``--init-from``, and the ``GPTConfig`` of its ``config.json``."""
    from mmnnx.models import CheckpointError  # noqa: PLC0415
    from mmnnx.models.pretrained import check_tensors, check_tokenizer  # noqa: PLC0415
    from mmnnx.models.pretrained.files import TOKENIZER  # noqa: PLC0415
    from mmnnx.train.config import ARCHITECTURE  # noqa: PLC0415
    from mmnnx.train.run_model import model_config  # noqa: PLC0415
    from mmnnx.train.tokenizers import conversion_hint  # noqa: PLC0415

    init_from, model_axis = run.model.init_from, run.layout.model_axis
    conflicting = [name for name in ARCHITECTURE if name in given]
    if conflicting:
        return (
            f"{flag(conflicting[0])} conflicts with {flag('init_from')}: the architecture and "
            f"tokenizer come from {init_from}/config.json and tokenizer.json"
        ), None
    try:  # with the run's --scan-layers: a MoE whose layers are not all alike cannot stack
        config = model_config(run, 0)  # the vocabulary is the checkpoint's
    except CheckpointError as e:
        return f"{flag('init_from')}: {e}", None
    tokenizer = pathlib.Path(init_from, TOKENIZER)
    if not tokenizer.is_file():
        hint = conversion_hint(tokenizer.parent) or (
            f"{tokenizer} does not exist; mmnnx train reads the text with the checkpoint's own "
            "tokenizer"
        )
        return f"{flag('init_from')}: {hint}", None
    try:
        check_tokenizer(init_from, config.vocab_size)
        if not run.outputs.resume:  # a resumed run's weights come from its own checkpoint
            check_tensors(init_from, config)  # headers only, before the run writes anything
    except CheckpointError as e:
        return f"{flag('init_from')}: {e}", None
    found = _targets_problem(run.model.lora_targets or (), config, init_from)
    if found:
        return found, None
    for name, size in (
        ("num_attention_heads", config.num_heads),
        ("num_key_value_heads", config.num_kv_heads or config.num_heads),
        ("vocab_size", config.vocab_size),
    ):
        if size % model_axis:
            return (
                f"{flag('init_from')}'s {name} {size} is not divisible by "
                f"{flag('model_axis', model_axis)}"
            ), None
    return None, config


def given_sizes(text: str) -> tuple[int, ...] | None:
    """The blocks per stage ``--partition`` gives, or ``None`` for ``params`` and ``auto``.

    Example:
        >>> given_sizes("3,1"), given_sizes("auto")
        ((3, 1), None)
    """
    if text in ("params", "auto"):
        return None
    return tuple(int(p) for p in text.split(","))


def partition_problem(run: RunConfig, blocks: int, depth: str) -> str | None:
    """Fewer blocks than stages, or what ``--partition`` cannot do with the other options.

    Example:
        >>> partition_problem(RunConfig.of({"partition": "3,2"}), 4, "--depth 4")
        '--partition 3,2 gives 5 blocks, but the model has 4 (--depth 4)'
    """
    lay, split = run.layout, flag("partition", run.layout.partition)
    if blocks < lay.stages:
        return f"{depth} gives fewer blocks than {flag('stages', lay.stages)}"
    stages = lay.stages * lay.virtual_stages
    sizes = given_sizes(lay.partition)
    if sizes is not None:
        if len(sizes) != stages:
            return (
                f"{split} gives {len(sizes)} stages, but {flag('stages', lay.stages)} x "
                f"{flag('virtual_stages', lay.virtual_stages)} makes {stages}"
            )
        if sum(sizes) != blocks:
            return f"{split} gives {sum(sizes)} blocks, but the model has {blocks} ({depth})"
    if lay.partition != "params" and run.model.scan_layers:
        return (
            f"{split} needs the blocks as a list: leave out {flag('scan_layers')} (stacked "
            "blocks are split into equal chunks)"
        )
    return None


def _schedule_problem(run: RunConfig, blocks: int, depth: str) -> str | None:
    """A schedule not of ``--virtual-stages`` stages per task, or too few blocks for them."""
    v, name, stages = run.layout.virtual_stages, run.training.schedule, run.layout.stages
    # 'auto' tunes among the schedules of one stage per task
    placement = Placement.ONE_PER_RANK if name == "auto" else registered(name).placement
    schedule, virtual = flag("schedule", name), flag("virtual_stages")
    if placement.order(v) is None:
        runs = [n for n in schedule_names() if registered(n).placement.order(v) is not None]
        return (
            f"{schedule} needs {virtual} {placement.runs} ({placement.needs}); "
            f"{virtual} {v} runs with {', '.join(runs) or 'no registered schedule'}"
        )
    if v > 1 and run.model.scan_layers:
        return f"{virtual} {v} needs the blocks as a list: leave out {flag('scan_layers')}"
    if blocks < stages * v:
        return f"{depth} gives fewer blocks than {flag('stages', stages)} x {virtual} {v} stages"
    if run.model.scan_layers and blocks % stages:
        return (
            f"{flag('scan_layers')} splits {depth} blocks into equal chunks, one per stage; "
            f"{flag('stages', stages)} does not divide it"
        )
    return None


def _batch_problem(run: RunConfig) -> str | None:
    """A batch the microbatches, or a microbatch the data (and expert) axis, cannot split."""
    batch, micro = run.training.batch_size, run.training.microbatches
    if batch % micro:
        return f"{flag('batch_size', batch)} is not divisible by {flag('microbatches', micro)}"
    data, expert = run.layout.data_axis, run.layout.expert_axis
    rows = batch // micro
    if rows % (data * expert):
        over = flag("data_axis", data)
        if expert > 1:
            over += f" x {flag('expert_axis', expert)} (the tokens are split over both)"
        return f"a microbatch of {rows} sequences is not divisible by {over}"
    return None


def _outputs_problem(run: RunConfig) -> str | None:
    """A path the run could not write (``run_outputs``)."""
    logging = run.logging
    return output_problem(
        run_outputs(
            run.outputs.output_dir,
            run.outputs.checkpoint_dir,
            timeline=bool(run.training.timeline_step),
            tensorboard=logging.tensorboard,
            profile=logging.profile_steps is not None,
            wandb=logging.wandb is not None,
        )
    )


def _other_problem(run: RunConfig) -> str | None:
    """An option that needs another, or a value another rules out."""
    training, logging, data = run.training, run.logging, run.dataset
    if run.layout.fsdp_gather != "microbatch" and run.layout.fsdp_axis == 1:
        return f"{flag('fsdp_gather', run.layout.fsdp_gather)} needs {flag('fsdp_axis', 'N')}"
    if data.data is not None and training.text:
        return f"{flag('data')} rules out {flag('text')} (train on one or the other)"
    if run.preference.dpo:  # a pair's two completions are its row's segments, and its targets
        if data.data is None:
            return f"{flag('dpo')} needs {flag('data', 'PAIRS')}"
        if data.pack or data.train_on != "completions":
            wrong = flag("pack") if data.pack else flag("train_on", data.train_on)
            return f"{flag('dpo')} rules out {wrong}"
    budget = training.memory_budget
    if budget is not None:
        try:
            size = parse_bytes(budget)
        except ValueError as e:
            return f"{flag('memory_budget')}: {e}"
        if size <= 0:
            return f"{flag('memory_budget')} must be positive, got {budget}"
    bpe = training.tokenizer == "bpe"
    if training.vocab_size is not None and not bpe and not run.outputs.resume:
        return f"{flag('vocab_size')} needs {flag('tokenizer', 'bpe')}"
    if logging.wandb_name is not None and logging.wandb is None:
        return f"{flag('wandb_name')} needs {flag('wandb', 'PROJECT')}"
    profile = logging.profile_steps
    if profile is not None and profile[0] > training.steps:
        return (
            f"{flag('profile_steps')} starts at step {profile[0]}, after "
            f"{flag('steps', training.steps)}"
        )
    return None


def _steps_problem(run: RunConfig, tied: bool) -> str | None:
    """A schedule that cannot run the stages and microbatches; a head ``tied`` to the
    embedding makes the forward pass come back to the first stage."""
    name, stages, v = run.training.schedule, run.layout.stages, run.layout.virtual_stages
    micro = run.training.microbatches
    if name == "auto":
        return None
    try:
        schedule_runs(name, stages, v, micro, tied)
    except ValueError as e:
        with_v = f", {flag('virtual_stages', v)}" if v > 1 else ""
        return (
            f"{flag('schedule', name)} with {flag('stages', stages)}{with_v} and "
            f"{flag('microbatches', micro)}: {e}"
        )
    return None


def memory_problem(
    run: RunConfig, config: Any, data_axis: int, devices: int | None = None
) -> str | None:
    """With ``--memory-budget``, a layout whose predicted peak per device (``config``: the
    run's ``GPTConfig``) exceeds it, naming the stage and the smallest change that fits
    (``devices``: the devices the run has, which more stages must fit in).

    Example:
        >>> from mmnnx.models import GPTConfig
        >>> run = RunConfig.of({"memory_budget": "5MiB", "microbatches": 4, "model_axis": 1})
        >>> print(memory_problem(run, GPTConfig(dim=64, depth=4, max_seq_len=64), 2))
        --memory-budget 5MiB: stage 0 needs 6.1 MiB per device (parameters 451.5 KiB, \
optimizer state 903.0 KiB, activations 2.3 MiB of 2 microbatch(es) in flight); --microbatches 8 \
fits (4.3 MiB)
    """
    from mmnnx.partition.memory import fitting_change, format_bytes, predict_memory  # noqa: PLC0415

    training, lay = run.training, run.layout
    budget = training.memory_budget
    if budget is None or training.schedule == "auto" or lay.partition == "auto":
        return None
    size = parse_bytes(budget)
    layout, options = memory_inputs(run, data_axis)
    try:
        predicted = predict_memory(config, layout, **options)
    except ValueError as e:
        return f"{flag('memory_budget')}: {e}"
    if predicted.peak <= size:
        return None
    worst = predicted.worst
    needs = (
        f"{flag('memory_budget')} {budget}: stage {worst.task} needs "
        f"{format_bytes(worst.peak)} per device (parameters {format_bytes(worst.parameters)}, "
        f"optimizer state {format_bytes(worst.optimizer)}, activations "
        f"{format_bytes(worst.activations)} of {worst.in_flight} microbatch(es) in flight)"
    )
    change = fitting_change(config, layout, size, devices=devices, **options)
    if change is None:
        gather = lay.fsdp_gather == "step" and lay.fsdp_axis > 1
        return (
            f"{needs}; no single change fits: "
            + (f"{flag('fsdp_gather', 'microbatch')}, " if gather else "")
            + f"not 1F1B, twice {flag('microbatches')}, "
            f"{flag('remat')} dots or full, a larger {flag('fsdp_axis')} of 2, 4 or 8 dividing "
            f"{flag('data_axis', data_axis)}, nor more {flag('stages')}"
        )
    shown = flag({"fsdp": "fsdp_axis"}.get(change.option, change.option), change.value)
    return f"{needs}; {shown} fits ({format_bytes(change.prediction.peak)})"


def memory_inputs(run: RunConfig, data_axis: int) -> tuple[Any, dict[str, Any]]:
    """The ``MemoryLayout`` of a run and the options ``predict_memory`` takes from it.

    Example:
        >>> layout, options = memory_inputs(RunConfig.of({"stages": 4}), 2)
        >>> layout.stages, layout.data, options["batch"], options["microbatches"]
        (4, 2, 16, 4)
    """
    from mmnnx.partition.memory import MemoryLayout  # noqa: PLC0415

    training, lay = run.training, run.layout
    layout = MemoryLayout(
        stages=lay.stages, data=data_axis, tensor=lay.model_axis, expert=lay.expert_axis,
        fsdp=lay.fsdp_axis, virtual_stages=lay.virtual_stages,
        blocks=given_sizes(lay.partition),
    )  # fmt: skip
    options = dict(
        batch=training.batch_size, seq_len=run.model.seq_len, schedule=training.schedule,
        microbatches=training.microbatches, trainable=0.0 if run.model.lora_rank else 1.0,
        pack_weights=training.pack_weights, fsdp_gather=lay.fsdp_gather,
    )  # fmt: skip
    return layout, options
