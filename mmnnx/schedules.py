"""``mm.schedules``: pipeline schedules as data (the engine's :mod:`mmnnx.mpmd.schedules`),
what a step's transfers and launches cost (:mod:`mmnnx.link_timing`), :func:`tune`, which
measures a step and picks among them (:mod:`mmnnx.tuning`), and :func:`partition`, which plans
the split of a model's layers over the tasks with them (:mod:`mmnnx.partition`).

Example:
    >>> import mmnnx as mm
    >>> mm.schedules.names()[:2]
    ('gpipe', '1f1b')
    >>> mm.schedules.simulate(mm.schedules.get("1f1b", 2, 3)).makespan
    12
"""

from mmnnx.errors import NoCandidateError
from mmnnx.link_timing import (
    StepTransfers,
    boundary_bytes,
    measure_launch_cost,
    measure_link,
    measure_transfers,
)
from mmnnx.mpmd import schedules as _engine
from mmnnx.mpmd.schedules import *  # noqa: F403  (the engine's public names, as its __all__ lists)
from mmnnx.partition import PartitionResult, Split, StagePlan, partition
from mmnnx.tuning import Candidate, TuneResult, tune

__all__ = [
    *_engine.__all__,
    "Candidate",
    "NoCandidateError",
    "PartitionResult",
    "Split",
    "StagePlan",
    "StepTransfers",
    "TuneResult",
    "boundary_bytes",
    "measure_launch_cost",
    "measure_link",
    "measure_transfers",
    "partition",
    "tune",
]
