"""``mm.predict_memory``: each device's peak bytes for a GPT on a pipelined layout, from the
config's shapes and a simulation of the schedule alone (nothing built, traced or compiled), so
a layout that cannot fit is refused before anything compiles and a 70B config can be sized on a
laptop.

The model (docs/memory.md works one example through): a stage's devices hold its parameters,
its gradient sums (laid out as the parameters), its optimizer state and the block weights the
runner packs into one buffer (a second copy); each microbatch in flight keeps its blocks'
residuals (what each block's forward keeps for its backward under the remat policy) from its
forward until its backward, plus buffers at its stage boundaries; the largest program, a
backward, works on one microbatch's weight gradients and the stage's activations as
cotangents, recomputed once more under remat. The stage running the head and the loss keeps
the float32 logits, and its backward holds two more logits-sized buffers; a head tied to the
embedding runs where the table lives, on the first task (:func:`head_stage`). At the end of
the step the new parameters and optimizer state are written beside the old ones. Each term is
per device: tensor-parallel weights and heads divide by ``tensor``, experts by ``expert``,
parameters, gradient sums and optimizer state by ``fsdp``, the batch by ``data`` x ``expert``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

from mmnnx.models.gpt import REMAT, GPTConfig
from mmnnx.modules import (
    AttentionConfig,
    BlockConfig,
    ClampedMoEConfig,
    MLPConfig,
    MoEConfig,
)
from mmnnx.modules.deepseek_moe import DeepSeekMoEConfig
from mmnnx.modules.latent_attention import LatentAttentionConfig
from mmnnx.mpmd import schedules as sched
from mmnnx.mpmd.lower.pack import PACK_WEIGHT_BYTES, weight_bound
from mmnnx.mpmd.schedules.registry import registered

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
OPTIMIZER_COPIES = {"adamw": 2, "adam": 2, "sgd": 0, "momentum": 1, "lion": 1, "adafactor": 0}
"""Optimizer state per trained parameter, in parameter-sized copies (AdamW: two moments)."""
_FEED_FORWARD = (MLPConfig, MoEConfig, DeepSeekMoEConfig, ClampedMoEConfig)
_ATTENTION = (AttentionConfig, LatentAttentionConfig)
_F32 = 4  # norms, softmax and the loss are float32 whatever the compute dtype
_STATS_PER_TOKEN = 2  # a block's two norms' rsqrt, kept per token
_HEAD_STATS_PER_TOKEN = 3  # the final norm's rsqrt, the loss's log-sum-exp and target


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryLayout:
    """How a model is laid out over devices, as :func:`predict_memory` charges it.

    ``stages`` tasks, each of ``data`` x ``expert`` x ``tensor`` devices (the batch split over
    ``data`` x ``expert``, attention heads and MLP features over ``tensor``, experts over
    ``expert``); ``fsdp`` divides each stage's parameters, gradient sums and optimizer state
    (sharded over that many of its ``data`` devices, as ``mmnnx train --fsdp-axis`` carves
    it); ``virtual_stages`` model stages per task; ``blocks``: the blocks of
    each model stage (default: as ``stage_rules`` balances parameter counts).

    Example:
        >>> MemoryLayout(stages=2, tensor=2).devices
        4
    """

    stages: int = 1
    data: int = 1
    tensor: int = 1
    expert: int = 1
    fsdp: int = 1
    virtual_stages: int = 1
    blocks: tuple[int, ...] | None = None

    def __post_init__(self):
        for name in ("stages", "data", "tensor", "expert", "fsdp", "virtual_stages"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MemoryLayout.{name} must be an int >= 1, got {value!r}")
        if self.data % self.fsdp:
            raise ValueError(
                f"MemoryLayout.fsdp {self.fsdp} must divide data {self.data} (its devices)"
            )
        if self.blocks is not None:
            count = self.stages * self.virtual_stages
            if len(self.blocks) != count or min(self.blocks, default=0) < 1:
                raise ValueError(
                    f"MemoryLayout.blocks {self.blocks!r}: expected {count} (stages x "
                    "virtual_stages) counts of blocks >= 1"
                )

    @property
    def devices(self) -> int:
        """The devices the layout spans (``fsdp`` shards within them)."""
        return self.stages * self.data * self.tensor * self.expert


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageMemory:
    """One task's predicted bytes per device (its model stages summed), by what holds them.

    ``peak`` is the larger of the pipelined phase (``parameters + gradients + optimizer +
    packed_weights + activations + transfers + workspace``) and the update at the step's end
    (``update``: old and new parameters and optimizer state, and the gradients).
    """

    task: int
    blocks: tuple[int, ...]  # first and last block of each of its model stages, flattened
    parameters: int
    gradients: int
    optimizer: int
    packed_weights: int
    activations: int  # residuals of the microbatches in flight at the worst moment
    in_flight: int  # those microbatches
    transfers: int
    workspace: int  # the largest program's own buffers (a backward)
    update: int

    @property
    def pipelined(self) -> int:
        """Bytes held while the microbatches run."""
        return (
            self.parameters + self.gradients + self.optimizer + self.packed_weights
            + self.activations + self.transfers + self.workspace
        )  # fmt: skip

    @property
    def peak(self) -> int:
        """The most bytes any device of this task holds during the step."""
        return max(self.pipelined, self.update)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryPrediction:
    """:func:`predict_memory`'s answer: one :class:`StageMemory` per task; ``peak`` the
    largest, ``worst`` its task. ``str`` draws the table."""

    tasks: tuple[StageMemory, ...]
    schedule: str
    microbatches: int
    remat: str

    @property
    def peak(self) -> int:
        """The most bytes one device holds."""
        return max(t.peak for t in self.tasks)

    @property
    def worst(self) -> StageMemory:
        """The task whose devices hold the most."""
        return max(self.tasks, key=lambda t: t.peak)

    def __str__(self) -> str:
        columns = ("task", "params", "grads", "optimizer", "packed", "activations", "transfers",
                   "workspace", "update", "peak")  # fmt: skip
        rows = [columns]
        for t in self.tasks:
            values = (t.parameters, t.gradients, t.optimizer, t.packed_weights, t.activations,
                      t.transfers, t.workspace, t.update, t.peak)  # fmt: skip
            rows.append((str(t.task), *(format_bytes(v) for v in values)))
        widths = [max(len(r[i]) for r in rows) for i in range(len(columns))]
        lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
        head = f"predicted bytes per device ({self.schedule}, M={self.microbatches}, remat "
        return "\n".join([head + f"{self.remat})", *lines])


def format_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit under it.

    Example:
        >>> format_bytes(3 * 2**30), format_bytes(1536)
        ('3.0 GiB', '1.5 KiB')
    """
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


