"""The options of ``mmnnx train``, declared once: one dataclass per table of a config file
(and group of ``mmnnx train --help``); ``TrainConfig`` and ``GPTConfig`` are built from their
values (:func:`train_config`, :func:`gpt_config`). Adding an option is adding a field."""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Mapping
from typing import Any

from mmnnx.models.gpt import DTYPES, REMAT, GPTConfig
from mmnnx.modules.lora import MOE_TARGETS, TARGETS
from mmnnx.mpmd.lower.pack import PACK_RESIDUAL_BYTES, PACK_WEIGHT_BYTES
from mmnnx.mpmd.schedules import names as schedule_names
from mmnnx.mpmd.schedules.registry import registered
from mmnnx.train.loop import TrainConfig
from mmnnx.train.options import (
    finite,
    integer,
    names,
    nonempty,
    option,
    options_where,
    positive,
    spec,
    split_or,
    step_range,
    switch,
    table,
    tables,
)
from mmnnx.train.records import FORMATS, TRAIN_ON, Fields, PairFields

T, G = TrainConfig, GPTConfig  # whose defaults the options feeding them take


def count(default: int, help: str, **more) -> Any:
    """An option of an int >= 1, its help ending with its default."""
    return option(default, help + " (%(default)s)", positive, **more)


def moe(help: str, parse: Any, metavar: str) -> Any:
    """An architecture option of a mixture of experts, ``None`` (the default) unless given."""
    return option(None, help, parse, metavar=metavar, omit=(None,), moe=True, architecture=True)


def _schedule_help() -> str:
    groups: dict[str, list[str]] = {}
    for name in schedule_names():
        placement = registered(name).placement
        groups.setdefault(f"--virtual-stages {placement.runs} ({placement.needs})", []).append(name)
    choices = "; ".join(f"{', '.join(names)}: {need}" for need, names in groups.items())
    return (
        f"pipeline schedule (1f1b). {choices}. 'auto' (one stage per task) measures a step "
        "once and picks the fastest schedule that fits --memory-budget (mm.schedules.tune), "
        "printing its choice"
    )


@dataclasses.dataclass
class Model:
    dim: int = count(G.dim, "model width", architecture=True)
    depth: int = count(G.depth, "number of transformer blocks", architecture=True)
    heads: int = count(G.num_heads, "attention heads", api="num_heads", architecture=True)
    scan_layers: bool = switch(
        "--scan-layers",
        "stack the blocks and run them with nnx.scan, each stage scanning its own chunk "
        "(--depth must be a multiple of --stages); traced once whatever the depth: use it for "
        "deep models (more than 32 blocks unrolled warn)",
    )
    seq_len: int = count(64, "tokens per sequence", api="max_seq_len")
    remat: str = option(
        "none",
        "recompute each block's forward in its backward (nnx.remat), keeping of it: none "
        "recomputed (none), only its input (full), its matmuls' outputs (dots), those in host "
        "memory (offload); the same numbers, less memory, more compute (%(default)s)",
        choices=tuple(REMAT),
        omit=("none",),
        may_change=True,
    )
    gated_mlp: bool = switch(
        "--gated-mlp",
        "a SiLU-gated MLP without biases (Llama's and Qwen3's) instead of GELU with biases: a "
        "run so trained exports as LlamaForCausalLM (mmnnx export)",
        architecture=True,
    )
    init_from: str | None = option(
        None,
        "fine-tune a Hugging Face checkpoint directory of a family docs/pretrained.md lists "
        "(Llama, Qwen3, Qwen3-MoE, Mistral, Mixtral, Gemma 3, gpt-oss, DeepSeek-V3 / Kimi K2): "
        "its config.json gives the architecture (no --dim, --depth, --heads, --gated-mlp, "
        "--tokenizer, --vocab-size with it), its safetensors the weights, read straight onto "
        "the stages, its tokenizer.json the tokenizer",
        metavar="HF_DIR",
    )
    lora_rank: int | None = option(
        None,
        "train LoRA adapters of this rank only (mm.modules.add_lora), every other parameter "
        "frozen: no gradients, no optimizer state",
        positive,
        metavar="R",
    )
    lora_alpha: float | None = option(
        None,
        "with --lora-rank: the adapters' alpha, their update scaled by alpha / R (default R)",
        finite(positive=True),
        metavar="A",
    )
    lora_targets: tuple[str, ...] | None = option(
        None,
        f"with --lora-rank: the projections adapted, comma-separated among {','.join(TARGETS)} "
        f"(default: those the model has) and {','.join(MOE_TARGETS)} (a mixture of experts' "
        "router: only when named)",
        names(TARGETS + MOE_TARGETS),
        metavar="NAMES",
        text=",".join,
    )
    experts: int | None = moe(
        "make blocks mixtures of this many SwiGLU experts (mm.modules.MoE, routed as "
        "Qwen3-MoE; dropless unless --capacity-factor); which blocks: --moe-every (default: "
        "none, a dense GPT)",
        positive,
        "E",
    )
    experts_per_token: int | None = moe(
        "with --experts: the experts each token is routed to, top-k "
        f"(default {G.experts_per_token})",
        positive,
        "K",
    )
    expert_hidden: int | None = moe(
        "with --experts: each expert's hidden size (default: the dense MLP's, 4 x --dim)",
        positive,
        "H",
    )
    moe_every: int | None = moe(
        f"with --experts: block i is a mixture of experts when (i + 1) %% N == 0, the others "
        f"dense (Qwen3-MoE's decoder_sparse_step; default {G.moe_every}: every block)",
        positive,
        "N",
    )
    capacity_factor: float | None = moe(
        "with --experts: each expert computes at most ceil(C x tokens x K / E) assignments of "
        "a microbatch, the later ones dropped (logged as dropped_tokens) (default: dropless)",
        finite(positive=True),
        "C",
    )
    router_aux_loss_coef: float | None = moe(
        "with --experts: weight of the routers' load-balancing loss added to the loss "
        f"(default {G.router_aux_loss_coef})",
        finite(positive=False),
        "A",
    )
    router_z_loss_coef: float | None = moe(
        "with --experts: weight of the routers' z-loss added to the loss "
        f"(default {G.router_z_loss_coef})",
        finite(positive=False),
        "Z",
    )


