"""A Hugging Face checkpoint directory on disk, read lazily by slices, written by shards."""

from __future__ import annotations

import json
import mmap
import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
TOKENIZER = "tokenizer.json"
CARRIED = (
    *(TOKENIZER, "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"),
    *("generation_config.json", "tokenizer.model"),
)
"""The files beside the weights that a checkpoint written from a loaded one carries over."""

DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
"""Safetensors dtype codes and the numpy dtypes they read as."""

TORCH_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64"}
"""The dtypes ``config.json``'s ``torch_dtype`` names, as safetensors codes."""


class CheckpointError(ValueError):
    """A checkpoint directory that does not hold what a model needs; names the file and tensor."""


def read_json(path: str | os.PathLike) -> Any:
    """The JSON value in the file ``path``; ``CheckpointError`` naming it where it has none.

    Example:
        >>> import tempfile
        >>> bad = pathlib.Path(tempfile.mkdtemp()) / "config.json"
        >>> _ = bad.write_text("{'hidden_size': 32}")
        >>> try:
        ...     read_json(bad)
        ... except CheckpointError as e:
        ...     print(str(e).replace(str(bad), "config.json")[:41])
        config.json: not JSON: Expecting property
    """
    try:
        text = pathlib.Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: cannot be read: {e}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not JSON: {e}") from None


class TensorInfo(NamedTuple):
    file: str  # relative to the directory
    shape: tuple[int, ...]
    dtype: str  # a safetensors code


