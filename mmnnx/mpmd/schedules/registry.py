"""The schedule names: one record per name (its builder, its placement, whether it orders its passes
for given costs), read by ``mm.microbatch(schedule=name)``, ``mmnnx train --schedule`` and
``multimesh_compat``."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from mmnnx.mpmd.schedules.builders import (
    gpipe,
    interleaved_1f1b,
    interleaved_gpipe,
    one_f_one_b,
    zero_bubble_h1,
)
from mmnnx.mpmd.schedules.ir import Schedule, validate
from mmnnx.mpmd.schedules.placement import Placement
from mmnnx.mpmd.schedules.zero_bubble import (
    dualpipe_v,
    interleaved_zero_bubble,
    zero_bubble_h2,
    zero_bubble_v,
)


class CostsNotUsed(ValueError):
    """Raised by :func:`get` when ``costs`` are given for a schedule whose order ignores them.

    Example:
        >>> from mmnnx.mpmd.schedules import CostsNotUsed, get
        >>> try:
        ...     get("1f1b", 2, 2, costs={"F": 1, "I": 1, "W": 1})
        ... except CostsNotUsed as e:
        ...     print(e)
        schedule '1f1b' is built the same whatever the passes cost; pass no costs
    """


Builder = Callable[[int, int, int], Schedule]
"""A schedule builder: ``builder(num_stages, num_microbatches, virtual_stages) -> Schedule``."""


@dataclasses.dataclass(frozen=True)
class RegisteredSchedule:
    """One schedule name: its builder, its placement, whether it takes ``costs``."""

    name: str
    builder: Callable[..., Schedule]
    placement: Placement
    takes_costs: bool = False

    def build(
        self,
        num_stages: int,
        num_microbatches: int,
        virtual_stages: int,
        costs: Mapping[Any, float] | None = None,
    ) -> Schedule:
        """Calls the builder as :attr:`placement` says, ``virtual_stages`` and ``costs`` checked."""
        sizes = (num_stages, num_microbatches, virtual_stages)
        self.placement.check(self.name, *sizes)
        if self.placement.order(virtual_stages) is None:
            runs = [  # those whose placement is known
                n
                for n, e in _REGISTRY.items()
                if e.placement.order(virtual_stages)
                and e.placement is not Placement.BUILDER_DECIDES
            ]
            raise ValueError(
                f"virtual_stages={virtual_stages} applies only to schedules that run several "
                f"stages per rank ({', '.join(map(repr, runs))}); {self.name!r} runs "
                f"{self.placement.name}"
            )
        if costs is None:
            return self.builder(*self.placement.sizes(*sizes))
        if not self.takes_costs:
            raise CostsNotUsed(
                f"schedule {self.name!r} is built the same whatever the passes cost; pass no costs"
            )
        return self.builder(*self.placement.sizes(*sizes), costs=costs)


_BUILT_IN = (
    RegisteredSchedule("gpipe", gpipe, Placement.ONE_PER_RANK),
    RegisteredSchedule("1f1b", one_f_one_b, Placement.ONE_PER_RANK),
    RegisteredSchedule("interleaved-1f1b", interleaved_1f1b, Placement.INTERLEAVED),
    RegisteredSchedule("interleaved-gpipe", interleaved_gpipe, Placement.INTERLEAVED),
    RegisteredSchedule("zero-bubble-h1", zero_bubble_h1, Placement.ONE_PER_RANK),
    RegisteredSchedule("zero-bubble-h2", zero_bubble_h2, Placement.ONE_PER_RANK, takes_costs=True),
    RegisteredSchedule("zero-bubble-v", zero_bubble_v, Placement.V_SHAPED, takes_costs=True),
    RegisteredSchedule(
        "interleaved-zero-bubble", interleaved_zero_bubble, Placement.INTERLEAVED, takes_costs=True
    ),
    RegisteredSchedule("dualpipev", dualpipe_v, Placement.V_SHAPED),
)

_REGISTRY: dict[str, RegisteredSchedule] = {entry.name: entry for entry in _BUILT_IN}


def _takes_costs(name: str, builder: Callable[..., Schedule]) -> bool:
    """Whether ``builder`` takes ``costs``; a TypeError unless it can be called as a
    :data:`Builder`."""
    try:
        signature = inspect.signature(builder)
    except (TypeError, ValueError):  # a callable whose signature cannot be read: trust it
        return False
    extra = {"costs": None} if "costs" in signature.parameters else {}
    try:
        signature.bind(1, 1, 1, **extra)
    except TypeError as e:
        shown = getattr(builder, "__name__", type(builder).__name__)
        raise TypeError(
            f"the builder of schedule {name!r} must take (num_stages, num_microbatches, "
            f"virtual_stages) positionally, and optionally costs=; {shown}{signature} cannot "
            f"({e})"
        ) from None
    return bool(extra)


def register(name: str, builder: Builder, *, replace: bool = False) -> None:
    """Make ``builder`` available as the schedule ``name`` everywhere a name is accepted.

    ``builder(num_stages, num_microbatches, virtual_stages)`` returns the :class:`Schedule`
    (``num_stages`` counts model stages, ``virtual_stages`` those per rank); one with a ``costs``
    parameter is also given :func:`get`'s ``costs``. A taken name raises unless ``replace=True``; a
    builder that cannot be called so raises a TypeError naming the signature it needs.

    Example:
        >>> from mmnnx.mpmd import schedules
        >>> def forwards_first(num_stages, num_microbatches, virtual_stages):
        ...     rows = [[f"F{s}.{m}" for m in range(num_microbatches)]
        ...             + [f"B{s}.{m}" for m in reversed(range(num_microbatches))]
        ...             for s in range(num_stages)]
        ...     return schedules.custom(rows, name="forwards-first")
        >>> schedules.register("forwards-first", forwards_first)
        >>> schedules.get("forwards-first", 2, 2).actions_of(0)[2]
        Action(kind='B', stage=0, microbatch=1)
        >>> schedules.unregister("forwards-first")
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"a schedule name must be a non-empty str, got {name!r}")
    if not callable(builder):
        raise TypeError(f"the builder of schedule {name!r} is not callable: {builder!r}")
    if name in _REGISTRY and not replace:
        raise ValueError(
            f"schedule {name!r} is already registered; pass replace=True to replace it"
        )
    _REGISTRY[name] = RegisteredSchedule(
        name=name,
        builder=builder,
        placement=Placement.BUILDER_DECIDES,
        takes_costs=_takes_costs(name, builder),
    )


