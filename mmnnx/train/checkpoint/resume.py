"""Resuming from the newest step that reads back whole: :func:`newest_readable`, ``Resumed``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from mmnnx.train.checkpoint.integrity import CheckpointCorruptError


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


def newest_readable(
    directory: str,
    complete: Sequence[int],
    incomplete: Sequence[int],
    restore: Callable[[int], dict[str, Any]],
    why: Callable[[int], str],
) -> Resumed:
    """``restore(step)`` of the newest of the ``complete`` steps (oldest first) that reads back
    whole, passing over damaged ones (:class:`CheckpointCorruptError`) and the ``incomplete``
    steps newer than it (``why(step)`` says why each is incomplete).

    Raises:
        FileNotFoundError: ``directory`` holds no step at all.
        NoReadableCheckpointError: every step is damaged or incomplete.
    """
    if not complete and not incomplete:
        raise FileNotFoundError(f"no checkpoint in {directory}")
    damaged: list[Skipped] = []
    for step in reversed(complete):
        try:
            extra = restore(step)
        except CheckpointCorruptError as e:
            what = f"{e.file or 'one of its files'} cannot be read"
            if e.array is not None:
                what = f"array {e.array!r} fails its checksum"
            damaged.append(Skipped(step, f"damaged ({what})"))
            continue
        newer = [Skipped(s, why(s)) for s in incomplete if s > step]
        return Resumed(step, extra, sorted(damaged + newer, key=lambda k: -k.step))
    skipped = damaged + [Skipped(s, why(s)) for s in incomplete]
    raise NoReadableCheckpointError(directory, sorted(skipped, key=lambda k: -k.step))
