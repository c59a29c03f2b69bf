"""A checkpoint directory's layout: one directory per step, committed by an atomic rename.

On-disk layout, one directory per step (Orbax's ``CheckpointManager`` with four items)::

    <directory>/
      3/                          # a complete step: only ever created by an atomic rename
        _CHECKPOINT_METADATA      # Orbax's step metadata (timestamps, item names)
        model/                    # Orbax PyTree: {"layers": {"0": {"kernel": ...}}, ...}
          _METADATA  _sharding  manifest.ocdbt  ocdbt.process_0/ ...
        opt/                      # {"opt_state": {"0": {"mu": {...}, ...}}, "step": ...}
        extra/metadata            # the JSON ``extra`` dict
        mmnnx/metadata            # JSON: format version, per Variable type, task, RNG key impl
      4.orbax-checkpoint-tmp/     # a save in progress (or one that was interrupted)

The saved trees are nested dicts keyed by the Variables' paths (``"0"`` for a list index).

With several processes, every process writes its own part of a step
(``formats/process_arrays.py``)::

    <directory>/
      3/
        _CHECKPOINT_METADATA
        arrays/model/blocks/0/attn/q/kernel/   # a zarr array, one chunk per slice of its layout
        arrays/opt/...
        extra/metadata
        mmnnx/metadata    # the manifest: each array's shape, dtype, chunks (checksum, writer)
      4.orbax-checkpoint-tmp-processes/   # a save in progress (or one that was interrupted)

A step directory set aside as unreadable is renamed ``<step>.unreadable`` (``-N`` added when
taken), out of the listing.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections.abc import Callable, Sequence
from typing import Any

import orbax.checkpoint as ocp
from etils import epath

MODEL, OPT, EXTRA, META = "model", "opt", "extra", "mmnnx"
ITEMS = (MODEL, OPT, EXTRA, META)
TMP_SUFFIX = ocp.path.atomicity.TMP_DIR_SUFFIX
STEP_METADATA = "_CHECKPOINT_METADATA"
_SET_ASIDE = ".unreadable"
_LIST_ATTEMPTS = 10


def is_local(path: epath.Path) -> bool:
    """Whether ``path`` is an existing directory of this machine's file system."""
    return "://" not in os.fspath(path) and os.path.isdir(os.fspath(path))


def fsync(path: str, *, directory: bool) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: epath.Path, *, recursive: bool = True) -> None:
    """fsyncs the files below ``root`` (in it only, unless ``recursive``), then the folders."""
    if not is_local(root):
        return
    top = os.fspath(root)
    for dirpath, _, filenames in os.walk(top, topdown=False) if recursive else [next(os.walk(top))]:
        for name in filenames:
            fsync(os.path.join(dirpath, name), directory=False)
        fsync(dirpath, directory=True)


class SyncedAtomicRename(ocp.path.atomicity.AtomicRenameTemporaryPath):
    """Orbax's atomic rename, which syncs neither its JSON files nor the rename, made durable:
    the step fsynced before the rename, the files its commit rewrote and the parent after."""

    async def finalize(self) -> None:
        """Syncs the step, commits it by the rename, then syncs the rename."""
        final = self.get_final()
        if TMP_SUFFIX in final.parent.name:  # an item inside a step not yet committed:
            await super().finalize()  # the step's own finalize syncs everything below it
            return
        await asyncio.to_thread(fsync_tree, self.get())
        await super().finalize()
        await asyncio.to_thread(fsync_tree, final, recursive=False)
        if is_local(final.parent):
            await asyncio.to_thread(fsync, os.fspath(final.parent), directory=True)


def commit(tmp: epath.Path, final: epath.Path) -> None:
    """Makes the step written into ``tmp`` durable, then commits it as ``final`` by a rename."""
    fsync_tree(tmp)
    tmp.rename(final)
    if is_local(final.parent):
        fsync(os.fspath(final.parent), directory=True)


def listing(read: Callable[[], Any]) -> Any:
    """``read()``, again if a step it was listing vanished (deleted by the writer meanwhile)."""
    for attempt in range(1, _LIST_ATTEMPTS):
        try:
            return read()
        except (FileNotFoundError, NotADirectoryError):
            time.sleep(0.01 * attempt)
    return read()


def incomplete(lacking: str) -> str:
    """Why a step that lacks ``lacking`` is not a complete checkpoint (a ``Skipped`` reason)."""
    if lacking in (STEP_METADATA, f"{META}/metadata"):
        return "incomplete (no metadata)"
    return f"incomplete (no {lacking} item)"


def remove_abandoned_saves(directory: epath.Path) -> None:
    """Removes the temporary directories of saves that never committed (call under the lock)."""
    for path in directory.iterdir():
        if TMP_SUFFIX in path.name:
            _remove(path)


def remove_unkept(
    directory: epath.Path, steps: Sequence[int], keep: int | None, *, saved: int | None = None
) -> list[int]:
    """Deletes the directories of the ``steps`` newer than the one just ``saved`` (those of a
    run that went further before this one restored an older step), then of all but ``keep`` of
    the others (oldest first): the step just saved and the newest others. Returns the newer
    steps deleted."""
    newer = [s for s in steps if saved is not None and s > saved]
    others = [s for s in steps if s != saved and s not in newer]
    room = len(others) if keep is None else max(0, keep - (saved in steps))
    for old in (*newer, *others[: max(0, len(others) - room)]):
        _remove(directory / str(old))
    return newer


def _remove(path: epath.Path) -> None:
    if is_local(path.parent):
        shutil.rmtree(os.fspath(path), ignore_errors=True)
    else:
        path.rmtree()


def set_aside(directory: epath.Path, steps: Sequence[int]) -> list[str]:
    """Renames the directories of ``steps`` to ``<step>.unreadable[-N]``; the new names."""
    names: list[str] = []
    for step in steps:
        name, n = f"{step}{_SET_ASIDE}", 0
        while (directory / name).exists():
            n += 1
            name = f"{step}{_SET_ASIDE}-{n}"
        (directory / str(step)).rename(directory / name)
        names.append(name)
    return names
