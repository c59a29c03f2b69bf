"""Filling a model built abstractly from a checkpoint's tensors, read straight onto devices."""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import jax
import numpy as np
from flax import nnx

from mmnnx._nnx import variables_of
from mmnnx.models.pretrained.files import CheckpointError, CheckpointFiles
from mmnnx.models.pretrained.names import Source, TensorRule, match, tensors_of
from mmnnx.models.pretrained.quantized import dequantizing
from mmnnx.sharding.arrays import slice_key
from mmnnx.sharding.place import place_made
from mmnnx.sharding.rules import path_str

M = TypeVar("M")


def sources_as_read(
    model: Any, files: CheckpointFiles, rules: Sequence[TensorRule]
) -> tuple[Any, dict[str, Source]]:
    """``files`` as they are read (FP8 and MXFP4 weights dequantized:
    :mod:`~mmnnx.models.pretrained.quantized`) and every Variable's source in them, all tensors
    and shapes checked; no data read."""
    files = dequantizing(files)
    where = files.directory
    try:
        sources, unmatched = match(files.tensors, rules)
    except ValueError as e:
        raise CheckpointError(f"{where}: {e}") from None
    variables = {path_str(p): v for p, v in variables_of(model)}
    model_name = type(model).__name__
    for path, variable in variables.items():
        if path in sources:
            continue
        expected = tensors_of(path, variable.get_value().shape, rules)
        if expected is None:
            raise CheckpointError(
                f"no tensor rule fills Variable {path!r} of {model_name}; add a TensorRule "
                "whose variable template matches it"
            )
        name = next(iter(expected[1].values()))
        raise CheckpointError(
            f"{where}: missing tensor {name!r} (for Variable {path!r} of {model_name})"
        )
    extra = unmatched + [
        n for s in sources.values() if s.path not in variables for n in s.tensors.values()
    ]
    # a tensor of no elements holds nothing to fill: transformers writes DeepSeek-V3's shared
    # experts so when there are none (n_shared_experts 0)
    extra = [n for n in extra if math.prod(files.tensors[n].shape)]
    if extra:
        first = extra[0]
        raise CheckpointError(
            f"{where / files.tensors[first].file}: tensor {first!r} fills no Variable of "
            f"{model_name} ({len(extra)} such tensor{'s' if len(extra) > 1 else ''}: "
            f"{', '.join(extra[:4])}{', ...' if len(extra) > 4 else ''})"
        )
    for path, source in sources.items():
        want = tuple(variables[path].get_value().shape)
        _check_slots(files, source, want[: len(source.rule.stacked)], model_name)
        wanted = variables[path].get_value().dtype
        for name in source.tensors.values():
            info = files.tensors[name]
            stored = files.dtype(name)  # a dtype mmnnx cannot read fails here, before anything
            if _floating(wanted) and not _floating(stored):
                raise CheckpointError(
                    f"{where / info.file}: tensor {name!r} is stored as {info.dtype} "
                    f"({stored.name}), not floating point, and cannot fill Variable {path!r} "
                    f"of {model_name} ({np.dtype(wanted).name})"
                )
            try:
                got = source.stack_shape + source.rule.variable_shape(info.shape, name)
            except ValueError as e:
                raise CheckpointError(f"{where / info.file}: {e}") from None
            if got != want:
                raise CheckpointError(
                    f"{where / info.file}: tensor {name!r} has shape {info.shape}, not "
                    f"{_stored_shape(source.rule, want)}, the shape that fills Variable "
                    f"{path!r} of {model_name} (shape {want}); does config.json describe "
                    "these files?"
                )
    return files, sources


def _floating(dtype: Any) -> bool:
    return bool(jax.dtypes.issubdtype(dtype, np.floating))


def _stored_shape(rule: TensorRule, variable_shape: tuple[int, ...]) -> Any:
    try:
        return rule.tensor_shape(variable_shape)
    except ValueError:
        return "?"


