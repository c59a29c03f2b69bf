"""How long a value takes to cross from one rank to another: a latency plus its bytes over a
bandwidth, fitted to measured copies (``mmnnx.link_timing`` measures them)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class Link:
    """A one-way connection between two ranks: ``latency`` seconds per value plus ``bandwidth``
    bytes per second.

    Example:
        >>> link = Link(latency=20e-6, bandwidth=1e9)
        >>> round(link.seconds(1_000_000), 6)
        0.00102
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