@dataclasses.dataclass
class Layout:
    stages: int = count(2, "pipeline stages, one task each")
    data_axis: int = count(2, "data-parallel size inside each stage")
    model_axis: int = count(2, "tensor-parallel size inside each stage")
    expert_axis: int = count(
        1,
        "with --experts: expert-parallel size inside each stage, an 'expert' mesh axis the "
        "experts are split over (E / N per device) and the batch too, tokens travelling to "
        "their experts by all_to_all",
        metavar="N",
    )
    fsdp_axis: int = count(
        1,
        "FSDP (ZeRO-3) inside each stage: parameters, gradients and optimizer state sharded over "
        "N of the --data-axis devices (an 'fsdp' mesh axis that splits the batch too; N must "
        "divide --data-axis), gathered where each stage's program uses them",
        metavar="N",
    )
    fsdp_gather: str = option(
        T.fsdp_gather,
        "with --fsdp-axis: when each stage's weights are gathered: in every microbatch's "
        "forward and backward (least memory), or once per step, kept until the stage's last "
        "microbatch (mm.jit(gather_weights='fsdp'): fewer collectives, the weights held "
        "whole meanwhile) (%(default)s)",
        choices=("microbatch", "step"),
        omit=(T.fsdp_gather,),
        may_change=True,
    )
    virtual_stages: int = option(
        T.virtual_stages,
        "model stages per task (%(default)s): the blocks are cut into --stages x V stages, "
        "looped over the tasks for the interleaved schedules, down and back up (a V, the "
        "embedding and head on the first task) for zero-bubble-v and dualpipev",
        positive,
        metavar="V",
    )
    devices: int = count(8, "simulated CPU devices when no accelerator is used")
    partition: str = option(
        "params",
        "how the blocks are split over the stages: 'params' balances their parameter counts "
        "(stage_rules); 'auto' times each block, the embedding and the head with the loss on "
        "the stages' devices and simulates every split (mm.schedules.partition), printing why, "
        "and with --schedule auto picks the schedule and --microbatches too; or the blocks per "
        "stage, e.g. 3,1 (%(default)s). --resume reuses the split a run was planned with",
        split_or(("params", "auto")),
        metavar="HOW",
    )


