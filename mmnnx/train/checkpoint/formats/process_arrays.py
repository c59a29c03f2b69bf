"""A step whose arrays every process writes, each the slices it holds: :class:`ProcessArrays`,
the format of several processes.

Each array is a zarr array under ``arrays/<item>/<path>/`` written with TensorStore (Orbax
0.12.8 writes an array held by one process only from process 0), chunked as it is laid out:
each distinct slice is one chunk, written by the process of its first holding device. Nothing
crosses processes; process 0 commits the manifest, ``extra`` and the rename. A restore reads
the chunks each process's devices need, checks each against its writer's checksum, and builds
the array in the layout it has now. A value of no task (:func:`own`) is written by process 0.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import tensorstore as ts
from etils import epath

from mmnnx.distributed.gather import gather, together
from mmnnx.train.checkpoint import integrity, layout
from mmnnx.train.checkpoint.formats.base import Variables
from mmnnx.train.checkpoint.layout import EXTRA, META, MODEL, OPT, STEP_METADATA
from mmnnx.train.checkpoint.tree import Path, Trees, show

FORMAT_VERSION = 2
_ARRAYS = "arrays"
_JSON_ITEMS = "orbax.checkpoint._src.handlers.json_checkpoint_handler.JsonCheckpointHandler"
Chunk = tuple[tuple[int, ...], tuple[int, ...]]  # (start, stop) per dimension


def _spec(root: epath.Path, item: str, path: Path) -> dict[str, Any]:
    folder = root / _ARRAYS / item / "/".join(path)
    return {"driver": "zarr", "kvstore": {"driver": "file", "path": str(folder) + "/"}}


def _slices(index: tuple, shape: Sequence[int]) -> Chunk:
    bounds = [s.indices(n)[:2] for s, n in zip(index, shape, strict=True)]
    return tuple(a for a, _ in bounds), tuple(b for _, b in bounds)


def own(value: Any) -> bool:
    """Whether no task holds ``value``: NumPy, or an array on one device of this process."""
    return not isinstance(value, jax.Array) or (
        isinstance(value.sharding, jax.sharding.SingleDeviceSharding) and value.is_fully_addressable
    )


def _written_here(value: Any, me: int) -> Iterator[tuple[Chunk, Any]]:
    """The chunks of ``value`` whose first holding device is this process's, with their data."""
    shape = tuple(np.shape(value))
    if own(value):
        if me == 0:
            yield ((0,) * len(shape), shape), value
        return
    first: dict[Chunk, Any] = {}
    for device, index in value.sharding.devices_indices_map(shape).items():
        first.setdefault(_slices(index, shape), device)
    shards = {s.device: s.data for s in value.addressable_shards}
    for chunk, device in first.items():
        if device.process_index == me:
            yield chunk, shards[device]


def create(root: epath.Path, items: Trees, me: int) -> None:
    """Creates the zarr arrays of which this process is the lowest holder (0: of no task's)."""
    opening = []
    for item, flat in items.items():
        for path, value in flat.items():
            shape, dtype = tuple(np.shape(value)), np.dtype(value.dtype)
            if own(value):
                creator, chunks = 0, shape
            else:
                creator = min(d.process_index for d in value.sharding.device_set)
                chunks = value.sharding.shard_shape(shape)
            if creator != me:
                continue
            metadata = {
                "shape": list(shape),
                "dtype": "bfloat16" if dtype.name == "bfloat16" else dtype.str,  # zarr's name
                "chunks": [max(1, n) for n in chunks],
            }
            spec = {**_spec(root, item, path), "metadata": metadata}
            opening.append(ts.open(spec, create=True, delete_existing=True))
    for future in opening:
        future.result()


def write(root: epath.Path, items: Trees, me: int) -> dict[str, dict[str, list]]:
    """Writes this process's chunks: by item and path, ``[[start, stop, checksum, process]]``."""
    written: dict[str, dict[str, list]] = {}
    pending = []
    for item, flat in items.items():
        for path, value in flat.items():
            chunks = list(_written_here(value, me))
            if not chunks:
                continue
            array = ts.open(_spec(root, item, path), open=True).result()
            records = written.setdefault(item, {}).setdefault("/".join(path), [])
            for (start, stop), data in chunks:
                host = np.asarray(data)
                region = tuple(slice(a, b) for a, b in zip(start, stop, strict=True))
                pending.append(array[region].write(host))
                records.append([list(start), list(stop), integrity.checksum(host), me])
    for future in pending:
        future.result()
    return written


