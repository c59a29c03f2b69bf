"""Packing: which results of a pipelined program travel to later programs as one buffer.

A stage's forward returns every residual its backward reads (60 for a 2-block GPT stage), and
each returned array costs the host a few microseconds per call. On a one-device task the
residuals that only later programs of the same task read can be returned concatenated, one flat
buffer per dtype, which each reader slices back: one output instead of many, with no change of
layout. Likewise a backward's running gradient sums (one per parameter) live in one flat buffer
per dtype, a bucket: the backward adds its gradients to it concatenated, one argument and one
result instead of one per parameter, and the update after the loop slices them back. This
module decides which, from a :class:`StepProgram`; the runner compiles the programs that way. A
pure pass: it compiles nothing.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax

from mmnnx.mpmd.ir import Graph
from mmnnx.mpmd.program import Recv, Run, Send, StepProgram, Zeros


@dataclasses.dataclass(frozen=True)
class Packed:
    """One flat buffer in slot ``slot``: the results of one run at ``positions`` (of its
    outputs), each ``(member slot, offset, shape)`` in ``members``, all of ``dtype``."""

    slot: int
    dtype: Any
    positions: tuple[int, ...]
    members: tuple[tuple[int, int, tuple[int, ...]], ...]

    @property
    def size(self) -> int:
        return sum(math.prod(shape) for _, _, shape in self.members)


@dataclasses.dataclass
class Packing:
    """The packed buffers of a program: by the index of the Run making them, by member, and the
    buckets of running sums by the sums (slots) of the runs adding to them (a Zeros action's
    slots). A bucket's ``positions`` are those of the results it sums in the first fragment
    adding to it (several may: a zero-bubble stage's B and W)."""

    by_run: dict[int, tuple[Packed, ...]]
    of_member: dict[int, Packed]
    num_slots: int
    buckets: dict[tuple[int, ...], tuple[Packed, ...]] = dataclasses.field(default_factory=dict)

    @property
    def buffers(self) -> list[Packed]:
        """Every packed buffer, buckets included."""
        made = [packed for made in self.by_run.values() for packed in made]
        return made + [bucket for buckets in self.buckets.values() for bucket in buckets]

    def sums(self, run: Run) -> tuple[list[int], tuple[tuple[int, ...], ...]]:
        """The sum slots ``run`` reads and returns updated (a bucket once for all its members),
        and for each the positions of the fragment's results added to it: one for a sum of its
        own, several (concatenated) for a bucket."""
        buckets = self.buckets.get(run.sums, ())
        bucketed = {s for bucket in buckets for s, _, _ in bucket.members}
        position = dict(zip(run.sums, run.summed, strict=True))  # fragments adding differ
        pairs = [(s, (position[s],)) for s in run.sums if s not in bucketed]
        pairs += [(b.slot, tuple(position[s] for s, _, _ in b.members)) for b in buckets]
        return [s for s, _ in pairs], tuple(group for _, group in pairs)

    def zeros(self, zeros: Zeros) -> list[tuple[int, tuple[int, ...], Any, Any]]:
        """``(slot, shape, dtype, sharding)`` of each buffer ``zeros`` starts: its sums, a bucket
        once for all its members (flat, on the task)."""
        buckets = self.buckets.get(zeros.slots, ())
        bucketed = {s for bucket in buckets for s, _, _ in bucket.members}
        made = [
            (s, tuple(shape), dtype, sharding)
            for s, shape, dtype, sharding in zip(
                zeros.slots, zeros.shapes, zeros.dtypes, zeros.shardings, strict=True
            )
            if s not in bucketed
        ]
        return made + [(b.slot, (b.size,), b.dtype, zeros.task.sharding()) for b in buckets]

    def inputs(self, run: Run) -> tuple[list[int], tuple | None, dict[int, Packed]]:
        """The slots ``run`` reads (a packed buffer once for all its members); how to find each
        of the fragment's inputs among them, ``(argument, offset, shape)`` with offset ``None``
        for the argument itself (``None`` when nothing is packed); and the packed buffers among
        the arguments, by position."""
        if not any(s in self.of_member for s in run.ins):
            return list(run.ins), None, {}
        args: list[int] = []
        where: list[tuple[int, int | None, tuple[int, ...]]] = []
        packed_args: dict[int, Packed] = {}
        for s in run.ins:
            packed = self.of_member.get(s)
            slot = s if packed is None else packed.slot
            if slot not in args:
                args.append(slot)
            k = args.index(slot)
            if packed is None:
                where.append((k, None, ()))
            else:
                _, offset, shape = next(m for m in packed.members if m[0] == s)
                where.append((k, offset, shape))
                packed_args[k] = packed
        return args, tuple(where), packed_args

    def released(self, slots: Sequence[int], remaining: dict[int, int]) -> list[int]:
        """``slots`` (a Release's) with members replaced by their buffer once its last member
        goes (``remaining``: members left per buffer, updated)."""
        out = []
        for s in slots:
            packed = self.of_member.get(s)
            if packed is None:
                out.append(s)
                continue
            remaining[packed.slot] -= 1
            if remaining[packed.slot] == 0:
                out.append(packed.slot)
        return out


def unpacked_outputs(run: Run, packs: Sequence[Packed]) -> list[int]:
    """The positions of ``run``'s results that its program returns as they are: those it
    returns (not only added to a sum) and does not pack into one of ``packs``."""
    packed = {p for pk in packs for p in pk.positions}
    return [i for i, s in enumerate(run.outs) if s is not None and i not in packed]


def plan_packing(program: StepProgram, graph: Graph) -> Packing:
    """Packs, per Run of a pipelined microbatch on a one-device task, the results of one dtype
    (two or more) that only runs of other fragments on that task read, in every microbatch alike
    (so each fragment keeps one compiled program). Values that a transfer, a running sum or the
    step's outputs read, and extended dtypes (PRNG keys), are left alone.

    Buckets, per Zeros action on a one-device task whose sums only one fragment adds to: the
    sums of one dtype (two or more) that only programs read (no transfer, no step output, no
    donation)."""
    actions = program.actions
    readers: dict[int, list[Run | None]] = {}  # None: a transfer or the step's outputs
    summed: set[int] = set()
    for a in actions:
        if isinstance(a, Run):
            for s in a.ins:
                readers.setdefault(s, []).append(a)
            summed.update(a.sums)
        elif isinstance(a, Recv):
            readers.setdefault(a.from_slot, []).append(None)
        elif isinstance(a, Send):
            readers.setdefault(a.slot, []).append(None)
    for slot, _, _ in program.outputs:
        if slot is not None:
            readers.setdefault(slot, []).append(None)

    def packable(run: Run, position: int) -> bool:
        slot = run.outs[position]
        value = run.fragment.out_ids[position]
        reads = readers.get(slot, [])
        return (
            bool(reads)
            and slot not in summed
            and all(
                r is not None
                and r.fragment is not run.fragment
                and r.microbatch is not None
                and not r.donate
                for r in reads
            )
            and not jax.dtypes.issubdtype(graph.dtypes[value], jax.dtypes.extended)
        )

    runs = [
        (i, a)
        for i, a in enumerate(actions)
        if isinstance(a, Run) and a.microbatch is not None and a.task.jax_mesh.devices.size == 1
    ]
    positions: dict[int, set[int]] = {}  # fragment id -> output positions packable every time
    for _, run in runs:
        here = {p for p, s in enumerate(run.outs) if s is not None and packable(run, p)}
        key = id(run.fragment)
        positions[key] = positions[key] & here if key in positions else here
    by_run: dict[int, tuple[Packed, ...]] = {}
    of_member: dict[int, Packed] = {}
    next_slot = program.num_slots
    for i, run in runs:
        groups: dict[Any, list[int]] = {}
        for p in sorted(positions[id(run.fragment)]):
            groups.setdefault(graph.dtypes[run.fragment.out_ids[p]], []).append(p)
        made = []
        for dtype, group in groups.items():
            if len(group) < 2:
                continue
            members, offset = [], 0
            for p in group:
                shape = tuple(graph.shapes[run.fragment.out_ids[p]])
                members.append((run.outs[p], offset, shape))
                offset += math.prod(shape)
            packed = Packed(next_slot, dtype, tuple(group), tuple(members))
            next_slot += 1
            made.append(packed)
            of_member.update({s: packed for s, _, _ in members})
        if made:
            by_run[i] = tuple(made)
    buckets: dict[tuple[int, ...], tuple[Packed, ...]] = {}
    for zeros in actions:
        if not isinstance(zeros, Zeros) or zeros.task.jax_mesh.devices.size != 1:
            continue
        adders = [a for a in actions if isinstance(a, Run) and set(a.sums) & set(zeros.slots)]
        if not adders or any(a.sums != zeros.slots for a in adders):
            continue  # another fragment adds to one of these sums too: leave them alone
        run = adders[0]
        groups = {}
        for s, p, shape, dtype in zip(
            zeros.slots, run.summed, zeros.shapes, zeros.dtypes, strict=True
        ):
            reads = readers.get(s, [])
            plain = not jax.dtypes.issubdtype(dtype, jax.dtypes.extended)
            if plain and reads and all(r is not None and not r.donate for r in reads):
                groups.setdefault(dtype, []).append((s, p, tuple(shape)))
        made = []
        for dtype, group in groups.items():
            if len(group) < 2:
                continue
            members, offset = [], 0
            for s, _, shape in group:
                members.append((s, offset, shape))
                offset += math.prod(shape)
            bucket = Packed(next_slot, dtype, tuple(p for _, p, _ in group), tuple(members))
            next_slot += 1
            made.append(bucket)
            of_member.update({s: bucket for s, _, _ in members})
        if made:
            buckets[zeros.slots] = tuple(made)
    return Packing(by_run, of_member, next_slot, buckets)


def no_packing(program: StepProgram) -> Packing:
    """A program run as lowered: nothing packed."""
    return Packing({}, {}, program.num_slots)
