"""``mm.plan_cluster``: the layout (stages, data, FSDP, tensor and expert axes, schedule,
microbatches, remat) that trains a GPT fastest on a cluster, on paper: each candidate's
memory from :func:`~mmnnx.partition.predict_memory` and its step from the cost model
(:mod:`mmnnx.partition.cost`); nothing is built, traced or compiled."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Mapping
from typing import Any

from mmnnx.errors import NoCandidateError
from mmnnx.models.gpt import REMAT, GPTConfig
from mmnnx.modules import MoEConfig
from mmnnx.mpmd import schedules as sched
from mmnnx.partition.cost import (
    _SHORT,
    ENGINE,
    ClusterLayout,
    Collectives,
    DeviceSpec,
    StepCost,
    _fields_text,
    stage_costs,
    step_cost,
)
from mmnnx.partition.memory import (
    MemoryPrediction,
    format_bytes,
    pipeline_schedule,
    predict_memory,
)

SCHEDULES = ("1f1b", "interleaved-1f1b", "zero-bubble-h1", "gpipe")
"""The schedules the search tries (interleaved with 2 and 4 model stages per task)."""
_KEYS = {key: name for name, key in _SHORT.items()} | {"m": "microbatches"}
_FIELDS = {f.name: f.type for f in dataclasses.fields(ClusterLayout)}
_ACTIONS = 4096  # most microbatches x stages simulated (the simulator's time grows with it)
_CHECKED = 48  # candidates whose memory is predicted, fastest first, before giving up


def parse_layout(text: str) -> dict[str, Any]:
    """The fields a ``--layout`` text fixes, e.g. ``pp=16,tp=8,dp=64,schedule=1f1b``
    (``pp``/``stages``, ``dp``/``data``, ``tp``/``tensor``, ``ep``/``expert``, ``fsdp``,
    ``v``/``virtual_stages``, ``schedule``, ``m``/``microbatches``, ``remat``).

    Example:
        >>> parse_layout("pp=4,tp=8,schedule=1f1b")
        {'stages': 4, 'tensor': 8, 'schedule': '1f1b'}

    Raises:
        ValueError: an entry not ``key=value``, a key not known or given twice (``pp`` and
            ``stages`` are one), a count not an int >= 1, a schedule or remat policy not known.
    """
    fixed: dict[str, Any] = {}
    for entry in filter(None, (e.strip() for e in text.split(","))):
        key, eq, value = entry.partition("=")
        name = _KEYS.get(key.strip(), key.strip())
        if not eq or name not in _FIELDS:
            known = ", ".join([*_KEYS, *(f for f in _FIELDS if f not in _KEYS.values())])
            raise ValueError(f"layout entry {entry!r}: expected key=value with a key of {known}")
        value, known = value.strip(), {"schedule": sched.names(), "remat": REMAT}.get(name)
        if known is not None and value not in known:
            raise ValueError(f"layout {name}={value}: expected one of {', '.join(known)}")
        if known is None and (not value.isdigit() or int(value) < 1):
            raise ValueError(f"layout {key}={value}: expected an int >= 1")
        if name in fixed:
            raise ValueError(f"layout entry {entry!r}: {name} is given twice")
        fixed[name] = value if known is not None else int(value)
    return fixed


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlannedStep:
    """One layout evaluated: its ``memory`` (per task) and ``cost`` (the step), on
    ``device``s training on ``batch`` sequences of ``seq`` tokens; ``str`` prints the
    report, :meth:`to_json` the record ``mmnnx plan --json`` prints."""

    layout: ClusterLayout
    memory: MemoryPrediction
    cost: StepCost
    device: DeviceSpec
    batch: int
    seq: int
    collectives: Collectives
    trainable: float = 1.0  # the share of the weights trained (0: LoRA's frozen base)
    searched: int = 1  # layouts the search ranked

    @property
    def fits(self) -> bool:
        """Whether every device's predicted peak is within the device's memory."""
        return self.memory.peak <= self.device.memory

    @property
    def step_seconds(self) -> float:
        """The predicted step."""
        return self.cost.step_seconds

    @property
    def tokens_per_second(self) -> float:
        """Tokens trained per second."""
        return self.batch * self.seq / self.cost.step_seconds

    @property
    def mfu(self) -> float:
        """Model FLOPs (no recomputation) per second over the devices' peak, a fraction."""
        peak = self.layout.devices * self.device.flops
        return self.cost.model_flops / (peak * self.cost.step_seconds)

    @property
    def assumptions(self) -> list[str]:
        """The cost model's assumptions (:func:`assumptions`), and what is not trained."""
        frozen = [] if self.trainable == 1 else [
            f"{self.trainable:.0%} of the weights trained (LoRA: the frozen base has no "
            "gradients, optimizer state, weight gradients' matmuls or reduce; the adapters are "
            "not charged)"
        ]  # fmt: skip
        return assumptions(self.device, self.collectives) + frozen

    def to_json(self) -> dict[str, Any]:
        """The plan as one JSON-able dict."""
        return {
            "layout": dataclasses.asdict(self.layout) | {"devices": self.layout.devices},
            "device": dataclasses.asdict(self.device),
            "batch": self.batch,
            "seq_len": self.seq,
            "stages": [dataclasses.asdict(t) | {"peak_bytes": t.peak} for t in self.memory.tasks],
            "step_seconds": self.step_seconds,
            "bubble": self.cost.bubble,
            "tokens_per_second": self.tokens_per_second,
            "mfu": self.mfu,
            "fits": self.fits,
            "collectives": dataclasses.asdict(self.collectives),
            "trainable": self.trainable,
            "layouts_searched": self.searched,
            "assumptions": self.assumptions,
        }

    def __str__(self) -> str:
        lay = self.layout
        lines = [
            f"layout: {lay.text()}  ({lay.devices} x {self.device.name})",
            f"step: {self.step_seconds:.3f} s predicted, bubble {self.cost.bubble:.1%}, "
            f"{self.tokens_per_second:,.0f} tokens/s, MFU {self.mfu:.1%}",
            f"memory: peak {format_bytes(self.memory.peak)} of "
            f"{format_bytes(self.device.memory)} per device: "
            + ("fits" if self.fits else "does NOT fit"),
            "",
            str(self.memory),
            "",
            "assumptions:",
            *(f"  - {a}" for a in self.assumptions),
        ]
        return "\n".join(lines)