@dataclasses.dataclass(frozen=True)
class _Weights:
    """A module's parameter elements per device (``total``) and the replicated ones a stage
    packs (of at most the pack bound each)."""

    total: float = 0
    packed: float = 0

    def __add__(self, other: _Weights) -> _Weights:
        return _Weights(self.total + other.total, self.packed + other.packed)


def _weight(shape: Sequence[int], shards: int, pack_limit: float, itemsize: int) -> _Weights:
    """One Variable of ``shape`` split ``shards`` ways (1: replicated, then maybe packed)."""
    size = math.prod(shape) / shards
    packed = size if shards == 1 and size * itemsize <= pack_limit else 0
    return _Weights(size, packed)


def _block_weights(
    block: BlockConfig, dim: int, lay: MemoryLayout, pack_limit: float, itemsize: int
) -> _Weights:
    """A block's parameters per device (before ``fsdp``)."""
    tp, ep = lay.tensor, lay.expert
    w = lambda shape, shards=1: _weight(shape, shards, pack_limit, itemsize)
    norm = 2 if block.norm.kind == "layer" else 1
    total = w((norm * dim,)) + w((norm * dim,))
    total += attention_weights(block.attention, dim, w, tp)
    ff = block.feed_forward
    if isinstance(ff, MoEConfig):
        total += w((dim + ff.router_bias, ff.num_experts))
        total += w((ff.num_experts, 3 * dim * ff.hidden), ep * tp)
        if isinstance(ff, ClampedMoEConfig):  # gpt-oss's experts' biases: gate_up's and down's
            total += w((ff.num_experts, 2 * ff.hidden), ep * tp) + w((ff.num_experts, dim), ep)
        if getattr(ff, "shared_hidden", None):  # DeepSeek's shared expert: a gated MLP
            total += w((3 * dim, ff.shared_hidden), tp)
    elif isinstance(ff, MLPConfig):
        total += w((dim, ff.hidden), tp) + w((ff.hidden, dim), tp)
        if ff.gated:
            total += w((dim, ff.hidden), tp)
        if ff.bias:
            total += w((ff.hidden,), tp) + w((dim,))
    return total


def attention_weights(att, dim: int, w=None, tp: int = 1) -> _Weights:
    """An attention's parameters per device, each made by ``w(shape, shards)`` (default:
    whole): projections split over ``tensor`` (``tp``) by head, a latent attention's down-
    projections and latents' norms whole.

    Example:
        >>> attention_weights(AttentionConfig(num_heads=2), 8).total
        256.0
    """
    w = w or (lambda shape, shards=1: _weight(shape, shards, 0, 1))
    if isinstance(att, LatentAttentionConfig):
        heads, qk = att.num_heads, att.qk_nope_head_dim + att.qk_rope_head_dim
        total = w((dim, att.kv_lora_rank + att.qk_rope_head_dim)) + w((att.kv_lora_rank,))
        total += w((att.kv_lora_rank, heads * (att.qk_nope_head_dim + att.v_head_dim)), tp)
        total += w((heads * att.v_head_dim, dim), tp)
        if att.q_lora_rank:
            total += w((dim, att.q_lora_rank)) + w((att.q_lora_rank,))
            return total + w((att.q_lora_rank, heads * qk), tp)
        return total + w((dim, heads * qk), tp)
    hd = att.head_dim or dim // att.num_heads
    q, kv = att.num_heads * hd, (att.num_kv_heads or att.num_heads) * hd
    total = w((dim, q), tp) + w((dim, kv), tp) + w((dim, kv), tp) + w((q, dim), tp)
    if att.qk_norm:
        total += w((hd,)) + w((hd,))
    if att.bias:  # gpt-oss: q, k, v split by head, out's whole
        total += w((q + 2 * kv,), tp) + w((dim,))
    if att.sinks:  # a logit per head
        total += w((att.num_heads,), tp)
    return total


