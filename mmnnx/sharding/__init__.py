"""mmnnx.sharding: meshes, tasks and placement rules. Pure data: nothing here runs a model."""

from mmnnx.sharding.multi_mesh import MultiMesh, current_multimesh
from mmnnx.sharding.place import init, place, place_optimizer, placement, task_of
from mmnnx.sharding.rules import path_str
from mmnnx.sharding.specs import bytes_per_device
from mmnnx.sharding.task import Task, logical_rules
from mmnnx.sharding.task_mesh import TaskMesh

__all__ = [
    "MultiMesh",
    "Task",
    "TaskMesh",
    "bytes_per_device",
    "current_multimesh",
    "init",
    "logical_rules",
    "path_str",
    "place",
    "place_optimizer",
    "placement",
    "task_of",
]