def _check_slots(
    files: CheckpointFiles, source: Source, stack: tuple[int, ...], model_name: str
) -> None:
    """Raises unless the files hold one tensor for every slot of ``stack``, and none beyond."""
    per = "/".join(source.rule.stacked)
    for slot in itertools.product(*(range(n) for n in stack)):
        if slot not in source.tensors:
            raise CheckpointError(
                f"{files.directory}: missing tensor {source.name(slot)!r} (for Variable "
                f"{source.path!r} of {model_name}, {' x '.join(map(str, stack))} tensors, one "
                f"per {per})"
            )
    if stack == source.stack_shape:
        return
    extra = next(n for s, n in source.tensors.items() if any(map(int.__ge__, s, stack)))
    raise CheckpointError(
        f"{files.directory / files.tensors[extra].file}: tensor {extra!r} fills no Variable of "
        f"{model_name} (Variable {source.path!r} stacks {' x '.join(map(str, stack))} tensors, "
        f"one per {per}); does config.json describe these files?"
    )


def read_part(
    files: CheckpointFiles, source: Source, index: tuple[slice, ...], dtype: Any
) -> np.ndarray:
    """The part ``index`` of the Variable ``source`` fills, read and cast to ``dtype``."""
    rule = source.rule
    stack, inner = index[: len(rule.stacked)], index[len(rule.stacked) :]
    ranges = [range(*s.indices(n)) for s, n in zip(stack, source.stack_shape, strict=True)]
    if not ranges:
        return _read_one(files, rule, source.tensors[()], inner).astype(dtype, copy=False)
    lead = tuple(len(r) for r in ranges)
    out = None
    for at, slot in zip(np.ndindex(*lead), itertools.product(*ranges), strict=True):
        part = _read_one(files, rule, source.tensors[slot], inner)
        if out is None:  # each slot's part written in place: the stack is never held twice
            out = np.empty((*lead, *part.shape), dtype)
        out[at] = part
    return out


def _read_one(
    files: CheckpointFiles, rule: TensorRule, name: str, inner: tuple[slice, ...]
) -> np.ndarray:
    if rule.reshape is not None:  # slices of a reshaped tensor are not slices of the file
        return files.read(name, transpose=rule.transpose).reshape(rule.reshape)[inner]
    shape = files.tensors[name].shape
    order = rule.transpose or tuple(range(len(shape)))
    wanted = list(rule.part.of(shape) if rule.part else (slice(None),) * len(shape))
    for axis, part in zip(order, inner, strict=False):  # a slice of the part, in file offsets
        whole = wanted[axis]
        start, stop, _ = whole.indices(shape[axis])
        lo, hi, step = part.indices(stop - start)
        wanted[axis] = slice(start + lo, start + hi, step)
    return files.read(name, tuple(wanted), transpose=rule.transpose)


def load_into(
    model: M,
    files: CheckpointFiles,
    rules: Sequence[TensorRule],
    placement: Sequence[tuple] | Mapping | None = None,
) -> M:
    """Fills ``model``'s Variables from ``files``, each shard read where it is placed
    (quantized weights dequantized as read: :mod:`~mmnnx.models.pretrained.quantized`)."""
    files, sources = sources_as_read(model, files, rules)

    def make(path: str, variable: nnx.Variable, sharding: Any) -> jax.Array:
        source = sources[path]
        abstract = variable.get_value()
        read: dict[tuple, np.ndarray] = {}

        def shard(index: tuple[slice, ...]) -> np.ndarray:
            key = slice_key(index)
            if key not in read:
                read[key] = read_part(files, source, index, abstract.dtype)
            return read[key]

        return jax.make_array_from_callback(abstract.shape, sharding, shard, dtype=abstract.dtype)

    if placement is not None:
        return place_made(model, placement, make)
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    for path, variable in variables_of(model):
        variable.set_value(make(path_str(path), variable, device))
    return model
