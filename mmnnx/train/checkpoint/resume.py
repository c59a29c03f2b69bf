"""What a resume from the newest step that reads back whole reports: ``Resumed``, ``Skipped``,
``NoReadableCheckpointError``."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Skipped:
    """A step passed over by :meth:`Checkpointer.restore_newest_readable`, and why: ``damaged
    (FILE cannot be read)``, ``damaged (array 'P' fails its checksum)``, ``incomplete (no
    metadata)`` or ``incomplete (no ITEM item)``."""

    step: int
    reason: str

    def __str__(self) -> str:
        return f"skipped step {self.step}: {self.reason}"


@dataclasses.dataclass(frozen=True)
class Resumed:
    """What :meth:`Checkpointer.restore_newest_readable` restored: the ``step``, its ``extra``
    dict, and the newer steps it ``skipped`` (newest first)."""

    step: int
    extra: dict[str, Any]
    skipped: list[Skipped]


class NoReadableCheckpointError(RuntimeError):
    """No step of a checkpoint directory can be restored: each is damaged or incomplete.
    ``directory`` names the directory and ``skipped`` lists every step and why (newest first).
    Nothing was written into the model."""

    def __init__(self, directory: str, skipped: list[Skipped]):
        self.directory, self.skipped = directory, skipped
        super().__init__(f"no readable checkpoint in {directory}: " + "; ".join(map(str, skipped)))