def assumptions(device: DeviceSpec, collectives: Collectives) -> list[str]:
    """The cost model's assumptions, in words, for a plan on ``device``.

    Example:
        >>> from mmnnx.partition.cost import DEVICES
        >>> assumptions(DEVICES["h100"], ENGINE)[0][:60]
        'h100: 989 TFLOP/s peak dense bf16, 70% reached on the model '
    """
    grads = {
        "microbatch": "in every backward (mmnnx's engine)",
        "step": "once per step in float32, on the network beside the compute",
    }
    gathers = {"microbatch": "in every forward and backward (mmnnx's engine)",
               "step": "in the compute dtype once per model stage per step (twice with one "
                       "microbatch), prefetched; pipeline sends split over the tensor devices; "
                       "memory as Megatron/torchtitan hold it (sequence parallelism)"}  # fmt: skip
    flops = device.flops
    rate = f"{flops / 1e12:.0f} TFLOP/s" if flops >= 1e12 else f"{flops / 1e9:.3g} GFLOP/s"
    return [
        f"{device.name}: {rate} peak dense bf16, "
        f"{device.efficiency:.0%} reached on the model FLOPs (one number for every device "
        "and model)",
        f"links: {device.intra_bandwidth / 1e9:.0f} GB/s per device one way inside a node of "
        f"{device.node_size}, {device.inter_bandwidth / 1e9:.0f} GB/s across nodes; ring "
        "collectives",
        "per block: 2 tensor-parallel all-reduces forward, 2 backward; per MoE block 2 "
        "all-to-alls each way, experts balanced; none overlapped with compute",
        f"gradient all-reduce over data x expert {grads[collectives.gradients]}; FSDP "
        f"all-gathers {gathers[collectives.gathers]}",
        f"FLOPs: 2 per weight per token forward, causal attention scores, backward "
        f"{device.backward:g} x forward, remat full recomputes the forward; MFU counts 3 x "
        "forward (no recompute)",
        f"optimizer update: each task's AdamW state read and written once at "
        f"{device.memory_bandwidth / 1e12:.2f} TB/s, after its gradients are reduced",
        f"host: {device.launch * 1e3:g} ms per program launched, each task's by a host of its "
        "own, which launches a reader once the value it reads from another task has arrived",
        "not charged: data loading, stragglers",
    ]


