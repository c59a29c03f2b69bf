"""The cost model of ``mmnnx plan``: a GPT's step time on a cluster, from its config's shapes,
a device's published peak FLOP/s and link bandwidths, and the schedule simulator.

Each pipeline action (a model stage's F, B, or with a split backward I and W, on one
microbatch) costs its FLOPs at ``efficiency`` x the device's peak, plus the collectives it
runs, none overlapped with compute: per block two tensor-parallel all-reduces of the
activations forward and two backward (Megatron's), per mixture-of-experts block two
all-to-alls forward (dispatch, combine) and two backward, and, as ``Collectives`` says, the
FSDP all-gathers of the stage's weights and the gradient all-reduce over the data (expert)
devices. Activations and their cotangents cross stages at the bandwidth of the link between
them. :func:`~mmnnx.mpmd.schedules.simulate` plays the schedule with these costs; the step is
its makespan plus the collectives run once per step. docs/planning.md states every
assumption.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

from mmnnx.models.gpt import GPTConfig
from mmnnx.modules import MoEConfig
from mmnnx.modules.latent_attention import LatentAttentionConfig
from mmnnx.mpmd import schedules as sched
from mmnnx.partition.memory import DTYPE_BYTES, MemoryLayout, default_blocks

EFFICIENCY = 0.7
"""The share of its peak dense bf16 FLOP/s a device reaches on the model's FLOPs: the same
for every device and every model, never fitted to a run. 0.7 is what large bf16 matmuls
reach in vendors' GEMM benchmarks (H100 SXM about 700 of 989 TFLOP/s; A100 about 220 of
312); the model's other work (norms, softmax, elementwise) is not charged apart, so this
number also stands for it."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """One accelerator as the cost model sees it: ``flops`` peak dense bf16 FLOP/s,
    ``memory`` bytes of HBM, ``intra_bandwidth`` and ``inter_bandwidth`` bytes/s each device
    sends one way inside its node (``node_size`` devices) and across nodes, ``efficiency``
    the share of ``flops`` reached (:data:`EFFICIENCY`).

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
    efficiency: float = EFFICIENCY

    def bandwidth(self, span: int) -> float:
        """Bytes/s per device for a collective over a group spanning ``span`` consecutive
        devices (inside one node: its links; beyond: the network).

        Example:
            >>> DEVICES["h100"].bandwidth(8) > DEVICES["h100"].bandwidth(16)
            True
        """
        return self.intra_bandwidth if span <= self.node_size else self.inter_bandwidth


