"""mmnnx.sharding: meshes, tasks and placement rules. Pure data: nothing here runs a model."""

from mmnnx.sharding.fsdp import FSDPReplicatedWarning, fsdp_rules
from mmnnx.sharding.multi_mesh import MultiMesh, current_multimesh
from mmnnx.sharding.place import (
    home_of,
    init,
    place,
    place_optimizer,
    placement,
    stack_of,
    task_of,
)
from mmnnx.sharding.rules import path_str
from mmnnx.sharding.specs import bytes_per_device
from mmnnx.sharding.stack import TaskStack
from mmnnx.sharding.task import Task, logical_rules
from mmnnx.sharding.task_mesh import TaskMesh

__all__ = [
    "FSDPReplicatedWarning",
    "MultiMesh",
    "Task",
    "TaskStack",
    "TaskMesh",
    "bytes_per_device",
    "current_multimesh",
    "fsdp_rules",
    "home_of",
    "init",
    "logical_rules",
    "path_str",
    "place",
    "place_optimizer",
    "placement",
    "stack_of",
    "task_of",
]
