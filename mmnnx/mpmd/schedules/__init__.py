"""Pipeline schedules as pure data: build them, check that they run, and simulate their timing.

A schedule says, for every rank (the devices running one or more model stages), the order of its
actions: one pass of one stage over one microbatch, ``F`` (forward), ``B`` (full backward), or a
split backward's ``I`` (input gradient, which the previous stage waits for) and ``W`` (weight
gradient, which nobody waits for). Two adjacent actions of a rank may form an *overlapped pair*, run
as one program (DualPipe). This package imports only the standard library; ``mm.schedules`` adds
``tune``, which runs steps (``mmnnx.tuning``).

Example:
    >>> from mmnnx.mpmd.schedules import get, simulate
    >>> schedule = get("1f1b", num_stages=2, num_microbatches=3)
    >>> print(schedule)
    1f1b: 2 stages, 3 microbatches, 2 ranks (unit-time steps; blank = idle)
    rank 0 | F0.0 F0.1      B0.0 F0.2 B0.1      B0.2
    rank 1 |      F1.0 B1.0 F1.1 B1.1 F1.2 B1.2
    >>> simulate(schedule).makespan
    12
"""

from mmnnx.mpmd.schedules.builders import (
    gpipe,
    interleaved_1f1b,
    interleaved_gpipe,
    one_f_one_b,
    zero_bubble_h1,
)
from mmnnx.mpmd.schedules.host import dispatch_order
from mmnnx.mpmd.schedules.ir import KINDS, TRANSFER, Action, Schedule, custom, from_csv, validate
from mmnnx.mpmd.schedules.links import Link, transfer_costs
from mmnnx.mpmd.schedules.registry import (
    Builder,
    CostsNotUsed,
    get,
    names,
    register,
    unregister,
)
from mmnnx.mpmd.schedules.simulation import (
    Event,
    SimulationResult,
    measured_bubble,
    measured_costs,
    measured_pair_costs,
    measured_transfer_costs,
    simulate,
)
from mmnnx.mpmd.schedules.zero_bubble import (
    dualpipe_v,
    interleaved_zero_bubble,
    v_stages,
    zero_bubble_h2,
    zero_bubble_v,
)

__all__ = [
    "KINDS",
    "TRANSFER",
    "Action",
    "Builder",
    "CostsNotUsed",
    "Event",
    "Link",
    "Schedule",
    "SimulationResult",
    "custom",
    "dispatch_order",
    "dualpipe_v",
    "from_csv",
    "get",
    "gpipe",
    "interleaved_1f1b",
    "interleaved_gpipe",
    "interleaved_zero_bubble",
    "measured_bubble",
    "measured_costs",
    "measured_pair_costs",
    "measured_transfer_costs",
    "names",
    "one_f_one_b",
    "register",
    "simulate",
    "transfer_costs",
    "unregister",
    "v_stages",
    "validate",
    "zero_bubble_h1",
    "zero_bubble_h2",
    "zero_bubble_v",
]
