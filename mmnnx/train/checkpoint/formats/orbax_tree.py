"""A step as Orbax's ``CheckpointManager`` writes it (four items, see ``layout``'s docstring):
:class:`OrbaxTree`, the format of one process, whose manager also lists the steps of every
format (:meth:`OrbaxTree.steps`).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from flax.traverse_util import unflatten_dict

from mmnnx.sharding.arrays import put
from mmnnx.train.checkpoint import integrity, layout
from mmnnx.train.checkpoint.formats.base import Variables
from mmnnx.train.checkpoint.layout import EXTRA, META, MODEL, OPT
from mmnnx.train.checkpoint.tree import Path, Trees, show

FORMAT_VERSION = 1


class OrbaxTree:
    """Orbax's manager, saving synchronously; each process lists and reads on its own."""

    marker: ClassVar[str | None] = None
    required: ClassVar[tuple[str, ...]] = (layout.STEP_METADATA, MODEL, META)

    def __init__(self, directory: epath.Path, process: int | None, *, use_ocdbt: bool) -> None:
        self._directory, self._process = directory, process
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None,  # the Checkpointer deletes steps, as for every format
            enable_async_checkpointing=False,
            cleanup_tmp_directories=False,  # readers must not touch a save in progress
            temporary_path_class=layout.SyncedAtomicRename,
            create=process is None,
            multiprocessing_options=ocp.options.MultiprocessingOptions()
            if process is None
            else ocp.options.MultiprocessingOptions(
                primary_host=process, active_processes={process}
            ),
        )
        handlers = {
            MODEL: ocp.StandardCheckpointHandler(use_ocdbt=use_ocdbt),
            OPT: ocp.StandardCheckpointHandler(use_ocdbt=use_ocdbt),
            EXTRA: ocp.JsonCheckpointHandler(),
            META: ocp.JsonCheckpointHandler(),
        }
        self._manager = layout.listing(
            lambda: ocp.CheckpointManager(
                directory, options=options, item_names=layout.ITEMS, item_handlers=handlers
            )
        )

    def steps(self) -> list[int]:
        """Every step directory (complete or not, of any format), oldest first, as on disk now."""

        def listed() -> list[int]:
            self._manager.reload()
            return sorted(int(s) for s in self._manager.all_steps())

        return layout.listing(listed)

    def reload(self) -> None:
        self._manager.reload()

    def save(self, step: int, trees: Trees, extra: dict[str, Any], variables: Variables) -> None:
        """See :meth:`Format.save`; each array's checksum is computed on its devices."""
        args: dict[str, Any] = {}
        described = {name: dict(info) for name, info in variables.items()}
        for item, flat in trees.items():
            sums = integrity.checksums({show(item, path): value for path, value in flat.items()})
            for name, checksum in sums.items():
                described[name]["checksum"] = checksum
            args[item] = ocp.args.StandardSave(unflatten_dict(flat))
        args[EXTRA] = ocp.args.JsonSave(extra)
        args[META] = ocp.args.JsonSave(
            {
                "format": FORMAT_VERSION,
                "variables": described,
                "extra_checksum": integrity.extra_checksum(extra),
            }
        )
        running = set(threading.enumerate())
        try:
            self._manager.save(step, args=ocp.args.Composite(**args), force=True)
        except BaseException:
            _join_writers(running)
            raise
        self._manager.wait_until_finished()

    def open(self, step: int) -> _OrbaxStep:
        """See :meth:`Format.open`: the items' tree metadata and mmnnx's JSON item."""
        folder = self._directory / str(step)
        metadata = _read(step, folder, lambda: self._manager.item_metadata(step))
        saved_items = set(metadata.keys())
        meta: dict[str, Any] = {}
        if META in saved_items:
            args = ocp.args.Composite(**{META: ocp.args.JsonRestore()})
            meta = _read(step, folder, lambda: self._manager.restore(step, args=args)[META])
        arrays = {
            item: dict(_flatten(getattr(metadata[item], "tree", metadata[item])))
            if item in saved_items and metadata[item] is not None
            else None
            for item in (MODEL, OPT)
        }
        has_extra = EXTRA in saved_items
        return _OrbaxStep(self._manager, self._process, step, folder, arrays, meta, has_extra)

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()


