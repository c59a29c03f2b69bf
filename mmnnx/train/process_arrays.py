"""A checkpoint's arrays written by every process, each the slices it holds.

With several processes, ``Checkpointer.save`` writes each array of a step with TensorStore (the
storage layer under Orbax; Orbax 0.12.8 itself writes an array held by one process only from
process 0) as a zarr array under ``arrays/<item>/<path>/``, chunked as the array is laid out:
each distinct slice is one chunk, written by the process of the first device holding it, from
that device, in parallel with the others. Nothing crosses processes and no host holds more than
its own slices. A restore reads, on each process, the chunks holding the slices its devices
need, checks each against the checksum its writer recorded, and builds each array in the layout
it has now (any mesh, task or process count).

A value held by no task (:func:`own`: a NumPy array, or an array on one device of each
process, such as an optimizer's step count made outside ``mm.jit``) is the same on every
process: process 0 writes it whole.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import tensorstore as ts
from etils import epath

Path = tuple[str, ...]
Chunk = tuple[tuple[int, ...], tuple[int, ...]]  # (start, stop) per dimension


def checksum(values: np.ndarray) -> int:
    """A position-weighted sum of ``values``' bits as uint32 words (wrapping): any changed,
    lost or moved word changes it; the same as ``checkpoint._checksum`` computes on device.

    Example:
        >>> checksum(np.arange(3, dtype=np.float32)) == checksum(np.arange(3, dtype=np.float32))
        True
        >>> checksum(np.array([1, 2], np.int32)) != checksum(np.array([2, 1], np.int32))
        True
    """
    values = np.ascontiguousarray(values)
    if values.dtype == np.bool_:
        values = values.astype(np.uint8)
    size = values.dtype.itemsize
    if size == 8:
        words = values.view(np.uint32).reshape(-1)
    else:
        unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32}[size]
        words = values.view(unsigned).reshape(-1).astype(np.uint32)
    position = np.arange(words.size, dtype=np.uint32)
    with np.errstate(over="ignore"):
        weights = position * np.uint32(2654435761) + np.uint32(1)
        return int(np.sum(words * weights, dtype=np.uint32))


def _spec(root: epath.Path, item: str, path: Path) -> dict[str, Any]:
    folder = root / "arrays" / item / "/".join(path)
    return {"driver": "zarr", "kvstore": {"driver": "file", "path": str(folder) + "/"}}


def _slices(index: tuple, shape: Sequence[int]) -> Chunk:
    starts, stops = [], []
    for s, n in zip(index, shape, strict=True):
        start, stop, _ = s.indices(n)
        starts.append(start)
        stops.append(stop)
    return tuple(starts), tuple(stops)


Values = Mapping[str, Mapping[Path, Any]]


def own(value: Any) -> bool:
    """Whether ``value`` is this process's own, as every process has one (no task holds it):
    NumPy, or an array on one device of this process (with several processes, the values of
    tasks are laid out on the task, even on one device: ``mm.jit`` hands them back so), which
    every process tells alike.

    Example:
        >>> own(np.zeros(2)), own(jax.numpy.zeros(2))
        (True, True)
    """
    return not isinstance(value, jax.Array) or (
        isinstance(value.sharding, jax.sharding.SingleDeviceSharding) and value.is_fully_addressable
    )


def _written_here(value: Any, me: int) -> Iterator[tuple[Chunk, Any]]:
    """The chunks of ``value`` this process writes, with their data (a device array or NumPy):
    those whose first holding device is its own; a value of no task, whole, on process 0."""
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


def _zarr_dtype(dtype: Any) -> str:
    """``dtype`` as zarr metadata names it (TensorStore names bfloat16 itself)."""
    dtype = np.dtype(dtype)
    return "bfloat16" if dtype.name == "bfloat16" else dtype.str


def _chunk_shape(value: Any) -> tuple[int, ...]:
    shape = tuple(np.shape(value))
    if not own(value):
        shape = value.sharding.shard_shape(shape)
    return tuple(max(1, n) for n in shape)


def _creator(value: Any) -> int:
    """The process that creates ``value``'s zarr array: the lowest holding it (0 for a value
    of no task)."""
    return 0 if own(value) else min(d.process_index for d in value.sharding.device_set)


def create(root: epath.Path, items: Values, me: int) -> None:
    """Creates the zarr arrays of the values whose creator this process is (every process
    calls it, then waits for all before :func:`write`)."""
    opening = []
    for item, flat in items.items():
        for path, value in flat.items():
            if _creator(value) != me:
                continue
            spec = {
                **_spec(root, item, path),
                "metadata": {
                    "shape": list(np.shape(value)),
                    "dtype": _zarr_dtype(value.dtype),
                    "chunks": list(_chunk_shape(value)),
                },
            }
            opening.append(ts.open(spec, create=True, delete_existing=True))
    for future in opening:
        future.result()


def write(root: epath.Path, items: Values, me: int) -> dict[str, dict[str, list]]:
    """Writes this process's chunks of every value (their zarr arrays created); returns, per
    item and ``/``-joined path, the chunks written with their checksums and writer,
    ``[[start, stop, checksum, process], ...]``."""
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
                records.append([list(start), list(stop), checksum(host), me])
    for future in pending:
        future.result()
    return written


class DamagedChunk(ValueError):
    """A chunk read back different from the checksum its writer recorded (or unreadable)."""

    def __init__(self, name: str, chunk: Chunk, cause: str):
        super().__init__(f"{name} chunk {list(chunk[0])}..{list(chunk[1])}: {cause}")
        self.name = name


def read(root: epath.Path, item: str, path: Path, record: Mapping[str, Any], target: Any) -> Any:
    """The saved array at ``path`` of ``item`` (``record``: its manifest entry, shape, dtype
    and chunks) laid out as ``target``: a ``jax.sharding.Sharding``, read as the slices this
    process's devices hold; ``None``, read whole as a NumPy array. Each chunk read is checked
    against its checksum (:class:`DamagedChunk`)."""
    name = "/".join((item, *path))
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
            if checksum(data) != expected:
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