@dataclasses.dataclass
class Training:
    batch_size: int = count(16, "sequences per step")
    microbatches: int = count(T.microbatches, "microbatches per step", may_change=True)
    schedule: str = option(
        T.schedule,
        _schedule_help,
        choices=lambda: (*schedule_names(), "auto"),
        may_change=True,
    )
    memory_budget: str | None = option(
        None,
        "bytes per device the run may use (e.g. 24GiB): a layout whose peak, predicted from "
        "the shapes (mm.predict_memory), exceeds it is refused before anything compiles, "
        "naming the stage and the smallest change that fits; with --schedule auto or "
        "--partition auto, what the schedule and the split may use",
        nonempty,  # a TOML integer of bytes reads as its digits
        may_change=True,
    )
    pack_residuals: bool | int = option(
        T.pack_residuals,
        switches={
            "--pack-residuals": (
                True,
                "return all of each forward's residuals as one buffer "
                "(mm.jit(pack_residuals=True)); by default those of at most "
                f"{PACK_RESIDUAL_BYTES // 1024} KiB are",
            ),
            "--no-pack-residuals": (
                False,
                "return each residual as an array of its own (mm.jit(pack_residuals=False))",
            ),
        },
        may_change=True,
    )
    pack_weights: bool = switch(
        "--no-pack-weights",
        "pass each block weight to the pipelined programs as an array of its own "
        "(mm.jit(pack_weights=False)); by default each block's weights of at most "
        f"{PACK_WEIGHT_BYTES // 1024} KiB travel as one buffer",
        default=True,
        omit=(True,),
        may_change=True,
    )
    steps: int = count(T.steps, "optimizer steps", may_change=True)
    schedule_steps: int | None = option(
        T.schedule_steps,
        "horizon of the learning-rate schedule, warm-up + cosine decay to a tenth of --lr "
        "(default: --steps; with --resume, the horizon saved with the checkpoint)",
        positive,
        may_change=True,
        from_run=False,  # the checkpoint holds it: a run's config.toml would fix it on resume
    )
    lr: float = option(
        T.learning_rate,
        "peak learning rate, reached after the warm-up; the cosine decay ends at a tenth of it "
        "(3e-3)",
        finite(positive=True),
        api="learning_rate",
    )
    warmup_steps: int = option(
        T.warmup_steps,
        "steps of linear learning-rate warm-up from 0 (%(default)s); at most the schedule's "
        "horizon - 1 (--schedule-steps): a shorter run warms up over all but its last step",
        integer(0),
    )
    weight_decay: float = option(
        T.weight_decay,
        "AdamW's decoupled weight decay, of every trained parameter: norm scales, biases and "
        "embeddings too (%(default)s)",
        finite(positive=False),
    )
    router_bias_rate: float = option(
        0.0,
        "DeepSeek-V3's auxiliary-loss-free balancing (a DeepseekV3ForCausalLM --init-from): "
        "after each step every router's correction bias moves by R per expert, up for the "
        "experts below the mean load, down above it (DeepSeek-V3: 0.001; default: off)",
        finite(positive=False),
        metavar="R",
        omit=(0.0,),
        may_change=True,
    )
    eval_every: int = count(T.eval_every, "steps between evaluations", may_change=True)
    eval_batches: int = count(
        T.eval_batches, "held-out batches each evaluation averages", may_change=True
    )
    timeline_step: int = option(
        T.timeline_step,
        "the step whose pipeline timeline is measured and drawn (%(default)s; 0: none)",
        integer(0),
        may_change=True,
    )
    seed: int = option(0, "initialisation and data seed (%(default)s)", integer(0))
    text: list[str] | None = option(
        None,
        "your own UTF-8 text files or directories (default: embedded text); tokenized a "
        "chunk at a time into OUTPUT_DIR/data/tokens.bin, read from disk as training goes",
        many=True,
        metavar="PATH",
    )
    tokenizer: str = option(
        "bytes",
        "bytes (256 tokens) or a byte-level BPE trained on the text (saved with the run "
        "under OUTPUT_DIR/tokenizer; --resume reuses it) (%(default)s)",
        choices=("bytes", "bpe"),
        architecture=True,
    )
    vocab_size: int | None = option(
        None,
        "with --tokenizer bpe: tokens of the BPE, at least 256; fewer if the text has "
        "fewer pairs to merge; --resume keeps the saved tokenizer's (1024)",
        integer(256),
        architecture=True,
    )


