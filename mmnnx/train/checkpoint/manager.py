"""The ``Checkpointer``: saves, lists and restores the steps of one directory over a format."""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from etils import epath
from flax import nnx

from mmnnx.distributed.gather import gather, together
from mmnnx.train.checkpoint import integrity, layout, lock, tree
from mmnnx.train.checkpoint.formats import base, orbax_tree, process_arrays

CheckExtra = Callable[[int, dict[str, Any]], str | None]
"""Why a step's ``extra`` dict cannot be used (the step counts as damaged), or ``None``: called
with the step and its ``extra`` before anything is written (``restore``'s ``check_extra``)."""


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


class Checkpointer:
    """Saves and restores task-placed NNX models and optimizers, one directory per step.

    ``save`` returns once the step is written, fsynced and committed by an atomic rename of its
    temporary directory, so an interrupted save (an exception, a killed process) leaves the
    previous steps intact and ``latest_step()`` on the last complete one; the next save, under
    the directory's writer lock (``lock.py``), removes what it left. Opening a ``Checkpointer``
    and reading from it never removes anything, so any number of readers may watch a directory
    while one process saves into it. Only ``max_to_keep`` steps are kept: the one just saved
    and the newest others. Saving step ``s`` continues the directory's run from ``s``: once
    ``s`` is committed, the steps newer than ``s`` (saved by a run that went further before
    this one restored an older step) are deleted, with a warning naming them, so that a later
    ``restore()`` of the latest step (or ``mmnnx train --resume``) continues from ``s``.

    A step is stored in one of the formats of ``formats/``: Orbax's tree with one process, the
    arrays every process writes with several; a step of either restores with any process count.

    Args:
        directory: where the steps live; created if missing.
        max_to_keep: how many steps to keep (a positive int: the one just saved and the
            newest others), or ``None`` for all.
        use_ocdbt: write each item as one OCDBT database (Orbax's default, few files) instead of
            one Zarr directory per array.

    Example:
        >>> import tempfile
        >>> import optax
        >>> from flax import nnx
        >>> from mmnnx.train import Checkpointer
        >>> model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
        >>> opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        >>> with Checkpointer(tempfile.mkdtemp()) as ckpt:
        ...     ckpt.save(7, model=model, opt=opt, extra={"seed": 0})
        ...     fresh = nnx.Linear(2, 3, rngs=nnx.Rngs(1))
        ...     ckpt.restore(model=fresh)
        {'seed': 0}
        >>> bool((fresh.kernel.get_value() == model.kernel.get_value()).all())
        True
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        max_to_keep: int | None = 3,
        use_ocdbt: bool = True,
    ) -> None:
        if max_to_keep is not None and (
            isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int) or max_to_keep < 1
        ):
            raise ValueError(
                f"max_to_keep must be a positive int (how many of the newest steps to keep) or "
                f"None to keep every step, got {max_to_keep!r}"
            )
        path = os.fspath(directory)
        self._directory = epath.Path(path if "://" in path else os.path.abspath(path))
        self._me = jax.process_index() if jax.process_count() > 1 else None
        if self._me is not None:
            self._directory.mkdir(parents=True, exist_ok=True)
        self._lock = lock.WriterLock(self._directory)
        self._max_to_keep = max_to_keep
        self._orbax = orbax_tree.OrbaxTree(self._directory, self._me, use_ocdbt=use_ocdbt)
        parts = process_arrays.ProcessArrays(self._directory, self._me)
        self._format: base.Format = self._orbax if self._me is None else parts
        self._readers: tuple[base.Format, ...] = (parts, self._orbax)

    @property
    def directory(self) -> epath.Path:
        """The absolute directory holding the steps."""
        return self._directory

    def claim(self) -> None:
        """Takes the directory's writer lock now, as the first save would, and holds it until
        :meth:`close`: a trainer calls it before training, so that a second writer fails at
        once rather than at its first save. With several processes, process 0 holds it (a
        collective: every process calls it, and raises if process 0 could not).

        Raises:
            CheckpointDirectoryBusyError: another ``Checkpointer`` (in this or another process
                or host) holds it; the message names it.

        Example:
            >>> import tempfile
            >>> from mmnnx.train import Checkpointer
            >>> directory = tempfile.mkdtemp()
            >>> with Checkpointer(directory) as ckpt:
            ...     ckpt.claim()
            ...     try:
            ...         Checkpointer(directory).claim()
            ...     except RuntimeError as e:
            ...         print(type(e).__name__)
            CheckpointDirectoryBusyError
        """
        if self._me is None:
            self._lock.hold()
        else:  # process 0 writes the directory; every process learns whether it could
            what = f"claiming checkpoint directory {self._directory}"

            def hold() -> str | None:
                if self._me != 0:
                    return None
                try:
                    self._lock.hold()
                except lock.CheckpointDirectoryBusyError as e:
                    return str(e)
                return None

            # a busy directory is the same error on every process (before: a RuntimeError
            # wrapping it, which `mmnnx train` under `mmnnx launch` showed as a traceback, exit 1)
            busy = gather(together(what, hold), what=what)[0]
            if busy:
                raise lock.CheckpointDirectoryBusyError(busy)

    def save(
        self,
        step: int,
        *,
        model: Any,
        opt: nnx.Optimizer | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        """Writes ``model``'s Variables, ``opt``'s state and ``extra`` as checkpoint ``step``.

        Every Variable of ``model`` (any NNX graph node) is saved, with its current sharding;
        ``opt`` adds the optimizer state, including its step. ``extra`` is a JSON-able dict (data
        position, seeds, ...), returned by ``restore`` as JSON gives it back (tuples become
        lists, keys strings). Returns once the step is durable and committed; an exception on
        the way leaves no trace of the step but a temporary directory, and every step as it
        was. Once committed, the steps newer than ``step`` are deleted (with a warning) and
        the oldest beyond ``max_to_keep``.

        Raises:
            ValueError: ``step`` is negative or already saved.
            CheckpointDirectoryBusyError: another ``Checkpointer`` writes this directory (the
                first save takes the directory's writer lock; :meth:`close` releases it).
            TypeError: ``extra`` is not a JSON-able dict; a Variable holds no array.

        Example:
            >>> import tempfile
            >>> from flax import nnx
            >>> from mmnnx.train import Checkpointer
            >>> ckpt = Checkpointer(tempfile.mkdtemp(), max_to_keep=2)
            >>> model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
            >>> for step in (1, 2, 3):
            ...     ckpt.save(step, model=model)
            >>> ckpt.all_steps()
            [2, 3]
            >>> sorted(p.name for p in (ckpt.directory / "3").iterdir() if p.is_dir())
            ['extra', 'mmnnx', 'model']
            >>> ckpt.close()
        """
        step = _step_number(step)
        self.claim()  # before looking at what is there: one writer decides
        if step in self.all_steps():
            raise ValueError(f"checkpoint step {step} already exists in {self._directory}")
        extra = {} if extra is None else extra
        if not isinstance(extra, Mapping):
            raise TypeError(f"extra must be a dict, not a {type(extra).__name__}")
        try:
            extra = json.loads(json.dumps(dict(extra)))
        except (TypeError, ValueError) as e:
            raise TypeError(f"extra must be JSON-able: {e}") from None
        trees, variables = tree.saved_trees(model, opt)
        if self._me in (None, 0):  # under the writer lock: no other save is in progress
            layout.remove_abandoned_saves(self._directory)
        self._format.save(step, trees, extra, variables)
        self._remove_unkept(step)

    def _remove_unkept(self, step: int) -> None:
        """Once ``step`` is committed: deletes the steps newer than it and the oldest beyond
        ``max_to_keep`` (process 0 does, every process waits), warning of the newer ones."""

        def remove() -> list[int]:
            steps = self.all_steps()
            return layout.remove_unkept(self._directory, steps, self._max_to_keep, saved=step)

        if self._me is None:
            newer = remove()
        else:
            what = f"deleting the checkpoints not kept after saving step {step}"
            newer = together(what, lambda: remove() if self._me == 0 else None)
            newer = gather(newer, what=what)[0]
            self._orbax.reload()
        if newer:
            warnings.warn(
                f"saved checkpoint step {step} in {self._directory} and deleted the newer steps "
                f"{newer}: they were saved by a run that went further before this one restored "
                "an older step",
                stacklevel=3,
            )

    def wait(self) -> None:
        """Waits for a save in flight; saves are synchronous, so this returns at once."""
        self._orbax.wait()

    def restore(
        self,
        step: int | None = None,
        *,
        model: Any,
        opt: nnx.Optimizer | None = None,
        check_extra: CheckExtra | None = None,
    ) -> dict[str, Any]:
        """Restores checkpoint ``step`` (default: the latest) into ``model`` and ``opt`` in place.

        Each array is read bit-exact into the sharding its Variable has now, and written into
        the same Variable (``set_value``, keeping its metadata). Everything is checked first, and
        nothing is written unless every array was read. Without ``opt``, saved optimizer state is
        ignored. Without ``step``, the newest step that reads back whole is restored, with a
        warning naming each newer one passed over and why (:meth:`restore_newest_readable`).
        ``check_extra(step, extra)``, when given, says why the step's ``extra`` cannot be used
        (a string), or ``None``: a step it refuses is damaged. With several processes, every
        process restores the same step together, and all fail if one does.

        Returns:
            the ``extra`` dict saved with the step.

        Raises:
            ValueError: ``step`` is not a non-negative int (``2.5``, ``"2"``).
            FileNotFoundError: no checkpoint (or no such step) in the directory.
            NoReadableCheckpointError: without ``step``: every step is damaged or incomplete (a
                directory of one damaged step raises its ``CheckpointCorruptError``).
            CheckpointMismatchError: the checkpoint does not match, or holds no optimizer state;
                the model and optimizer are left untouched.
            CheckpointCorruptError: a file of the step is damaged or missing, an array reads
                back different from its saved checksum, or ``check_extra`` refuses the step;
                nothing is written.

        Example:
            >>> import tempfile
            >>> from flax import nnx
            >>> from mmnnx.train import Checkpointer
            >>> ckpt = Checkpointer(tempfile.mkdtemp())
            >>> ckpt.save(1, model=nnx.Linear(2, 3, rngs=nnx.Rngs(0)), extra={"epoch": 4})
            >>> ckpt.restore(model=nnx.Linear(2, 3, rngs=nnx.Rngs(1)))
            {'epoch': 4}
            >>> ckpt.restore(model=nnx.Linear(2, 4, rngs=nnx.Rngs(1)))  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            mmnnx.train.checkpoint.CheckpointMismatchError: checkpoint step 1: 'model/bias' has ...
            >>> ckpt.restore(  # doctest: +ELLIPSIS
            ...     model=nnx.Linear(2, 3, rngs=nnx.Rngs(1)),
            ...     check_extra=lambda step, extra: None if extra["epoch"] < 4 else "too late",
            ... )
            Traceback (most recent call last):
            ...
            mmnnx.train.checkpoint.CheckpointCorruptError: checkpoint step 1 in ...: too late; ...
        """
        if step is None:  # the newest step that reads back whole, saying what it passed over
            return self._restore_newest(model, opt, check_extra)
        step = _step_number(step)
        self._check_saved(step)
        found = tree.entries(model, opt)

        def read() -> tuple[dict[str, Any], tree.Trees]:
            saved = self._format_of(step).open(step)
            folder = self._directory / str(step)
            integrity.check_items(step, folder, saved.arrays, saved.variables, found)
            tree.check(step, saved.arrays, found, saved.variables)
            extra, values = saved.read(tree.stored(found))
            extra = dict(extra or {})
            reason = None if check_extra is None else check_extra(step, extra)
            if reason is not None:
                raise integrity.CheckpointCorruptError(step, os.fspath(folder), reason=reason)
            return extra, values

        extra, values = _read_together(f"restoring checkpoint step {step}", read)
        tree.write_back(step, found, values)
        return extra

    def read_extra(self, step: int) -> dict[str, Any]:
        """The ``extra`` dict saved with step ``step``, read alone (no array is read), checked
        against its checksum.

        Raises:
            ValueError: ``step`` is not a non-negative int.
            FileNotFoundError: no such complete step in the directory.
            CheckpointCorruptError: the step's description or ``extra`` cannot be read whole.

        Example:
            >>> import tempfile
            >>> from flax import nnx
            >>> from mmnnx.train import Checkpointer
            >>> with Checkpointer(tempfile.mkdtemp()) as ckpt:
            ...     ckpt.save(3, model=nnx.Linear(1, 1, rngs=nnx.Rngs(0)), extra={"seed": 5})
            ...     ckpt.read_extra(3)
            {'seed': 5}
        """
        step = _step_number(step)
        self._check_saved(step)
        extra, _ = self._format_of(step).open(step).read({})
        return dict(extra or {})

    def _restore_newest(
        self, model: Any, opt: nnx.Optimizer | None, check_extra: CheckExtra | None
    ) -> dict[str, Any]:
        """:meth:`restore` without a step (one step alone: its own error)."""
        if len(self.all_steps()) == 1 and not self.incomplete_steps():
            return self.restore(self.all_steps()[0], model=model, opt=opt, check_extra=check_extra)
        resumed = self.restore_newest_readable(model=model, opt=opt, check_extra=check_extra)
        if resumed.skipped:
            warnings.warn(
                f"restored checkpoint step {resumed.step} of {self._directory}, the newest "
                f"that reads back whole; {'; '.join(str(s) for s in resumed.skipped)}",
                stacklevel=3,
            )
        return resumed.extra

    def restore_newest_readable(
        self,
        *,
        model: Any,
        opt: nnx.Optimizer | None = None,
        check_extra: CheckExtra | None = None,
    ) -> Resumed:
        """Restores the newest step that reads back whole, like :meth:`restore`, passing over
        newer steps that are damaged (:class:`CheckpointCorruptError`, ``check_extra``'s
        refusals included) or incomplete. With several processes, all pass over the same steps.

        Returns:
            the step restored, its ``extra`` dict and the newer steps skipped, with why.

        Raises:
            FileNotFoundError: the directory holds no step at all.
            NoReadableCheckpointError: every step is damaged or incomplete (each is named).
            CheckpointMismatchError: the newest readable step does not match the model; older
                steps are not tried (they hold the same model).

        Example:
            >>> import os, tempfile
            >>> from flax import nnx
            >>> from mmnnx.train import Checkpointer
            >>> ckpt = Checkpointer(tempfile.mkdtemp())
            >>> ckpt.save(4, model=nnx.Linear(2, 3, rngs=nnx.Rngs(0)), extra={"step": 4})
            >>> os.mkdir(ckpt.directory / "8")
            >>> resumed = ckpt.restore_newest_readable(model=nnx.Linear(2, 3, rngs=nnx.Rngs(1)))
            >>> resumed.step, resumed.extra, [str(s) for s in resumed.skipped]
            (4, {'step': 4}, ['skipped step 8: incomplete (no metadata)'])
            >>> ckpt.save(9, model=nnx.Linear(2, 3, rngs=nnx.Rngs(0)), extra={"step": 4})
            >>> resumed = ckpt.restore_newest_readable(
            ...     model=nnx.Linear(2, 3, rngs=nnx.Rngs(1)),
            ...     check_extra=lambda step, extra: (
            ...         None if extra["step"] == step else f"its extra says step {extra['step']}"
            ...     ),
            ... )
            >>> resumed.step, [str(s) for s in resumed.skipped][0]
            (4, 'skipped step 9: damaged (its extra says step 4)')
        """
        complete, incomplete = self.all_steps(), self.incomplete_steps()
        if not complete and not incomplete:
            raise FileNotFoundError(f"no checkpoint in {os.fspath(self._directory)}")
        skipped = [Skipped(s, layout.incomplete(self._missing(s) or "")) for s in incomplete]
        for step in reversed(complete):
            try:
                extra = self.restore(step, model=model, opt=opt, check_extra=check_extra)
            except integrity.CheckpointCorruptError as e:
                skipped.append(Skipped(step, f"damaged ({e.summary})"))
                continue
            newer = sorted((k for k in skipped if k.step > step), key=lambda k: -k.step)
            return Resumed(step, extra, newer)
        skipped.sort(key=lambda k: -k.step)
        raise NoReadableCheckpointError(os.fspath(self._directory), skipped)

    def set_aside(self, steps: Sequence[int]) -> list[str]:
        """Renames the directories of ``steps`` (damaged or incomplete ones) to
        ``<step>.unreadable`` (or ``<step>.unreadable-N``), out of the listing, so that a run
        resumed from an older step can save those steps again; nothing is deleted. Holds the
        writer lock. Returns the new names (with several processes, process 0 renames them, and
        every process returns its names).

        Example:
            >>> import os, tempfile
            >>> from mmnnx.train import Checkpointer
            >>> ckpt = Checkpointer(tempfile.mkdtemp())
            >>> os.mkdir(ckpt.directory / "8")
            >>> ckpt.set_aside([8]), ckpt.incomplete_steps()
            (['8.unreadable'], [])
        """

        def rename() -> list[str]:
            self._lock.hold()
            return layout.set_aside(self._directory, steps)

        if self._me is None:
            return rename()
        what = "setting aside unreadable checkpoints"
        names = together(what, lambda: rename() if self._me == 0 else None)
        names = gather(names, what=what)[0]  # process 0's, once it renamed them
        self._orbax.reload()
        return names

    def all_steps(self) -> list[int]:
        """The complete steps in the directory, oldest first, as on disk now.

        Read afresh on each call, so steps committed by another process (or another
        ``Checkpointer``) show up; temporary directories of saves in progress or interrupted
        never do, and neither does a step directory that lacks what every committed step of its
        format holds, such as an empty ``5/`` left by a copy or a file system without atomic
        renames (see :meth:`incomplete_steps`).
        """
        return [s for s in self._orbax.steps() if self._missing(s) is None]

    def incomplete_steps(self) -> list[int]:
        """Step directories that are not complete checkpoints (skipped by :meth:`all_steps`,
        :meth:`latest_step` and a ``restore`` of the latest step), oldest first.

        Example:
            >>> import os, tempfile
            >>> from mmnnx.train import Checkpointer
            >>> ckpt = Checkpointer(tempfile.mkdtemp())
            >>> os.mkdir(ckpt.directory / "5")
            >>> ckpt.incomplete_steps(), ckpt.latest_step()
            ([5], None)
        """
        return [s for s in self._orbax.steps() if self._missing(s) is not None]

    def latest_step(self) -> int | None:
        """The newest complete step, or ``None`` when there is none.

        Example:
            >>> import tempfile
            >>> from flax import nnx
            >>> from mmnnx.train import Checkpointer
            >>> ckpt = Checkpointer(tempfile.mkdtemp())
            >>> ckpt.save(5, model=nnx.Linear(1, 1, rngs=nnx.Rngs(0)))
            >>> ckpt.latest_step()
            5
        """
        steps = self.all_steps()
        return steps[-1] if steps else None

    def _check_saved(self, step: int) -> None:
        steps = self.all_steps()
        if step not in steps:
            raise FileNotFoundError(
                f"no checkpoint for step {step} in {self._directory}; steps saved: {steps}"
            )

    def _format_of(self, step: int) -> base.Format:
        """The format step ``step`` was written in (``formats/base.py`` says how it is found)."""
        folder = self._directory / str(step)
        return next(f for f in self._readers if f.marker is None or (folder / f.marker).exists())

    def _missing(self, step: int) -> str | None:
        """What step ``step`` lacks of what every committed step of its format holds."""
        folder = self._directory / str(step)
        return next((n for n in self._format_of(step).required if not (folder / n).exists()), None)

    def close(self) -> None:
        """Waits for pending work, releases Orbax's resources and the writer lock."""
        self._orbax.close()
        self._lock.release()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Checkpointer({os.fspath(self._directory)!r}, steps={self.all_steps()})"


def _step_number(step: Any) -> int:
    """``step`` as an int; a ``ValueError`` for anything but a non-negative int (``2.5`` or
    ``"2"`` would otherwise name another step, or none, without a word)."""
    if isinstance(step, bool) or not isinstance(step, int | np.integer) or step < 0:
        raise ValueError(f"step must be a non-negative int, not {step!r}")
    return int(step)


def _read_together(what: str, read: Callable[[], Any]) -> Any:
    """``read()``, this process's part of reading a step (a collective). A damaged file may
    fail one process only: every process then raises the first failure, a checkpoint's error as
    such (so that all pass over the same steps), any other as a ``RuntimeError`` naming it."""
    if jax.process_count() == 1:
        return read()
    error: Exception | None = None
    try:
        result = read()
    except Exception as e:
        error, result = e, None
    reports = gather(_report(error), what=what, timeout_s=3600.0)
    first = next((p for p, report in enumerate(reports) if report), None)
    if first is None:
        return result
    if first == jax.process_index():
        raise error  # type: ignore[misc]
    report = reports[first]
    if report["kind"] == "corrupt":
        raise integrity.CheckpointCorruptError.reported(report["error"]) from error
    if report["kind"] == "mismatch":
        raise tree.CheckpointMismatchError(report["error"]) from error
    raise RuntimeError(f"{what} failed on process {first}: {report['error']}") from error


def _report(error: Exception | None) -> dict[str, Any] | None:
    if error is None:
        return None
    if isinstance(error, integrity.CheckpointCorruptError):
        return {"kind": "corrupt", "error": error.report()}
    if isinstance(error, tree.CheckpointMismatchError):
        return {"kind": "mismatch", "error": str(error)}
    return {"kind": "other", "error": f"{type(error).__name__}: {error}"}
