"""The cost model of ``mmnnx plan``: a GPT's step time on a cluster, from its config's shapes,
a device's published peak FLOP/s, memory and link bandwidths, and the schedule simulator.

Each pipeline action (a model stage's F, B, or with a split backward I and W, on one
microbatch) costs its FLOPs at ``efficiency`` x the device's peak (the backward
``DeviceSpec.backward`` x the forward's), plus the collectives it runs in the compute's way: per
block two tensor-parallel all-reduces of the activations forward and two backward
(Megatron's), per mixture-of-experts block two all-to-alls each way, and, as ``Collectives``
says, the data-parallel ones. Activations and their cotangents cross stages at the bandwidth
of the link between them. :func:`~mmnnx.mpmd.schedules.simulate` plays the schedule with these
costs, each program launched by its task's host (``DeviceSpec.launch``); once-per-step
data-parallel collectives run on the network beside the compute, a block at a time (only a
task's first block's weight gather waits), then each task's optimizer update reads and writes
its state at the device's memory bandwidth. docs/planning.md states every assumption.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from mmnnx.models.gpt import GPTConfig
from mmnnx.modules import MoEConfig
from mmnnx.modules.latent_attention import LatentAttentionConfig
from mmnnx.mpmd import schedules as sched
from mmnnx.partition.memory import (
    DTYPE_BYTES,
    OPTIMIZER_COPIES,
    MemoryLayout,
    attention_weights,
    default_blocks,
    head_stage,
    stage_weights,
)

EFFICIENCY = 0.7
"""The share of its peak dense bf16 FLOP/s a device reaches on the model's FLOPs: the same
for every device and every model, never fitted to a run. 0.7 is what large bf16 matmuls
reach in vendors' GEMM benchmarks (H100 SXM about 700 of 989 TFLOP/s; A100 about 220 of
312); the model's other work (norms, softmax, elementwise) is not charged apart, so this
number also stands for it."""

LAUNCH = 2e-4
"""Seconds of host time mmnnx's runner spends launching one program: measured, 0.10-0.25 ms
per launch for a pipelined GPT on this repository's 2-core host
(benchmarks/results/dispatch.json, ``host ms per launch``; 0.15-0.51 ms in
benchmarks/plan_cpu.py), the runner's Python work, which a GPU's host does alike."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """One accelerator as the cost model sees it: ``flops`` peak dense bf16 FLOP/s,
    ``memory`` bytes of HBM and ``memory_bandwidth`` its bytes/s (the optimizer update is
    bound by it), ``intra_bandwidth`` and ``inter_bandwidth`` bytes/s each device sends one way
    inside its node (``node_size`` devices) and across nodes, ``efficiency`` the share of
    ``flops`` reached (:data:`EFFICIENCY`), ``backward`` a backward's time over its forward's
    (2: a matmul's input and weight gradients are each one matmul of its size), ``launch`` the
    host's seconds per program it launches (:data:`LAUNCH`).

    Example:
        >>> DEVICES["h100"].flops, DEVICES["h100"].node_size
        (989000000000000.0, 8)
    """

    name: str
    flops: float
    memory: int
    intra_bandwidth: float
    inter_bandwidth: float
    node_size: int
    memory_bandwidth: float
    efficiency: float = EFFICIENCY
    backward: float = 2.0
    launch: float = LAUNCH

    def bandwidth(self, span: int) -> float:
        """Bytes/s per device for a collective over a group spanning ``span`` consecutive
        devices (inside one node: its links; beyond: the network).

        Example:
            >>> DEVICES["h100"].bandwidth(8) > DEVICES["h100"].bandwidth(16)
            True
        """
        return self.intra_bandwidth if span <= self.node_size else self.inter_bandwidth


DEVICES = {
    # H100 SXM5: 989.4 TFLOP/s dense BF16, 80 GB HBM3 at 3.35 TB/s, NVLink 4 900 GB/s per GPU
    # both ways (nvidia.com/en-us/data-center/h100, datasheet); 8 per HGX node, one 400 Gb/s
    # ConnectX-7 NIC per GPU (DGX H100 user guide): 50 GB/s one way.
    "h100": DeviceSpec(name="h100", flops=989e12, memory=80 * 10**9, memory_bandwidth=3.35e12,
                       intra_bandwidth=450e9, inter_bandwidth=50e9, node_size=8),
    # H200 SXM: H100's compute, 141 GB HBM3e at 4.8 TB/s (nvidia.com/en-us/data-center/h200).
    "h200": DeviceSpec(name="h200", flops=989e12, memory=141 * 10**9, memory_bandwidth=4.8e12,
                       intra_bandwidth=450e9, inter_bandwidth=50e9, node_size=8),
    # H800 SXM: H100's compute and memory, NVLink cut to 400 GB/s both ways; DeepSeek-V3's
    # cluster: 8 per node, 400 Gb/s InfiniBand per GPU (arXiv:2412.19437, section 3.1).
    "h800": DeviceSpec(name="h800", flops=989e12, memory=80 * 10**9, memory_bandwidth=3.35e12,
                       intra_bandwidth=200e9, inter_bandwidth=50e9, node_size=8),
    # A100 SXM 80GB: 312 TFLOP/s dense BF16, HBM2e 2,039 GB/s, NVLink 3 600 GB/s both ways,
    # 200 Gb/s HDR per GPU (nvidia.com/en-us/data-center/a100, DGX A100 user guide).
    "a100": DeviceSpec(name="a100", flops=312e12, memory=80 * 10**9, memory_bandwidth=2.039e12,
                       intra_bandwidth=300e9, inter_bandwidth=25e9, node_size=8),
    # TPU v5p: 459 TFLOP/s BF16, 95 GB HBM at 2,765 GB/s, ICI 4,800 Gb/s per chip over 6 links
    # (a ring along one axis uses 2: 200 GB/s one way); a pod of 8,960 chips is one ICI domain
    # (cloud.google.com/tpu/docs/v5p).
    "tpu-v5p": DeviceSpec(name="tpu-v5p", flops=459e12, memory=95 * 10**9,
                          memory_bandwidth=2.765e12, intra_bandwidth=200e9,
                          inter_bandwidth=25e9, node_size=8960),
}  # fmt: skip
"""The devices ``mmnnx plan --device`` knows, with their sources."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Collectives:
    """When the step's data-parallel collectives run. ``gradients``: ``"microbatch"``, each
    backward all-reduces its microbatch's weight gradients over the data (expert) devices,
    as mmnnx's engine does (docs/pipelining.md, FSDP); ``"step"``, once per step (a
    reduce-scatter with FSDP) in float32, as Megatron, torchtitan and the published runs do.
    ``gathers``: FSDP's all-gathers of a stage's weights, in each F and each B in the
    parameters' dtype (the engine), or once per model stage per step in the compute dtype
    (mixed-precision FSDP casts before gathering and keeps them for the backward, as
    torchtitan does under pipelining). Once-per-step collectives run on the network while the
    device computes, a block at a time (FSDP's prefetch, Megatron's overlapped gradient
    reduce): a task's first block's gather delays its first forward, a model stage's
    reduce-scatter runs from its last backward's start, its last block's after its end.

    Example:
        >>> ENGINE.gradients, PUBLISHED.gradients
        ('microbatch', 'step')
    """

    gradients: str = "microbatch"
    gathers: str = "microbatch"

    def __post_init__(self):
        if {self.gradients, self.gathers} - {"microbatch", "step"}:
            raise ValueError(f"{self}: each field 'microbatch' or 'step'")


ENGINE = Collectives()
"""mmnnx's engine as built (per-microbatch gradient all-reduces and FSDP gathers)."""
PUBLISHED = Collectives(gradients="step", gathers="step")
"""Once per step, as the frameworks of the published runs do."""


TRAIN_OPTION = "train_option"
"""The metadata key of a :class:`ClusterLayout` field naming the ``mmnnx train`` option
(``mmnnx.train.config``) that sets it: the plan's layout and the train flags are one record."""

_SHORT = {"stages": "pp", "data": "dp", "tensor": "tp", "expert": "ep", "virtual_stages": "v"}


def _fields_text(fields: Mapping[str, Any]) -> str:
    """Layout fields as ``--layout`` writes them: ``{"stages": 3}`` -> ``pp=3``."""
    return ",".join(f"{_SHORT.get(name, name)}={value}" for name, value in fields.items())


def _field(default: Any, option: str) -> Any:
    return dataclasses.field(default=default, metadata={TRAIN_OPTION: option})


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClusterLayout:
    """A parallel layout and how the step runs on it: ``stages`` pipeline tasks, each
    ``data`` x ``expert`` x ``tensor`` devices (``fsdp`` of the data devices sharding
    parameters), ``virtual_stages`` model stages per task, ``schedule``, ``microbatches``
    and the ``remat`` policy.

    Example:
        >>> ClusterLayout(stages=2, tensor=4, data=8).devices
        64
    """

    stages: int = _field(1, "stages")
    data: int = _field(1, "data_axis")
    tensor: int = _field(1, "model_axis")
    expert: int = _field(1, "expert_axis")
    fsdp: int = _field(1, "fsdp_axis")
    virtual_stages: int = _field(1, "virtual_stages")
    schedule: str = _field("1f1b", "schedule")
    microbatches: int = _field(1, "microbatches")
    remat: str = _field("none", "remat")

    @property
    def devices(self) -> int:
        """The devices the layout spans."""
        return self.stages * self.data * self.tensor * self.expert

    def train_options(self) -> dict[str, Any]:
        """The ``mmnnx train`` options that run this layout, by option name (``mmnnx train
        --layout-from`` sets them from a plan).

        Example:
            >>> options = ClusterLayout(stages=2, data=4, fsdp=2, remat="dots").train_options()
            >>> options["data_axis"], options["fsdp_axis"], options["remat"]
            (4, 2, 'dots')
        """
        return {f.metadata[TRAIN_OPTION]: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def of_json(cls, fields: Mapping[str, Any], where: str = "layout") -> ClusterLayout:
        """The layout of ``fields`` (a plan's ``layout`` object, ``mmnnx plan --json``), its
        other keys (``devices``) ignored; ``ValueError`` naming ``where`` and the field for one
        missing or of the wrong type.

        Example:
            >>> plan = ClusterLayout(stages=2, microbatches=4)
            >>> ClusterLayout.of_json(dataclasses.asdict(plan) | {"devices": 2}) == plan
            True
            >>> ClusterLayout.of_json({"stages": 2})
            Traceback (most recent call last):
            ...
            ValueError: layout: no 'data' (a plan names every field of its layout)
        """
        values = {}
        for f in dataclasses.fields(cls):
            if f.name not in fields:
                raise ValueError(f"{where}: no {f.name!r} (a plan names every field of its layout)")
            value, kind = fields[f.name], int if f.type == "int" else str
            if type(value) is not kind or (kind is int and value < 1):
                expected = "an int >= 1" if kind is int else "a string"
                raise ValueError(f"{where}: {f.name} is {value!r}, expected {expected}")
            values[f.name] = value
        return cls(**values)

    def memory_layout(self, config: GPTConfig | None = None) -> MemoryLayout:
        """The :class:`~mmnnx.partition.MemoryLayout` of its axes (with ``config``, its blocks
        split as :func:`~mmnnx.partition.memory.default_blocks` splits them)."""
        count = self.stages * self.virtual_stages
        axes = {k: getattr(self, k) for k in ("stages", "data", "tensor", "expert", "fsdp")}
        blocks = default_blocks(config, count) if config is not None else None
        return MemoryLayout(**axes, virtual_stages=self.virtual_stages, blocks=blocks)

    def text(self) -> str:
        """The layout as ``--layout`` reads it.

        Example:
            >>> ClusterLayout(stages=2, microbatches=4).text()
            'pp=2,dp=1,tp=1,ep=1,fsdp=1,v=1,schedule=1f1b,microbatches=4,remat=none'
        """
        return _fields_text(dataclasses.asdict(self))


def attention_flops(att, dim: int, seq: int) -> float:
    """Forward FLOPs per token of one attention: its projections (2 per weight) and the
    scores and weighted values of a causal mask (half of ``seq`` keys on average).

    Example:
        >>> from mmnnx.modules import AttentionConfig
        >>> attention_flops(AttentionConfig(num_heads=2), 8, 4)
        576.0
    """
    if isinstance(att, LatentAttentionConfig):  # a score's and a weighted value's sizes
        per_head = att.qk_nope_head_dim + att.qk_rope_head_dim + att.v_head_dim
    else:
        per_head = 2 * (att.head_dim or dim // att.num_heads)
    return 2.0 * attention_weights(att, dim).total + 2.0 * att.num_heads * per_head * seq / 2


def feed_forward_flops(ff, dim: int) -> float:
    """Forward FLOPs per token of an MLP or a mixture of experts (the router, the ``top_k``
    experts a token reaches and any shared expert).

    Example:
        >>> from mmnnx.modules import MLPConfig
        >>> feed_forward_flops(MLPConfig(16, gated=True), 8)
        768.0
    """
    if isinstance(ff, MoEConfig):
        shared = getattr(ff, "shared_hidden", None) or 0
        return 2.0 * dim * (ff.num_experts + 3 * ff.hidden * ff.top_k + 3 * shared)
    return 2.0 * dim * ff.hidden * (3 if ff.gated else 2)


def block_flops(config: GPTConfig, index: int, seq: int) -> float:
    """Forward FLOPs per token of block ``index`` on sequences of ``seq`` tokens.

    Example:
        >>> block_flops(GPTConfig(dim=8, depth=1, num_heads=2, mlp_ratio=2), 0, 4)
        1088.0
    """
    block = config.block_configs[index]
    return attention_flops(block.attention, config.dim, seq) + feed_forward_flops(
        block.feed_forward, config.dim
    )


def model_flops_per_token(config: GPTConfig, seq: int) -> float:
    """Training FLOPs per token (forward and backward, 3 x the forward; no recomputation):
    every block and the head. MFU divides these.

    Example:
        >>> model_flops_per_token(GPTConfig(vocab_size=16, dim=8, depth=1, num_heads=2,
        ...                                 mlp_ratio=2), 4)
        4032.0
    """
    blocks = sum(block_flops(config, i, seq) for i in range(config.depth))
    return 3.0 * (blocks + 2.0 * config.dim * config.vocab_size)


def ring(size: float, group: int, bandwidth: float, passes: int = 1) -> float:
    """Seconds of a ring collective over ``group`` devices whose whole result is ``size``
    bytes: ``passes=1`` an all-gather, reduce-scatter or all-to-all, ``2`` an all-reduce.

    Example:
        >>> ring(100.0, 2, 100.0), ring(100.0, 2, 100.0, passes=2)
        (0.5, 1.0)
    """
    return passes * (group - 1) / group * size / bandwidth


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageCosts:
    """Each model stage's costs in seconds: ``actions`` per microbatch ``{(kind, stage): s}``;
    ``transfer``, an activation crossing a stage boundary; once per step ``gathers`` and
    ``reduces`` (its data-parallel collectives, on the network) and ``updates`` (its optimizer
    update); ``compute_share``, the busiest stage's FLOPs' share of its F + B."""

    actions: dict
    transfer: float
    gathers: list
    reduces: list
    updates: list
    compute_share: float


def stage_costs(
    config: GPTConfig, layout: ClusterLayout, device: DeviceSpec, *, batch: int, seq: int,
    collectives: Collectives = ENGINE, optimizer: str = "adamw", trainable: float = 1.0,
) -> StageCosts:  # fmt: skip
    """Each model stage's costs (:class:`StageCosts`) training on ``batch`` sequences of
    ``seq`` tokens, ``trainable`` the share of the weights trained (``0`` for LoRA's frozen
    base: no weight gradients' matmuls, reduce or update; the adapters' are not charged).
    The head's matmul counts on the stage that runs it
    (:func:`~mmnnx.partition.memory.head_stage`): the last, but a head tied to the embedding
    runs on the first task's devices, in a looped placement as a stage of its own, charged to
    stage 0's actions.

    Example:
        >>> config = GPTConfig(vocab_size=64, dim=32, depth=2, num_heads=2, max_seq_len=8)
        >>> costs = stage_costs(config, ClusterLayout(stages=2, microbatches=2),
        ...                     DEVICES["h100"], batch=4, seq=8)
        >>> sorted(costs.actions)[:2], costs.actions[("B", 0)] > costs.actions[("F", 0)]
        ([('B', 0), ('B', 1)], True)
    """
    lay, count = layout, layout.stages * layout.virtual_stages
    t, e, d, f = lay.tensor, lay.expert, lay.data, lay.fsdp
    act, param = DTYPE_BYTES[config.dtype], DTYPE_BYTES[config.param_dtype]
    tokens = batch / lay.microbatches / (d * e) * seq  # of one microbatch, on one device
    speed = device.flops * device.efficiency
    sizes = default_blocks(config, count)
    starts = [sum(sizes[:s]) for s in range(count)]
    tp_bw, ep_bw, data_bw = (device.bandwidth(n) for n in (t, t * e, t * e * d))
    per_step = collectives.gradients == "step"  # as the published frameworks run
    costs, gathers, reduces, updates, share = {}, [], [], [], 0.0
    # a tied head's stage of its own (``count``) runs on the first task's devices
    head = head_stage(config.tie_embeddings, lay.stages, lay.virtual_stages, lay.schedule) % count
    for s in range(count):
        indices = range(starts[s], starts[s] + sizes[s])
        blocks = [config.block_configs[i] for i in indices]
        flops = sum(block_flops(config, i, seq) for i in indices)
        weights = stage_weights(config, lay.memory_layout(), indices, s == 0, s == count - 1).total
        if s == head:
            flops += 2.0 * config.dim * config.vocab_size
        compute = flops * tokens / t / speed
        comm = 2 * len(blocks) * ring(tokens * config.dim * act, t, tp_bw, passes=2)
        for block in blocks:
            if isinstance(block.feed_forward, MoEConfig):
                comm += 2 * ring(tokens * block.feed_forward.top_k * config.dim * act, e, ep_bw)
        gather = ring(weights * (act if collectives.gathers == "step" else param), f, data_bw)
        if collectives.gathers == "step" and lay.microbatches == 1:  # for forward and backward
            gather *= 2
        trained = weights * trainable
        reduce = ring(trained * param, d * e, data_bw, passes=1 if f > 1 and per_step else 2)
        in_action = 0.0 if collectives.gathers == "step" else gather
        recompute = compute + comm if lay.remat == "full" else 0.0
        half = device.backward / 2 * compute  # the input and the weight gradients' matmuls
        costs[("F", s)] = compute + comm + in_action
        costs[("I", s)] = half + comm + recompute + in_action
        costs[("W", s)] = half * trainable + (0.0 if per_step else reduce)
        costs[("B", s)] = costs[("I", s)] + costs[("W", s)]
        gathers.append(gather - in_action)
        reduces.append(reduce if per_step else 0.0)
        state = trained / f * param * (3 + 2 * OPTIMIZER_COPIES[optimizer])  # read, write
        updates.append(state / device.memory_bandwidth)
        busy = costs[("F", s)] + costs[("B", s)]
        share = max(share, (1 + device.backward * (1 + trainable) / 2) * compute / busy)
    # two neighbouring stages' devices: one node's links when both fit in it; published
    # frameworks send each tensor-parallel device's slice, gathered on arrival (Megatron)
    sent = tokens * config.dim * act / (t if per_step else 1)
    transfer = sent / device.bandwidth(2 * t * e * d)
    return StageCosts(actions=costs, transfer=transfer, gathers=gathers, reduces=reduces,
                      updates=updates, compute_share=share)  # fmt: skip


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepCost:
    """:func:`step_cost`'s answer: the ``step_seconds`` (the simulated ``makespan`` plus
    ``per_step_seconds``: the exposed data-parallel collectives and the optimizer update of
    the last task to finish), the schedule's ``bubble`` (its idle share of rank-time),
    ``model_flops`` of the step and the :class:`StageCosts` simulated (``stages``)."""

    step_seconds: float
    makespan: float
    per_step_seconds: float
    bubble: float
    model_flops: float
    stages: StageCosts


def step_cost(
    config: GPTConfig, layout: ClusterLayout, device: DeviceSpec, *, batch: int, seq: int,
    collectives: Collectives = ENGINE, costs: StageCosts | None = None, one_host: bool = False,
    trainable: float = 1.0,
) -> StepCost:  # fmt: skip
    """The predicted step of training ``GPT(config)`` on ``layout`` over ``device``s with
    ``batch`` sequences of ``seq`` tokens: the schedule simulated with each action's costs
    (``costs``, by default :func:`stage_costs`), transfers and launches (each pipeline task's
    programs launched by a host of its own, ``device.launch`` seconds each; ``one_host``: one
    host launches every task's); beside it, each task's once-per-step collectives on its
    network link (:class:`Collectives`); then its update. ``trainable``: as
    :func:`stage_costs`'s, the model FLOPs those of its forward and backward.

    Example:
        >>> config = GPTConfig(vocab_size=64, dim=32, depth=2, num_heads=2, max_seq_len=8)
        >>> cost = step_cost(config, ClusterLayout(stages=2, microbatches=2), DEVICES["h100"],
        ...                  batch=4, seq=8)
        >>> cost.step_seconds > cost.makespan > 0, 0 < cost.bubble < 1
        (True, True)
    """
    count = layout.stages * layout.virtual_stages
    costs = costs or stage_costs(config, layout, device, batch=batch, seq=seq,
                                 collectives=collectives, trainable=trainable)  # fmt: skip
    table = sched.get(layout.schedule, count, layout.microbatches, layout.virtual_stages)
    moves = {(k, s): costs.transfer for k in ("F", "B", "I") for s in range(count)}
    hosts = (0,) * table.num_ranks if one_host else tuple(range(table.num_ranks))
    launches = {"launch_cost": device.launch, "processes": hosts} if device.launch else {}
    result = sched.simulate(table, action_costs=costs.actions, transfer_costs=moves, **launches)
    first, last, busy = {}, {}, dict.fromkeys(range(table.num_ranks), 0.0)
    for ev in result.events:
        first.setdefault(ev.stage, ev.start)
        if ev.kind != "F":  # a stage's last backward action, its gradients ready block by block
            last[ev.stage] = max(last.get(ev.stage, (0.0, 0.0)), (ev.end, ev.start))
        busy[ev.rank] = max(busy[ev.rank], ev.end)
    ends, blocks = [], default_blocks(config, count)
    for rank, compute_end in busy.items():
        mine = sorted((s for s in range(count) if table.stage_to_rank[s] == rank), key=first.get)
        wait = costs.gathers[mine[0]] / blocks[mine[0]]  # its first block's gather, alone
        link = sum(costs.gathers[s] for s in mine)
        for s in sorted(mine, key=last.get):
            end, start = last[s]
            link = max(max(link, start + wait) + costs.reduces[s],
                       end + wait + costs.reduces[s] / blocks[s])  # fmt: skip
        ends.append(max(compute_end + wait, link) + sum(costs.updates[s] for s in mine))
    step = max(ends)
    return StepCost(
        step_seconds=step, makespan=result.makespan, per_step_seconds=step - result.makespan,
        bubble=result.bubble_fraction, stages=costs,
        model_flops=model_flops_per_token(config, seq) * batch * seq * (2 + trainable) / 3,
    )  # fmt: skip