@dataclasses.dataclass
class Data:
    data: str | None = option(
        None,
        "train on records instead of --text: a JSON Lines, JSON, Parquet or CSV file, a "
        "directory of them, or a Hugging Face Hub dataset id (where a network exists), read "
        "with the datasets library",
        nonempty,
        metavar="PATH",
        omit=(None,),
    )
    data_format: str = option(
        "auto",
        "with --data: text (every token trained on), completion (prompt and completion "
        "fields), chat (a messages field rendered with --init-from's chat template), or auto: "
        "by the first record's fields (%(default)s)",
        choices=("auto", *FORMATS),
        omit=("auto",),
    )
    text_field: str = option(Fields.text, "with --data: the text field (%(default)s)", nonempty)
    prompt_field: str = option(Fields.prompt, "the prompt field (%(default)s)", nonempty)
    completion_field: str = option(
        Fields.completion, "the completion field (%(default)s)", nonempty
    )
    messages_field: str = option(Fields.messages, "the messages field (%(default)s)", nonempty)
    train_on: str = option(
        "completions",
        "with --data: the loss on the completions or the assistant's turns only, or on all "
        "tokens; averaged over those of the whole batch (%(default)s)",
        choices=TRAIN_ON,
        omit=("completions",),
    )
    pack: bool = switch(
        "--pack",
        "with --data: several examples to a sequence, attention kept within each and "
        "positions restarting (by default one a sequence, padded)",
    )
    truncate: bool = switch(
        "--no-truncate",
        "with --data: refuse an example longer than --seq-len + 1 tokens, naming it (by "
        "default cut and counted)",
        default=True,
        omit=(True,),
    )
    eval_data: str | None = option(
        None,
        "with --data: held-out records to evaluate on (default: the last --eval-fraction of "
        "--data)",
        nonempty,
        metavar="PATH",
        omit=(None,),
    )
    eval_fraction: float = option(
        0.05,
        "with --data and no --eval-data: the share of the records held out (%(default)s)",
        finite(positive=True),
        omit=(0.05,),
    )


@dataclasses.dataclass
class Preference:
    dpo: bool = switch(
        "--dpo",
        "preference-tune by DPO on --data of prompt, chosen and rejected records (text, or chat "
        "messages rendered with --init-from's template) against the frozen initial model, "
        "computed in the same pipelined step (with --lora-rank: the base model, adapters off, "
        "no second copy held)",
    )
    dpo_beta: float = option(
        0.1, "with --dpo: how far the policy may move from the reference (%(default)s)",
        finite(positive=True), omit=(0.1,),
    )  # fmt: skip
    chosen_field: str = option(
        PairFields.chosen, "with --dpo: the preferred completion's field (%(default)s)", nonempty
    )
    rejected_field: str = option(
        PairFields.rejected, "with --dpo: the other completion's field (%(default)s)", nonempty
    )


@dataclasses.dataclass
class Precision:
    dtype: str = option(
        G.dtype,
        "compute dtype of activations and matmuls; the parameters' and optimizer state's: "
        "--param-dtype and --optimizer-dtype (%(default)s)",
        choices=DTYPES,
    )
    param_dtype: str = option(
        G.param_dtype,
        "dtype the model's parameters are stored in, read by the forward and backward: with "
        "bfloat16 the optimizer updates float32 master copies of them (saved in the "
        "checkpoints), each rounded to bfloat16 after its update; with --lora-rank, the "
        "frozen base's dtype (the adapters train in float32) (%(default)s)",
        choices=DTYPES,
    )
    optimizer_dtype: str = option(
        T.optimizer_dtype,
        "dtype AdamW's moments are stored in between steps (computed in float32) (%(default)s)",
        choices=DTYPES,
    )
    clip_grad_norm: float | None = option(
        T.clip_grad_norm,
        "scale the gradients down to this global norm, over every stage's (default: none)",
        finite(positive=True),
        metavar="NORM",
    )


@dataclasses.dataclass
class Logging:
    log_every: int = count(
        T.log_every, "steps between logged metrics; without a terminal, one line each"
    )
    tensorboard: bool = switch(
        "--no-tensorboard",
        "write no TensorBoard event files (by default under OUTPUT_DIR/tensorboard)",
        default=T.tensorboard,
    )
    profile_steps: tuple[int, int] | None = option(
        T.profile_steps,
        "trace steps A to B with jax.profiler into OUTPUT_DIR/profile",
        step_range,
        metavar="A:B",
        text=lambda steps: f"{steps[0]}:{steps[1]}",
    )
    wandb: str | None = option(
        T.wandb,
        "log the TensorBoard scalars and this run's config to this Weights & Biases project "
        "too (process 0); files under OUTPUT_DIR/wandb unless WANDB_DIR says where; "
        "WANDB_MODE=offline logs without a network; --resume continues the same wandb run",
        nonempty,
        metavar="PROJECT",
    )
    wandb_name: str | None = option(
        T.wandb_name,
        "with --wandb: the run's name (default: OUTPUT_DIR's name)",
        nonempty,
        metavar="NAME",
    )