class CheckpointFiles:
    """A checkpoint's tensors by name, their headers read, their data by slices.

    Example:
        >>> import tempfile
        >>> d = tempfile.mkdtemp()
        >>> write_shards(d, {"w": np.arange(6, dtype=np.float32).reshape(2, 3)})
        >>> files = CheckpointFiles(d)
        >>> files.tensors["w"].shape, files.read("w", (slice(1, 2), slice(0, 2))).tolist()
        ((2, 3), [[3.0, 4.0]])
    """

    def __init__(self, directory: str | os.PathLike):
        self.directory = pathlib.Path(directory)
        if not self.directory.is_dir():
            raise CheckpointError(f"{self.directory}: no such checkpoint directory")
        config = self.directory / CONFIG
        self.config: dict[str, Any] | None = read_json(config) if config.exists() else None
        self.tensors: dict[str, TensorInfo] = {}
        for file, names in self._files().items():
            with self._opened(file) as f:
                stored = set(f.keys())
                for name in names if names is not None else sorted(stored):
                    if name not in stored:
                        raise CheckpointError(
                            f"{self.directory / INDEX}: tensor {name!r} is mapped to {file}, "
                            "which does not hold it"
                        )
                    if name in self.tensors:
                        raise CheckpointError(
                            f"{self.directory}: tensor {name!r} is stored in both "
                            f"{self.tensors[name].file} and {file}"
                        )
                    part = f.get_slice(name)
                    self.tensors[name] = TensorInfo(file, tuple(part.get_shape()), part.get_dtype())

    def _files(self) -> dict[str, list[str] | None]:
        """Each shard file and the tensor names the index puts in it (``None``: all of them).
        ``model.safetensors`` is read alone where it is, before any index, as transformers reads
        it (a directory can hold both: the shards and index of an earlier save beside it)."""
        if (self.directory / SINGLE).is_file():
            return {SINGLE: None}
        index = self.directory / INDEX
        if index.exists():
            content = read_json(index)
            weight_map = content.get("weight_map") if isinstance(content, dict) else None
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index}: no 'weight_map' object")
            files: dict[str, list[str]] = {}
            for name, file in weight_map.items():
                if not isinstance(file, str):
                    raise CheckpointError(
                        f"{index}: weight_map: tensor {name!r} is mapped to {file!r}, not a "
                        "file name"
                    )
                files.setdefault(file, []).append(name)
            for file in files:
                if not (self.directory / file).exists():
                    raise CheckpointError(
                        f"{index}: names {file}, which is not in {self.directory}"
                    )
            return dict(files)
        if not (found := sorted(p.name for p in self.directory.glob("*.safetensors"))):
            raise CheckpointError(
                f"{self.directory}: no *.safetensors files (a Hugging Face checkpoint holds "
                f"{SINGLE} or shards listed in {INDEX})"
            )
        return {name: None for name in found}

    def dtype(self, name: str) -> np.dtype:
        code = self.tensors[name].dtype
        if code not in DTYPES:
            raise CheckpointError(
                f"{self.directory / self.tensors[name].file}: tensor {name!r} has dtype "
                f"{code}, which mmnnx cannot read (readable: {', '.join(DTYPES)})"
            )
        return DTYPES[code]

    def read(
        self, name: str, index: tuple[slice, ...] = (), transpose: Sequence[int] | None = None
    ) -> np.ndarray:
        """Part ``index`` (slices of step 1) of tensor ``name``, permuted by ``transpose``."""
        info = self.tensors[name]
        dtype = self.dtype(name)
        shape = info.shape
        if len(index) > len(shape) or not all(isinstance(s, slice) for s in index):
            raise IndexError(f"tensor {name!r} {shape}: read takes up to {len(shape)} slices")
        order = tuple(range(len(shape)) if transpose is None else transpose)
        if sorted(order) != list(range(len(shape))):
            raise ValueError(f"tensor {name!r} {shape}: transpose {order} is not a permutation")
        slices = tuple(index) + (slice(None),) * (len(shape) - len(index))
        ranges = [range(*s.indices(n)) for s, n in zip(slices, shape, strict=True)]
        if any(r.step != 1 for r in ranges):
            raise IndexError(f"tensor {name!r}: read takes slices of step 1, got {index}")
        out = _empty([len(ranges[i]) for i in order], dtype)
        if out.size == 0:
            return out
        part = out.transpose(np.argsort(order))  # out, its axes in the file's order
        inner = tuple(slice(r.start, r.stop) for r in ranges[1:])
        row = int(np.prod([len(r) for r in ranges[1:]])) * dtype.itemsize
        rows = ranges[0] if shape else range(1)
        per_block = max(1, BLOCK_BYTES // max(row, 1))
        for at in range(0, len(rows), per_block):
            block = rows[at : at + per_block]
            with self._opened(info.file) as f:
                tensor = f.get_slice(name)
                if not shape:
                    part[...] = tensor[...]
                else:
                    part[at : at + len(block)] = tensor[(slice(block.start, block.stop), *inner)]
        return out

    def _opened(self, file: str) -> Any:
        try:
            return safe_open(self.directory / file, framework="numpy")
        except Exception as e:  # safetensors' own error: a damaged or truncated file
            raise CheckpointError(f"{self.directory / file}: {e}") from None


BLOCK_BYTES = 16 * 2**20
"""How much of a tensor ``CheckpointFiles.read`` holds at once, beyond the part it returns."""


PAGED_BYTES = 2**20
"""Arrays ``read`` returns of at least this size get pages of their own (anonymous mmap), given
back when freed: reading a 0.8 GiB model left 60 MiB of ``np.empty``'s in malloc's heap."""


def _empty(shape: Sequence[int], dtype: np.dtype) -> np.ndarray:
    nbytes = int(np.prod(shape)) * dtype.itemsize
    if nbytes < PAGED_BYTES:
        return np.empty(shape, dtype)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(pages, dtype).reshape(shape)


def write_shards(
    directory: str | os.PathLike,
    shards: Mapping[str, np.ndarray] | Mapping[str, Mapping[str, np.ndarray]],
) -> None:
    """Writes tensor maps (or file name -> tensor map) as safetensors files.

    Example:
        >>> import tempfile
        >>> d = tempfile.mkdtemp()
        >>> write_shards(d, {"model-00001-of-00001.safetensors": {"b": np.zeros(2, np.int32)}})
        >>> sorted(p.name for p in pathlib.Path(d).iterdir())
        ['model-00001-of-00001.safetensors']
    """
    directory = pathlib.Path(directory)
    if shards and all(isinstance(v, np.ndarray) for v in shards.values()):
        shards = {SINGLE: shards}
    codes = {dtype: code for code, dtype in DTYPES.items()}
    for file, tensors in shards.items():
        for name, array in tensors.items():
            if np.dtype(array.dtype) not in codes:
                raise CheckpointError(
                    f"{directory / file}: tensor {name!r} has dtype {array.dtype}, which "
                    f"safetensors cannot hold (it holds {', '.join(map(str, codes))})"
                )
        save_file(
            {k: np.ascontiguousarray(v) for k, v in tensors.items()},
            str(directory / file),
            metadata={"format": "pt"},
        )


def shard_name(i: int, count: int) -> str:
    """The Hugging Face name of shard ``i`` (from 0) of ``count``.

    Example:
        >>> shard_name(0, 2)
        'model-00001-of-00002.safetensors'
    """
    return SINGLE if count == 1 else f"model-{i + 1:05d}-of-{count:05d}.safetensors"