def _attention_residuals(att, dim: int, tokens: float, tp: int, dtype: int) -> tuple:
    """An attention's kept projections (bytes) and heads per device: q, k, v and the heads'
    output; a latent attention also its two latents (whole on each device)."""
    if isinstance(att, LatentAttentionConfig):
        heads = att.num_heads / tp
        qk = att.qk_nope_head_dim + att.qk_rope_head_dim
        latents = att.kv_lora_rank + att.qk_rope_head_dim + (att.q_lora_rank or 0)
        per_token = heads * (2 * qk + 2 * att.v_head_dim) + latents
        return tokens * per_token * dtype, heads
    hd = att.head_dim or dim // att.num_heads
    heads, kv = att.num_heads / tp, (att.num_kv_heads or att.num_heads) / tp
    return tokens * hd * (2 * heads + 2 * kv) * dtype, heads


@dataclasses.dataclass(frozen=True)
class _Residuals:
    """Bytes one block keeps per microbatch per device: all it would keep without remat, those
    the remat policy keeps, and its matmuls' outputs (whose cotangents a split backward's
    input-gradient pass leaves for its weight-gradient pass)."""

    full: float
    kept: float
    outputs: float


def _block_residuals(
    block: BlockConfig, dim: int, tokens: float, seq: int, lay: MemoryLayout, dtype: int,
    remat: str, *, reference: bool = False,
) -> _Residuals:  # fmt: skip
    """What one block's forward keeps for its backward, in bytes per device per microbatch of
    ``tokens`` tokens per device (the backward recomputes arithmetic and layout ops from them,
    so these are the block's input, its matmuls' and softmax's outputs, and norm statistics;
    as a ``reference`` framework runs it, a fused attention keeps no probabilities and an
    expert axis pads no slots)."""
    tp = lay.tensor
    projections, heads = _attention_residuals(block.attention, dim, tokens, tp, dtype)
    scores = 0 if reference else tokens * heads * seq * _F32  # the softmax's probabilities
    # a reference framework splits the residual stream's tokens over ``tensor`` (Megatron's
    # sequence parallelism, MaxText's activation_embed sharding)
    stream = tokens * dim * dtype / (tp if reference else 1)
    stats = tokens * 2 * heads * _F32 + stream / dim / dtype * _STATS_PER_TOKEN * _F32
    residual = 2 * stream  # the block's input and its sum after attention
    ff = block.feed_forward
    if isinstance(ff, MoEConfig):
        rows = tokens * ff.top_k  # each token's copies, one per expert it is routed to
        if ff.capacity_factor is not None:
            rows = min(rows, math.ceil(ff.capacity_factor * rows / ff.num_experts)
                       * ff.num_experts)  # fmt: skip
        hidden, local = ff.hidden / tp, ff.num_experts / lay.expert
        # with an expert axis, a padded slot for every assignment at each of its devices
        slots = rows * lay.expert if lay.expert > 1 and not reference else rows
        feed = (
            tokens * ff.num_experts * _F32  # the router's probabilities
            + slots * dim * dtype * 4.25  # sent (and its mask), received, sorted, returned
            + slots * hidden * dtype * 6  # the grouped SwiGLU's gate, up, SiLU and product
            + rows * dim * dtype * 2.25  # each assignment's output, weighted, and its mask
            + 2 * local * dim * hidden * dtype  # the gate and up weights, as the experts ran
        )
        saved_dots = tokens * ff.num_experts * _F32  # the router's logits (grouped: not dots)
        outputs = saved_dots + slots * (2 * hidden + dim) * dtype
        if getattr(ff, "shared_hidden", None):  # the shared expert, a gated MLP
            shared = ff.shared_hidden / tp
            feed += tokens * shared * 3 * dtype
            saved_dots += tokens * (2 * shared + dim) * dtype
            outputs += tokens * (2 * shared + dim) * dtype
    else:
        hidden = ff.hidden / tp
        feed = tokens * hidden * (3 if ff.gated else 2) * dtype  # up (gate), its activation
        saved_dots = tokens * (hidden * (2 if ff.gated else 1) + dim) * dtype
        outputs = saved_dots
    full = residual + projections + scores + stats + feed
    kept = {
        "none": full,
        "full": stream,  # its input
        "dots": projections + saved_dots,  # its input is the last block's outputs summed
        "offload": stream,  # the matmuls' outputs wait in host memory
    }[remat]
    return _Residuals(full, kept, projections + outputs)


