"""Packing: which results of a pipelined program travel to later programs as one buffer.

A stage's forward returns every residual its backward reads (60 for a 2-block GPT stage), and
each returned array costs the host a few microseconds per call. On a one-device task the
residuals that only later programs of the same task read can be returned concatenated, one flat
buffer per dtype, which each reader slices back: one output instead of many, with no change of
layout. This module decides which, from a :class:`StepProgram`; the runner compiles the programs
that way. A pure pass: it compiles nothing.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax

from mmnnx.mpmd.ir import Graph
from mmnnx.mpmd.program import Recv, Run, Send, StepProgram


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
    """The packed buffers of a program: by the index of the Run making them, and by member."""

    by_run: dict[int, tuple[Packed, ...]]
    of_member: dict[int, Packed]
    num_slots: int

    @property
    def buffers(self) -> list[Packed]:
        """Every packed buffer."""
        return [packed for made in self.by_run.values() for packed in made]

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
    step's outputs read, and extended dtypes (PRNG keys), are left alone."""
    actions = program.actions
    readers: dict[int, list[Run | None]] = {}
    for a in actions:
        if isinstance(a, Run):
            for s in a.ins:
                readers.setdefault(s, []).append(a)
            for s in a.sums:
                readers.setdefault(s, []).append(None)
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
    return Packing(by_run, of_member, next_slot)


def no_packing(program: StepProgram) -> Packing:
    """A program run as lowered: nothing packed."""
    return Packing({}, {}, program.num_slots)
