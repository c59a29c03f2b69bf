"""Packing: which values of a pipelined step travel between programs as one buffer.

Each array a program takes or returns costs the host up to a few microseconds per call. Values
whole on each device of their task can travel concatenated, one flat buffer per dtype, which
each reader slices back: running sums (a stage's gradients) always, and residuals that only
later programs of the same task read, up to ``mm.jit(pack_residuals=...)`` bytes each (by
default :data:`PACK_RESIDUAL_BYTES`), and block weights up to ``pack_weights`` bytes.

The ``pack`` pass decides which, from a lowered :class:`StepProgram`, and returns the program
that runs them packed (:class:`~.program.PackWeights`, :class:`~.program.Zeros`, offsets as
:class:`~.program.Constant` actions, each :class:`~.program.Run`'s
:class:`~.program.RunPacking`). It compiles nothing.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax

from mmnnx.mpmd.ir import Graph
from mmnnx.mpmd.lower.localize import processes_of
from mmnnx.mpmd.lower.program import (
    Action,
    Buffer,
    Constant,
    InputRead,
    Member,
    Output,
    PackWeights,
    Recv,
    Run,
    RunPacking,
    Send,
    StepProgram,
    SumArg,
    Zeros,
)
from mmnnx.mpmd.primitives import is_gathered
from mmnnx.mpmd.step_io import StepInput
from mmnnx.sharding.specs import itemsize

_MAX_PACKED = 2**31 - 1  # elements: programs take the offsets into a buffer as int32
_MAX_BYTES = 2**63 - 1  # no bound on a packed residual's size

PACK_RESIDUAL_BYTES = 64 * 2**10
"""The largest residual ``mm.jit`` packs by default, in bytes. Smaller arrays cost the host more
per launch (a few microseconds each) than copying them into the buffer costs the device; the
larger ones travel alone, so packing never holds a second copy of a large activation."""


def residual_bound(pack_residuals: bool | int) -> int:
    """The largest residual, in bytes, packed for ``mm.jit(pack_residuals=...)``: ``True``,
    every one; ``False``, none; a number, those of at most that many bytes.

    Example:
        >>> residual_bound(False), residual_bound(4096)
        (0, 4096)
    """
    return _bound(pack_residuals, "pack_residuals", "residual", PACK_RESIDUAL_BYTES)


PACK_WEIGHT_BYTES = PACK_RESIDUAL_BYTES
"""The largest weight ``mm.jit`` packs by default, in bytes (see :func:`weight_bound`)."""


def weight_bound(pack_weights: bool | int) -> int:
    """The largest weight, in bytes, packed for ``mm.jit(pack_weights=...)``: ``True``, every
    one; ``False``, none; a number, those of at most that many bytes.

    Example:
        >>> weight_bound(True) > 2**40, weight_bound(0)
        (True, 0)
    """
    return _bound(pack_weights, "pack_weights", "weight", PACK_WEIGHT_BYTES)


def _bound(value: bool | int, option: str, what: str, default: int) -> int:
    if value is True:
        return _MAX_BYTES
    if value is False:
        return 0
    if isinstance(value, int) and value >= 0:
        return value
    raise TypeError(
        f"mm.jit: {option} must be True, False or a number of bytes (the largest {what} "
        f"packed; default {default}), got {value!r}"
    )


@dataclasses.dataclass
class Packing:
    """What to pack in a lowered program: buffers by the index of the action making them, by member,
    and weight buffers by task."""

    by_run: dict[int, tuple[Buffer, ...]]
    of_member: dict[int, Buffer]
    num_slots: int
    by_zeros: dict[int, tuple[Buffer, ...]] = dataclasses.field(default_factory=dict)
    # Weights: per task, the buffers a program at the step's start packs from step inputs, which
    # the pipelined runs (of one microbatch) read instead of the inputs; other readers do not.
    weights: dict[Any, tuple[Buffer, ...]] = dataclasses.field(default_factory=dict)
    of_weight: dict[int, Buffer] = dataclasses.field(default_factory=dict)

    @property
    def buffers(self) -> list[Buffer]:
        """Every packed buffer."""
        made = (*self.by_run.values(), *self.by_zeros.values(), *self.weights.values())
        return [packed for buffers in made for packed in buffers]

    def zeros(self, index: int, action: Zeros) -> Zeros:
        """The :class:`Zeros` action at ``index``: its unpacked sums, then one buffer per packed
        group."""
        packs = self.by_zeros.get(index, ())
        if not packs:
            return action
        packed = {m.slot for pk in packs for m in pk.members}
        kept = [i for i, slot in enumerate(action.slots) if slot not in packed]
        return Zeros(
            task=action.task,
            slots=tuple([action.slots[i] for i in kept] + [pk.slot for pk in packs]),
            shapes=tuple([action.shapes[i] for i in kept] + [(pk.size,) for pk in packs]),
            dtypes=tuple([action.dtypes[i] for i in kept] + [pk.dtype for pk in packs]),
            shardings=tuple(
                [action.shardings[i] for i in kept] + [action.task.sharding() for _ in packs]
            ),
        )

    def sums(self, run: Run) -> tuple[SumArg, ...]:
        """The running sums ``run`` reads and returns: a packed buffer once for all its members."""
        position = dict(zip(run.sums, run.summed, strict=True))
        sums: list[SumArg] = []
        for s in run.sums:
            packed = self.of_member.get(s)
            if packed is None:
                sums.append(SumArg(slot=s, positions=(position[s],)))
            elif all(a.slot != packed.slot for a in sums):
                positions = tuple(position[m.slot] for m in packed.members)
                sums.append(SumArg(slot=packed.slot, positions=positions, buffer=packed))
        return tuple(sums)

    def inputs(self, run: Run) -> tuple[tuple[int, ...], tuple[InputRead, ...], dict[int, Buffer]]:
        """The slots ``run`` reads (a packed buffer once), where each fragment input is among them,
        and the packed buffers among them by position."""
        args: list[int] = []
        reads: list[InputRead] = []
        packed_args: dict[int, Buffer] = {}
        for s in run.ins:
            packed = self.of_member.get(s)
            if packed is None and run.microbatch is not None:
                packed = self.of_weight.get(s)
            slot = s if packed is None else packed.slot
            if slot not in args:
                args.append(slot)
            k = args.index(slot)
            reads.append(InputRead(arg=k, member=packed and packed.member_of[s]))
            if packed is not None:
                packed_args[k] = packed
        return tuple(args), tuple(reads), packed_args


def slice_offsets(reads: Sequence[InputRead], buffers: dict[int, Buffer]) -> list[int]:
    """The distinct offsets a program takes as arguments to slice members out of its packed
    arguments: each member's block's base (:meth:`Buffer.base_of`); a ``fixed`` buffer's are in the
    program.

    Example:
        >>> two_blocks = (Member(1, 0, (2,)), Member(2, 2, (3,)), Member(3, 5, (2,)),
        ...               Member(4, 7, (3,)))
        >>> packed = Buffer(9, "float32", two_blocks, bases=(0, 5))
        >>> slice_offsets([InputRead(0, m) for m in two_blocks], {0: packed})
        [0, 5]
    """
    return sorted(
        {
            buffers[read.arg].base_of(read.member.offset)
            for read in reads
            if read.member is not None and not buffers[read.arg].fixed
        }
    )


def pack(
    program: StepProgram,
    graph: Graph,
    *,
    residual_bytes: int = _MAX_BYTES,
    weight_bytes: int = 0,
    inputs: Sequence[StepInput] = (),
) -> StepProgram:
    """The pass: ``program`` with the running sums (:func:`_sum_packing`), residuals of at most
    ``residual_bytes`` (:func:`_residual_packing`) and block weights of at most ``weight_bytes``
    (:func:`_weight_packing`, blocks found by the paths of the step's ``inputs``) travelling as
    flat buffers."""
    input_names = [i.name for i in inputs]
    readers = _readers(program)
    packing = (
        _residual_packing(program, graph, residual_bytes, input_names, readers)
        if residual_bytes
        else Packing({}, {}, program.num_slots)
    )
    packing = _sum_packing(program, graph, packing, readers)
    if weight_bytes and input_names:
        packing = _weight_packing(program, graph, packing, weight_bytes, input_names, readers)
    if not packing.buffers:
        return program
    shardings = [*program.shardings, *[None] * (packing.num_slots - program.num_slots)]
    actions: list[Action] = []
    for task, buffers in packing.weights.items():  # made first: no run reads them before
        for buffer in buffers:
            shardings[buffer.slot] = task.sharding()
        actions.append(PackWeights(task=task, buffers=buffers))
    offset_slots: dict[tuple[Any, int], int] = {}
    constants: list[Constant] = []  # put before the step, with the weights
    for i, action in enumerate(program.actions):
        if isinstance(action, Zeros):
            action = packing.zeros(i, action)
            for slot, sharding in zip(action.slots, action.shardings, strict=True):
                shardings[slot] = sharding
        elif isinstance(action, Run):
            args, reads, buffers = packing.inputs(action)
            sums = packing.sums(action)
            packs = packing.by_run.get(i, ())
            if buffers or packs or any(s.buffer is not None for s in sums):
                for buffer in packs:
                    shardings[buffer.slot] = action.task.sharding()
                offsets = []
                for value in slice_offsets(reads, buffers):
                    slot = offset_slots.get((action.task, value))
                    if slot is None:
                        slot = offset_slots[(action.task, value)] = len(shardings)
                        shardings.append(action.task.sharding())
                        constants.append(Constant(slot=slot, task=action.task, value=value))
                    offsets.append((slot, value))
                action = dataclasses.replace(
                    action,
                    packing=RunPacking(
                        args=args,
                        reads=reads,
                        buffers=tuple(sorted(buffers.items())),
                        packs=tuple(packs),
                        sums=sums,
                        offsets=tuple(offsets),
                    ),
                )
        actions.append(action)
    activations = dict(program.activations)
    for buffer in packing.buffers:
        first = buffer.members[0].slot
        if first in program.activations:
            activations[buffer.slot] = program.activations[first]
    weights = len(packing.weights)
    actions = [*actions[:weights], *constants, *actions[weights:]]
    return program.replace(
        actions=tuple(actions), shardings=tuple(shardings), activations=activations
    )


def block_of(path: str) -> tuple[str, str] | None:
    """A Variable's block and its path inside it: the path up to its first index (a layer of a
    list), and the rest; ``None`` for a path without one.

    Example:
        >>> block_of("arg0/blocks/3/attn/kernel"), block_of("arg0/head/kernel")
        (('arg0/blocks/3', 'attn/kernel'), None)
    """
    parts = path.split("/")
    for i, part in enumerate(parts[:-1]):
        if i and part.isdigit():
            return "/".join(parts[: i + 1]), "/".join(parts[i + 1 :])
    return None


def _weight_packing(
    program: StepProgram,
    graph: Graph,
    packing: Packing,
    weight_bytes: int,
    input_names: Sequence[str],
    readers: dict[int, list[Run | None]],
) -> Packing:
    """Adds to ``packing``, per task and block, one buffer per dtype of the step inputs of at most
    ``weight_bytes`` that pipelined runs on that task alone read, more than once, without donating.
    Members go in the order of their paths in the block, so blocks alike are laid out alike."""
    groups: dict[tuple, list[tuple[str, int, tuple[int, ...]]]] = {}
    seen: set[int] = set()
    for slot, leaf in program.inputs:
        if slot in seen or leaf >= len(input_names):
            continue
        seen.add(slot)
        where = block_of(input_names[leaf])
        runs = [r for r in readers.get(slot, []) if r is not None and r.microbatch is not None]
        if where is None or len(runs) < 2 or len({r.task for r in runs}) != 1:
            continue
        task, value = runs[0].task, graph.inputs[leaf]
        dtype, shape = graph.dtypes[value], graph.shapes[value]
        if (
            not _packs_on(task, program.shardings[slot])
            or any(slot in {r.ins[d] for d in r.donate} for r in runs)
            or jax.dtypes.issubdtype(dtype, jax.dtypes.extended)
            or math.prod(shape) * itemsize(dtype) > weight_bytes
        ):
            continue
        groups.setdefault((task, where[0], dtype), []).append((where[1], slot, shape))
    next_slot = packing.num_slots
    for (task, _, dtype), members in groups.items():
        members.sort()
        packed = _buffer(next_slot, dtype, (), [(slot, shape) for _, slot, shape in members])
        if packed is not None:
            packed = dataclasses.replace(packed, fixed=True)
            next_slot += 1
            packing.weights[task] = (*packing.weights.get(task, ()), packed)
            packing.of_weight.update({m.slot: packed for m in packed.members})
    packing.num_slots = next_slot
    return packing


def _readers(program: StepProgram) -> dict[int, list[Run | None]]:
    """The Runs reading each slot as an argument; ``None`` for any other reader."""
    readers: dict[int, list[Run | None]] = {}
    for a in program.actions:
        if isinstance(a, Run):
            for s in a.ins:
                readers.setdefault(s, []).append(a)
            for s in a.sums:
                readers.setdefault(s, []).append(None)
        elif isinstance(a, Recv):
            readers.setdefault(a.from_slot, []).append(None)
        elif isinstance(a, Send):
            readers.setdefault(a.slot, []).append(None)
    for output in program.outputs:
        if isinstance(output, Output):
            readers.setdefault(output.slot, []).append(None)
    return readers


def _sum_packing(
    program: StepProgram, graph: Graph, packing: Packing, readers: dict[int, list[Run | None]]
) -> Packing:
    """Adds to ``packing`` the running sums of each :class:`Zeros` action, whole on its task, that
    only Runs on its task read, without donating, other than those gathering an output (each
    microbatch writes its own rows): one buffer per dtype and set of Runs adding to them."""
    gathered_values = {op.ins[0] for op in graph.ops if is_gathered(op)}
    adders: dict[int, list[int]] = {}
    gathered: set[int] = set()
    for i, a in enumerate(program.actions):
        if isinstance(a, Run):
            for s, position in zip(a.sums, a.summed, strict=True):
                adders.setdefault(s, []).append(i)
                if a.fragment.out_ids[position] in gathered_values:
                    gathered.add(s)

    def packable(slot: int, dtype: Any, task: Any) -> bool:
        reads = [r for r in readers.get(slot, []) if r is not None]
        return (
            slot not in gathered
            and len(reads) == len(readers.get(slot, [])) - len(adders.get(slot, []))
            and all(r.task == task and slot not in {r.ins[d] for d in r.donate} for r in reads)
            and not jax.dtypes.issubdtype(dtype, jax.dtypes.extended)
        )

    next_slot = packing.num_slots
    for i, action in enumerate(program.actions):
        if not isinstance(action, Zeros) or len(processes_of(action.task)) != 1:
            continue
        groups: dict[tuple, list[int]] = {}
        for k, (slot, dtype) in enumerate(zip(action.slots, action.dtypes, strict=True)):
            if packable(slot, dtype, action.task) and _whole(action.shardings[k], action.task):
                groups.setdefault((dtype, tuple(adders.get(slot, ()))), []).append(k)
        made = []
        for (dtype, _), group in groups.items():
            members = [(action.slots[k], action.shapes[k]) for k in group]
            packed = _buffer(next_slot, dtype, (), members)
            if packed is not None:
                next_slot += 1
                made.append(packed)
                packing.of_member.update({m.slot: packed for m in packed.members})
        if made:
            packing.by_zeros[i] = tuple(made)
    packing.num_slots = next_slot
    return packing


def _packs_on(task: Any, sharding: Any) -> bool:
    """Whether a value laid out as ``sharding`` may travel in a flat buffer of ``task``."""
    return _whole(sharding, task) and len(processes_of(task)) == 1


def _whole(sharding: Any, task: Any) -> bool:
    """Whether a value laid out as ``sharding`` is whole on each of ``task``'s devices."""
    if task.jax_mesh.devices.size == 1:
        return True
    return sharding is not None and sharding.is_fully_replicated