def _workspace(gradients: float, stage: _Stage, *, split: bool, reference: bool) -> float:
    """A ``stage``'s largest backward program's own buffers: one microbatch's weight
    ``gradients``, the stage's activations (``full``: all it would keep; its largest block's
    for a ``reference`` framework) as cotangents, and those remat recomputes (``full -
    kept``). Under remat a ``split`` backward's input-gradient pass recomputes and holds the
    cotangents, its weight-gradient pass the gradients: the larger of the two (the first
    stage, with no input gradient, runs one pass). ``loss``: what the loss's backward holds
    beside the logits' cotangent before any weight gradient is made, which the gradients then
    take the place of (the larger of the two); a split backward's input-gradient pass returns
    the logits' cotangent instead (``waiting``), but holds ``input_loss`` under remat (a tied
    head's: see :class:`_Stage`)."""
    full, kept = (stage.block_full, stage.block_kept) if reference else (stage.full, stage.kept)
    cotangents = full + (full - kept)
    if not split:
        return max(gradients, stage.loss) + cotangents
    return max(cotangents + stage.input_loss, gradients) if full > kept else gradients + cotangents


def _held_peaks(events: Sequence[sched.Event], stages: Sequence[_Stage],
                homes: Sequence[int]) -> dict[int, float]:  # fmt: skip
    """Most bytes each task (``homes[s]``: stage ``s``'s) holds at once for its microbatches
    in flight: a stage's ``kept`` from its F until its B (or W; with a split
    backward, what only its I reads, ``released``, until its I), with a split backward its
    ``waiting`` cotangents from its I until its W, and a tied head's gradient of the table
    (``table``) from its backward's first pass until the first stage's backward adds it to
    its sums."""
    changes, passed = [], sum(st.table for st in stages)
    for e in events:
        st = stages[e.stage]
        delta = {
            "F": st.kept, "I": st.waiting - st.released + st.table, "B": st.table - st.kept,
            "W": st.released - st.kept - st.waiting,
        }[e.kind]  # fmt: skip
        if e.stage == 0 and e.kind in "BW":
            delta -= passed
        changes.append((e.start if e.kind == "F" else e.end, delta > 0, homes[e.stage], delta))
    now = dict.fromkeys(homes, 0.0)
    peak = dict(now)
    for _, _, home, delta in sorted(changes):  # at one instant, releases before new holds
        now[home] += delta
        peak[home] = max(peak[home], now[home])
    return peak


def head_stage(tied: bool, stages: int, virtual_stages: int, schedule: str) -> int:
    """The pipeline stage whose programs run the head and the loss (and their backward): the
    last model stage (``stages * virtual_stages - 1``), but for a head ``tied`` to the embedding
    (``embed.attend``) on several tasks placed in a loop, one stage more (``stages``): the
    forward pass comes back to the first task, where the table lives, as a stage of its own
    (mm.jit's chain: 1F1B on 2 tasks runs 3 stages). A V placement's last model stage is on the
    first task already. Raises ValueError for a tied head on an interleaved placement (looped,
    ``virtual_stages >= 2``), which cannot fold that stage in.

    Example:
        >>> head_stage(False, 2, 1, "1f1b"), head_stage(True, 2, 1, "1f1b")
        (1, 2)
        >>> head_stage(True, 2, 2, "zero-bubble-v")
        3
    """
    count = stages * virtual_stages
    if not tied or stages == 1 or registered(schedule).placement.order(virtual_stages) != "loop":
        return count - 1
    if virtual_stages > 1:
        raise ValueError(
            f"{schedule} with v={virtual_stages}: the head tied to the embedding brings the "
            "forward pass back to the first task, which a looped placement cannot fold in"
        )
    return count


def pipeline_schedule(
    schedule: str, stages: int, virtual_stages: int, microbatches: int, tied: bool = False
) -> tuple[sched.Schedule, int]:
    """The schedule table a step of ``stages`` tasks of ``virtual_stages`` model stages runs, and
    the stage of it running the head (:func:`head_stage`; a head of its own, on the first task,
    makes one stage more). ValueError when the schedule cannot run them.

    Example:
        >>> table, head = pipeline_schedule("1f1b", 2, 1, 4, tied=True)
        >>> table.num_stages, head
        (3, 2)
    """
    count = stages * virtual_stages
    head = head_stage(tied, stages, virtual_stages, schedule)
    if head < count:
        return sched.get(schedule, count, microbatches, virtual_stages), head
    try:
        return sched.get(schedule, count + 1, microbatches), head
    except ValueError as e:
        raise ValueError(
            f"{e} (the head tied to the embedding brings the forward pass back to the first "
            f"task: {count + 1} stages on {stages} tasks)"
        ) from None


