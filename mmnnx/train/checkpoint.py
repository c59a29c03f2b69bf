"""Checkpoints of task-placed NNX state with Orbax: ``Checkpointer``.

A checkpoint holds a model's Variables (parameters, batch statistics, RNG state, ...), optionally
an ``nnx.Optimizer``'s state (moments and step), and a JSON ``extra`` dict. Every array is written
by Orbax from the devices it lives on, as it is sharded on its task's submesh; nothing is gathered.
A restore reads each array straight into the sharding the target Variable has *now*, so a
checkpoint saved from a model placed on two tasks restores into the same architecture placed on
four tasks, or on one device, and the reverse.

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

The saved trees are nested dicts keyed by the Variables' paths, with string keys (``"0"`` for a list
index); typed PRNG keys are saved as their ``jax.random.key_data`` (``uint32``).

With several processes, every process writes its own part of a step (``process_arrays.py``)::

    <directory>/
      3/
        _CHECKPOINT_METADATA
        arrays/model/blocks/0/attn/q/kernel/   # a zarr array, one chunk per slice of its layout
        arrays/opt/...
        extra/metadata
        mmnnx/metadata    # the manifest: each array's shape, dtype, chunks (checksum, writer)
      4.orbax-checkpoint-tmp-processes/   # a save in progress (or one that was interrupted)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import re
import shutil
import socket
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx

from mmnnx._nnx import variables_of
from mmnnx.distributed.agree import share_outcome
from mmnnx.distributed.gather import gather
from mmnnx.sharding.arrays import put
from mmnnx.sharding.place import SPEC_KEY, TASK_KEY
from mmnnx.train import process_arrays

__all__ = [
    "CheckpointCorruptError",
    "CheckpointMismatchError",
    "Checkpointer",
    "NoReadableCheckpointError",
    "Resumed",
    "Skipped",
]

FORMAT_VERSION = 1
PARTS_FORMAT_VERSION = 2  # several processes: each writes its own arrays (process_arrays.py)
_MODEL, _OPT, _EXTRA, _META = "model", "opt", "extra", "mmnnx"
_ARRAYS = "arrays"
_ITEMS = (_MODEL, _OPT, _EXTRA, _META)
_TMP_SUFFIX = ocp.path.atomicity.TMP_DIR_SUFFIX
_STEP_METADATA = "_CHECKPOINT_METADATA"
_SET_ASIDE = ".unreadable"

Path = tuple[str, ...]


# -- durability ---------------------------------------------------------------------------------


def _is_local(path: epath.Path) -> bool:
    return "://" not in os.fspath(path) and os.path.isdir(os.fspath(path))


def _fsync(path: str, *, directory: bool) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: epath.Path, *, recursive: bool = True) -> None:
    """fsyncs every file below ``root``, then each directory bottom-up (local paths only).

    With ``recursive=False``, only the files directly in ``root``, then ``root`` itself.
    """
    if not _is_local(root):
        return
    top = os.fspath(root)
    if not recursive:
        with os.scandir(top) as entries:
            for entry in entries:
                if entry.is_file(follow_symlinks=False):
                    _fsync(entry.path, directory=False)
        _fsync(top, directory=True)
        return
    for dirpath, _, filenames in os.walk(top, topdown=False):
        for name in filenames:
            _fsync(os.path.join(dirpath, name), directory=False)
        _fsync(dirpath, directory=True)


class CheckpointMismatchError(ValueError):
    """A checkpoint does not match the model or optimizer it is restored into (a path missing on
    either side, another shape, dtype or RNG key implementation); the message names the first
    mismatching path. Nothing was written into the model."""


class CheckpointCorruptError(RuntimeError):
    """A checkpoint step's files cannot be read (truncated, damaged or missing).

    ``step`` and ``directory`` (the step's directory) say which checkpoint; ``file`` the damaged
    or missing file when it can be found, else ``None``; ``array`` the saved array whose data
    read back different from what was written (caught by the checksum saved with it), if that
    was the failure. Nothing was written into the model.
    """

    def __init__(
        self,
        step: int,
        directory: str,
        *,
        file: str | None = None,
        cause: BaseException | None = None,
        array: str | None = None,
    ):
        self.step, self.directory, self.file, self.array = step, directory, file, array
        if array is not None:
            what = f"the data of {array!r} reads back different from what was saved (checksum)"
        else:
            where = f"file {file}" if file else "one of its files"
            first = next((ln.strip() for ln in str(cause).splitlines() if ln.strip()), "")
            what = f"{where} cannot be read ({type(cause).__name__}: {first[:300]})"
        super().__init__(
            f"checkpoint step {step} in {directory} is damaged: {what}; restore another step "
            "(Checkpointer.all_steps() lists them) or save again"
        )


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


def _damage(error: CheckpointCorruptError) -> str:
    """The reason a :class:`Skipped` step gives for ``error``."""
    if error.array is not None:
        return f"damaged (array {error.array!r} fails its checksum)"
    return f"damaged ({error.file or 'one of its files'} cannot be read)"


@jax.jit
def _checksum(x: jax.Array) -> jax.Array:
    """A position-weighted sum of ``x``'s bits as uint32 words (wrapping): any changed, lost or
    moved word changes it. Computed where ``x`` lives; only the scalar comes to the host."""
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    size = x.dtype.itemsize
    if size == 8:
        words = jax.lax.bitcast_convert_type(x, jnp.uint32)
    else:
        unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[size]
        words = jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)
    words = words.reshape(-1)
    position = jnp.arange(words.size, dtype=jnp.uint32)
    return jnp.sum(words * (position * jnp.uint32(2654435761) + jnp.uint32(1)), dtype=jnp.uint32)


def _key_impl_problems(
    step: int, item: str, entries: Sequence[tuple[Path, Any, Any]], saved: Mapping, info: Mapping
) -> list[str]:
    """A line for each saved Variable of ``item`` whose RNG key implementation (in ``info``,
    mmnnx's metadata of the step) differs from the model's; Variables the metadata does not
    describe (a checkpoint written without it) are not compared."""
    problems = []
    for path, _, value in entries:
        if path not in saved or _show(item, path) not in info:
            continue
        want = info[_show(item, path)].get("key_impl")
        have = str(jax.random.key_impl(value)) if _is_key(value) else None
        if want != have:
            problems.append(
                f"checkpoint step {step}: {_show(item, path)!r} holds RNG keys of impl "
                f"{want} in the checkpoint but {have} in the model"
            )
    return problems


def _raise_mismatches(problems: list[str]) -> None:
    """Raises :class:`CheckpointMismatchError` with the first of ``problems``, if any."""
    if problems:
        more = f" (and {len(problems) - 1} more mismatches)" if len(problems) > 1 else ""
        raise CheckpointMismatchError(problems[0] + more)


def _extra_checksum(extra: Mapping[str, Any]) -> str:
    """The checksum of a step's ``extra`` (what a resume depends on: data position, step,
    schedule horizon, seeds), over its canonical JSON."""
    canonical = json.dumps(extra, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def _check_extra(step: int, folder: epath.Path, extra: Any, saved_checksum: str | None) -> None:
    """Raises :class:`CheckpointCorruptError` when ``extra`` (``None``: missing) does not match
    the checksum saved with the step (steps saved without one are not checked)."""
    if saved_checksum is None:
        return
    where = os.fspath(folder)
    if extra is None:
        missing = FileNotFoundError(f"the step's {_EXTRA}/ item is missing")
        raise CheckpointCorruptError(
            step, where, file=os.path.join(where, _EXTRA, "metadata"), cause=missing
        )
    if _extra_checksum(extra) != saved_checksum:
        raise CheckpointCorruptError(step, where, array=_EXTRA)


def _checksums(values: Mapping[str, Any]) -> dict[str, int]:
    sums = {name: _checksum(jnp.asarray(value)) for name, value in values.items()}
    return {name: int(value) for name, value in jax.device_get(sums).items()}


_JSON_FILES = ("_CHECKPOINT_METADATA", "_METADATA", "_sharding", "metadata")


def _damaged_file(folder: str, error: BaseException) -> str | None:
    """The file of step directory ``folder`` that ``error`` came from: a missing OCDBT manifest,
    else the longest path under ``folder`` named in the error (or its causes), else a JSON file
    that does not parse; ``None`` when none is found."""
    for item in (_MODEL, _OPT):
        item_dir = os.path.join(folder, item)
        manifest = os.path.join(item_dir, "manifest.ocdbt")
        if os.path.isdir(os.path.join(item_dir, "d")) and not os.path.exists(manifest):
            return manifest
    text, cause = "", error
    while cause is not None:
        text += f"\n{cause}"
        cause = cause.__cause__ or cause.__context__
    named = re.findall(re.escape(folder) + r"/[^\s'\",\\}]+", text)
    if named:
        return max(named, key=len).rstrip("/.")
    for root, _, files in os.walk(folder):
        for name in sorted(files):
            if name in _JSON_FILES:
                path = os.path.join(root, name)
                try:
                    with open(path, "rb") as f:
                        json.loads(f.read() or b"!")
                except (OSError, ValueError):
                    return path
    return None


class _SyncedAtomicRename(ocp.path.atomicity.AtomicRenameTemporaryPath):
    """Orbax's atomic rename, with the written data made durable before the rename commits it.

    Orbax writes a step into ``<step>.orbax-checkpoint-tmp`` and renames it to ``<step>`` once every
    item is written, but syncs neither its own JSON files nor the rename. Here every file and
    directory of the step is fsynced before the rename; right after it, the files Orbax's commit
    rewrote (``_CHECKPOINT_METADATA``, ``commit_success.txt``) and the parent directory, which
    holds the rename. Items inside a step being written are left to the step's own finalize.
    """

    async def finalize(self) -> None:
        """Syncs the step, commits it by the rename, then syncs the rename."""
        final = self.get_final()
        if _TMP_SUFFIX in final.parent.name:  # an item inside a step not yet committed:
            await super().finalize()  # the step's own finalize syncs everything below it
            return
        await asyncio.to_thread(_fsync_tree, self.get())
        await super().finalize()
        await asyncio.to_thread(_fsync_tree, final, recursive=False)
        if _is_local(final.parent):
            await asyncio.to_thread(_fsync, os.fspath(final.parent), directory=True)


_WRITER_LOCK = ".mmnnx-writer.lock"
_LIST_ATTEMPTS = 10


class CheckpointDirectoryBusyError(RuntimeError):
    """Another writer (a ``Checkpointer`` in this or another process) holds the checkpoint
    directory; the message names it (host, process id, since when)."""


class _WriterLock:
    """One writer per checkpoint directory: an ``flock`` on ``.mmnnx-writer.lock``, taken when a
    ``Checkpointer`` first writes (or :meth:`Checkpointer.claim`) and held until it is closed,
    with the holder (host, process id, since when) written in the file for the next one to name.

    The holder's lock ends with its process, so the lock of a process that died is taken over
    (saying so, from the holder it left in the file). While it is held, a temporary directory
    belongs to no save in progress: its writer died or failed, and it may be removed. Readers
    never take it and never remove anything. Remote (non-local) directories have no lock: there
    only one writer may use a directory.
    """

    def __init__(self, directory: epath.Path):
        self._directory = directory
        self._fd: int | None = None

    def hold(self) -> None:
        """Takes the lock unless this writer holds it already.

        Raises:
            CheckpointDirectoryBusyError: another writer holds it.
        """
        if self._fd is not None or not _is_local(self._directory):
            return
        self._directory.mkdir(parents=True, exist_ok=True)
        path = os.path.join(os.fspath(self._directory), _WRITER_LOCK)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise CheckpointDirectoryBusyError(
                f"{self._directory} is being written by another Checkpointer "
                f"({holder or 'its holder did not say who it is'}); one writer per checkpoint "
                "directory: stop that one, or write to another directory"
            ) from None
        left = _holder(fd)
        me = {"host": socket.gethostname(), "pid": os.getpid(), "since": _now()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        os.fsync(fd)
        self._fd = fd
        if left:
            warnings.warn(
                f"took over the writer lock of {self._directory} from {left}, which ended "
                "without closing its Checkpointer",
                stacklevel=4,
            )

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)  # a clean end: the next holder takes over from no one
            os.close(fd)  # releases the lock


def _holder(fd: int) -> str:
    """Who the lock file says holds it, in words (empty when it says nothing)."""
    try:
        said = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"process {said['pid']} on host {said['host']}, since {said['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return ""


def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S %Z")


def _listing(read: Callable[[], Any]) -> Any:
    """``read()``, again if a step it was listing vanished (the writer deleted a step older than
    ``max_to_keep`` meanwhile): Orbax lists the step directories, then reads each one."""
    for attempt in range(_LIST_ATTEMPTS):
        try:
            return read()
        except (FileNotFoundError, NotADirectoryError):
            if attempt == _LIST_ATTEMPTS - 1:
                raise
            time.sleep(0.01 * (attempt + 1))
    raise AssertionError("unreachable")


def _remove_abandoned_saves(directory: epath.Path) -> None:
    """Removes the temporary directories of saves that never committed (call under the lock)."""
    for path in directory.iterdir():
        if _TMP_SUFFIX in path.name:
            if _is_local(directory):
                shutil.rmtree(os.fspath(path), ignore_errors=True)
            else:
                path.rmtree()


def _join_writers(running: set[threading.Thread], timeout: float = 120.0) -> None:
    """Waits for the writer threads a failed save leaves behind.

    When one item of a step fails, Orbax 0.12.8 raises at once while the other items' writes go
    on in its background threads (``threading.Thread`` subclasses), into the step's temporary
    directory; a retry of the step, or the clean-up of temporary directories, would race them.
    Executor workers (plain ``threading.Thread``) are left alone: they idle rather than end.
    """
    deadline = time.monotonic() + timeout
    for thread in threading.enumerate():
        if thread in running or type(thread) is threading.Thread:
            continue
        if thread is threading.current_thread() or thread.daemon:
            continue
        thread.join(max(0.0, deadline - time.monotonic()))


def _together(what: str, work: Callable[[], Any]) -> Any:
    """``work()``, this process's part of a step every process takes (a collective); raises
    on every process when it failed on any, naming the first that failed."""
    error: Exception | None = None
    try:
        result = work()
    except Exception as e:
        error, result = e, None
    failures = gather(
        "" if error is None else f"{type(error).__name__}: {error}", what=what, timeout_s=3600.0
    )
    bad = next((p for p, f in enumerate(failures) if f), None)
    if bad is not None:
        raise RuntimeError(f"{what} failed on process {bad}: {failures[bad]}") from error
    return result


# -- the saved tree -----------------------------------------------------------------------------


def _variables(node: Any) -> list[tuple[Path, nnx.Variable]]:
    """Every Variable reachable from ``node`` (shared ones once), with its path as strings."""
    return [(tuple(str(k) for k in path), var) for path, var in variables_of(node)]


def _is_key(value: Any) -> bool:
    return isinstance(value, jax.Array) and jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key)


def _show(item: str, path: Path) -> str:
    return "/".join((item, *path))


def _leaf(item: str, path: Path, var: nnx.Variable) -> Any:
    value = var.get_value()
    if not isinstance(value, jax.Array | np.ndarray):
        raise TypeError(
            f"Variable {_show(item, path)!r} holds a {type(value).__name__}; only Variables "
            "holding a jax.Array or a numpy array can be checkpointed"
        )
    return value


def _nest(flat: Mapping[Path, Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for path, value in flat.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree


def _flatten(tree: Any, prefix: Path = ()) -> Iterator[tuple[Path, Any]]:
    if isinstance(tree, Mapping):
        for key, sub in tree.items():
            yield from _flatten(sub, (*prefix, str(key)))
    else:
        yield prefix, tree


def _tree_of(metadata: Any) -> Any:
    """The nested dict of an Orbax item's tree metadata."""
    return getattr(metadata, "tree", metadata)


def _describe(item: str, path: Path, var: nnx.Variable) -> dict[str, Any]:
    value = var.get_value()
    task = var.get_metadata(TASK_KEY, None)
    info: dict[str, Any] = {
        "type": type(var).__name__,
        "task": getattr(task, "name", None),
        "spec": None if task is None else str(var.get_metadata(SPEC_KEY, None)),
    }
    if _is_key(value):
        info["key_impl"] = str(jax.random.key_impl(value))
    return info


# -- restore targets ----------------------------------------------------------------------------


def _target(value: Any, process: int | None) -> Any:
    """The restore target of a current value: its shape, dtype and current sharding; with
    several processes (``process`` is this one's index), a host array, moved to its sharding
    after reading (each process keeps its own part)."""
    if _is_key(value):
        value = jax.random.key_data(value)
    if isinstance(value, jax.Array) and process is None:
        return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=value.sharding)
    return np.zeros(value.shape, value.dtype)  # numpy leaves restore as numpy arrays