class _OrbaxStep:
    """One step of :class:`OrbaxTree`, opened (see :class:`SavedStep`)."""

    def __init__(
        self,
        manager: ocp.CheckpointManager,
        process: int | None,
        step: int,
        folder: epath.Path,
        arrays: dict[str, dict[Path, Any] | None],
        meta: Mapping[str, Any],
        has_extra: bool,
    ) -> None:
        self._manager, self._process, self._step, self._folder = manager, process, step, folder
        self.arrays, self.variables = arrays, meta.get("variables", {})
        self._extra_checksum, self._has_extra = meta.get("extra_checksum"), has_extra

    def read(self, targets: Trees) -> tuple[dict[str, Any] | None, Trees]:
        """See :meth:`SavedStep.read`."""
        step, folder, manager, process = self._step, self._folder, self._manager, self._process
        args: dict[str, Any] = {
            item: ocp.args.StandardRestore(
                unflatten_dict({p: _target(v, process) for p, v in flat.items()})
            )
            for item, flat in targets.items()
        }
        if self._has_extra:
            args[EXTRA] = ocp.args.JsonRestore()
        restored = _read(
            step, folder, lambda: manager.restore(step, args=ocp.args.Composite(**args))
        )
        extra = restored[EXTRA] if self._has_extra else None
        integrity.check_extra(step, folder, extra, self._extra_checksum)
        values = {item: dict(_flatten(restored[item])) for item in targets}
        named = {show(item, path): values[item][path] for item in targets for path in targets[item]}
        integrity.verify(step, folder, named, self.variables)
        laid_out = {
            item: {
                path: _laid_out(values[item][path], target, process)
                for path, target in flat.items()
            }
            for item, flat in targets.items()
        }
        return extra, laid_out


def _read(step: int, folder: epath.Path, read: Callable[[], Any]) -> Any:
    """``read()`` through Orbax, all its reads ended on return (:class:`_FinishingLoop`)."""

    def finished() -> Any:
        previous = asyncio.get_event_loop_policy()
        if type(previous) is not asyncio.DefaultEventLoopPolicy:  # a user's own (uvloop, ...)
            return read()
        asyncio.set_event_loop_policy(_FinishingLoops())
        try:
            return read()
        finally:
            asyncio.set_event_loop_policy(previous)

    return integrity.read_or_corrupt(step, folder, finished)


class _FinishingLoop(asyncio.SelectorEventLoop):
    """An event loop that lets its tasks finish before it closes: when one read of an Orbax
    0.12.8 restore fails, the others complete later, into the closed loop (an ``Event loop is
    closed`` traceback each, on stderr)."""

    def close(self) -> None:
        pending = asyncio.all_tasks(self)
        if pending and not self.is_running() and not self.is_closed():
            self.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        super().close()


class _FinishingLoops(asyncio.DefaultEventLoopPolicy):
    """The default policy, making :class:`_FinishingLoop` s (only while Orbax reads a step)."""

    _loop_factory = _FinishingLoop


def _target(value: Any, process: int | None) -> Any:
    """The restore target of a value; with several processes a host array (put after)."""
    if isinstance(value, jax.Array) and process is None:
        return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=value.sharding)
    return np.zeros(value.shape, value.dtype)  # numpy leaves restore as numpy arrays


def _laid_out(value: Any, target: Any, process: int | None) -> Any:
    """A restored ``value`` laid out as ``target``, the value it is restored into."""
    if process is not None and isinstance(target, jax.Array):
        value = put(value, target.sharding)
    if isinstance(target, jax.Array) and not target.committed:
        value = jnp.asarray(np.asarray(value))  # state on no task stays uncommitted
    return value


def _flatten(tree: Any, prefix: Path = ()) -> Iterator[tuple[Path, Any]]:
    if isinstance(tree, Mapping):
        for key, sub in tree.items():
            yield from _flatten(sub, (*prefix, str(key)))
    else:
        yield prefix, tree


def _join_writers(running: set[threading.Thread], timeout: float = 120.0) -> None:
    """Waits for the writer threads (``threading.Thread`` subclasses; executor workers idle)
    that go on writing after Orbax 0.12.8 raised for one item of a step: a retry, or the
    clean-up of temporary directories, would race them."""
    deadline = time.monotonic() + timeout
    for thread in threading.enumerate():
        if thread in running or type(thread) is threading.Thread:
            continue
        if thread is threading.current_thread() or thread.daemon:
            continue
        thread.join(max(0.0, deadline - time.monotonic()))