@functools.cache
def default_blocks(config: GPTConfig, stages: int, layout: MemoryLayout | None = None) -> tuple:
    """Blocks per model stage as ``stage_rules`` (by parameter counts) cuts them (computed once
    per config and count).

    Example:
        >>> default_blocks(GPTConfig(depth=4), 2)
        (2, 2)
    """
    from mmnnx.models.stages import _split  # noqa: PLC0415

    lay = layout or MemoryLayout()
    costs = [
        int(_block_weights(b, config.dim, lay, 0, 1).total * lay.tensor)
        for b in config.block_configs
    ]
    first = config.vocab_size * config.dim
    last = config.dim * (0 if config.tie_embeddings else config.vocab_size) + config.dim
    return tuple(_split(costs, stages, first, last))


class _Shapes(NamedTuple):
    """What every stage's terms are computed from."""

    config: GPTConfig
    layout: MemoryLayout
    seq: int
    remat: str
    dtype: int  # bytes of the compute dtype
    param_bytes: int
    pack_limit: float  # the largest weight mm.jit packs
    tokens: float  # of one microbatch, on one device
    reference: bool  # charged as a reference framework holds it (predict_memory's argument)


class _Stage(NamedTuple):
    """One pipeline stage's weights and what one microbatch of it keeps, in bytes per device."""

    weights: _Weights
    kept: float  # from its forward to its backward, under the remat policy
    full: float  # the same without remat
    waiting: float  # with a split backward, from its input- to its weight-gradient pass
    block_full: float  # the largest block's full, and below kept, residuals (with the head's)
    block_kept: float
    released: float = 0.0  # of these, what only a split backward's input-gradient pass reads
    loss: float = 0.0  # the loss's backward's buffers beside the logits' cotangent
    # of these, what a split backward's input-gradient pass holds under remat: a tied head's
    # table gradient is the gradient of the head's matmul over the table, made in that pass
    # (without remat the engine ran it in parts, each holding less, as measured)
    input_loss: float = 0.0
    table: float = 0.0  # a tied head's gradient of the table, added into the first stage's sums


def stage_weights(config: GPTConfig, lay: MemoryLayout, blocks: Sequence[int], first: bool,
                  last: bool, pack_limit: float = 0, itemsize: int = 1) -> _Weights:  # fmt: skip
    """The parameters per device (before ``fsdp``) of a model stage holding ``blocks`` (the
    embedding when ``first``, the final norm and head when ``last``).

    Example:
        >>> config = GPTConfig(vocab_size=8, dim=4, depth=2, num_heads=2)
        >>> stage_weights(config, MemoryLayout(), [0], True, False).total
        252.0
    """
    dim, vocab = config.dim, config.vocab_size
    weights = sum((_block_weights(config.block_configs[i], dim, lay, pack_limit, itemsize)
                   for i in blocks), _Weights())  # fmt: skip
    if first:
        weights += _weight((vocab, dim), lay.tensor, 0, itemsize)
    if last:
        head = 0 if config.tie_embeddings else vocab * dim
        weights += _weight((head,), lay.tensor, 0, itemsize) + _Weights(dim, 0)
    return weights


def _stage(shapes: _Shapes, blocks: range, *, first: bool, last: bool, head: bool) -> _Stage:
    """The terms of the pipeline stage holding ``blocks`` (and the embedding when ``first``,
    the final norm, and the head's weights unless tied, when ``last``), running the head and
    the loss when ``head`` (:func:`head_stage`)."""
    config, lay, dtype, tokens = shapes.config, shapes.layout, shapes.dtype, shapes.tokens
    dim, vocab, param_bytes = config.dim, config.vocab_size, shapes.param_bytes
    layers = [config.block_configs[i] for i in blocks]
    weights = stage_weights(config, lay, blocks, first, last, shapes.pack_limit, param_bytes)
    res = [_block_residuals(b, dim, tokens, shapes.seq, lay, dtype, shapes.remat,
                            reference=shapes.reference) for b in layers]  # fmt: skip
    block_full = max((r.full for r in res), default=0.0)
    block_kept = max((r.kept for r in res), default=0.0)
    kept = sum(r.kept for r in res)
    full = sum(r.full for r in res)
    outputs = sum(r.outputs for r in res)
    if first:
        kept += tokens * 4  # the token ids the embedding's gradient scatters by
    # a split backward's weight-gradient pass reads its matmuls' output cotangents; under
    # remat it recomputes them from the cotangent at each block's output
    waiting = outputs if shapes.remat == "none" else len(layers) * tokens * dim * dtype
    released = loss = input_loss = table = 0.0
    if head:
        logits = tokens * vocab / lay.tensor * _F32  # float32 for the log-softmax
        terms = logits + tokens * dim * dtype + tokens * _HEAD_STATS_PER_TOKEN * _F32
        kept, full = kept + terms, full + terms
        block_full, block_kept = block_full + terms, block_kept + terms
        waiting += tokens * vocab / lay.tensor * dtype  # the logits' cotangent (no remat)
        if not shapes.reference:
            # the input-gradient pass alone reads the logits; the weight-gradient pass the
            # head's input and the logits' cotangent
            released = logits + tokens * 2 * _F32
            # besides the logits' cotangent, the cotangent of the log-probabilities (the
            # targets' gather transposed) and the logits' cotangent laid out again for the
            # head's weight-gradient matmul (measured on the CPU backend)
            loss = 2 * logits
            if config.tie_embeddings:
                # the table's gradient, which the first stage's backward adds to its sums
                input_loss = loss
                table = 0.0 if first else vocab * dim / lay.tensor * param_bytes
    if shapes.remat == "dots":
        kept += tokens * dim * dtype  # the first block's input
    return _Stage(weights=weights, kept=kept, full=full, waiting=waiting,
                  block_full=block_full, block_kept=block_kept, released=released, loss=loss,
                  input_loss=input_loss, table=table)  # fmt: skip


