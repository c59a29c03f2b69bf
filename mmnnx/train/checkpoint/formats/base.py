"""The interface of a step's storage format: :class:`Format` writes steps, :class:`SavedStep`
reads one back.

The ``Checkpointer`` owns the directory, its writer lock, step numbers, which Variables are
saved (:mod:`..tree`) and the check against the model; a format only stores and loads arrays,
``extra`` and mmnnx's description of each Variable, proves what it read (:mod:`..integrity`),
commits a step by one atomic rename of its temporary directory (the ``Checkpointer`` then
deletes the steps it does not keep). A step is read with the format whose :attr:`Format.marker`
its directory holds (else Orbax's tree, which has none).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Protocol

from mmnnx.train.checkpoint.tree import Path, Trees

Variables = Mapping[str, Mapping[str, Any]]  # "item/path" -> mmnnx's description


class SavedStep(Protocol):
    """A committed step as its format reads it, opened by :meth:`Format.open`."""

    arrays: Mapping[str, Mapping[Path, Any] | None]  # item -> path -> shape and dtype; or None
    variables: Variables

    def read(self, targets: Trees) -> tuple[dict[str, Any] | None, Trees]:
        """The step's ``extra`` (or ``None``) and the arrays of ``targets`` (the values they are
        restored into, by item and path), bit-exact and laid out as their targets (``None``
        where this process holds no part).

        Raises:
            CheckpointCorruptError: a file cannot be read, or an array or ``extra`` reads back
                different from its checksum.
        """
        ...


class Format(Protocol):
    """One way of storing a step on disk (see the module's docstring)."""

    marker: ClassVar[str | None]  # held only by this format's steps (None: every other step's)
    required: ClassVar[tuple[str, ...]]  # what every committed step of it holds

    def save(self, step: int, trees: Trees, extra: dict[str, Any], variables: Variables) -> None:
        """Writes step ``step``, durable and committed when it returns (on an error, at most
        its temporary directory is left). Every process calls it; the caller holds the writer
        lock and has removed abandoned saves."""
        ...

    def open(self, step: int) -> SavedStep:
        """Committed step ``step``'s description (no array data yet)."""
        ...
