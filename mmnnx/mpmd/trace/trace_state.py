"""What ``mm.jit`` records while it traces a step (:class:`Trace`), the context marking a trace,
and shape-only traces (``mm.tabulate``'s)."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator

from mmnnx.mpmd.schedules import Schedule
from mmnnx.sharding import Task


@dataclasses.dataclass(frozen=True)
class MicrobatchGroup:
    """What ``mm.microbatch`` recorded while mm.jit traced it."""

    num_microbatches: int
    schedule: str | Schedule
    virtual_stages: int
    batch_size: int | None = None  # rows split into the microbatches


@dataclasses.dataclass
class Trace:
    """What annotations record while mm.jit traces a step."""

    regions: dict[str, Task] = dataclasses.field(default_factory=dict)
    microbatches: dict[int, MicrobatchGroup] = dataclasses.field(default_factory=dict)
    # scope resolvers (annotations.ScopeResolver): (scope, backward) -> Task | None
    resolvers: list[Callable[[str, bool], Task | None]] = dataclasses.field(default_factory=list)
    unrolled: list[str] = dataclasses.field(default_factory=list)  # why, per unrolled call


_TRACING: contextvars.ContextVar[Trace | None] = contextvars.ContextVar("mm_tracing", default=None)
_SHAPES_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar("mm_shapes_only", default=False)


@contextlib.contextmanager
def tracing() -> Iterator[Trace]:
    """Marks an mm.jit trace; collects ``mm.task`` regions and ``mm.microbatch`` groups."""
    trace = Trace()
    token = _TRACING.set(trace)
    try:
        yield trace
    finally:
        _TRACING.reset(token)


def current_trace() -> Trace | None:
    """The annotations of the mm.jit trace in progress, or ``None`` outside mm.jit."""
    return _TRACING.get()


@contextlib.contextmanager
def shapes_only() -> Iterator[None]:
    """Marks a trace that only computes shapes (``mm.tabulate``'s): inside it, unless ``mm.jit`` is
    tracing, ``mm.with_sharding_constraint`` returns its input, so no mesh need be in context."""
    token = _SHAPES_ONLY.set(True)
    try:
        yield
    finally:
        _SHAPES_ONLY.reset(token)


def is_shapes_only() -> bool:
    """Whether a :func:`shapes_only` trace is in progress."""
    return _SHAPES_ONLY.get()