def evaluate(
    config: GPTConfig, layout: ClusterLayout, device: DeviceSpec, *, batch: int, seq: int,
    collectives: Collectives = ENGINE, trainable: float = 1.0,
) -> PlannedStep:  # fmt: skip
    """``layout`` evaluated: its memory per task and its predicted step. With
    ``collectives`` other than mmnnx's engine, memory is charged as a reference framework
    holds it (``predict_memory(reference=True)``). ``trainable``: the share of the weights
    trained (``0``: LoRA's frozen base, as ``predict_memory`` and ``stage_costs`` take it).

    Example:
        >>> from mmnnx.partition.cost import DEVICES
        >>> config = GPTConfig(vocab_size=64, dim=32, depth=2, num_heads=2, max_seq_len=8)
        >>> step = evaluate(config, ClusterLayout(stages=2, microbatches=2), DEVICES["h100"],
        ...                 batch=4, seq=8)
        >>> step.fits, len(step.to_json()["stages"]), 0 < step.mfu < 1
        (True, 2, True)
    """
    if why := _misfit(config, layout.devices, dataclasses.asdict(layout)):
        raise ValueError(f"layout {layout.text()}: {why}")
    schedule_runs(layout.schedule, layout.stages, layout.virtual_stages, layout.microbatches,
                   config.tie_embeddings)  # fmt: skip
    memory = predict_memory(
        config, layout.memory_layout(config), batch=batch, seq_len=seq, schedule=layout.schedule,
        microbatches=layout.microbatches, remat=layout.remat,
        reference=collectives != ENGINE, trainable=trainable,
    )  # fmt: skip
    cost = step_cost(config, layout, device, batch=batch, seq=seq, collectives=collectives,
                     trainable=trainable)  # fmt: skip
    return PlannedStep(layout=layout, memory=memory, cost=cost, device=device, batch=batch,
                       seq=seq, collectives=collectives, trainable=trainable)  # fmt: skip


def candidates(
    config: GPTConfig, devices: int, device: DeviceSpec, *, batch: int,
    fixed: Mapping[str, Any] | None = None,
) -> list[ClusterLayout]:  # fmt: skip
    """Every layout of ``devices`` the search considers, ``fixed``'s fields as given.

    Example:
        >>> from mmnnx.partition.cost import DEVICES
        >>> config = GPTConfig(vocab_size=64, dim=32, depth=2, num_heads=2, max_seq_len=8)
        >>> lays = candidates(config, 2, DEVICES["h100"], batch=4, fixed={"remat": "none"})
        >>> sorted({(lay.stages, lay.data, lay.tensor) for lay in lays})
        [(1, 1, 2), (1, 2, 1), (2, 1, 1)]
    """
    fixed = dict(fixed or {})
    if _misfit(config, devices, fixed):
        return []
    heads, experts = _heads_and_experts(config)

    def options(name: str, values):
        return [fixed[name]] if name in fixed else list(values)

    out = []
    divisors = [k for k in range(1, devices + 1) if devices % k == 0]
    tensors = options("tensor", (t for t in divisors if t <= device.node_size and heads % t == 0))
    expert_axes = options("expert", (e for e in divisors if experts and experts[0] % e == 0)
                          if experts else [1])  # fmt: skip
    for t, e, p in itertools.product(tensors, expert_axes, options("stages", divisors)):
        if devices % (t * e * p) or p > config.depth:
            continue
        d = devices // (t * e * p)
        if "data" in fixed and fixed["data"] != d or batch % (d * e):
            continue
        local = batch // (d * e)
        fsdps = options("fsdp", sorted({1, min(8, d), d}))
        counts = {p, 2 * p, 4 * p, local}
        counts = options("microbatches", sorted(m for m in counts if m <= local and local % m == 0
                                                and m * p <= _ACTIONS))  # fmt: skip
        for f, m, remat in itertools.product(
            fsdps, counts, options("remat", ("none", "dots", "full"))
        ):
            if d % f:
                continue
            for schedule, v in _schedules(p, config.depth, fixed):
                out.append(ClusterLayout(stages=p, data=d, tensor=t, expert=e, fsdp=f,
                                  virtual_stages=v, schedule=schedule, microbatches=m,
                                  remat=remat))  # fmt: skip
    return out