def _stored(value: Any) -> jax.ShapeDtypeStruct:
    """The shape and dtype ``value`` is stored with (an RNG key as its key data)."""
    if _is_key(value):
        value = jax.random.key_data(value)
    return jax.ShapeDtypeStruct(np.shape(value), value.dtype)


def _compare(
    step: int, item: str, saved: Mapping[Path, Any], wanted: Mapping[Path, Any]
) -> list[str]:
    """Every difference between a saved tree's metadata and the restore targets, model first."""
    problems = []
    for path, target in wanted.items():
        where = repr(_show(item, path))
        meta = saved.get(path)
        if meta is None:
            problems.append(f"{where} is in the model but missing from the checkpoint")
            continue
        shape, dtype = getattr(meta, "shape", None), getattr(meta, "dtype", None)
        if shape is None or dtype is None:
            problems.append(f"{where} is a {type(meta).__name__} in the checkpoint, not an array")
        elif tuple(shape) != tuple(target.shape):
            problems.append(
                f"{where} has shape {tuple(shape)} in the checkpoint but {tuple(target.shape)} "
                "in the model"
            )
        elif np.dtype(dtype) != np.dtype(target.dtype):
            problems.append(
                f"{where} has dtype {np.dtype(dtype)} in the checkpoint but "
                f"{np.dtype(target.dtype)} in the model"
            )
    for path in saved:
        if path not in wanted:
            problems.append(f"{_show(item, path)!r} is in the checkpoint but not in the model")
    return [f"checkpoint step {step}: {p}" for p in problems]


