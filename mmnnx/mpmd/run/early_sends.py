"""Offering a value to another process as soon as it is made, not when its reader's turn comes.

A process waits for a value it receives before launching its reader, so a send left at its
reader's turn waits on everything its process waits for first (under 1F1B over two processes,
the ranks would take turns instead of overlapping). Each send moves up to right after the step
making its value, never past an earlier send to the same peer (messages are matched by order);
its releases stay where they were. A send that first gathers its value over a source spanning
processes stays at its turn: that gather is a program every process of the source must run at the
same point among the source's other programs, and how far a send could move depends on this
process's peers, which differ between them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def send_early(steps: Sequence[Any], cross: type, writes: Any) -> list[Any]:
    """``steps`` with each ``cross`` step that only sends, and gathers nothing over processes,
    moved up to right after the last earlier step writing its source slot (``writes(step)``) or
    sending to one of its peers."""
    out: list[Any] = []
    last_write: dict[int, int] = {}  # slot -> index in ``out`` of the step that wrote it last
    last_send: dict[int, int] = {}  # peer -> index in ``out`` of the last send to it
    for step in steps:
        route = step.route if type(step) is cross else None
        if route is not None and route.sends and not route.receives and not route.gathers:
            peers = step.route.outgoing_peers
            after = max([last_write.get(step.source, -1), *(last_send.get(p, -1) for p in peers)])
            if after + 1 < len(out) and step.drop:
                out[-1].drop = (*out[-1].drop, *step.drop)  # released where it was
                step.drop = ()
            at = after + 1
            out.insert(at, step)
            _shift(last_write, at)
            _shift(last_send, at)
            for p in peers:
                last_send[p] = at
            continue
        for slot in writes(step):
            last_write[slot] = len(out)
        if type(step) is cross and step.route.sends:
            for p in step.route.outgoing_peers:
                last_send[p] = len(out)
        out.append(step)
    return out


def _shift(positions: dict[int, int], inserted_at: int) -> None:
    """``positions`` after a step was inserted at ``inserted_at``."""
    for key, at in positions.items():
        if at >= inserted_at:
            positions[key] = at + 1