def _heads_and_experts(config: GPTConfig) -> tuple[int, list[int]]:
    """The first block's attention heads, and each MoE block's experts."""
    experts = [b.feed_forward.num_experts for b in config.block_configs
               if isinstance(b.feed_forward, MoEConfig)]  # fmt: skip
    return config.block_configs[0].attention.num_heads, experts


def _misfit(config: GPTConfig, devices: int, fields: Mapping[str, Any]) -> str | None:
    """Why the layout fields ``fields`` (some or all of a :class:`ClusterLayout`'s) cannot
    train ``config`` on ``devices``: axes not dividing the devices, a tensor axis not dividing
    the heads, an expert axis the experts do not fill, more model stages than blocks; else
    ``None``.

    Example:
        >>> _misfit(GPTConfig(depth=4, num_heads=4), 8, {"stages": 3})
        'pp=3 does not divide 8 devices'
    """
    heads, experts = _heads_and_experts(config)
    axes = {k: fields[k] for k in ("stages", "data", "tensor", "expert") if k in fields}
    if devices % math.prod(axes.values()):
        return f"{_fields_text(axes)} does not divide {devices} devices"
    tensor, expert = fields.get("tensor", 1), fields.get("expert", 1)
    if heads % tensor:
        return f"tp={tensor} does not divide the model's {heads} attention heads"
    if expert > 1 and not experts:
        return f"ep={expert} needs experts to split; the model has none (ep=1)"
    if expert > 1 and experts[0] % expert:
        return f"ep={expert} does not divide the model's {experts[0]} experts"
    pp, v = fields.get("stages", 1), fields.get("virtual_stages", 1)
    if pp * v > config.depth:
        return (f"pp={pp} x v={v} = {pp * v} model stages for the model's {config.depth} "
                "blocks (one block at least each)")  # fmt: skip
    return None


def _schedules(stages: int, depth: int, fixed: Mapping[str, Any]) -> list[tuple[str, int]]:
    names = [fixed["schedule"]] if "schedule" in fixed else list(SCHEDULES)
    if stages == 1:
        names = [n for n in names if n in ("gpipe", "1f1b")][:1] or names
    out = []
    for name in names:
        interleaved = name.startswith("interleaved") or name in ("zero-bubble-v", "dualpipev")
        virtual = [2, 4] if interleaved else [1]
        if "virtual_stages" in fixed:
            virtual = [fixed["virtual_stages"]]
        out += [(name, v) for v in virtual if stages * v <= depth]
    return out


def _estimate(config, layout, device, batch, seq, collectives, trainable) -> float:
    """A step's seconds without simulating: the schedule's textbook bubble on the slowest
    stage's costs (ranks the candidates; the chosen ones are simulated)."""
    costs = stage_costs(config, layout, device, batch=batch, seq=seq, collectives=collectives,
                        trainable=trainable)  # fmt: skip
    p, v, m = layout.stages, layout.virtual_stages, layout.microbatches
    f, b, w = (max(c for (k, _), c in costs.actions.items() if k == kind) * v for kind in "FBW")
    if layout.schedule.startswith("zero-bubble"):
        span = m * (f + b) + (p - 1) * max(f + b - 2 * w, f / 3)
    else:
        span = (m + (p - 1) / v) * (f + b)
    once = max(costs.gathers) + sum(costs.updates) / p
    return span + 2 * (p - 1) * costs.transfer + once


