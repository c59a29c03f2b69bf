"""Writing a model's Variables as a Hugging Face checkpoint directory, process by process."""

from __future__ import annotations

import functools
import json
import os
import pathlib
import shutil
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from mmnnx._nnx import variables_of
from mmnnx.distributed.gather import together
from mmnnx.models.pretrained.files import (
    CONFIG,
    DTYPES,
    INDEX,
    TORCH_DTYPES,
    CheckpointError,
    CheckpointFiles,
    shard_name,
    write_shards,
)
from mmnnx.models.pretrained.names import TensorRule, tensors_of
from mmnnx.sharding.rules import path_str

MAX_SHARD_BYTES = 5 * 2**30
"""The largest shard file ``save_pretrained`` writes by default (as transformers: 5 GB)."""


class Layout(NamedTuple):
    """A checkpoint's config file and ``single`` safetensors file (or shards and index)."""

    config: str = CONFIG
    single: str | None = None


CHECKPOINT = Layout()


class _Tensor(NamedTuple):
    name: str
    path: str
    slot: tuple[int, ...]
    rule: TensorRule
    shape: tuple[int, ...]
    writer: int


def _covers(
    indices: Mapping[Any, tuple], shape: tuple[int, ...], slot: tuple[int, ...]
) -> list[int]:
    """The processes whose devices (holding ``indices``) together hold all of ``slot``."""

    def volume(box: Sequence[tuple[int, int]]) -> int:
        return int(np.prod([b - a for a, b in box]))

    region = [(i, i + 1) for i in slot] + [(0, n) for n in shape[len(slot) :]]
    size = volume(region)
    held: dict[int, set[tuple]] = {}
    for device, index in indices.items():
        bounds = [s.indices(n)[:2] for s, n in zip(index, shape, strict=True)]
        box = [(max(a, lo), min(b, hi)) for (a, b), (lo, hi) in zip(region, bounds, strict=True)]
        if all(lo < hi for lo, hi in box):
            held.setdefault(device.process_index, set()).add(tuple(box))
    return sorted(p for p, boxes in held.items() if sum(map(volume, boxes)) == size)


def _host_shards(value: jax.Array) -> list[tuple[tuple, np.ndarray]]:
    """This process's distinct shards of ``value`` on the host, each with its index."""
    shards = {}
    for shard in value.addressable_shards:
        key = tuple((s.start, s.stop) for s in shard.index)
        if key not in shards:
            shards[key] = (shard.index, np.asarray(shard.data))
    return list(shards.values())


def _local_slot(
    shards: list[tuple[tuple, np.ndarray]], shape: tuple[int, ...], slot: tuple[int, ...]
) -> np.ndarray:
    """Slot ``slot`` of an array of ``shape`` assembled from this process's ``shards``."""
    out = np.empty(shape[len(slot) :], dtype=shards[0][1].dtype)
    for index, data in shards:
        lead = [s.indices(n)[:2] for s, n in zip(index, shape, strict=False)][: len(slot)]
        if all(lo <= i < hi for (lo, hi), i in zip(lead, slot, strict=True)):
            out[index[len(slot) :]] = data[
                tuple(i - lo for (lo, _), i in zip(lead, slot, strict=True))
            ]
    return out


@functools.cache
def _replicated(sharding: jax.sharding.NamedSharding) -> Any:
    spread = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    return jax.jit(lambda x: x, out_shardings=spread)


def _plan(
    values: Mapping[str, jax.Array], rules: Sequence[TensorRule]
) -> tuple[list[_Tensor], dict[str, jax.Array]]:
    """Every tensor to write and its writer; the values no one process holds replicated."""
    tensors, gathered = [], {}
    for path, value in values.items():
        found = tensors_of(path, value.shape, rules)
        if found is None:
            raise CheckpointError(
                f"no tensor rule writes Variable {path!r}; add a TensorRule whose variable "
                "template matches it"
            )
        rule, names = found
        try:
            shape = rule.tensor_shape(value.shape)
        except ValueError as e:
            raise CheckpointError(f"Variable {path!r}: {e}") from None
        indices = value.sharding.devices_indices_map(value.shape)
        spread = None
        for slot, name in names.items():
            covering = _covers(indices, value.shape, slot)
            if not covering:  # a task spanning processes, sharded: replicate within it
                if path not in gathered:
                    gathered[path] = _replicated(value.sharding)(value)
                    spread = gathered[path].sharding.devices_indices_map(value.shape)
                covering = _covers(spread, value.shape, slot)
            tensors.append(
                _Tensor(name=name, path=path, slot=slot, rule=rule, shape=shape, writer=covering[0])
            )
    return tensors, gathered