@dataclasses.dataclass
class Outputs:
    output_dir: str = option(
        T.output_dir,
        "metrics, loss curve and timeline go here (%(default)s)",
        from_run=False,  # where the run is now
    )
    checkpoint_dir: str | None = option(
        T.checkpoint_dir, "checkpoints (default: OUTPUT_DIR/checkpoints)"
    )
    resume: bool = switch(
        "--resume", "continue from the latest checkpoint", from_run=False, unrecorded=True
    )
    checkpoint_every: int = count(
        T.checkpoint_every, "save a checkpoint every this many steps, and at the end"
    )

    def checkpoints(self, run_dir: str | pathlib.Path | None = None) -> pathlib.Path:
        """The run's checkpoint directory: ``checkpoint_dir``, else ``checkpoints/`` in
        ``run_dir`` (where the run is now; default ``output_dir``).

        Example:
            >>> Outputs(output_dir="runs/a").checkpoints()
            PosixPath('runs/a/checkpoints')
        """
        run_dir = self.output_dir if run_dir is None else run_dir
        return pathlib.Path(self.checkpoint_dir or pathlib.Path(run_dir, "checkpoints"))


@dataclasses.dataclass
class RunConfig:
    """A run's options, one table each (a resumed run may change those of ``layout``,
    ``logging`` and ``outputs``: how a step is run, not what it computes)."""

    model: Model = table(Model)
    layout: Layout = table(Layout, may_change=True)
    training: Training = table(Training)
    dataset: Data = table(Data)
    preference: Preference = table(Preference)
    precision: Precision = table(Precision)
    logging: Logging = table(Logging, may_change=True)
    outputs: Outputs = table(Outputs, may_change=True)

    @classmethod
    def of(cls, values: Mapping[str, Any]) -> RunConfig:
        """The config of option ``values`` by name (a parsed command line's, ``config.toml``'s
        read by ``read_config``); other names are ignored, options missing take their defaults.

        Example:
            >>> RunConfig.of({"dim": 64, "steps": 5, "command": "train"}).model.dim
            64
        """
        kinds = {t.name: t.default_factory for t in dataclasses.fields(cls)}
        return cls(
            **{
                title: kind(
                    **{f.name: values[f.name] for f in tables(cls)[title] if f.name in values}
                )
                for title, kind in kinds.items()
            }
        )

    def options(self) -> dict[str, Any]:
        """Every option's value by name, as the run records it (``config.toml``, the
        checkpoints' run record): with ``--init-from``, the architecture options left out (the
        checkpoint's ``config.json`` gives them).

        Example:
            >>> config = RunConfig.of({"init_from": "hf/llama"})
            >>> config.options()["init_from"], "dim" in config.options()
            ('hf/llama', False)
        """
        values = {
            f.name: getattr(getattr(self, title), f.name)
            for title, fields in tables(type(self)).items()
            for f in fields
        }
        if self.model.init_from is not None:
            values = {k: v for k, v in values.items() if k not in ARCHITECTURE}
        return values


MOE = options_where(RunConfig, "moe")
"""The options of a mixture of experts, which need ``--experts``."""

ARCHITECTURE = options_where(RunConfig, "architecture")
"""The options that describe a model trained from scratch, which ``--init-from`` takes from the
checkpoint instead (given with it: an error; not recorded in its ``config.toml``)."""

UNRECORDED = options_where(RunConfig, "unrecorded")
"""The options a run's ``config.toml`` leaves out: what one start of it does (``--resume``), not
what the run is, which a ``--config`` of that file would otherwise repeat."""

MAY_CHANGE_ON_RESUME = options_where(RunConfig, "may_change")
"""The options a resumed run may give other values than its checkpoints were trained with: its
length and learning-rate horizon, its layout (how a step is run, not what it computes), logging
and outputs. Every other option is recorded with each checkpoint and must match on ``--resume``
(``mmnnx.train.run_record``); an option added later is so recorded unless its field says
``may_change``."""


FIELDS = {f.name: f for fields in tables(RunConfig).values() for f in fields}
"""Every option's field, by name."""