DEVICES = {
    # H100 SXM5: 989.4 TFLOP/s dense BF16, 80 GB HBM3, NVLink 4 900 GB/s per GPU both ways
    # (nvidia.com/en-us/data-center/h100, datasheet); 8 per HGX node, one 400 Gb/s
    # ConnectX-7 NIC per GPU (DGX H100 user guide): 50 GB/s one way.
    "h100": DeviceSpec(
        name="h100",
        flops=989e12,
        memory=80 * 10**9,
        intra_bandwidth=450e9,
        inter_bandwidth=50e9,
        node_size=8,
    ),  # fmt: skip
    # H200 SXM: H100's compute, 141 GB HBM3e (nvidia.com/en-us/data-center/h200).
    "h200": DeviceSpec(
        name="h200",
        flops=989e12,
        memory=141 * 10**9,
        intra_bandwidth=450e9,
        inter_bandwidth=50e9,
        node_size=8,
    ),  # fmt: skip
    # H800 SXM: H100's compute, NVLink cut to 400 GB/s both ways; DeepSeek-V3's cluster: 8 per
    # node, 400 Gb/s InfiniBand per GPU (DeepSeek-V3 technical report, arXiv:2412.19437, 3.1).
    "h800": DeviceSpec(
        name="h800",
        flops=989e12,
        memory=80 * 10**9,
        intra_bandwidth=200e9,
        inter_bandwidth=50e9,
        node_size=8,
    ),  # fmt: skip
    # A100 SXM 80GB: 312 TFLOP/s dense BF16, NVLink 3 600 GB/s both ways, 200 Gb/s HDR per GPU
    # (nvidia.com/en-us/data-center/a100, DGX A100 user guide).
    "a100": DeviceSpec(
        name="a100",
        flops=312e12,
        memory=80 * 10**9,
        intra_bandwidth=300e9,
        inter_bandwidth=25e9,
        node_size=8,
    ),  # fmt: skip
    # TPU v5p: 459 TFLOP/s BF16, 95 GB HBM, ICI 4,800 Gb/s per chip over 6 links (a ring along
    # one axis uses 2: 200 GB/s one way); a pod of 8,960 chips is one ICI domain
    # (cloud.google.com/tpu/docs/v5p).
    "tpu-v5p": DeviceSpec(
        name="tpu-v5p",
        flops=459e12,
        memory=95 * 10**9,
        intra_bandwidth=200e9,
        inter_bandwidth=25e9,
        node_size=8960,
    ),  # fmt: skip
}
"""The devices ``mmnnx plan --device`` knows, with their sources."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Collectives:
    """When the step's data-parallel collectives run. ``gradients``: ``"microbatch"``, each
    backward all-reduces its microbatch's weight gradients over the data (expert) devices,
    as mmnnx's engine does (docs/pipelining.md, FSDP); ``"step"``, once per step (a
    reduce-scatter with FSDP), as Megatron, torchtitan and the published runs do.
    ``gathers``: FSDP's all-gathers of a stage's weights, in each F and each B (the engine)
    or once per model stage per step.

    Example:
        >>> ENGINE.gradients, PUBLISHED.gradients
        ('microbatch', 'step')
    """

    gradients: str = "microbatch"
    gathers: str = "microbatch"

    def __post_init__(self):
        for name in ("gradients", "gathers"):
            if getattr(self, name) not in ("microbatch", "step"):
                raise ValueError(f"Collectives.{name}: 'microbatch' or 'step', got "
                                 f"{getattr(self, name)!r}")  # fmt: skip


ENGINE = Collectives()
"""mmnnx's engine as built (per-microbatch gradient all-reduces and FSDP gathers)."""
PUBLISHED = Collectives(gradients="step", gathers="step")
"""Once per step, as the frameworks of the published runs do."""


