"""The training loop: ``fit`` runs pipelined ``mm.jit`` steps with a progress bar, periodic
evaluation, JSONL metrics, a loss curve, a measured pipeline timeline and Orbax checkpoints."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import pathlib
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from mmnnx.cached_partial import cached_partial
from mmnnx.distributed.fetch import fetch
from mmnnx.distributed.preemption import Preemption
from mmnnx.distributed.progress import progress as report
from mmnnx.jit import jit
from mmnnx.microbatch import microbatch
from mmnnx.modules.deepseek_moe import balance_router_biases
from mmnnx.mpmd.lower.pack import (
    PACK_RESIDUAL_BYTES,
    PACK_WEIGHT_BYTES,
    residual_bound,
    weight_bound,
)
from mmnnx.mpmd.schedules import Schedule, measured_bubble
from mmnnx.timeline import plot_timeline
from mmnnx.train.checkpoint import Checkpointer
from mmnnx.train.data import DataStateError, TextDataset
from mmnnx.train.precision import DTYPES, cast_state, master_weights
from mmnnx.train.preference import PreferenceModel, preference_metrics
from mmnnx.train.router_metrics import has_router_metrics, router_metrics
from mmnnx.train.run_log import RunLog, print_line
from mmnnx.train.wandb_writer import WandbWriter
from mmnnx.tuning import tune

Filter = Any  # an nnx filter: a Variable type, a predicate, ... (flax.nnx.filterlib)


@dataclasses.dataclass
class TrainConfig:
    """What ``fit`` does: steps, optimizer, pipelining, evaluation, outputs and checkpoints.

    ``schedule`` is a registered schedule name, a ``Schedule``, or ``"auto"``: ``fit`` measures
    a step once and uses the fastest schedule whose memory per device fits ``memory_budget``
    (bytes, or a string such as ``"2GiB"``; ``None``: no limit), printing the candidates
    (``mm.schedules.tune``), and runs the very table it simulated (a zero-bubble schedule
    ordered for the measured durations). ``pack_residuals``: the train step's
    ``mm.jit(pack_residuals=...)``: ``True`` packs every residual, ``False`` none, a number
    those of at most that many bytes (the default, ``mm.PACK_RESIDUAL_BYTES``).
    ``fsdp_gather``: ``"step"`` gathers each FSDP-sharded weight once per step
    (``mm.jit(gather_weights="fsdp")``), ``"microbatch"`` where each program reads it.
    ``pack_weights``: the train step's ``mm.jit(pack_weights=...)``, likewise for each block's
    weights (default ``mm.PACK_WEIGHT_BYTES``).

    ``clip_grad_norm``: gradients are scaled down to this global norm (over every task's
    gradients) before AdamW (``None``: no clipping). ``param_dtype``: the dtype of the trained
    parameters, ``"float32"`` or ``"bfloat16"``; with bfloat16 the optimizer updates float32
    master copies of them, each parameter its master rounded after the update
    (``mmnnx.train.precision.master_weights``; ``fit`` refuses a model whose trained Variables
    are of another dtype). ``optimizer_dtype``: AdamW's moments stored in ``"float32"`` or
    ``"bfloat16"`` (``precision.cast_state``). ``virtual_stages``: model stages per task
    for the schedules that run several (``mm.microbatch(virtual_stages=...)``; the model must
    be placed so, e.g. ``stage_rules(..., virtual_stages=2, order="v")``). ``tensorboard``:
    TensorBoard event files under ``output_dir/tensorboard``. ``profile_steps``: ``(a, b)``
    traces steps ``a`` to ``b`` with ``jax.profiler`` into ``output_dir/profile``. ``wandb``:
    a Weights & Biases project that gets the TensorBoard scalars too, in a run named
    ``wandb_name`` (default: the output directory's name) that ``resume`` continues
    (``WandbWriter.start``; ``WANDB_MODE=offline`` logs without a network).
    """

    steps: int = 300
    learning_rate: float = 3e-3
    warmup_steps: int = 20
    weight_decay: float = 0.01
    microbatches: int = 4
    schedule: str | Schedule = "1f1b"
    eval_every: int = 50
    eval_batches: int = 4
    log_every: int = 10
    checkpoint_every: int = 100
    output_dir: str = "runs/latest"
    checkpoint_dir: str | None = None
    resume: bool = False
    timeline_step: int | None = 3
    schedule_steps: int | None = None
    memory_budget: int | str | None = None
    pack_residuals: bool | int = PACK_RESIDUAL_BYTES
    pack_weights: bool | int = PACK_WEIGHT_BYTES
    fsdp_gather: str = "microbatch"
    clip_grad_norm: float | None = None
    param_dtype: str = "float32"
    optimizer_dtype: str = "float32"
    virtual_stages: int = 1
    tensorboard: bool = True
    profile_steps: tuple[int, int] | None = None
    wandb: str | None = None
    wandb_name: str | None = None

    def __post_init__(self):
        counts = ("steps", "microbatches", "eval_every", "eval_batches", "log_every")
        for name in (*counts, "checkpoint_every", "virtual_stages"):
            if getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.schedule_steps is not None and self.schedule_steps < 1:
            raise ValueError(
                f"TrainConfig.schedule_steps must be >= 1 or None, got {self.schedule_steps}"
            )
        if self.warmup_steps < 0:
            raise ValueError(f"TrainConfig.warmup_steps must be >= 0, got {self.warmup_steps}")
        if not (math.isfinite(self.learning_rate) and self.learning_rate > 0):
            raise ValueError(
                f"TrainConfig.learning_rate must be a finite number > 0, got {self.learning_rate}"
            )
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ValueError(
                f"TrainConfig.weight_decay must be a finite number >= 0, got {self.weight_decay}"
            )
        residual_bound(self.pack_residuals)  # a TypeError naming it before any step is built
        weight_bound(self.pack_weights)
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            raise ValueError(
                f"TrainConfig.clip_grad_norm must be > 0 or None, got {self.clip_grad_norm}"
            )
        for name in ("param_dtype", "optimizer_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(
                    f"TrainConfig.{name} must be one of {', '.join(DTYPES)}, got "
                    f"{getattr(self, name)!r}"
                )
        if self.virtual_stages > 1 and self.schedule == "auto":
            raise ValueError(
                "TrainConfig.schedule='auto' picks among schedules of one stage per task; "
                f"name a schedule for virtual_stages={self.virtual_stages}"
            )
        if self.profile_steps is not None:
            first, last = self.profile_steps
            if not 1 <= first <= last:
                raise ValueError(
                    "TrainConfig.profile_steps must be (first, last) steps with "
                    f"1 <= first <= last, got {self.profile_steps}"
                )


@dataclasses.dataclass
class FitResult:
    """What a run did: metrics per logged step, evaluation losses, throughput and files written."""

    metrics: list[dict]
    eval_losses: list[tuple[int, float]]
    first_step: int
    last_step: int
    tokens_per_second: float
    files: dict[str, str]
    skipped_batches: int = 0
    """Batches passed over because no token of them is trained on (``ExampleDataset``)."""
    bubble: tuple[int, float] | None = None
    """``(step, fraction)``: the idle share of every task's time in the step whose timeline
    was drawn (``mm.schedules.measured_bubble``; with several processes, over every process's
    tasks); ``None`` when none was (no pipeline, or ``timeline_step`` not reached)."""
    preempted: bool = False
    """Whether a preemption notice (``SIGTERM``) stopped the run after ``last_step``, which was
    saved (``mm.distributed.Preemption``)."""

    @property
    def first_eval(self) -> float:
        return self.eval_losses[0][1]

    @property
    def final_eval(self) -> float:
        return self.eval_losses[-1][1]


def learning_rates(config: TrainConfig) -> optax.Schedule:
    """The learning rate of each update (0-based): linear warm-up from 0 to
    ``config.learning_rate`` over ``config.warmup_steps`` (at most the horizon - 1, so that a
    shorter run still reaches the peak, at its last update), then cosine decay to a tenth of it
    at the end of ``config.schedule_steps`` (the schedule's horizon; ``config.steps`` when it
    is ``None``).

    Example:
        >>> rate = learning_rates(TrainConfig(steps=100, learning_rate=1e-3, warmup_steps=10))
        >>> [round(float(rate(n)), 6) for n in (0, 5, 10, 99)]  # warm-up, peak, decayed
        [0.0, 0.0005, 0.001, 0.0001]
    """
    horizon = config.schedule_steps or config.steps
    return optax.warmup_cosine_decay_schedule(
        0.0,
        config.learning_rate,
        min(config.warmup_steps, horizon - 1),  # a one-step run trains at the peak
        max(horizon, 2),
        end_value=config.learning_rate * 0.1,
    )


def make_optimizer(config: TrainConfig) -> optax.GradientTransformation:
    """AdamW following :func:`learning_rates`, after clipping the gradients to the global norm
    ``config.clip_grad_norm`` (over every parameter, whatever task holds it) when it is set;
    its moments stored in ``config.optimizer_dtype``, run on float32 master copies of
    ``config.param_dtype`` bfloat16 parameters (``mmnnx.train.precision``).

    Example:
        >>> params = {"w": jax.numpy.zeros(3)}
        >>> tx = make_optimizer(TrainConfig(clip_grad_norm=1.0))
        >>> updates, _ = tx.update({"w": jax.numpy.full(3, 100.0)}, tx.init(params), params)
        >>> updates["w"].shape
        (3,)
    """
    tx = optax.adamw(learning_rates(config), weight_decay=config.weight_decay)
    if config.clip_grad_norm is not None:
        tx = optax.chain(optax.clip_by_global_norm(config.clip_grad_norm), tx)
    if config.optimizer_dtype != "float32":
        tx = cast_state(tx, config.optimizer_dtype)
    if config.param_dtype != "float32":
        tx = master_weights(tx)
    return tx


def _loss(model, batch):
    return model.loss(batch)


def _loss_and_metrics(model, batch):
    return nnx.capture(_loss, nnx.Intermediate)(model, batch)


def loss_and_grads(
    config: TrainConfig, trainable: Filter = nnx.Param, *, metrics: bool = False
) -> Callable:
    """``(model, batch) -> (loss, grads)``: the mean loss of ``batch`` and its gradients with
    respect to the Variables of ``model`` that ``trainable`` selects (an ``nnx`` filter:
    ``nnx.Param`` trains everything, ``nnx.LoRAParam`` only the adapters of ``add_lora``, the
    other Variables then getting no gradients), over ``config.microbatches`` microbatches run
    with ``config.schedule``; what the train step of :func:`make_steps` applies. With
    ``metrics``, ``(model, batch) -> ((loss, intermediates), grads)``: what the model sows
    under ``nnx.capture(..., nnx.Intermediate)`` (a ``MoE``'s router metrics), one value per
    microbatch stacked (``router_metrics`` reads them).

    Example:
        >>> from mmnnx.models import GPT, GPTConfig
        >>> from mmnnx.modules import add_lora
        >>> with nnx.use_eager_sharding(False):
        ...     model = GPT(GPTConfig(dim=32, depth=1, vocab_size=64), rngs=nnx.Rngs(0))
        ...     model = add_lora(model, rank=2, targets=("q",))
        >>> step = loss_and_grads(TrainConfig(microbatches=1), nnx.LoRAParam)
        >>> loss, grads = step(model, jax.numpy.zeros((2, 9), jax.numpy.int32))
        >>> sorted(".".join(map(str, p)) for p, _ in nnx.to_flat_state(grads))
        ['blocks.0.attn.q.lora.a', 'blocks.0.attn.q.lora.b']
    """
    grad_fn = nnx.value_and_grad(
        _loss_and_metrics if metrics else _loss,
        argnums=nnx.DiffState(0, trainable),
        has_aux=metrics,
    )
    if config.microbatches > 1:
        grad_fn = microbatch(
            grad_fn,
            num=config.microbatches,
            reduce=(("mean", "stack"), "mean") if metrics else "mean",
            schedule=config.schedule,
            virtual_stages=config.virtual_stages,
        )
    return grad_fn


def make_steps(config: TrainConfig, trainable: Filter = nnx.Param, *, metrics: bool = False):
    """The jitted train step (of :func:`loss_and_grads`, then the update and, with a
    ``router_bias_rate``, ``balance_router_biases``) and eval step."""
    grad_fn = loss_and_grads(config, trainable, metrics=metrics)
    captured_fn = grad_fn if metrics else loss_and_grads(config, trainable, metrics=True)

    def train_step(model, opt, batch):
        rate = getattr(getattr(model, "config", None), "router_bias_rate", 0.0)
        loss, grads = (captured_fn if rate else grad_fn)(model, batch)
        opt.update(model, grads)
        if rate:  # DeepSeek-V3's auxiliary-loss-free balancing, from the step's routing
            balance_router_biases(model, loss[1], rate)
            return loss if metrics else loss[0]
        return loss

    gather = "fsdp" if config.fsdp_gather == "step" else None  # mm.fsdp_rules' axis
    train = jit(
        train_step,
        pack_residuals=config.pack_residuals,
        pack_weights=config.pack_weights,
        gather_weights=gather,
    )
    return train, jit(_loss)


def fit(
    model: nnx.Module,
    dataset: TextDataset,
    config: TrainConfig,
    *,
    optimizer: nnx.Optimizer | None = None,
    trainable: Filter = nnx.Param,
    console: Console | None = None,
    wandb_config: Mapping[str, Any] | None = None,
    checkpointer: Checkpointer | None = None,
    checkpoint_extra: Mapping[str, Any] | None = None,
) -> FitResult:
    """Trains ``model`` (placed with ``mm.place``/``mm.init``; it needs ``loss(batch)``) on
    ``dataset`` and writes ``metrics.jsonl``, ``loss.png``, ``timeline.png`` and
    ``timeline.json`` (the events drawn, and the bubble), TensorBoard event files
    (``tensorboard/``) and a profiler trace (``profile/``, with ``config.profile_steps``) under
    ``config.output_dir`` and checkpoints under ``config.checkpoint_dir``. With
    ``config.wandb`` the same scalars go to a wandb run whose config is ``wandb_config``
    (default: ``config``'s fields), started before the first evaluation. Without a terminal
    it prints one plain line per ``config.log_every`` steps instead of the progress bar, and
    evaluation losses as they come (``RunLog``). With several processes, process 0 writes and
    reports; the timeline and bubble are the whole job's, every process's tasks.

    ``trainable`` (an ``nnx`` filter, ``nnx.Param`` by default) selects the Variables trained:
    the optimizer's (``nnx.Optimizer(..., wrt=trainable)``, unless ``optimizer`` is given, made
    with the same filter) and those the gradients are taken of; with ``nnx.LoRAParam`` only
    the adapters of ``mm.modules.add_lora`` train, the frozen weights having neither
    gradients nor optimizer state (checkpoints still hold them, with the adapters).

    Checkpoints go to ``checkpointer`` when given (its writer lock claimed, the checkpointer
    left open: a caller that claimed it before writing anything keeps its directory to itself
    throughout), else to a ``Checkpointer`` of ``config.checkpoint_dir`` opened and closed
    here. Each holds ``checkpoint_extra`` (JSON-able, e.g. ``mmnnx train``'s run record) in its
    ``extra`` beside the data position, step and schedule horizon. A preemption notice
    (``SIGTERM``; with several processes, to any of them) stops the run at the next step
    boundary every process agrees on (``mm.distributed.Preemption``): that step is saved, and
    the result says ``preempted``. Each phase of each step is reported to
    ``mm.distributed.progress``, which ``mmnnx launch --step-timeout`` watches. With
    ``config.resume`` it continues from the newest readable checkpoint (:func:`_resume`).

    Raises:
        NoReadableCheckpointError: ``config.resume`` and every step is damaged or incomplete.
        CheckpointMismatchError: ``config.resume`` into a checkpoint of another model.
        DataStateError: ``config.resume`` from a step whose data position ``dataset`` cannot
            take (edited by hand); the model then holds that step's weights, the checkpoints
            are as they were.
        WandbStartError: ``config.wandb`` and wandb could not start its run.

    Example (``mmnnx train``, in mmnnx/cli/train.py, is a complete script)::

        dataset = TextDataset.from_text(embedded_text(), seq_len=64, batch_size=16)
        result = fit(model, dataset, TrainConfig(steps=300, microbatches=4, schedule="1f1b"))
        assert result.final_eval < result.first_eval
    """
    loop = _Loop.prepare(model, dataset, config, optimizer, trainable, console)
    config, out, ckpt_dir = loop.config, loop.out, loop.ckpt_dir  # the config tuned
    with contextlib.ExitStack() as opened:
        checkpoints = checkpointer or opened.enter_context(Checkpointer(ckpt_dir))
        start, horizon = _resume(loop, checkpoints, own_optimizer=optimizer is None)
        loop.run_step = cached_partial(loop.train_step, model, loop.opt)
        loop.files.update(metrics=str(out / "metrics.jsonl"), checkpoints=str(ckpt_dir))
        if optimizer is None:  # a given optimizer's learning rates are its own, not known here
            loop.rates = learning_rates(dataclasses.replace(config, schedule_steps=horizon))
        loop.save = functools.partial(_save, loop, checkpoints, checkpoint_extra or {}, horizon)
        log = _log(loop, start, wandb_config)
        with log, _progress(loop.console, log.plain) as progress, Preemption() as preemption:
            stopped = loop.train(start, log, progress, preemption)
    report("finished training", stopped or config.steps, finished=True)
    return _finish(loop, log, start, stopped)


@dataclasses.dataclass
class _Loop:
    """What the steps of :func:`fit` share, and what the run has gathered."""

    model: nnx.Module
    opt: nnx.Optimizer
    dataset: TextDataset
    config: TrainConfig
    console: Console
    out: pathlib.Path
    ckpt_dir: pathlib.Path
    leader: bool  # process 0 (with several processes): reports and writes
    sows: bool  # a mixture of experts or DPO: what the model sows is logged
    eval_data: list
    train_step: Any = None  # make_steps's, microbatched with the config's schedule
    eval_step: Any = None
    run_step: Any = None  # train_step with the model and optimizer bound (cached_partial)
    captured_step: Any = dataclasses.field(default_factory=lambda: jit(_loss_and_metrics))
    rates: optax.Schedule | None = None  # None: a given optimizer's, not known here
    save: Callable[[int], None] | None = None  # saves a step's checkpoint
    files: dict[str, str] = dataclasses.field(default_factory=dict)
    metrics: list[dict] = dataclasses.field(default_factory=list)  # the rows logged
    eval_losses: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    bubble: tuple[int, float] | None = None  # the timeline step's, measured
    timed: list[float] = dataclasses.field(default_factory=lambda: [0, 0.0])  # tokens, seconds

    @classmethod
    def prepare(
        cls,
        model: nnx.Module,
        dataset: TextDataset,
        config: TrainConfig,
        optimizer: nnx.Optimizer | None,
        trainable: Filter,
        console: Console | None,
    ) -> _Loop:
        """What :func:`fit` trains with, before its checkpoints are opened."""
        if optimizer is None:
            _check_param_dtype(model, trainable, config.param_dtype)
        leader = jax.process_index() == 0  # with several processes, process 0 reports and writes
        console = console or Console(quiet=not leader)
        out = pathlib.Path(config.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        ckpt_dir = pathlib.Path(config.checkpoint_dir or out / "checkpoints")
        opt = optimizer or nnx.Optimizer(model, make_optimizer(config), wrt=trainable)
        eval_data = dataset.eval_batches(config.eval_batches)
        sows = has_router_metrics(model) or isinstance(model, PreferenceModel)
        if config.schedule == "auto":
            config = _tuned(config, model, opt, eval_data[0], console, trainable, metrics=sows)
        train_step, eval_step = make_steps(config, trainable, metrics=sows)
        return cls(
            model=model,
            opt=opt,
            dataset=dataset,
            config=config,
            console=console,
            out=out,
            ckpt_dir=ckpt_dir,
            leader=leader,
            sows=sows,
            eval_data=eval_data,
            train_step=train_step,
            eval_step=eval_step,
        )

    def evaluate(self) -> float:
        loss = cached_partial(self.eval_step, self.model)
        return float(np.mean([float(fetch(loss(b))) for b in self.eval_data]))

    def tokens_per_second(self) -> float:
        tokens, seconds = self.timed
        return tokens / seconds if seconds else 0.0

    def train(self, start: int, log: RunLog, progress: Progress, preemption: Any) -> int | None:
        """Evaluates, then trains from ``start``: the step a preemption stopped after, or None."""
        config, metrics_path = self.config, self.out / "metrics.jsonl"
        report("evaluating", start)
        self.eval_losses.append((start, self.evaluate()))
        if self.leader and start == 0:
            metrics_path.write_text(
                json.dumps({"step": 0, "eval_loss": self.eval_losses[0][1]}) + "\n"
            )
        elif self.leader:
            _keep_metrics_up_to(metrics_path, start)
        log.evaluation(start, self.eval_losses[0][1])
        bar = progress.add_task(
            "train", total=config.steps, completed=start, loss=float("nan"), tps=0.0
        )
        tokens_per_step = self.dataset.batch_size * self.dataset.seq_len
        for step in range(start + 1, config.steps + 1):
            report("loading batch", step)
            batch = next(self.dataset)
            report("running the step", step)
            log.step_begins(step)
            began = time.perf_counter()
            logged = step % config.log_every == 0 or step == config.steps
            loss, sown = self.step(step, batch, logged)
            elapsed = time.perf_counter() - began
            log.step_ends(step)
            if step > start + 1:  # the first step compiles
                self.timed = [self.timed[0] + tokens_per_step, self.timed[1] + elapsed]
            progress.update(bar, completed=step, loss=loss, tps=self.tokens_per_second())
            self.record(step, loss, sown, log, logged)
            preempted = step < config.steps and preemption.reached(step)
            if step % config.checkpoint_every == 0 or step == config.steps or preempted:
                self.save(step)
            if preempted:
                print_line(
                    self.console,
                    f"preemption notice (SIGTERM): stopped after step {step}, saved in "
                    f"{self.ckpt_dir}; continue with --resume (TrainConfig.resume)",
                )
                return step
        return None

    def step(self, step: int, batch: Any, logged: bool) -> tuple[float, list]:
        """Trains step ``step``: its loss and what the model sowed (``_sown``); the timeline
        step is drawn."""
        config, model, sown = self.config, self.model, []
        if step != config.timeline_step:
            if not self.sows:
                return float(fetch(self.run_step(batch))), []
            loss, captured = self.run_step(batch)
            if logged:
                sown = _sown(fetch(captured), microbatched=config.microbatches > 1)
            return float(fetch(loss)), sown
        if self.sows and logged:  # the batch's metrics, before the step's update
            loss, captured = fetch(self.captured_step(model, batch))
            sown = _sown(captured, microbatched=False)
        else:
            loss = fetch(self.eval_step(model, batch))  # before the step's update
        loss = float(loss)
        # every task's events (every process's), overlapping as in any step
        events = self.train_step.overlapped_timeline(model, self.opt, batch)
        if events:  # none when the step has no pipeline (one stage)
            self.bubble = (step, measured_bubble(events))
            path = self.out / "timeline.png"
            if self.leader:
                plot_timeline(events, path, title=f"measured pipeline, step {step}")
                rows = [dataclasses.asdict(e) for e in events]
                record = {"step": step, "bubble": self.bubble[1], "events": rows}
                (self.out / "timeline.json").write_text(json.dumps(record, indent=1) + "\n")
            self.files["timeline"] = str(path)
            self.files["timeline_events"] = str(self.out / "timeline.json")
        return loss, sown

    def record(self, step: int, loss: float, sown: list, log: RunLog, logged: bool) -> None:
        """Logs step ``step``, evaluates when it is time, and appends a row to ``metrics.jsonl``."""
        config, tps = self.config, self.tokens_per_second()
        record: dict[str, Any] = {"step": step, "loss": loss, "tokens_per_s": tps}
        if self.rates is not None:
            record["learning_rate"] = float(self.rates(step - 1))  # this step's update's
        for metrics in sown:
            record.update(metrics.record())
        if skipped := getattr(self.dataset, "skipped", 0):  # batches with nothing to train on
            record["skipped_batches"] = skipped
        if logged:
            rate = record.get("learning_rate")
            log.train(step, loss=loss, tokens_per_s=tps, learning_rate=rate, sown=sown)
        if step % config.eval_every == 0 or step == config.steps:
            report("evaluating", step)
            record["eval_loss"] = self.evaluate()
            self.eval_losses.append((step, record["eval_loss"]))
            log.evaluation(step, record["eval_loss"])
        if step % config.log_every == 0 or "eval_loss" in record:
            self.metrics.append(record)
            if self.leader:
                with (self.out / "metrics.jsonl").open("a") as f:
                    f.write(json.dumps(record) + "\n")


def _sown(captured: Any, *, microbatched: bool) -> list:
    """The metrics of what a step's model sowed: its routers' and its preference pairs'."""
    found = (f(captured, microbatched=microbatched) for f in (router_metrics, preference_metrics))
    return [metrics for metrics in found if metrics is not None]


def _resume(loop: _Loop, checkpoints: Checkpointer, *, own_optimizer: bool) -> tuple[int, int]:
    """Claims ``checkpoints`` and restores the newest readable step: (step, horizon)."""
    config, ckpt_dir = loop.config, loop.ckpt_dir
    checkpoints.claim()  # a second writer fails here, before training
    if not config.resume and checkpoints.latest_step() is not None:
        raise FileExistsError(
            f"{ckpt_dir} already holds checkpoints (steps {checkpoints.all_steps()}); resume "
            "from them (TrainConfig.resume / --resume) or use another checkpoint directory"
        )
    horizon = config.schedule_steps or config.steps
    if not (config.resume and (checkpoints.all_steps() or checkpoints.incomplete_steps())):
        return 0, horizon
    report("restoring checkpoint")
    resumed = checkpoints.restore_newest_readable(
        model=loop.model, opt=loop.opt, check_extra=_saved_as
    )
    try:
        loop.dataset.restore(resumed.extra.get("data"))
    except DataStateError as e:
        raise DataStateError(
            f"checkpoint step {resumed.step} in {ckpt_dir}: {e}; move "
            f"{ckpt_dir / str(resumed.step)} aside to resume from an older step"
        ) from None
    set_aside = checkpoints.set_aside([s.step for s in resumed.skipped])
    skipped = zip(resumed.skipped, set_aside, strict=True)
    line = "".join(f"; {s}, set aside as {name}" for s, name in skipped)
    print_line(loop.console, f"resumed from step {resumed.step} ({ckpt_dir}){line}")
    horizon = _resumed_horizon(config, resumed.extra.get("schedule_steps"), loop.console)
    if own_optimizer:  # the schedule is the saved run's unless given
        loop.opt.tx = make_optimizer(dataclasses.replace(config, schedule_steps=horizon))
    return int(resumed.extra["step"]), horizon


def _save(
    loop: _Loop, checkpoints: Checkpointer, extra: Mapping[str, Any], horizon: int, step: int
) -> None:
    """Saves checkpoint ``step``, its ``extra`` with the data position, step and ``horizon``."""
    report("saving checkpoint", step)
    extra = {**extra, "data": loop.dataset.state(), "step": step, "schedule_steps": horizon}
    checkpoints.save(step, model=loop.model, opt=loop.opt, extra=extra)


def _log(loop: _Loop, start: int, wandb_config: Mapping[str, Any] | None) -> RunLog:
    """The run's ``RunLog`` from step ``start``, its wandb run started (it may fail)."""
    config, leader, writers = loop.config, loop.leader, []
    if config.wandb is not None and leader:
        if wandb_config is None:
            plain = (type(None), bool, int, float, str, tuple)
            wandb_config = {
                k: v if isinstance(v, plain) else str(v) for k, v in vars(config).items()
            }
        wandb_run = WandbWriter.start(
            config.wandb,
            loop.out,
            name=config.wandb_name,
            config=wandb_config,
            resume=config.resume,
        )
        loop.files["wandb"] = str(wandb_run.directory)
        writers.append(wandb_run)
    return RunLog(
        loop.console,
        loop.out,
        total_steps=config.steps,
        first_step=start,
        tensorboard=config.tensorboard and leader,
        profile_steps=config.profile_steps if leader else None,
        writers=writers,
    )


def _progress(console: Console, plain: bool) -> Progress:
    """The progress bar of a run (none without a terminal: ``RunLog``'s plain lines)."""
    return Progress(
        TextColumn("step {task.completed:>5.0f}/{task.total:.0f}"),
        BarColumn(),
        TextColumn("loss {task.fields[loss]:.3f}"),
        TextColumn("{task.fields[tps]:,.0f} tok/s"),
        TimeRemainingColumn(),
        console=console,
        transient=False,
        disable=plain,
    )


def _finish(loop: _Loop, log: RunLog, start: int, stopped: int | None) -> FitResult:
    """The run's result, its loss curve drawn and its report printed."""
    out = loop.out
    loop.files.update(log.files)
    loop.files["loss_curve"] = str(out / "loss.png")
    if loop.leader:
        _plot_losses(out / "metrics.jsonl", out / "loss.png")
    result = FitResult(
        metrics=loop.metrics,
        eval_losses=loop.eval_losses,
        first_step=start,
        last_step=loop.config.steps if stopped is None else stopped,
        tokens_per_second=loop.tokens_per_second(),
        files=loop.files,
        skipped_batches=getattr(loop.dataset, "skipped", 0),
        bubble=loop.bubble,
        preempted=stopped is not None,
    )
    _report(loop.console, result)
    return result


def _check_param_dtype(model: nnx.Module, trainable: Filter, param_dtype: str) -> None:
    """Raises a ``ValueError`` naming the first trained Variable not of ``param_dtype``."""
    state = nnx.to_pure_dict(nnx.state(model, trainable))
    for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
        if jax.numpy.issubdtype(x.dtype, jax.numpy.floating) and x.dtype != param_dtype:
            name = "/".join(str(getattr(k, "key", k)) for k in path)
            raise ValueError(
                f"fit: the trained Variable {name} is {x.dtype}, not TrainConfig.param_dtype "
                f"{param_dtype!r}: give param_dtype={x.dtype.name!r} (bfloat16 parameters are "
                "updated through float32 master weights), or build the model in that dtype"
            )


def _saved_as(step: int, extra: dict[str, Any]) -> str | None:
    """Why checkpoint ``step`` cannot resume the run: its ``extra`` says another step."""
    saved = extra.get("step")
    if isinstance(saved, bool) or saved != step:
        return f"its extra's step is {saved!r}, not {step}"
    return None


def _tuned(
    config: TrainConfig,
    model: Any,
    opt: Any,
    batch: Any,
    console: Console | None,
    trainable: Filter = nnx.Param,
    *,
    metrics: bool = False,
) -> TrainConfig:
    """``config`` with the schedule ``mm.schedules.tune`` picks (process 0's), printed."""
    from mmnnx.distributed.agree import from_process_zero  # noqa: PLC0415

    if config.microbatches == 1:
        return dataclasses.replace(config, schedule="1f1b")
    measured = dataclasses.replace(config, schedule="gpipe")
    step, _ = make_steps(measured, trainable, metrics=metrics)
    result = tune(step, model, opt, batch, memory_budget=config.memory_budget)
    best = result.best
    name_and_table = from_process_zero("--schedule auto", f"{best.schedule}\n{best.table.to_csv()}")
    choice, table = name_and_table.split("\n", 1)
    if jax.process_index() == 0:
        print_line(console, str(result).rstrip())
        print_line(
            console,
            f"schedule auto: {choice} with {config.microbatches} microbatches (predicted "
            f"{result.best.predicted_seconds * 1e3:.1f} ms per step)",
        )
    return dataclasses.replace(config, schedule=Schedule.from_csv(table, name=choice))


def _resumed_horizon(config: TrainConfig, saved: int | None, console: Console) -> int:
    """A resumed run's learning-rate horizon: the ``saved`` one, unless ``config`` says (said)."""
    if config.schedule_steps is None:
        if saved is not None and config.steps > saved:
            print_line(
                console,
                f"learning-rate schedule extended from the checkpoint's {saved} steps to "
                f"{config.steps} (TrainConfig.steps / --steps): the cosine decay now ends at step "
                f"{config.steps}; give --schedule-steps {saved} to keep the old one",
            )
            return config.steps
        return saved or config.steps
    if saved is not None and saved != config.schedule_steps:
        print_line(
            console,
            f"learning-rate schedule over {config.schedule_steps} steps as given "
            "(TrainConfig.schedule_steps / --schedule-steps), "
            f"not the {saved} steps saved with the checkpoint",
        )
    return config.schedule_steps


def _keep_metrics_up_to(path: pathlib.Path, step: int) -> None:
    """Drops the rows of ``path`` beyond ``step``, and any torn line; rewritten atomically."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step:
            kept.append(line + "\n")
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text("".join(kept))
    os.replace(temporary, path)


def _plot_losses(metrics_path: pathlib.Path, path: pathlib.Path) -> pathlib.Path:
    from matplotlib.figure import Figure  # noqa: PLC0415  (slow to import: only when plotting)

    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line]
    fig = Figure(figsize=(6, 3.5), layout="constrained")
    ax = fig.add_subplot()
    trained = [r for r in rows if "loss" in r]
    ax.plot([r["step"] for r in trained], [r["loss"] for r in trained], label="train")
    evals = [r for r in rows if "eval_loss" in r]
    ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.legend()
    fig.savefig(path, dpi=120)
    return path


def _report(console: Console, result: FitResult) -> None:
    table = Table(title="run report")
    table.add_column("measure")
    table.add_column("value", justify="right")
    stopped = " (preempted)" if result.preempted else ""
    table.add_row("steps", f"{result.first_step} -> {result.last_step}{stopped}")
    table.add_row("first eval loss", f"{result.first_eval:.3f}")
    table.add_row("final eval loss", f"{result.final_eval:.3f}")
    table.add_row("final / first", f"{result.final_eval / result.first_eval:.2f}")
    table.add_row("tokens/s", f"{result.tokens_per_second:,.0f}")
    if result.skipped_batches:
        table.add_row("batches skipped (no token trained on)", str(result.skipped_batches))
    if result.bubble is not None:
        step, fraction = result.bubble
        table.add_row(f"pipeline bubble (step {step}, measured)", f"{fraction:.0%}")
    for name, path in result.files.items():
        table.add_row(name, path)
    console.print(table)