def _held(layout: ClusterLayout, rank: int) -> float:
    """The microbatches a task holds at its worst moment, in units of all its model stages'
    activations of one microbatch (the schedules' textbook counts: GPipe all, 1F1B and ZB-H1
    one per later stage, interleaved 1F1B Megatron's warm-up plus one)."""
    p, v, m = layout.stages, layout.virtual_stages, layout.microbatches
    if layout.schedule == "gpipe":
        return m
    if v > 1:
        return min(m * v, 2 * (p - rank - 1) + (v - 1) * p + 1) / v
    return min(m, p - rank)


@functools.lru_cache(maxsize=1024)
def _affine_memory(config, layout: ClusterLayout, seq: int, reference: bool,
                   trainable: float) -> tuple:  # fmt: skip
    """Per task, the bytes held while microbatches run with one microbatch in flight and its
    activations, each as ``(at one sequence per device, per more sequence)``, and the update's
    bytes: ``predict_memory`` of one and of two sequences per device (its terms are affine in
    the tokens of a microbatch)."""
    shards = layout.data * layout.expert

    def predicted(sequences: int):
        return predict_memory(
            config, layout.memory_layout(config), batch=sequences * shards, seq_len=seq,
            schedule=layout.schedule, remat=layout.remat, reference=reference,
            trainable=trainable,
        ).tasks  # fmt: skip

    return tuple(
        ((one.pipelined, two.pipelined - one.pipelined),
         (one.activations, two.activations - one.activations), one.update)
        for one, two in zip(predicted(1), predicted(2), strict=True)
    )  # fmt: skip


def _memory_estimate(config, layout: ClusterLayout, batch: int, seq: int, reference: bool,
                     trainable: float) -> float:  # fmt: skip
    """A layout's peak bytes per device, fast: every term but the activations as
    ``predict_memory`` charges them, the activations times the microbatches the schedule
    holds (:func:`_held`; ``predict_memory`` simulates it)."""
    gpipe = "interleaved-gpipe" if layout.virtual_stages > 1 else "gpipe"
    axes = dataclasses.replace(layout, schedule=gpipe, microbatches=1)
    sequences = batch / layout.microbatches / (layout.data * layout.expert)
    worst = 0.0
    affine = _affine_memory(config, axes, seq, reference, trainable)
    for rank, (held, act, update) in enumerate(affine):
        pipelined = held[0] + held[1] * (sequences - 1)
        activations = act[0] + act[1] * (sequences - 1)
        worst = max(worst, pipelined + activations * (_held(layout, rank) - 1), update)
    return worst


@functools.lru_cache(maxsize=4096)
def schedule_runs(
    name: str, stages: int, virtual_stages: int, microbatches: int, tied: bool = False
) -> None:
    """Raises the schedule's ValueError when ``name`` cannot run ``stages`` tasks of
    ``virtual_stages`` model stages each on ``microbatches`` microbatches. A head ``tied`` to
    the embedding brings the forward pass back to the first task, one stage more where
    each task runs one (1F1B on 4 tasks: 5 stages), which no looped placement folds in.

    Example:
        >>> schedule_runs("1f1b", 2, 1, 2)
        >>> schedule_runs("1f1b", 2, 1, 2, tied=True)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: 1f1b needs at least as many microbatches as stages (3), got 2... (the head ...
    """
    pipeline_schedule(name, stages, virtual_stages, microbatches, tied)


