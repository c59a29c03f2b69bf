"""``mm.schedules``: pipeline schedules as data (the engine's :mod:`mmnnx.mpmd.schedules`) and
:func:`tune`, which measures a step and picks among them (:mod:`mmnnx.tuning`).

Example:
    >>> import mmnnx as mm
    >>> mm.schedules.names()[:2]
    ('gpipe', '1f1b')
    >>> mm.schedules.simulate(mm.schedules.get("1f1b", 2, 3)).makespan
    12
"""

from mmnnx.errors import NoCandidateError
from mmnnx.mpmd.schedules import (
    KINDS,
    Action,
    Builder,
    CostsNotUsed,
    Event,
    Schedule,
    SimulationResult,
    custom,
    dualpipe_v,
    from_csv,
    get,
    gpipe,
    interleaved_1f1b,
    interleaved_gpipe,
    interleaved_zero_bubble,
    measured_bubble,
    measured_costs,
    measured_pair_costs,
    names,
    one_f_one_b,
    register,
    simulate,
    unregister,
    v_stages,
    validate,
    zero_bubble_h1,
    zero_bubble_h2,
    zero_bubble_v,
)
from mmnnx.tuning import Candidate, TuneResult, tune

__all__ = [
    "KINDS",
    "Action",
    "Builder",
    "Candidate",
    "CostsNotUsed",
    "Event",
    "NoCandidateError",
    "Schedule",
    "SimulationResult",
    "TuneResult",
    "custom",
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
    "names",
    "one_f_one_b",
    "register",
    "simulate",
    "tune",
    "unregister",
    "v_stages",
    "validate",
    "zero_bubble_h1",
    "zero_bubble_h2",
    "zero_bubble_v",
]