# -- the checkpointer ---------------------------------------------------------------------------


class Checkpointer:
    """Saves and restores task-placed NNX models and optimizers, one directory per step.

    Wraps an Orbax ``CheckpointManager`` that saves synchronously: ``save`` returns once the step
    is written, fsynced and committed by an atomic rename of its temporary directory, so an
    interrupted save (an exception, a killed process) leaves the previous steps intact and
    ``latest_step()`` on the last complete one. Leftover temporary directories of interrupted
    saves are removed by the next save, which holds the directory's writer lock
    (``.mmnnx-writer.lock``) from start to commit: any temporary directory it finds belongs to
    no save in progress. Opening a ``Checkpointer`` and reading from it (``latest_step``,
    ``all_steps``, ``restore``) never removes anything, so any number of readers may watch a
    directory while one process saves into it. Only the newest ``max_to_keep`` steps are kept
    (``None`` keeps all); older ones are deleted after a new step is committed.

    Args:
        directory: where the steps live; created if missing.
        max_to_keep: how many of the newest steps to keep (a positive int), or ``None`` for all.
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
        self._max_to_keep = max_to_keep
        # With several processes, each has its own manager that never waits for the others:
        # it lists and reads steps; saves go through _save_parts, which writes every process's
        # own arrays and commits on process 0.
        self._me = jax.process_index() if jax.process_count() > 1 else None
        if self._me is not None:
            self._directory.mkdir(parents=True, exist_ok=True)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            enable_async_checkpointing=False,
            cleanup_tmp_directories=False,  # readers must not touch a save in progress
            temporary_path_class=_SyncedAtomicRename,
            create=self._me is None,
            multiprocessing_options=ocp.options.MultiprocessingOptions()
            if self._me is None
            else ocp.options.MultiprocessingOptions(
                primary_host=self._me, active_processes={self._me}
            ),
        )
        handlers = {
            _MODEL: ocp.StandardCheckpointHandler(use_ocdbt=use_ocdbt),
            _OPT: ocp.StandardCheckpointHandler(use_ocdbt=use_ocdbt),
            _EXTRA: ocp.JsonCheckpointHandler(),
            _META: ocp.JsonCheckpointHandler(),
        }
        self._lock = _WriterLock(self._directory)
        self._manager = _listing(
            lambda: ocp.CheckpointManager(
                self._directory, options=options, item_names=_ITEMS, item_handlers=handlers
            )
        )

    @property
    def directory(self) -> epath.Path:
        """The absolute directory holding the steps.

        Example:
            >>> import tempfile
            >>> from mmnnx.train import Checkpointer
            >>> with Checkpointer(tempfile.mkdtemp()) as ckpt:
            ...     ckpt.directory.is_dir()
            True
        """
        return self._directory

    # -- save -----------------------------------------------------------------------------------

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
            _together(
                f"claiming checkpoint directory {self._directory}",
                lambda: self._lock.hold() if self._me == 0 else None,
            )

    def save(
        self,
        step: int,
        *,
        model: Any,
        opt: nnx.Optimizer | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        """Writes ``model``'s Variables, ``opt``'s state and ``extra`` as checkpoint ``step``.

        Every Variable of ``model`` (any NNX graph node) is saved, each array from the devices it
        is on, with its current sharding; ``opt`` adds the optimizer state, including its step.
        ``extra`` is a JSON-able dict (data position, seeds, ...), returned by ``restore`` as JSON
        gives it back (tuples become lists, keys strings). Returns once the step is durable and
        committed; an exception on the way leaves no trace of the step but a temporary directory.

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
        if isinstance(step, bool) or not isinstance(step, int | np.integer) or step < 0:
            raise ValueError(f"step must be a non-negative int, not {step!r}")
        step = int(step)
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

        items: dict[str, dict[Path, Any]] = {}
        variables: dict[str, dict[str, Any]] = {}
        for item, node in ((_MODEL, model), (_OPT, opt)):
            if node is None:
                continue
            flat = items[item] = {}
            for path, var in _variables(node):
                value = _leaf(item, path, var)
                flat[path] = jax.random.key_data(value) if _is_key(value) else value
                variables[_show(item, path)] = _describe(item, path, var)
        if self._me is not None:
            self._save_parts(step, items, extra, variables)
            return
        args: dict[str, Any] = {}
        for item, flat in items.items():
            sums = _checksums({_show(item, path): value for path, value in flat.items()})
            for name, checksum in sums.items():
                variables[name]["checksum"] = checksum
            args[item] = ocp.args.StandardSave(_nest(flat))
        args[_EXTRA] = ocp.args.JsonSave(extra)
        args[_META] = ocp.args.JsonSave(
            {
                "format": FORMAT_VERSION,
                "variables": variables,
                "extra_checksum": _extra_checksum(extra),
            }
        )
        self._write(step, args)

    def _save_parts(
        self,
        step: int,
        items: dict[str, dict[Path, Any]],
        extra: dict[str, Any],
        variables: dict[str, dict[str, Any]],
    ) -> None:
        """A save with several processes, every one a collective step in the same order: each
        process writes its own slices of every array (:mod:`process_arrays`) into the step's
        temporary directory, in parallel; process 0, which holds the writer lock throughout,
        commits the step (manifest, ``extra``, one atomic rename) once every process has
        written, and tells the others. A process failing or dying on the way leaves the step
        uncommitted (and the previous one the latest)."""
        me, what = self._me, f"saving checkpoint step {step}"
        tmp = self._directory / f"{step}{_TMP_SUFFIX}-processes"
        if me == 0:
            _remove_abandoned_saves(self._directory)
        _together(what, lambda: tmp.mkdir(parents=True) if me == 0 else None)
        _together(what, lambda: process_arrays.create(tmp, items, me))
        written = _together(what, lambda: process_arrays.write(tmp, items, me))
        reports = gather(written, what=what, timeout_s=3600.0)
        _together(
            what,
            lambda: (
                self._commit_parts(step, tmp, items, reports, extra, variables) if me == 0 else None
            ),
        )
        self._manager.reload()

    def _commit_parts(
        self,
        step: int,
        tmp: epath.Path,
        items: dict[str, dict[Path, Any]],
        reports: list[dict[str, Any]],
        extra: dict[str, Any],
        variables: dict[str, dict[str, Any]],
    ) -> None:
        """Process 0's part of :meth:`_save_parts`, once every process has written: the
        manifest (each array's shape, dtype and chunks with their checksums), ``extra``, and
        the atomic rename; then the steps older than ``max_to_keep`` go."""
        arrays: dict[str, dict[str, Any]] = {}
        for item, flat in items.items():
            for path, value in flat.items():
                arrays[_show(item, path)] = {
                    "shape": list(np.shape(value)),
                    "dtype": np.dtype(value.dtype).name,
                    "chunks": [],
                }
        for report in reports:
            for item, by_path in report.items():
                for path, chunks in by_path.items():
                    arrays[f"{item}/{path}"]["chunks"] += chunks
        manifest = {
            "format": PARTS_FORMAT_VERSION,
            "variables": variables,
            "arrays": arrays,
            "extra_checksum": _extra_checksum(extra),
        }
        for item, content in ((_META, manifest), (_EXTRA, extra)):
            (tmp / item).mkdir(parents=True, exist_ok=True)
            (tmp / item / "metadata").write_text(json.dumps(content))
        json_items = "orbax.checkpoint._src.handlers.json_checkpoint_handler.JsonCheckpointHandler"
        now = time.time_ns()
        (tmp / _STEP_METADATA).write_text(  # as Orbax writes it, so its listing reads the step
            json.dumps(
                {
                    "item_handlers": {_EXTRA: json_items, _META: json_items},
                    "metrics": {},
                    "performance_metrics": {},
                    "init_timestamp_nsecs": now,
                    "commit_timestamp_nsecs": now,
                    "custom_metadata": {"mmnnx_format": PARTS_FORMAT_VERSION},
                }
            )
        )
        final = self._directory / str(step)
        _fsync_tree(tmp)
        tmp.rename(final)
        if _is_local(final.parent):
            _fsync(os.fspath(final.parent), directory=True)
        keep = self._max_to_keep
        steps = self.all_steps()
        for old in steps[: len(steps) - keep] if keep is not None else ():
            shutil.rmtree(os.fspath(self._directory / str(old)), ignore_errors=True)

    def _write(self, step: int, args: dict[str, Any]) -> None:
        running = set(threading.enumerate())
        self._lock.hold()
        _remove_abandoned_saves(self._directory)
        try:
            self._manager.save(step, args=ocp.args.Composite(**args), force=True)
        except BaseException:
            _join_writers(running)
            raise
        self._manager.wait_until_finished()

    def wait(self) -> None:
        """Waits for a save in flight; saves are synchronous, so this returns at once.

        Example:
            >>> import tempfile
            >>> from mmnnx.train import Checkpointer
            >>> Checkpointer(tempfile.mkdtemp()).wait()
        """
        self._manager.wait_until_finished()

    # -- restore --------------------------------------------------------------------------------

    def restore(
        self, step: int | None = None, *, model: Any, opt: nnx.Optimizer | None = None
    ) -> dict[str, Any]:
        """Restores checkpoint ``step`` (default: the latest) into ``model`` and ``opt`` in place.

        Each array is read directly into the sharding its Variable has now, which may differ from
        the one it was saved with (other tasks, another mesh, one device); values are bit-exact.
        The results are written into the same Variable objects (``set_value``), keeping their
        metadata. Everything is checked against the checkpoint's metadata first, and nothing is
        written unless every array was read. Without ``opt``, saved optimizer state is ignored.

        Returns:
            the ``extra`` dict saved with the step.

        Without ``step``, the newest step that reads back whole is restored, passing over newer
        damaged or incomplete ones with a warning that names each and why
        (:meth:`restore_newest_readable`).

        Raises:
            FileNotFoundError: no checkpoint (or no such step) in the directory.
            NoReadableCheckpointError: without ``step``: every step is damaged or incomplete
                (each is named; a directory of one damaged step raises that step's
                ``CheckpointCorruptError``).
            CheckpointMismatchError: (a ``ValueError``) the checkpoint does not match (a path
                missing on either side, another shape, dtype or RNG key implementation, no
                optimizer state saved), naming the first mismatching path; the model and
                optimizer are left untouched.
            CheckpointCorruptError: a file of the step is damaged or missing (naming it), or an
                array reads back different from its saved checksum; nothing is written.

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
        """
        if step is None:  # the newest step that reads back whole, saying what it passed over
            if len(self.all_steps()) == 1 and not self.incomplete_steps():
                return self.restore(self.all_steps()[0], model=model, opt=opt)  # its own error
            resumed = self.restore_newest_readable(model=model, opt=opt)
            if resumed.skipped:
                warnings.warn(
                    f"restored checkpoint step {resumed.step} of {self._directory}, the newest "
                    f"that reads back whole; {'; '.join(str(s) for s in resumed.skipped)}",
                    stacklevel=2,
                )
            return resumed.extra
        steps = self.all_steps()
        step = int(step)
        if step not in steps:
            raise FileNotFoundError(
                f"no checkpoint for step {step} in {self._directory}; steps saved: {steps}"
            )

        folder = self._directory / str(step)
        if (folder / _ARRAYS).exists():
            return self._restore_parts(step, folder, model, opt)
        metadata = self._read(step, lambda: self._manager.item_metadata(step))
        saved_items = set(metadata.keys())
        meta: dict[str, Any] = {}
        if _META in saved_items:
            meta = self._read(
                step,
                lambda: self._manager.restore(
                    step, args=ocp.args.Composite(**{_META: ocp.args.JsonRestore()})
                )[_META],
            )
        info = meta.get("variables", {})

        targets: dict[str, dict[Path, Any]] = {}
        owners: dict[str, list[tuple[Path, nnx.Variable, Any]]] = {}
        problems: list[str] = []
        for item, node in ((_MODEL, model), (_OPT, opt)):
            if node is None:
                continue
            entries = []
            for path, var in _variables(node):
                entries.append((path, var, _leaf(item, path, var)))
            owners[item] = entries
            targets[item] = {path: _target(value, self._me) for path, _, value in entries}
            if item not in saved_items or metadata[item] is None:
                what = "optimizer state" if item == _OPT else "model state"
                problems.append(f"checkpoint step {step}: no {what} ({item!r}) was saved")
                continue
            saved = dict(_flatten(_tree_of(metadata[item])))
            problems += _compare(step, item, saved, targets[item])
            problems += _key_impl_problems(step, item, entries, saved, info)
        _raise_mismatches(problems)

        args = {item: ocp.args.StandardRestore(_nest(t)) for item, t in targets.items()}
        if _EXTRA in saved_items:
            args[_EXTRA] = ocp.args.JsonRestore()
        restored = self._read(
            step, lambda: self._manager.restore(step, args=ocp.args.Composite(**args))
        )

        extra = restored[_EXTRA] if _EXTRA in saved_items else None
        _check_extra(step, folder, extra, meta.get("extra_checksum"))
        self._verify(step, restored, owners, info)
        updates: list[tuple[nnx.Variable, Any]] = []
        for item, entries in owners.items():
            values = dict(_flatten(restored[item]))
            for path, var, current in entries:
                value = values[path]
                if self._me is not None and isinstance(current, jax.Array):
                    layout = (
                        jax.random.key_data(current) if _is_key(current) else current
                    ).sharding
                    value = put(value, layout)
                if isinstance(current, jax.Array) and not current.committed:
                    value = jnp.asarray(np.asarray(value))  # state on no task stays uncommitted
                if _is_key(current):
                    value = jax.random.wrap_key_data(value, impl=jax.random.key_impl(current))
                if value.shape != current.shape or value.dtype != current.dtype:
                    raise CheckpointMismatchError(
                        f"checkpoint step {step}: {_show(item, path)!r} was restored as "
                        f"{value.dtype}{list(value.shape)}, not {current.dtype}"
                        f"{list(current.shape)}"
                    )
                updates.append((var, value))
        for var, value in updates:
            var.set_value(value)
        return dict(extra or {})

    def _restore_parts(
        self, step: int, folder: epath.Path, model: Any, opt: nnx.Optimizer | None
    ) -> dict[str, Any]:
        """:meth:`restore` of a step saved by several processes (:meth:`_save_parts`): each
        process reads the slices of the arrays its devices hold now."""

        def manifest() -> dict[str, Any]:
            return json.loads((folder / _META / "metadata").read_text())

        content = self._read(step, manifest)
        info, arrays = content.get("variables", {}), content["arrays"]
        owners: dict[str, list[tuple[Path, nnx.Variable, Any]]] = {}
        problems: list[str] = []
        for item, node in ((_MODEL, model), (_OPT, opt)):
            if node is None:
                continue
            entries = [(path, var, _leaf(item, path, var)) for path, var in _variables(node)]
            owners[item] = entries
            saved = {
                tuple(name.split("/")[1:]): jax.ShapeDtypeStruct(
                    tuple(record["shape"]), np.dtype(record["dtype"])
                )
                for name, record in arrays.items()
                if name.split("/")[0] == item
            }
            if not saved:
                what = "optimizer state" if item == _OPT else "model state"
                problems.append(f"checkpoint step {step}: no {what} ({item!r}) was saved")
                continue
            wanted = {path: _stored(value) for path, _, value in entries}
            problems += _compare(step, item, saved, wanted)
            problems += _key_impl_problems(step, item, entries, saved, info)
        _raise_mismatches(problems)
        extra_file = folder / _EXTRA / "metadata"
        extra = (
            self._read(step, lambda: json.loads(extra_file.read_text()))
            if extra_file.exists()
            else None
        )
        _check_extra(step, folder, extra, content.get("extra_checksum"))
        updates: list[tuple[nnx.Variable, Any]] = []
        for item, entries in owners.items():
            for path, var, current in entries:
                record = arrays[_show(item, path)]
                stored = jax.random.key_data(current) if _is_key(current) else current
                try:
                    if not process_arrays.own(stored):
                        if not stored.sharding.addressable_devices:
                            continue  # another process's: it reads it
                        value = process_arrays.read(folder, item, path, record, stored.sharding)
                    else:
                        value = process_arrays.read(folder, item, path, record, None)
                        if isinstance(stored, jax.Array):
                            value = (
                                jax.device_put(value, stored.sharding)
                                if stored.committed
                                else jnp.asarray(value)
                            )
                except process_arrays.DamagedChunk as e:
                    raise CheckpointCorruptError(step, os.fspath(folder), array=e.name) from e
                if _is_key(current):
                    value = jax.random.wrap_key_data(value, impl=jax.random.key_impl(current))
                updates.append((var, value))
        for var, value in updates:
            var.set_value(value)
        return dict(extra or {})

    def restore_newest_readable(self, *, model: Any, opt: nnx.Optimizer | None = None) -> Resumed:
        """Restores the newest step that reads back whole, like :meth:`restore`, passing over
        newer steps that are damaged (:class:`CheckpointCorruptError`) or incomplete.

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
        """
        complete, incomplete = self.all_steps(), self.incomplete_steps()
        if not complete and not incomplete:
            raise FileNotFoundError(f"no checkpoint in {self._directory}")
        damaged: list[Skipped] = []
        for step in reversed(complete):
            try:
                extra = self.restore(step, model=model, opt=opt)
            except CheckpointCorruptError as e:
                damaged.append(Skipped(step, _damage(e)))
                continue
            newer = [Skipped(s, self._incomplete(s)) for s in incomplete if s > step]
            return Resumed(step, extra, sorted(damaged + newer, key=lambda k: -k.step))
        skipped = damaged + [Skipped(s, self._incomplete(s)) for s in incomplete]
        raise NoReadableCheckpointError(
            os.fspath(self._directory), sorted(skipped, key=lambda k: -k.step)
        )

    def set_aside(self, steps: Sequence[int]) -> list[str]:
        """Renames the directories of ``steps`` (damaged or incomplete ones) to
        ``<step>.unreadable`` (or ``<step>.unreadable-N``), out of the listing, so that a run
        resumed from an older step can save those steps again; nothing is deleted. Holds the
        writer lock. Returns the new names.

        Example:
            >>> import os, tempfile
            >>> from mmnnx.train import Checkpointer
            >>> ckpt = Checkpointer(tempfile.mkdtemp())
            >>> os.mkdir(ckpt.directory / "8")
            >>> ckpt.set_aside([8]), ckpt.incomplete_steps()
            (['8.unreadable'], [])
        """
        names: list[str] = []
        if self._me in (None, 0):
            self._lock.hold()
            for step in steps:
                name, n = f"{step}{_SET_ASIDE}", 0
                while (self._directory / name).exists():
                    n += 1
                    name = f"{step}{_SET_ASIDE}-{n}"
                (self._directory / str(step)).rename(self._directory / name)
                names.append(name)
        if self._me is not None:  # process 0 renamed; the others see it once it is done
            share_outcome(0, "setting aside unreadable checkpoints", None)
            self._manager.reload()
        return names

    # -- steps ----------------------------------------------------------------------------------

    def all_steps(self) -> list[int]:
        """The complete steps in the directory, oldest first, as on disk now.

        Read afresh on each call, so steps committed by another process (or another
        ``Checkpointer``) show up; temporary directories of saves in progress or interrupted
        never do, and neither does a step directory that lacks what every committed step has
        (Orbax's step metadata and the ``model`` and ``mmnnx`` items), such as an empty ``5/``
        left by a copy or a file system without atomic renames (see :meth:`incomplete_steps`).

        Example:
            >>> import tempfile
            >>> from mmnnx.train import Checkpointer
            >>> Checkpointer(tempfile.mkdtemp()).all_steps()
            []
        """

        return [s for s in self._listed() if self._complete(s)]

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
        return [s for s in self._listed() if not self._complete(s)]

    def _verify(self, step: int, restored: Any, owners: dict, info: dict) -> None:
        """Compares each restored array with the checksum saved with it (steps saved before
        checksums existed have none and are not checked)."""
        values = {}
        for item, entries in owners.items():
            read = dict(_flatten(restored[item]))
            for path, _, _ in entries:
                if "checksum" in info.get(_show(item, path), {}):
                    values[_show(item, path)] = read[path]
        for name, checksum in _checksums(values).items():
            if checksum != info[name]["checksum"]:
                folder = os.fspath(self._directory / str(step))
                raise CheckpointCorruptError(step, folder, array=name)

    def _read(self, step: int, read: Callable[[], Any]) -> Any:
        """``read()`` of step ``step``; a failure to read its files is a CheckpointCorruptError
        naming the step directory and, when it can be found, the file."""
        try:
            return read()
        except Exception as e:
            folder = os.fspath(self._directory / str(step))
            raise CheckpointCorruptError(
                step, folder, file=_damaged_file(folder, e), cause=e
            ) from e

    def _listed(self) -> list[int]:
        def listed() -> list[int]:
            self._manager.reload()
            return sorted(int(s) for s in self._manager.all_steps())

        return _listing(listed)

    def _required(self, step: int) -> tuple[str, ...]:
        """What every committed step holds: Orbax's step metadata and the model and mmnnx items,
        or, saved by several processes, the manifest and the arrays."""
        if (self._directory / str(step) / _ARRAYS).exists():
            return (_STEP_METADATA, f"{_META}/metadata", _ARRAYS)
        return (_STEP_METADATA, _MODEL, _META)

    def _complete(self, step: int) -> bool:
        folder = self._directory / str(step)
        return all((folder / name).exists() for name in self._required(step))

    def _incomplete(self, step: int) -> str:
        """Why step ``step`` is not a complete checkpoint, as a :class:`Skipped` reason."""
        folder = self._directory / str(step)
        missing = next(name for name in self._required(step) if not (folder / name).exists())
        if missing in (_STEP_METADATA, f"{_META}/metadata"):
            return "incomplete (no metadata)"
        return f"incomplete (no {missing} item)"

    def latest_step(self) -> int | None:
        """The newest complete step, or ``None`` when there is none.

        Example:
            >>> import tempfile
            >>> from flax import nnx
            >>> from mmnnx.train import Checkpointer
            >>> ckpt = Checkpointer(tempfile.mkdtemp())
            >>> print(ckpt.latest_step())
            None
            >>> ckpt.save(5, model=nnx.Linear(1, 1, rngs=nnx.Rngs(0)))
            >>> ckpt.latest_step()
            5
        """
        steps = self.all_steps()
        return steps[-1] if steps else None

    def close(self) -> None:
        """Waits for pending work and releases Orbax's resources.

        Example:
            >>> import tempfile
            >>> from mmnnx.train import Checkpointer
            >>> Checkpointer(tempfile.mkdtemp()).close()
        """
        self._manager.close()
        self._lock.release()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Checkpointer({os.fspath(self._directory)!r}, steps={self.all_steps()})"