TRAIN_OPTION = "train_option"
"""The metadata key of a :class:`ClusterLayout` field naming the ``mmnnx train`` option
(``mmnnx.train.config``) that sets it: the plan's layout and the train flags are one record."""


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
        split as :func:`stage_blocks` splits them)."""
        blocks = None
        if config is not None:
            blocks = stage_blocks(config, self.stages * self.virtual_stages)
        return MemoryLayout(stages=self.stages, data=self.data, tensor=self.tensor,
                            expert=self.expert, fsdp=self.fsdp,
                            virtual_stages=self.virtual_stages, blocks=blocks)  # fmt: skip

    def text(self) -> str:
        """The layout as ``--layout`` reads it.

        Example:
            >>> ClusterLayout(stages=2, microbatches=4).text()
            'pp=2,dp=1,tp=1,ep=1,fsdp=1,v=1,schedule=1f1b,microbatches=4,remat=none'
        """
        return (f"pp={self.stages},dp={self.data},tp={self.tensor},ep={self.expert},"
                f"fsdp={self.fsdp},v={self.virtual_stages},schedule={self.schedule},"
                f"microbatches={self.microbatches},remat={self.remat}")  # fmt: skip


@functools.cache
def stage_blocks(config: GPTConfig, count: int) -> tuple[int, ...]:
    """The blocks of each of ``count`` model stages, balanced by parameters as
    ``stage_rules`` balances them (the tensor axis divides every block alike), computed once.

    Example:
        >>> stage_blocks(GPTConfig(depth=4), 2)
        (2, 2)
    """
    return tuple(default_blocks(config, count))


def attention_flops(att, dim: int, seq: int) -> float:
    """Forward FLOPs per token of one attention: its projections (2 per weight) and the
    scores and weighted values of a causal mask (half of ``seq`` keys on average).

    Example:
        >>> from mmnnx.modules import AttentionConfig
        >>> attention_flops(AttentionConfig(num_heads=2), 8, 4)
        576.0
    """
    if isinstance(att, LatentAttentionConfig):
        heads, qk = att.num_heads, att.qk_nope_head_dim + att.qk_rope_head_dim
        q = (dim * att.q_lora_rank + att.q_lora_rank * heads * qk if att.q_lora_rank
             else dim * heads * qk)  # fmt: skip
        kv = dim * (att.kv_lora_rank + att.qk_rope_head_dim)
        kv += att.kv_lora_rank * heads * (att.qk_nope_head_dim + att.v_head_dim)
        weights = q + kv + heads * att.v_head_dim * dim
        return 2.0 * weights + 2.0 * heads * (qk + att.v_head_dim) * seq / 2
    hd = att.head_dim or dim // att.num_heads
    kv_heads = att.num_kv_heads or att.num_heads
    weights = dim * hd * (2 * att.num_heads + 2 * kv_heads)
    return 2.0 * weights + 2.0 * att.num_heads * hd * 2 * seq / 2


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


def all_reduce(size: float, group: int, bandwidth: float) -> float:
    """Seconds of a ring all-reduce of ``size`` bytes over ``group`` devices.

    Example:
        >>> all_reduce(100.0, 2, 100.0)
        1.0
    """
    return 2 * (group - 1) / group * size / bandwidth if group > 1 else 0.0


def all_gather(size: float, group: int, bandwidth: float) -> float:
    """Seconds of a ring all-gather (or reduce-scatter) whose whole result is ``size`` bytes.

    Example:
        >>> all_gather(100.0, 2, 100.0)
        0.5
    """
    return (group - 1) / group * size / bandwidth if group > 1 else 0.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepCost:
    """:func:`step_cost`'s answer: the ``step_seconds`` (the simulated ``makespan`` plus
    ``per_step_seconds`` of collectives run once per step), the schedule's ``bubble`` (its
    idle share of rank-time), ``model_flops`` of the step, ``action_costs`` per
    ``(kind, stage)`` and ``transfer_seconds`` per boundary crossing."""

    step_seconds: float
    makespan: float
    per_step_seconds: float
    bubble: float
    model_flops: float
    action_costs: dict
    transfer_seconds: float
    compute_share: float  # of one microbatch's F + B on the busiest stage: its FLOPs


def stage_action_costs(
    config: GPTConfig, layout: ClusterLayout, device: DeviceSpec, *, batch: int, seq: int,
    collectives: Collectives = ENGINE,
) -> tuple[dict, float, list[float], float]:  # fmt: skip
    """Each model stage's per-microbatch action costs in seconds ``{(kind, stage): s}``,
    the seconds an activation takes to cross a stage boundary, each model stage's
    once-per-step collectives' seconds, and the busiest stage's compute share of its F + B.

    Example:
        >>> config = GPTConfig(vocab_size=64, dim=32, depth=2, num_heads=2, max_seq_len=8)
        >>> costs, *_ = stage_action_costs(config, ClusterLayout(stages=2, microbatches=2),
        ...                                DEVICES["h100"], batch=4, seq=8)
        >>> sorted(costs)[:2], costs[("B", 0)] > costs[("F", 0)]
        ([('B', 0), ('B', 1)], True)
    """
    lay, count = layout, layout.stages * layout.virtual_stages
    t, e, d, f = lay.tensor, lay.expert, lay.data, lay.fsdp
    act, param = DTYPE_BYTES[config.dtype], DTYPE_BYTES[config.param_dtype]
    tokens = batch / lay.microbatches / (d * e) * seq  # of one microbatch, on one device
    speed = device.flops * device.efficiency
    sizes = stage_blocks(config, count)
    starts = [sum(sizes[:s]) for s in range(count)]
    tp_bw, ep_bw = device.bandwidth(t), device.bandwidth(t * e)
    data_bw = device.bandwidth(t * e * d)
    weights = _stage_weights(config, lay, sizes)
    costs, per_step, share = {}, [], 0.0
    for s in range(count):
        blocks = range(starts[s], starts[s] + sizes[s])
        flops = sum(block_flops(config, i, seq) for i in blocks) * tokens / t
        if s == count - 1:
            flops += 2.0 * config.dim * config.vocab_size * tokens / t
        compute = flops / speed
        moe = sum(isinstance(config.block_configs[i].feed_forward, MoEConfig) for i in blocks)
        top_k = max((getattr(config.block_configs[i].feed_forward, "top_k", 1) for i in blocks),
                    default=1)  # fmt: skip
        comm = len(blocks) * 2 * all_reduce(tokens * config.dim * act, t, tp_bw)
        comm += moe * 2 * all_gather(tokens * top_k * config.dim * act, e, ep_bw)
        stage_bytes = weights[s] * param  # per device, before fsdp
        gather = all_gather(stage_bytes, f, data_bw)
        reduce = all_reduce(stage_bytes, d * e, data_bw)
        recompute = {"none": 0.0, "dots": 0.0, "full": compute + comm}.get(lay.remat, compute)
        per_action_gather = gather if collectives.gathers == "microbatch" else 0.0
        per_action_reduce = reduce if collectives.gradients == "microbatch" else 0.0
        once = 2 * gather if collectives.gathers == "step" else 0.0
        if collectives.gradients == "step":  # a reduce-scatter with fsdp
            once += all_gather(stage_bytes, d * e, data_bw) if f > 1 else reduce
        per_step.append(once)
        forward = compute + comm + per_action_gather
        input_grad = compute + comm + recompute + per_action_gather
        weight_grad = compute + per_action_reduce
        costs[("F", s)] = forward
        costs[("B", s)] = input_grad + weight_grad
        costs[("I", s)] = input_grad
        costs[("W", s)] = weight_grad
        share = max(share, 3 * compute / (forward + input_grad + weight_grad))
    # two neighbouring stages' devices: one node's links when both fit in it
    transfer = tokens * config.dim * act / device.bandwidth(2 * t * e * d)
    return costs, transfer, per_step, share


def _stage_weights(config: GPTConfig, lay: ClusterLayout, sizes: Sequence[int]) -> list[float]:
    """Each model stage's parameter elements per device before ``fsdp``."""
    from mmnnx.partition.memory import _block_weights, _weight  # noqa: PLC0415

    memory_layout = lay.memory_layout()
    out, start = [], 0
    for s, size in enumerate(sizes):
        total = sum(_block_weights(config.block_configs[i], config.dim, memory_layout, 0, 1).total
                    for i in range(start, start + size))  # fmt: skip
        if s == 0:
            total += _weight((config.vocab_size, config.dim), lay.tensor, 0, 1).total
        if s == len(sizes) - 1 and not config.tie_embeddings:
            total += config.vocab_size * config.dim / lay.tensor
        out.append(total)
        start += size
    return out