def _residual_packing(
    program: StepProgram,
    graph: Graph,
    residual_bytes: int,
    input_names: Sequence[str],
    readers: dict[int, list[Run | None]],
) -> Packing:
    """Packs, per pipelined Run, its results of one dtype (two or more) of at most
    ``residual_bytes``, whole on its task, that only later runs of other fragments on that task
    read, alike in every microbatch. Each block's results (:func:`_output_blocks`) go one after the
    other from a base of their own."""
    actions = program.actions
    weight_blocks = {  # the block of each step input under a list index
        v: where[0]
        for v, name in zip(graph.inputs, input_names, strict=False)
        if (where := block_of(name)) is not None
    }

    def packable(run: Run, position: int) -> bool:
        slot = run.outs[position]
        value = run.fragment.out_ids[position]
        reads = readers.get(slot, [])
        return (
            bool(reads)
            and all(
                r is not None
                and r.fragment is not run.fragment
                and not _parts_of_one(r, run)
                and r.microbatch is not None
                and not r.donate
                for r in reads
            )
            and not jax.dtypes.issubdtype(graph.dtypes[value], jax.dtypes.extended)
            and math.prod(graph.shapes[value]) * itemsize(graph.dtypes[value]) <= residual_bytes
            and _packs_on(run.task, program.shardings[slot])
        )

    runs = [
        (i, a)
        for i, a in enumerate(actions)
        if isinstance(a, Run) and a.microbatch is not None and len(processes_of(a.task)) == 1
    ]
    positions: dict[int, set[int]] = {}  # fragment id -> output positions packable every time
    for _, run in runs:
        here = {p for p, s in enumerate(run.outs) if s is not None and packable(run, p)}
        key = id(run.fragment)
        positions[key] = positions[key] & here if key in positions else here
    by_run: dict[int, tuple[Buffer, ...]] = {}
    of_member: dict[int, Buffer] = {}
    next_slot = program.num_slots
    blocks: dict[int, dict[int, int]] = {}
    for i, run in runs:
        block = blocks.get(id(run.fragment))
        if block is None:
            block = blocks[id(run.fragment)] = _output_blocks(run.fragment, weight_blocks)
        groups: dict[Any, list[int]] = {}
        for p in sorted(positions[id(run.fragment)], key=lambda p: _place(run, graph, block, p)):
            groups.setdefault(graph.dtypes[run.fragment.out_ids[p]], []).append(p)
        made = []
        for dtype, group in groups.items():
            members = [(run.outs[p], graph.shapes[run.fragment.out_ids[p]]) for p in group]
            packed = _buffer(next_slot, dtype, tuple(group), members)
            if packed is not None:
                starts: dict[int, int] = {}
                for p, member in zip(group, packed.members, strict=True):
                    if p in block:
                        starts.setdefault(block[p], member.offset)
                packed = dataclasses.replace(packed, bases=tuple(sorted(starts.values())))
                next_slot += 1
                made.append(packed)
                of_member.update({m.slot: packed for m in packed.members})
        if made:
            by_run[i] = tuple(made)
    return Packing(by_run, of_member, next_slot)


