"""The partition planner, ``mm.schedules.partition``: which layers go on which task, with the
schedule, microbatch count and stages per task, from each layer's measured forward, backward,
input- and weight-gradient times, each boundary's transfer time and each task's memory.

Modules: ``pieces`` (the model cut into the parts timed: the embedding, each layer, the head
and the loss), ``measure`` (timing a part on a task), ``search`` (the splits simulated),
``result`` (the records and the table) and ``plan`` (``partition`` itself); ``memory``
(``predict_memory``: each device's peak bytes predicted from shapes alone); ``cost`` (a
step's time on a cluster, on paper) and ``cluster`` (``plan_cluster``: the layout of a
cluster, searched on paper, as ``mmnnx plan`` prints it).
"""

from mmnnx.partition.cluster import PlannedStep, plan_cluster
from mmnnx.partition.cost import ClusterLayout, DeviceSpec
from mmnnx.partition.memory import MemoryLayout, MemoryPrediction, StageMemory, predict_memory
from mmnnx.partition.plan import partition
from mmnnx.partition.result import PartitionResult, Split, StagePlan

__all__ = [
    "ClusterLayout",
    "DeviceSpec",
    "PlannedStep",
    "plan_cluster",
    "MemoryLayout",
    "MemoryPrediction",
    "PartitionResult",
    "Split",
    "StageMemory",
    "StagePlan",
    "partition",
    "predict_memory",
]
