"""mmnnx.mpmd: the engine (trace, colour, cut, compile, run) behind mm.jit."""

from mmnnx.mpmd import schedules
from mmnnx.mpmd.errors import MPMDError, PlacementConflictError, SideEffectError
from mmnnx.mpmd.plan import Fragment, Plan, Transfer

__all__ = [
    "schedules",
    "Fragment",
    "MPMDError",
    "Plan",
    "PlacementConflictError",
    "SideEffectError",
    "Transfer",
]
