"""mmnnx.mpmd: the engine (trace, colour, cut, compile, run) behind mm.jit."""

from mmnnx.errors import (
    MPMDError,
    PlacementConflictError,
    SideEffectError,
    StepError,
    UnrolledMicrobatchWarning,
)
from mmnnx.mpmd import schedules
from mmnnx.mpmd.ir import GROUP_PREFIX, REGION_PREFIX
from mmnnx.mpmd.lower.plan import Plan
from mmnnx.mpmd.lower.program import Constant, Recv, Release, Run, Send, StepProgram, Zeros
from mmnnx.mpmd.plan.cut import Fragment, Transfer
from mmnnx.mpmd.trace.annotations import ScopeResolver, resolve_scopes
from mmnnx.mpmd.trace.tracing import is_backward_scope, scope_components, scopes_of

__all__ = [
    "GROUP_PREFIX",
    "REGION_PREFIX",
    "schedules",
    "Constant",
    "Fragment",
    "Recv",
    "Release",
    "Run",
    "Zeros",
    "ScopeResolver",
    "Send",
    "StepProgram",
    "is_backward_scope",
    "resolve_scopes",
    "scope_components",
    "scopes_of",
    "MPMDError",
    "Plan",
    "PlacementConflictError",
    "SideEffectError",
    "StepError",
    "Transfer",
    "UnrolledMicrobatchWarning",
]