def _parts_of_one(run: Run, other: Run) -> bool:
    """Whether ``run`` and ``other`` run parts of one stage fragment (``share_cores``)."""
    return (
        run.label is not None
        and other.label is not None
        and run.label[:3] == other.label[:3]
        and run.microbatch == other.microbatch
    )


def _place(run: Run, graph: Graph, block: dict[int, int], position: int) -> tuple:
    """Where ``run``'s result at ``position`` goes in its buffer: those in no block first, then by
    block and shape, so that blocks alike are laid out alike."""
    if position not in block:
        return (-1, (), position)
    return (block[position], graph.shapes[run.fragment.out_ids[position]], position)


def _output_blocks(fragment: Any, weight_blocks: dict[int, str]) -> dict[int, int]:
    """The block (numbered in the order the fragment reads them) each of ``fragment``'s results
    belongs to: that of the first block weight read by the op making it or after it."""
    read_by = [
        next((weight_blocks[a] for a in op.ins if isinstance(a, int) and a in weight_blocks), None)
        for op in fragment.ops
    ]
    number: dict[str, int] = {}
    for block in read_by:
        if block is not None:
            number.setdefault(block, len(number))
    block_of_value: dict[int, int] = {}
    current = None
    for op, block in zip(reversed(fragment.ops), reversed(read_by), strict=True):
        current = number[block] if block is not None else current
        if current is not None:
            block_of_value.update(dict.fromkeys(op.outs, current))
    return {p: block_of_value[v] for p, v in enumerate(fragment.out_ids) if v in block_of_value}


def _buffer(
    slot: int, dtype: Any, positions: tuple[int, ...], members: Sequence[tuple[int, tuple]]
) -> Buffer | None:
    """The buffer in ``slot`` holding ``members`` one after the other, or ``None`` if fewer than two
    or too large for int32 offsets."""
    if len(members) < 2 or sum(math.prod(shape) for _, shape in members) > _MAX_PACKED:
        return None
    at, offset = [], 0
    for member, shape in members:
        at.append(Member(slot=member, offset=offset, shape=tuple(shape)))
        offset += math.prod(shape)
    return Buffer(slot=slot, dtype=dtype, members=tuple(at), positions=positions)
