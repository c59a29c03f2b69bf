"""How long a value takes to cross from one rank to another: a latency plus its bytes over a
bandwidth, fitted to measured copies (``mmnnx.link_timing`` measures them), and the transfer
costs of a schedule's stage boundaries over such links."""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping, Sequence

from mmnnx.mpmd.schedules.ir import KINDS, Schedule, check_action_key


@dataclasses.dataclass(frozen=True)
class Link:
    """A one-way connection between two ranks: ``latency`` seconds per value plus ``bandwidth``
    bytes per second; :meth:`fit` fits one to measured copies.

    Example:
        >>> Link.fit([1_000, 1_001_000], [21e-6, 1021e-6])
        Link(latency=2e-05, bandwidth=1000000000.0)
    """

    latency: float
    bandwidth: float

    def __post_init__(self):
        if not self.latency >= 0:
            raise ValueError(f"Link: latency must be >= 0 seconds, got {self.latency!r}")
        if not self.bandwidth > 0:
            raise ValueError(f"Link: bandwidth must be > 0 bytes/s, got {self.bandwidth!r}")

    def seconds(self, nbytes: float) -> float:
        """The time a value of ``nbytes`` takes over this link."""
        return self.latency + nbytes / self.bandwidth

    @classmethod
    def fit(cls, sizes: Sequence[float], seconds: Sequence[float]) -> Link:
        """The least-squares line through ``(bytes, seconds)`` measurements (at least two
        distinct sizes), its intercept clipped at 0 and its slope at a positive floor."""
        if len(sizes) != len(seconds) or len(set(sizes)) < 2:
            raise ValueError(
                f"Link.fit: needs measurements at two or more distinct sizes, got {list(sizes)}"
            )
        n = len(sizes)
        mean_x, mean_y = sum(sizes) / n, sum(seconds) / n
        var = sum((x - mean_x) ** 2 for x in sizes)
        slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(sizes, seconds, strict=True)) / var
        slope = max(slope, 1e-15)
        latency = max(mean_y - slope * mean_x, 0.0)
        return cls(latency=round(latency, 12), bandwidth=round(1 / slope, 3))


def _reader_stage(kind: str, stage: int) -> int | None:
    """The stage that reads the result of action ``(kind, stage)``: a forward's activations go
    to the next stage, a backward's (or input-gradient half's) gradient to the one before; a
    weight-gradient half sends nothing."""
    if kind == "F":
        return stage + 1
    if kind in "BI":
        return stage - 1
    return None


def transfer_costs(
    schedule: Schedule,
    links: Mapping[tuple[int, int], Link],
    nbytes: Mapping[str | tuple[str, int], float],
) -> dict[tuple[str, int], float]:
    """The seconds each action's result takes to reach the stage that reads it, as
    :func:`~mmnnx.mpmd.schedules.simulate`'s ``transfer_costs`` takes them.

    ``links[(a, b)]``: the :class:`Link` from rank ``a`` to rank ``b`` (one way serves both).
    ``nbytes`` maps ``(kind, stage)``, or a kind, to the bytes that action sends per microbatch:
    ``("F", s)`` to stage ``s + 1``, ``("B", s)`` or ``("I", s)`` to stage ``s - 1``
    (``mm.schedules.boundary_bytes`` reads them off a step's plan). A reader on the producer's rank
    costs nothing; a key naming no rank pair or action, a bad value, or a missing link or size
    raises a ValueError.

    Example:
        >>> from mmnnx.mpmd.schedules import Link, one_f_one_b, transfer_costs
        >>> transfer_costs(one_f_one_b(2, 4), {(0, 1): Link(0.25, 4.0)}, {"F": 1, "B": 3})
        {('F', 0): 0.5, ('B', 1): 1.0}
    """
    ranks = schedule.num_ranks
    for key, link in links.items():
        if not (
            isinstance(key, tuple)
            and len(key) == 2
            and all(isinstance(r, numbers.Integral) and 0 <= r < ranks for r in key)
            and key[0] != key[1]
        ):
            raise ValueError(
                f"transfer_costs: links key {key!r} is not a pair of two distinct ranks of a "
                f"schedule of {ranks} ranks (0 to {ranks - 1})"
            )
        if not isinstance(link, Link):
            raise ValueError(f"transfer_costs: links[{key!r}] must be a Link, got {link!r}")
    for key, value in nbytes.items():
        check_action_key(schedule, key, "transfer_costs: nbytes")
        if not (isinstance(value, numbers.Real) and value >= 0):
            raise ValueError(
                f"transfer_costs: nbytes[{key!r}] must be a number >= 0, got {value!r}"
            )
    costs: dict[tuple[str, int], float] = {}
    present = {(a.kind, a.stage) for row in schedule.actions for a in row}
    for kind, stage in sorted(present, key=lambda ks: (ks[1], KINDS.index(ks[0]))):
        reader = _reader_stage(kind, stage)
        if reader is None or not 0 <= reader < schedule.num_stages:
            continue
        pair = (schedule.stage_to_rank[stage], schedule.stage_to_rank[reader])
        if pair[0] == pair[1]:
            continue
        link = links.get(pair, links.get(pair[::-1]))
        if link is None:
            raise ValueError(
                f"transfer_costs: no link between ranks {pair[0]} and {pair[1]}, which "
                f"{kind}{stage} sends to (stage {reader}); links has {sorted(links)}"
            )
        size = nbytes.get((kind, stage), nbytes.get(kind))
        if size is None:
            raise ValueError(
                f"transfer_costs: nbytes gives no size for ({kind!r}, {stage}), which sends to "
                f"stage {reader} on rank {pair[1]}"
            )
        costs[(kind, stage)] = link.seconds(size)
    return costs