def predict_memory(
    config: GPTConfig,
    layout: MemoryLayout,
    *,
    batch: int,
    seq_len: int | None = None,
    schedule: str = "1f1b",
    microbatches: int = 1,
    remat: str | None = None,
    optimizer: str = "adamw",
    trainable: float = 1.0,
    pack_weights: bool | int = PACK_WEIGHT_BYTES,
    fsdp_gather: str = "microbatch",
    reference: bool = False,
) -> MemoryPrediction:
    """Each task's peak bytes per device for training ``GPT(config)`` on ``layout`` with
    ``batch`` sequences of ``seq_len`` tokens (default ``config.max_seq_len``) per step, cut
    into ``microbatches`` run by ``schedule``; from shapes and the schedule's simulation only.

    ``remat`` (default ``config.remat``) is a :data:`~mmnnx.models.gpt.REMAT` policy;
    ``optimizer`` names the optimizer state per parameter (:data:`OPTIMIZER_COPIES`);
    ``trainable`` is the share of parameters trained (gradients and optimizer state);
    ``pack_weights`` is ``mm.jit``'s (a block's replicated weights of at most that many bytes
    are packed into a second copy). ``fsdp_gather``: when a stage's FSDP-sharded weights are
    gathered, ``"microbatch"`` (in each program that reads them) or ``"step"``
    (``mm.jit(gather_weights=...)``, ``mmnnx train --fsdp-gather step``: once, the gathered
    copy held from the stage's first forward to its last backward, charged in the
    workspace). The terms are described in this module's docstring and
    docs/memory.md. A head tied to the embedding (``config.tie_embeddings``) and its loss are
    charged to the task that runs them (:func:`head_stage`: on several tasks, the first), with
    the table's gradient its backward passes to the first stage's. ``reference``: charge what
    a reference framework (Megatron, torchtitan: the published runs) holds instead of this
    engine: a fused attention that keeps no probabilities, experts exchanging only the tokens
    routed to them (no padded slots), a backward's workspace of one block at a time, each
    microbatch's gradients accumulated in place, nothing packed.

    Example:
        >>> config = GPTConfig(vocab_size=64, dim=32, depth=2, num_heads=2, max_seq_len=8)
        >>> p = predict_memory(config, MemoryLayout(stages=2), batch=4, microbatches=2)
        >>> [t.parameters for t in p.tasks], [t.in_flight for t in p.tasks]
        ([58240, 58368], [2, 1])

    Raises:
        ValueError: a remat policy, optimizer or schedule not known (or one that cannot run
            the stages, a tied head's among them: :func:`pipeline_schedule`), ``seq_len`` above
            ``config.max_seq_len``, a layer of a kind the model does not know, a batch the
            microbatches and the data (expert) axis do not split, or fewer blocks than model
            stages.
    """
    remat = config.remat if remat is None else remat
    if remat not in REMAT:
        raise ValueError(f"predict_memory: remat {remat!r}: expected one of {', '.join(REMAT)}")
    if optimizer not in OPTIMIZER_COPIES:
        known = ", ".join(OPTIMIZER_COPIES)
        raise ValueError(f"predict_memory: optimizer {optimizer!r}: expected one of {known}")
    if fsdp_gather not in ("microbatch", "step"):
        raise ValueError(
            f"predict_memory: fsdp_gather {fsdp_gather!r}: expected 'microbatch' or 'step'"
        )
    lay, seq = layout, seq_len or config.max_seq_len
    if seq > config.max_seq_len:
        raise ValueError(
            f"predict_memory: seq_len {seq} exceeds the model's max_seq_len "
            f"{config.max_seq_len} (GPTConfig.max_seq_len): it cannot read such sequences"
        )
    shards = lay.data * lay.expert
    if batch % microbatches or (batch // microbatches) % shards:
        raise ValueError(
            f"predict_memory: a batch of {batch} in {microbatches} microbatches over data x "
            f"expert = {shards} devices does not split evenly"
        )
    for i, block in enumerate(config.block_configs):
        parts = (block.attention, block.feed_forward)
        if type(parts[0]) not in _ATTENTION or type(parts[1]) not in _FEED_FORWARD:
            kinds = " and ".join(type(part).__name__ for part in parts)
            raise ValueError(
                f"predict_memory: layer {i} is {kinds}; the model knows AttentionConfig or "
                "LatentAttentionConfig with MLPConfig or a MoEConfig (DeepSeek's, gpt-oss's)"
            )
    count = lay.stages * lay.virtual_stages
    if config.depth < count:
        raise ValueError(f"predict_memory: {config.depth} blocks for {count} model stages")
    sizes = lay.blocks or default_blocks(config, count, lay)
    if sum(sizes) != config.depth:
        raise ValueError(f"predict_memory: blocks {sizes} do not add up to depth {config.depth}")
    tied = config.tie_embeddings and not reference  # reference frameworks: on the last stage
    table, head = pipeline_schedule(schedule, lay.stages, lay.virtual_stages, microbatches, tied)
    # a tied head of its own stage (head == count) runs on the first task
    homes = [table.stage_to_rank[s] if s < count else 0 for s in range(table.num_stages)]

    shapes = _Shapes(
        config=config, layout=lay, seq=seq, remat=remat, dtype=DTYPE_BYTES[config.dtype],
        param_bytes=DTYPE_BYTES[config.param_dtype], pack_limit=weight_bound(pack_weights),
        tokens=batch // microbatches // shards * seq, reference=reference,
    )  # fmt: skip
    param_bytes, dtype, tokens, dim = shapes.param_bytes, shapes.dtype, shapes.tokens, config.dim
    starts = [sum(sizes[:s]) for s in range(count)]
    stages = [
        _stage(shapes, range(starts[s], starts[s] + sizes[s]) if s < count else range(0),
               first=s == 0, last=s == count - 1, head=s == head)
        for s in range(table.num_stages)
    ]  # fmt: skip

    simulated = sched.simulate(table, forward_cost=1, backward_cost=2)
    activations = _held_peaks(simulated.events, stages, homes)
    tasks = []
    for rank in range(lay.stages):
        mine = [s for s in range(table.num_stages) if homes[s] == rank]
        weights = sum((stages[s].weights for s in mine), _Weights())
        params = weights.total * param_bytes / lay.fsdp
        # the gradient sums, laid out as their parameters (split over tensor, expert and fsdp;
        # docs/pipelining.md, "Gradient sums: sharded as their parameters")
        grads = weights.total * param_bytes * trainable / lay.fsdp
        state = params * trainable * OPTIMIZER_COPIES[optimizer]
        packed = weights.packed * param_bytes if lay.fsdp == 1 and not reference else 0.0
        # downstream, an activation sent and its cotangent received; upstream, a cotangent sent
        buffers = sum(2 * (s < table.num_stages - 1) + (s > 0) for s in mine)
        largest = max(stages[s].weights.total for s in mine)
        gathered = largest * param_bytes * (1 - 1 / lay.fsdp)
        if dtype != param_bytes:  # the weights cast to the compute dtype for the matmuls
            gathered += largest * dtype
        if reference and lay.fsdp > 1:  # FSDP gathers in the compute dtype: kept the step when
            # microbatches share them, else a block at a time with the next one prefetched
            block = max(_block_weights(config.block_configs[b], dim, lay, 0, 1).total
                        for s in mine for b in range(starts[s], starts[s] + sizes[s]))  # fmt: skip
            gathered = dtype * (weights.total if microbatches > 1 else 2 * block)
        if fsdp_gather == "step" and lay.fsdp > 1 and not reference:
            gathered += weights.total * param_bytes  # the stage's weights gathered once, whole
        workspace = max(_workspace(
            # a reference framework accumulates each microbatch's gradients in place
            0 if reference else stages[s].weights.total * param_bytes * trainable, stages[s],
            split=table.splits_backward and s > 0, reference=reference,
        ) for s in mine) + gathered  # fmt: skip
        in_flight = max(simulated.peak_in_flight[s] for s in mine)
        ends = (b for s in mine if s < count for b in (starts[s], starts[s] + sizes[s] - 1))
        tasks.append(StageMemory(
            task=rank,
            blocks=tuple(ends),
            parameters=round(params), gradients=round(grads), optimizer=round(state),
            packed_weights=round(packed), activations=round(activations[rank]),
            in_flight=in_flight, transfers=round(buffers * tokens * dim * dtype),
            workspace=round(workspace), update=round(2 * (params + state) + grads),
        ))  # fmt: skip
    return MemoryPrediction(
        tasks=tuple(tasks), schedule=schedule, microbatches=microbatches, remat=remat
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Change:
    """One change to a layout or its options (``option`` set to ``value``) and what it
    predicts."""

    option: str  # "fsdp_gather", "schedule", "microbatches", "remat", "fsdp" or "stages"
    value: object
    prediction: MemoryPrediction


CHANGES = ("fsdp_gather", "schedule", "microbatches", "remat", "fsdp", "stages")
"""The changes :func:`fitting_change` tries, in its order."""


def fitting_change(
    config: GPTConfig,
    layout: MemoryLayout,
    budget: int,
    *,
    changes: Sequence[str] = CHANGES,
    devices: int | None = None,
    **options: object,
) -> Change | None:
    """The first single change that brings :func:`predict_memory`'s peak (same ``options``)
    under ``budget``, tried in this order: FSDP's weights gathered in each program rather than
    once a step (``fsdp_gather="microbatch"``), a schedule with fewer microbatches in flight
    (1F1B), twice the microbatches (smaller ones), a remat policy (``dots``, then ``full``),
    a larger FSDP axis (2, 4 or 8 dividing ``data``), more stages (up to the depth, and with
    ``devices`` given, as many as the layout's other axes fit in that many devices);
    ``None`` when none does.
    ``changes``: those of :data:`CHANGES` to try.

    Example:
        >>> config = GPTConfig(vocab_size=64, dim=32, depth=4, num_heads=2, max_seq_len=16)
        >>> lay, kw = MemoryLayout(stages=2), dict(batch=64, microbatches=8, schedule="gpipe")
        >>> change = fitting_change(config, lay, 3_000_000, **kw)
        >>> change.option, change.value, change.prediction.peak < 3_000_000
        ('schedule', '1f1b', True)
    """
    tries: list[tuple[str, object, MemoryLayout, dict]] = []
    schedule, m = options.get("schedule", "1f1b"), options.get("microbatches", 1)
    if options.get("fsdp_gather") == "step" and layout.fsdp > 1:
        tries.append(("fsdp_gather", "microbatch", layout, {"fsdp_gather": "microbatch"}))
    if schedule != "1f1b":
        tries.append(("schedule", "1f1b", layout, {"schedule": "1f1b"}))
    if options["batch"] % (2 * m) == 0:
        tries.append(("microbatches", 2 * m, layout, {"microbatches": 2 * m}))
    current = options.get("remat") or config.remat
    for policy in ("dots", "full"):
        if policy != current and current != "full":
            tries.append(("remat", policy, layout, {"remat": policy}))
    for fsdp in (2, 4, 8):
        if fsdp > layout.fsdp and layout.data % fsdp == 0:
            tries.append(("fsdp", fsdp, dataclasses.replace(layout, fsdp=fsdp), {}))
    most = config.depth // layout.virtual_stages
    if devices is not None:
        most = min(most, devices // (layout.devices // layout.stages))
    more = range(layout.stages + 1, most + 1)
    tries += [("stages", k, dataclasses.replace(layout, stages=k, blocks=None), {}) for k in more]
    for option, value, lay, changed in tries:
        if option not in changes:
            continue
        try:
            prediction = predict_memory(config, lay, **{**options, **changed})
        except ValueError:  # a schedule or split this layout cannot run
            continue
        if prediction.peak <= budget:
            return Change(option=option, value=value, prediction=prediction)
    return None


def fitting_candidates(
    config: GPTConfig,
    layout: MemoryLayout,
    budget: int,
    candidates: Sequence[tuple[str, int]],
    **options: object,
) -> tuple[list[tuple[str, int]], dict[tuple[str, int], MemoryPrediction]]:
    """Which ``(schedule, microbatches)`` candidates :func:`predict_memory` (same ``options``)
    fits under ``budget``, and the predictions of those it does not (a candidate the layout
    cannot run, e.g. an interleaved schedule on one stage per task, is in neither).

    Example:
        >>> config = GPTConfig(vocab_size=64, dim=32, depth=4, num_heads=2, max_seq_len=16)
        >>> pairs = [("gpipe", 8), ("1f1b", 8), ("interleaved-1f1b", 8)]
        >>> fits, over = fitting_candidates(config, MemoryLayout(stages=2), 3_000_000, pairs,
        ...                                 batch=64)
        >>> fits, list(over)
        ([('1f1b', 8)], [('gpipe', 8)])
    """
    fits, over = [], {}
    for schedule, m in candidates:
        try:
            prediction = predict_memory(
                config, layout, **{**options, "schedule": schedule, "microbatches": m}
            )
        except ValueError:
            continue
        if prediction.peak <= budget:
            fits.append((schedule, m))
        else:
            over[(schedule, m)] = prediction
    return fits, over