def plan_cluster(
    config: GPTConfig, devices: int, device: DeviceSpec, *, batch: int, seq: int,
    fixed: Mapping[str, Any] | None = None, collectives: Collectives = ENGINE,
    keep: int = 3, trainable: float = 1.0,
) -> PlannedStep:  # fmt: skip
    """The fastest layout of ``devices`` x ``device`` that fits, training ``GPT(config)`` on
    ``batch`` sequences of ``seq`` tokens: every candidate (:func:`candidates`, ``fixed``'s
    fields as given) ranked by an estimate of its step, the fastest ones whose memory fits
    (at most 48 predicted) simulated, the best of ``keep`` fitting ones returned.
    ``trainable``: the share of the weights trained (:func:`evaluate`'s).

    Example:
        >>> from mmnnx.partition.cost import DEVICES
        >>> config = GPTConfig(vocab_size=64, dim=32, depth=4, num_heads=4, max_seq_len=8)
        >>> best = plan_cluster(config, 4, DEVICES["h100"], batch=8, seq=8)
        >>> best.fits, best.layout.devices
        (True, 4)

    Raises:
        NoCandidateError: no candidate, or none of the fastest fits the device's memory.
    """
    lays = candidates(config, devices, device, batch=batch, fixed=fixed)
    if not lays:
        given = f" with {_fields_text(fixed)}" if fixed else ""
        why = _misfit(config, devices, fixed or {}) or (
            f"none divides the batch of {batch} and the model's {config.depth} blocks and heads"
        )
        raise NoCandidateError(f"no layout of {devices} devices{given}: {why}", [])
    reference = collectives != ENGINE
    estimated = []  # (bytes, layout) of each layout that can run
    cannot_run = []  # why each layout skipped below cannot run, in the order met
    for lay in lays:
        try:
            schedule_runs(lay.schedule, lay.stages, lay.virtual_stages, lay.microbatches,
                           config.tie_embeddings)  # fmt: skip
            estimated.append((_memory_estimate(config, lay, batch, seq, reference, trainable), lay))
        except ValueError as e:  # a schedule this layout cannot run
            cannot_run.append(f"{lay.text()}: {e}")
    if not estimated:
        raise NoCandidateError(_none_runs(len(lays), devices, cannot_run), [])
    small = [lay for estimate, lay in estimated if estimate <= device.memory]
    if not small:
        least, smallest = min(estimated, key=lambda pair: pair[0])
        raise NoCandidateError(
            f"none of the {len(lays)} layouts of {devices} devices fits "
            f"{format_bytes(device.memory)} per {device.name}: the smallest, "
            f"{smallest.text()}, about {format_bytes(least)}",
            [],
        )
    ranked = sorted(
        small, key=lambda lay: _estimate(config, lay, device, batch, seq, collectives, trainable)
    )
    fitting, checked = [], []
    for lay in ranked[:_CHECKED]:
        try:
            step = evaluate(config, lay, device, batch=batch, seq=seq, collectives=collectives,
                            trainable=trainable)  # fmt: skip
        except ValueError as e:  # a schedule this layout cannot run
            cannot_run.append(f"{lay.text()}: {e}")
            continue
        checked.append(step)
        if step.fits:
            fitting.append(step)
            if len(fitting) == keep:
                break
    if not checked:
        raise NoCandidateError(_none_runs(min(len(ranked), _CHECKED), devices, cannot_run), [])
    if not fitting:
        smallest = min(checked, key=lambda step: step.memory.peak)
        raise NoCandidateError(
            f"none of the {min(len(ranked), _CHECKED)} fastest layouts fits "
            f"{format_bytes(device.memory)} per {device.name}; the smallest of the {_CHECKED} "
            f"fastest, {smallest.layout.text()}, needs {format_bytes(smallest.memory.peak)}",
            checked,
        )
    best = min(fitting, key=lambda s: s.step_seconds)
    return dataclasses.replace(best, searched=len(lays))


def _none_runs(count: int, devices: int, reasons: list[str]) -> str:
    """The message for ``count`` layouts of ``devices`` none of which can run: the first
    layout's reason (a schedule that cannot take its stages, stages per task or
    microbatches)."""
    return f"none of the {count} layouts of {devices} devices can run; the first, {reasons[0]}"
