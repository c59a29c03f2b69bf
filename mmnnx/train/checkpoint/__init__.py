"""Checkpoints of task-placed NNX state: ``Checkpointer``.

A checkpoint holds a model's Variables (parameters, batch statistics, RNG state, ...), optionally
an ``nnx.Optimizer``'s state (moments and step), and a JSON ``extra`` dict. Every array is written
from the devices it lives on, as it is sharded on its task's submesh; nothing is gathered.
A restore reads each array straight into the sharding the target Variable has *now*, so a
checkpoint saved from a model placed on two tasks restores into the same architecture placed on
four tasks, or on one device, and the reverse.

The modules, as Orbax splits its own (a manager over handlers per format, path utilities):

    manager.py     Checkpointer: save / restore / list steps over a format, every process
                   reading a step together; what a resume from the newest readable step reports
    formats/       one module per storage format behind one interface (base.py): Orbax's tree
                   (orbax_tree.py, one process), every process's own arrays (process_arrays.py)
    tree.py        Variables <-> saved arrays, the check before a restore (mismatches)
    layout.py      the directory: steps, temporary directories, atomic renames (the on-disk
                   layout is described there)
    integrity.py   checksums, damaged files
    lock.py        one writer per directory
"""

from __future__ import annotations

from mmnnx.train.checkpoint.integrity import CheckpointCorruptError
from mmnnx.train.checkpoint.lock import CheckpointDirectoryBusyError
from mmnnx.train.checkpoint.manager import Checkpointer, NoReadableCheckpointError, Resumed, Skipped
from mmnnx.train.checkpoint.tree import CheckpointMismatchError

__all__ = [
    "CheckpointCorruptError",
    "CheckpointMismatchError",
    "Checkpointer",
    "NoReadableCheckpointError",
    "Resumed",
    "Skipped",
]

# Named here, as before the split, in tracebacks and pickles (not Checkpointer: the doctests of
# its methods are found by its module).
for _public in (
    CheckpointCorruptError,
    CheckpointDirectoryBusyError,
    CheckpointMismatchError,
    NoReadableCheckpointError,
    Resumed,
    Skipped,
):
    _public.__module__ = __name__
del _public