def unregister(name: str) -> None:
    """Remove the schedule ``name`` from the registry (see :func:`register`).

    Example:
        >>> from mmnnx.mpmd import schedules
        >>> schedules.unregister("no-such-schedule")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: unknown schedule 'no-such-schedule'; valid names: 'gpipe', ...
    """
    del _REGISTRY[registered(name).name]


def names() -> tuple[str, ...]:
    """The registered schedule names, in registration order.

    Example:
        >>> from mmnnx.mpmd.schedules import names
        >>> names()  # doctest: +NORMALIZE_WHITESPACE
        ('gpipe', '1f1b', 'interleaved-1f1b', 'interleaved-gpipe', 'zero-bubble-h1',
         'zero-bubble-h2', 'zero-bubble-v', 'interleaved-zero-bubble', 'dualpipev')
    """
    return tuple(_REGISTRY)


def registered(name: str) -> RegisteredSchedule:
    """The record of schedule ``name``; a ValueError listing the valid names if none."""
    if name not in _REGISTRY:
        valid = ", ".join(repr(n) for n in _REGISTRY)
        raise ValueError(f"unknown schedule {name!r}; valid names: {valid}")
    return _REGISTRY[name]


def get(
    name: str,
    num_stages: int,
    num_microbatches: int,
    virtual_stages: int = 1,
    costs: Mapping[Any, float] | None = None,
) -> Schedule:
    """Build the registered schedule called ``name`` (see :func:`names`).

    ``num_stages`` counts model stages: an interleaved schedule puts ``virtual_stages`` of them on
    each of ``num_stages / virtual_stages`` ranks. ``costs`` (durations by kind,
    ``{"F": 2, "I": 1, "W": 1}``, or by ``(kind, stage)``) asks a schedule that orders its passes by
    their durations (``zero-bubble-h2``, ``zero-bubble-v``, ``interleaved-zero-bubble``) to order
    them for these; another schedule raises :class:`CostsNotUsed`.

    Example:
        >>> from mmnnx.mpmd.schedules import get
        >>> schedule = get("interleaved-1f1b", num_stages=8, num_microbatches=8, virtual_stages=2)
        >>> schedule.num_ranks, schedule.stages_of(0)
        (4, (0, 4))
    """
    entry = registered(name)
    if (
        not isinstance(virtual_stages, int)
        or isinstance(virtual_stages, bool)
        or virtual_stages < 1
    ):
        raise ValueError(f"virtual_stages must be an int >= 1, got {virtual_stages!r}")
    schedule = entry.build(num_stages, num_microbatches, virtual_stages, costs)
    if not isinstance(schedule, Schedule):
        raise TypeError(f"the builder of schedule {name!r} returned {schedule!r}, not a Schedule")
    validate(schedule)
    if (schedule.num_stages, schedule.num_microbatches) != (num_stages, num_microbatches):
        raise ValueError(
            f"the builder of schedule {name!r} was asked for {num_stages} stages and "
            f"{num_microbatches} microbatches but built {schedule.num_stages} and "
            f"{schedule.num_microbatches}"
        )
    return schedule
