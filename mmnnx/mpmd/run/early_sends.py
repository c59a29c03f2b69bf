"""Offering a value to another process as soon as it is made, not when its reader's turn comes.

Every process walks one step's transfers in the same order (the order of the actions that read
them), and a process that receives a value waits for it before it launches what reads it. Left
at its reader's turn, a send therefore waits on everything the sending process waits for first:
under 1F1B over two processes, stage 0 offers microbatch 1's activation only after it has
received microbatch 0's cotangent, which stage 1 makes after its forward and backward of
microbatch 0, so stage 1 sits idle in between (the ranks take turns instead of overlapping).

Here each of this process's sends moves up to right after the step that makes its value (an
offer returns at once and keeps the buffers alive until the peer pulls them). Messages between
two processes are matched by order (the n-th send to a peer is its n-th receive), so a send
never passes an earlier send to the same peer. The values the send released stay released where
it was: a step between its new place and its old one may still read them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def send_early(steps: Sequence[Any], cross: type, writes: Any) -> list[Any]:
    """``steps`` with each step of kind ``cross`` that only sends (this process holds part of
    its value's source and none of its target) moved up to right after the last earlier step
    that writes its source slot (``writes(step)``: the slots a step writes) or sends to one of
    the same peers, whichever comes later."""
    out: list[Any] = []
    last_write: dict[int, int] = {}  # slot -> index in ``out`` of the step that wrote it last
    last_send: dict[int, int] = {}  # peer -> index in ``out`` of the last send to it
    for step in steps:
        if type(step) is cross and step.route.sends and not step.route.receives:
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