class DamagedChunk(ValueError):
    """A chunk read back different from the checksum its writer recorded (or unreadable)."""

    def __init__(self, name: str, chunk: Chunk, cause: str):
        super().__init__(f"{name} chunk {list(chunk[0])}..{list(chunk[1])}: {cause}")
        self.name = name


def read(root: epath.Path, item: str, path: Path, record: Mapping[str, Any], target: Any) -> Any:
    """The saved array laid out as ``target`` (``None``: whole, NumPy), its chunks checked."""
    name = show(item, path)
    shape, dtype = tuple(record["shape"]), np.dtype(record["dtype"])
    chunks = [((tuple(a), tuple(b)), s) for a, b, s, *_ in record["chunks"]]
    try:
        array = ts.open(_spec(root, item, path), open=True).result()
    except ValueError as e:
        raise DamagedChunk(name, ((0,) * len(shape), shape), str(e)) from e
    cache: dict[Chunk, np.ndarray] = {}

    def chunk_data(chunk: Chunk, expected: int) -> np.ndarray:
        if chunk not in cache:
            region = tuple(slice(a, b) for a, b in zip(*chunk, strict=True))
            try:
                data = np.asarray(array[region].read().result(), dtype=dtype)
            except ValueError as e:
                raise DamagedChunk(name, chunk, str(e)) from e
            if integrity.checksum(data) != expected:
                raise DamagedChunk(name, chunk, "fails its checksum")
            cache[chunk] = data
        return cache[chunk]

    def region(want: Chunk) -> np.ndarray:
        out = np.empty(tuple(b - a for a, b in zip(*want, strict=True)), dtype)
        covered = 0
        for chunk, expected in chunks:
            lo = [max(a, c) for a, c in zip(want[0], chunk[0], strict=True)]
            hi = [min(b, d) for b, d in zip(want[1], chunk[1], strict=True)]
            if any(a >= b for a, b in zip(lo, hi, strict=True)) and out.size:
                continue
            data = chunk_data(chunk, expected)
            src = tuple(slice(a - c, b - c) for a, b, c in zip(lo, hi, chunk[0], strict=True))
            dst = tuple(slice(a - w, b - w) for a, b, w in zip(lo, hi, want[0], strict=True))
            out[dst] = data[src]
            covered += math.prod(b - a for a, b in zip(lo, hi, strict=True))
        if covered < out.size:
            raise DamagedChunk(name, want, "no chunk holds part of it")
        return out

    if target is None:
        return region(((0,) * len(shape), shape))
    pieces = [
        jax.device_put(region(_slices(index, shape)), device)
        for device, index in target.addressable_devices_indices_map(shape).items()
    ]
    return jax.make_array_from_single_device_arrays(shape, target, pieces)