def step_cost(
    config: GPTConfig, layout: ClusterLayout, device: DeviceSpec, *, batch: int, seq: int,
    collectives: Collectives = ENGINE,
) -> StepCost:  # fmt: skip
    """The predicted step of training ``GPT(config)`` on ``layout`` over ``device``s with
    ``batch`` sequences of ``seq`` tokens: the schedule simulated with each action's costs
    (:func:`stage_action_costs`) and transfers, plus the once-per-step collectives.

    Example:
        >>> config = GPTConfig(vocab_size=64, dim=32, depth=2, num_heads=2, max_seq_len=8)
        >>> cost = step_cost(config, ClusterLayout(stages=2, microbatches=2), DEVICES["h100"],
        ...                  batch=4, seq=8)
        >>> cost.step_seconds == cost.makespan > 0, 0 < cost.bubble < 1
        (True, True)
    """
    count = layout.stages * layout.virtual_stages
    costs, transfer, per_stage, share = stage_action_costs(
        config, layout, device, batch=batch, seq=seq, collectives=collectives
    )
    table = sched.get(layout.schedule, count, layout.microbatches, layout.virtual_stages)
    moves = {("F", s): transfer for s in range(count)}
    moves.update({(k, s): transfer for k in ("B", "I") for s in range(count)})
    result = sched.simulate(table, action_costs=costs, transfer_costs=moves)
    ranks = [0.0] * table.num_ranks
    for s, seconds in enumerate(per_stage):
        ranks[table.stage_to_rank[s]] += seconds
    per_step = max(ranks)
    model_flops = model_flops_per_token(config, seq) * batch * seq
    return StepCost(
        step_seconds=result.makespan + per_step, makespan=result.makespan,
        per_step_seconds=per_step, bubble=result.bubble_fraction, model_flops=model_flops,
        action_costs=costs, transfer_seconds=transfer, compute_share=share,
    )  # fmt: skip
