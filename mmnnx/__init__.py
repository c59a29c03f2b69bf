"""mmnnx: multi-mesh (MPMD) parallelism for Flax NNX on stock JAX.

Example:
    >>> import mmnnx as mm
    >>> mesh = mm.MultiMesh(axis_sizes=(2, 4), axis_names=("stage", "data"))
    >>> s0 = mm.Task("stage0", mesh=mesh.slice(stage=0))
"""

from mmnnx import distributed, models, modules, mpmd, schedules, train
from mmnnx.errors import UnrolledLayersWarning
from mmnnx.jit import CachedPartial, JitFunction, cached_partial, jit
from mmnnx.microbatch import microbatch
from mmnnx.models.stages import stage_rules
from mmnnx.mpmd import (
    MPMDError,
    PlacementConflictError,
    Plan,
    SideEffectError,
    StepError,
    UnrolledMicrobatchWarning,
)
from mmnnx.mpmd.lower.pack import PACK_RESIDUAL_BYTES, PACK_WEIGHT_BYTES
from mmnnx.mpmd.trace.annotations import task, with_sharding_constraint
from mmnnx.sharding import (
    MultiMesh,
    Task,
    TaskMesh,
    TaskStack,
    bytes_per_device,
    current_multimesh,
    init,
    logical_rules,
    place,
    place_optimizer,
    placement,
    stack_of,
    task_of,
)
from mmnnx.summary import tabulate
from mmnnx.timeline import plot_timeline

__version__ = "0.1.0"

__all__ = [
    "CachedPartial",
    "JitFunction",
    "MPMDError",
    "MultiMesh",
    "PACK_RESIDUAL_BYTES",
    "PACK_WEIGHT_BYTES",
    "PlacementConflictError",
    "Plan",
    "SideEffectError",
    "StepError",
    "UnrolledLayersWarning",
    "UnrolledMicrobatchWarning",
    "Task",
    "TaskStack",
    "TaskMesh",
    "bytes_per_device",
    "cached_partial",
    "distributed",
    "current_multimesh",
    "init",
    "jit",
    "logical_rules",
    "microbatch",
    "models",
    "modules",
    "mpmd",
    "place",
    "place_optimizer",
    "placement",
    "plot_timeline",
    "schedules",
    "train",
    "stack_of",
    "stage_rules",
    "tabulate",
    "task",
    "task_of",
    "with_sharding_constraint",
]