class ProcessArrays:
    """Steps whose arrays every process writes (see the module's docstring); ``process``:
    ``None`` in a job of one process, which only reads them. Each part of a save is collective;
    a process failing on the way leaves the step uncommitted."""

    marker: ClassVar[str | None] = _ARRAYS
    required: ClassVar[tuple[str, ...]] = (STEP_METADATA, f"{META}/metadata", _ARRAYS)

    def __init__(self, directory: epath.Path, process: int | None) -> None:
        self._directory, self._process = directory, process

    def save(self, step: int, trees: Trees, extra: dict[str, Any], variables: Variables) -> None:
        """See :meth:`Format.save`: each process writes its slices; then process 0 commits."""
        me, what = self._process, f"saving checkpoint step {step}"
        tmp = self._directory / f"{step}{layout.TMP_SUFFIX}-processes"
        together(what, lambda: tmp.mkdir(parents=True) if me == 0 else None)
        together(what, lambda: create(tmp, trees, me))
        written = together(what, lambda: write(tmp, trees, me))
        reports = gather(written, what=what, timeout_s=3600.0)

        def commit() -> None:
            arrays: dict[str, dict[str, Any]] = {}
            for item, flat in trees.items():
                for path, value in flat.items():
                    shape, dtype = list(np.shape(value)), np.dtype(value.dtype).name
                    arrays[show(item, path)] = {"shape": shape, "dtype": dtype, "chunks": []}
            for report in reports:
                for item, by_path in report.items():
                    for path, chunks in by_path.items():
                        arrays[f"{item}/{path}"]["chunks"] += chunks
            manifest = {
                "format": FORMAT_VERSION,
                "variables": variables,
                "arrays": arrays,
                "extra_checksum": integrity.extra_checksum(extra),
            }
            for item, content in ((META, manifest), (EXTRA, extra)):
                (tmp / item).mkdir(parents=True, exist_ok=True)
                (tmp / item / "metadata").write_text(json.dumps(content))
            now = time.time_ns()
            step_metadata = {  # as Orbax writes it, so that its listing reads the step
                "item_handlers": {EXTRA: _JSON_ITEMS, META: _JSON_ITEMS},
                "metrics": {},
                "performance_metrics": {},
                "init_timestamp_nsecs": now,
                "commit_timestamp_nsecs": now,
                "custom_metadata": {"mmnnx_format": FORMAT_VERSION},
            }
            (tmp / STEP_METADATA).write_text(json.dumps(step_metadata))
            layout.commit(tmp, self._directory / str(step))

        together(what, lambda: commit() if me == 0 else None)

    def open(self, step: int) -> _ProcessArraysStep:
        """See :meth:`Format.open`: the manifest."""
        folder = self._directory / str(step)
        content = integrity.read_or_corrupt(
            step, folder, lambda: json.loads((folder / META / "metadata").read_text())
        )
        return _ProcessArraysStep(step, folder, content)


class _ProcessArraysStep:
    """One step of :class:`ProcessArrays`, opened (see :class:`SavedStep`)."""

    def __init__(self, step: int, folder: epath.Path, manifest: Mapping[str, Any]) -> None:
        self._step, self._folder, self._manifest = step, folder, manifest
        self.variables, self._records = manifest.get("variables", {}), manifest["arrays"]
        self.arrays: dict[str, dict[Path, Any] | None] = {
            item: {
                tuple(name.split("/")[1:]): jax.ShapeDtypeStruct(
                    tuple(record["shape"]), np.dtype(record["dtype"])
                )
                for name, record in self._records.items()
                if name.split("/")[0] == item
            }
            or None
            for item in (MODEL, OPT)
        }

    def read(self, targets: Trees) -> tuple[dict[str, Any] | None, Trees]:
        """See :meth:`SavedStep.read`: each process reads the slices its devices hold now."""
        step, folder = self._step, self._folder
        extra_file = folder / EXTRA / "metadata"
        extra = (
            integrity.read_or_corrupt(step, folder, lambda: json.loads(extra_file.read_text()))
            if extra_file.exists()
            else None
        )
        integrity.check_extra(step, folder, extra, self._manifest.get("extra_checksum"))
        values: Trees = {item: {} for item in targets}
        try:
            for item, flat in targets.items():
                for path, stored in flat.items():
                    record = self._records[show(item, path)]
                    values[item][path] = _read_as(stored, folder, item, path, record)
        except DamagedChunk as e:
            raise integrity.CheckpointCorruptError(step, os.fspath(folder), array=e.name) from e
        return extra, values


def _read_as(stored: Any, folder: epath.Path, item: str, path: Path, record: Any) -> Any:
    """The saved array laid out as ``stored``; ``None`` when another process holds all of it."""
    if not own(stored):
        if not stored.sharding.addressable_devices:
            return None  # another process's: it reads it
        return read(folder, item, path, record, stored.sharding)
    value = read(folder, item, path, record, None)
    if isinstance(stored, jax.Array):
        return jax.device_put(value, stored.sharding) if stored.committed else jnp.asarray(value)
    return value
