"""The interface of a step's storage format: :class:`Format` writes steps, :class:`SavedStep`
reads one back.

The ``Checkpointer`` owns everything around a format: the directory and its writer lock, step
numbers, which Variables are saved (:mod:`..tree`) and the check of a step's arrays against the
model. A format only stores and loads arrays, the JSON ``extra`` dict and mmnnx's description of
each Variable, and proves what it read (:mod:`..integrity`). It writes a step into a temporary
directory (a name holding ``layout.TMP_SUFFIX``), commits it by one atomic rename to
``<directory>/<step>`` and then deletes the steps older than ``max_to_keep``.

The ``Checkpointer`` saves with one format, chosen when it is made, and reads a step with the
format whose :attr:`Format.marker` the step directory holds (else Orbax's tree, which has none).
A new layout (Hugging Face's safetensors, say) is one more module here: its marker, the files
every committed step holds, a ``save`` and an ``open``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Protocol

from mmnnx.train.checkpoint.tree import Path, Trees

Variables = Mapping[str, Mapping[str, Any]]  # "item/path" -> mmnnx's description


class SavedStep(Protocol):
    """A committed step as its format reads it, opened by :meth:`Format.open`.

    ``arrays`` holds, by item (``"model"``, ``"opt"``), each saved array's shape and dtype (an
    object with ``.shape`` and ``.dtype``) by path, or ``None`` for an item the step does not
    hold; ``variables`` mmnnx's description of each saved Variable by ``item/path`` name.
    """

    arrays: Mapping[str, Mapping[Path, Any] | None]
    variables: Variables

    def read(self, targets: Trees) -> tuple[dict[str, Any] | None, Trees]:
        """Reads the step's ``extra`` dict (``None`` when the step holds none) and the arrays of
        ``targets`` (by item and path, the value each is restored into, as stored, checked
        against ``arrays``), each bit-exact and laid out as its target (the same sharding; NumPy
        for NumPy; uncommitted for uncommitted), or ``None`` where this process holds no part;
        all read before it returns.

        Raises:
            CheckpointCorruptError: a file cannot be read, or an array or ``extra`` reads back
                different from its checksum.
        """
        ...


class Format(Protocol):
    """One way of storing a step on disk (see the module's docstring).

    ``marker`` is a file or folder only this format's step directories hold (``None`` for the
    format of every other step); ``required`` what every committed step of this format holds
    (the first that is missing says why a step is incomplete: ``layout.incomplete``).
    """

    marker: ClassVar[str | None]
    required: ClassVar[tuple[str, ...]]

    def save(self, step: int, trees: Trees, extra: dict[str, Any], variables: Variables) -> None:
        """Writes ``trees`` (arrays by item and path, as stored), ``extra`` and ``variables`` as
        step ``step``, durable and committed when it returns. The caller holds the writer lock
        (with several processes, process 0 does; every process calls ``save``) and has removed
        abandoned saves.

        Raises:
            any error of the writing; the step then is not committed (at most its temporary
            directory is left).
        """
        ...

    def open(self, step: int) -> SavedStep:
        """Reads committed step ``step``'s description (no array data yet).

        Raises:
            CheckpointCorruptError: its description cannot be read.
        """
        ...