def _arguments(values: Mapping[str, Any], target: type) -> dict[str, Any]:
    """The fields of ``target`` that options in ``values`` set, by their names there."""
    names = {f.name for f in dataclasses.fields(target)}
    return {
        name: values[f.name]
        for name, f in ((spec(f).api or f.name, f) for f in FIELDS.values())
        if name in names and f.name in values and values[f.name] not in spec(f).omit
    }


def train_config(run: RunConfig) -> TrainConfig:
    """The ``TrainConfig`` of a run's options; its ``param_dtype``, of the trained parameters,
    is float32 with ``--lora-rank`` (the adapters', whatever the frozen base's).

    Example:
        >>> train_config(RunConfig.of({"pack_weights": False})).pack_weights
        False
        >>> lora = {"param_dtype": "bfloat16", "lora_rank": 8}
        >>> train_config(RunConfig.of(lora)).param_dtype
        'float32'
    """
    options = _arguments(run.options(), TrainConfig)
    if run.model.lora_rank:
        options["param_dtype"] = "float32"
    return TrainConfig(**options)


def gpt_config(run: RunConfig, vocab_size: int) -> GPTConfig:
    """The ``GPTConfig`` of a run's options for a model trained from scratch; the vocabulary is
    the tokenizer's ``vocab_size`` rounded up to a multiple of ``--model-axis`` (the embedding
    is sharded over it).

    Raises:
        ValueError: a model the options cannot describe, the message naming them as flags.

    Example:
        >>> gpt_config(RunConfig.of({"dim": 64, "model_axis": 2}), 289).vocab_size
        290
        >>> gpt_config(RunConfig.of({"experts": 4, "moe_every": 5}), 256)
        Traceback (most recent call last):
        ...
        ValueError: --moe-every 5 leaves none of --depth 4 blocks a mixture of experts
    """
    problem = model_problem(run.model, run.layout.model_axis)
    if problem:
        raise ValueError(problem)
    shards = run.layout.model_axis
    sizes = _arguments(run.options(), GPTConfig)
    if run.model.gated_mlp:
        sizes["mlp_bias"] = False  # Llama's MLP
    sizes["vocab_size"] = -(-vocab_size // shards) * shards  # not the option: that is the BPE's
    return GPTConfig(**sizes)


def flag(name: str, value: Any = None) -> str:
    """Option ``name`` as a flag (a switch: its flag), followed by ``value`` when given.

    Example:
        >>> flag("seq_len", 64), flag("pack_weights")
        ('--seq-len 64', '--no-pack-weights')
    """
    option = spec(FIELDS[name])
    shown = next(iter(option.switches), None) or option.flag(name)
    return shown if value is None else f"{shown} {value}"


def model_problem(model: Model, model_axis: int) -> str | None:
    """What keeps ``model``'s options from describing a GPT ``--model-axis`` shards, in a line."""
    dim, heads = model.dim, model.heads
    if dim % heads:
        return f"{flag('dim', dim)} is not divisible by {flag('heads', heads)}"
    if (dim // heads) % 2:
        return (
            f"{flag('dim', dim)} / {flag('heads', heads)} gives heads of {dim // heads} "
            "dimensions; rotary position embeddings need an even head size"
        )
    if heads % model_axis:
        return f"{flag('heads', heads)} is not divisible by {flag('model_axis', model_axis)}"
    if model.experts is None:
        return None
    e, k = model.experts, model.experts_per_token or G.experts_per_token
    if k > e:
        return (
            f"{flag('experts_per_token', k)} is more than {flag('experts', e)}: a token picks "
            "K of E experts"
        )
    if model.capacity_factor is not None and model.capacity_factor > e:
        return (
            f"{flag('capacity_factor', format(model.capacity_factor, 'g'))} is more than "
            f"{flag('experts', e)}: from {e / k:g} (E / K) on no expert drops a token; leave it "
            "out for dropless routing"
        )
    every = model.moe_every or G.moe_every
    if every > model.depth:
        return (
            f"{flag('moe_every', every)} leaves none of {flag('depth', model.depth)} blocks a "
            "mixture of experts"
        )
    if model.scan_layers and every > 1:
        return (
            f"{flag('scan_layers')} stacks alike blocks, but {flag('moe_every', every)} leaves "
            f"some dense; use {flag('moe_every', 1)} with it"
        )
    hidden = model.expert_hidden or int(G.mlp_ratio * dim)
    if hidden % model_axis:
        return (
            f"the experts' hidden size {hidden} ({flag('expert_hidden')}) is not divisible by "
            f"{flag('model_axis', model_axis)}"
        )
    return None