def _files(
    tensors: list[_Tensor], itemsize: int, max_bytes: int
) -> list[tuple[int, list[_Tensor]]]:
    """Tensors grouped into each process's shard files of at most ``max_bytes`` (or one)."""
    files: list[tuple[int, list[_Tensor]]] = []
    for process in sorted({t.writer for t in tensors}):
        size = 0
        for t in (t for t in tensors if t.writer == process):
            nbytes = int(np.prod(t.shape)) * itemsize
            if not files or files[-1][0] != process or (size + nbytes > max_bytes and size):
                files.append((process, []))
                size = 0
            files[-1][1].append(t)
            size += nbytes
    return files


def write_checkpoint(
    values: Mapping[str, jax.Array],
    directory: str | os.PathLike,
    rules: Sequence[TensorRule],
    *,
    config: dict[str, Any] | None,
    dtype: Any,
    extra_files: Sequence[str | os.PathLike] = (),
    max_shard_bytes: int = MAX_SHARD_BYTES,
    overwrite: bool = False,
    layout: Layout = CHECKPOINT,
    quantize: Callable[[str, np.ndarray], Mapping[str, np.ndarray] | None] | None = None,
) -> pathlib.Path:
    """Writes ``values`` by ``rules`` on every process (a collective) into a staging directory
    that replaces ``directory`` once complete (a failed save leaves an earlier one intact);
    ``quantize`` (``quantized.quantizing``) writes a tensor as the tensors it returns."""
    directory = pathlib.Path(directory)
    dtype = np.dtype(dtype)
    if dtype not in DTYPES.values():
        raise CheckpointError(f"{directory}: safetensors cannot hold dtype {dtype}")
    if directory.exists() and not overwrite:
        raise CheckpointError(f"{directory} exists; pass overwrite=True to replace it")
    tensors, gathered = _plan(values, rules)
    files = _files(tensors, dtype.itemsize, max_shard_bytes)
    staging = directory.parent / f".{directory.name}.partial"
    me = jax.process_index()

    def prepare() -> None:
        if me == 0:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)

    def write_mine() -> None:
        for i, (process, group) in enumerate(files):
            if process != me:
                continue
            out, held = {}, (None, [])
            for t in group:
                value = gathered.get(t.path, values[t.path])
                if held[0] != t.path:  # a Variable's slots come one after the other
                    held = (t.path, _host_shards(value))
                part = _local_slot(held[1], value.shape, t.slot)
                if t.rule.transpose is not None:
                    part = part.transpose(np.argsort(t.rule.transpose))
                stored = quantize(t.name, part) if quantize else None
                out |= stored if stored is not None else {t.name: part.astype(dtype)}
            write_shards(staging, {shard_name(i, len(files)): out})

    def finish() -> None:
        if me != 0:
            return
        names = [shard_name(i, len(files)) for i in range(len(files))]
        joined = CheckpointFiles(staging)
        if layout.single is not None:  # small (adapters): joined here, read back whole
            write_shards(staging, {layout.single: {t: joined.read(t) for t in joined.tensors}})
            for name in names:
                (staging / name).unlink()
        else:
            weight_map = {name: info.file for name, info in joined.tensors.items()}
            total = sum(
                int(np.prod(info.shape)) * DTYPES[info.dtype].itemsize
                for info in joined.tensors.values()
            )
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (staging / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        if config is not None:
            (staging / layout.config).write_text(json.dumps(config, indent=2) + "\n")
        for extra in extra_files:
            shutil.copy(extra, staging / pathlib.Path(extra).name)
        old = directory.parent / f".{directory.name}.old"
        if directory.exists():
            shutil.rmtree(old, ignore_errors=True)
            directory.rename(old)
        try:
            staging.rename(directory)
        except OSError:
            if old.exists():  # the earlier checkpoint back where it was
                old.rename(directory)
            raise
        shutil.rmtree(old, ignore_errors=True)

    try:
        for what, work in (("prepare", prepare), ("write", write_mine), ("finish", finish)):
            if jax.process_count() == 1:
                work()
            else:
                together(f"save_pretrained {directory} ({what})", work)
    except BaseException:
        if me == 0:  # the files written so far are half a checkpoint: not left lying beside it
            shutil.rmtree(staging, ignore_errors=True)
        raise
    return directory


def model_values(model: Any) -> dict[str, jax.Array]:
    return {path_str(p): v.get_value() for p, v in variables_of(model)}


def torch_dtype_of(dtype: Any) -> str:
    """``config.json``'s name for ``dtype`` (``"bfloat16"``, ``"float32"``, ...).

    Example:
        >>> torch_dtype_of(np.float32)
        'float32'
    """
    name = np.dtype(dtype).name
    if name not in TORCH_DTYPES:
        raise CheckpointError(
            f"dtype {name}: Hugging Face checkpoints are written in {', '.join(TORCH_DTYPES)}"
        )
    return name
