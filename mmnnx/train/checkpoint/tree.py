"""Variables <-> saved arrays: what a step saves of a model and optimizer, how a step's saved
arrays are checked against them (``CheckpointMismatchError``), and the write-back of a restore.

An array is named by its item (``model`` or ``opt``) and its Variable's path as strings
(``("layers", "0", "kernel")``); a typed PRNG key is saved as its ``jax.random.key_data``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx

from mmnnx._nnx import variables_of
from mmnnx.sharding.place import SPEC_KEY, TASK_KEY
from mmnnx.train.checkpoint.layout import MODEL, OPT

Path = tuple[str, ...]
Trees = dict[str, dict[Path, Any]]  # item -> path -> array
Entries = dict[str, list[tuple[Path, nnx.Variable, Any]]]  # item -> (path, Variable, its value)


class CheckpointMismatchError(ValueError):
    """A checkpoint does not match the model or optimizer it is restored into (a path missing on
    either side, another shape, dtype or RNG key implementation); the message names the first
    mismatching path. Nothing was written into the model."""


def show(item: str, path: Path) -> str:
    """An array's name: ``item/path``."""
    return "/".join((item, *path))


def is_key(value: Any) -> bool:
    return isinstance(value, jax.Array) and jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key)


def entries(model: Any, opt: nnx.Optimizer | None) -> Entries:
    """Every Variable of ``model`` and ``opt`` with its path and value, by item."""
    found: Entries = {}
    for item, node in ((MODEL, model), (OPT, opt)):
        if node is not None:
            found[item] = [_entry(item, tuple(map(str, p)), var) for p, var in variables_of(node)]
    return found


def saved_trees(model: Any, opt: nnx.Optimizer | None) -> tuple[Trees, dict[str, dict[str, Any]]]:
    """What a step saves: the arrays by item and path, and each Variable's description."""
    found = entries(model, opt)
    variables = {
        show(item, path): _describe(var, value)
        for item, item_entries in found.items()
        for path, var, value in item_entries
    }
    return stored(found), variables


def stored(found: Entries) -> Trees:
    """The values of ``found`` as saved (an RNG key as its key data), by item and path."""
    return {
        item: {p: jax.random.key_data(v) if is_key(v) else v for p, _, v in ents}
        for item, ents in found.items()
    }


def check(step: int, saved: Mapping[str, Any], found: Entries, info: Mapping[str, Any]) -> None:
    """A :class:`CheckpointMismatchError` naming the first mismatch of ``found``, model first."""
    problems: list[str] = []
    state_mismatches = 0  # of the optimizer's arrays: its structure differs
    wanted = stored(found)
    for item, item_entries in found.items():
        arrays = saved.get(item)
        if arrays is None:
            what = "optimizer state" if item == OPT else "model state"
            problems.append(f"no {what} ({item!r}) was saved")
            continue
        compared = _compare(item, arrays, wanted[item])
        problems += compared
        state_mismatches += len(compared) if item == OPT else 0
        for path, _, value in item_entries:  # the key impl of each Variable ``info`` describes
            if path in arrays and show(item, path) in info:
                want = info[show(item, path)].get("key_impl")
                have = str(jax.random.key_impl(value)) if is_key(value) else None
                if want != have:
                    problems.append(
                        f"{show(item, path)!r} holds RNG keys of impl {want} in the checkpoint "
                        f"but {have} in the model"
                    )
    if problems and state_mismatches == len(problems):
        raise CheckpointMismatchError(
            f"checkpoint step {step}: the optimizer's state has another structure than the "
            f"saved one: {problems[0]}{_more(problems, ', all in it')}; was the optimizer "
            "changed (e.g. gradient clipping added or removed)?"
        )
    if problems:
        raise CheckpointMismatchError(f"checkpoint step {step}: {problems[0]}{_more(problems)}")


def _more(problems: list[str], where: str = "") -> str:
    """`` (and N more mismatches)`` after the first of ``problems``; nothing for one."""
    return f" (and {len(problems) - 1} more mismatches{where})" if len(problems) > 1 else ""


def write_back(step: int, found: Entries, values: Mapping[str, Mapping[Path, Any]]) -> None:
    """Writes the restored ``values`` (``None``: none here) into ``found``, once all are checked."""
    updates: list[tuple[nnx.Variable, Any]] = []
    for item, item_entries in found.items():
        for path, var, current in item_entries:
            value = values[item][path]
            if value is None:
                continue
            if is_key(current):
                value = jax.random.wrap_key_data(value, impl=jax.random.key_impl(current))
            if value.shape != current.shape or value.dtype != current.dtype:
                raise CheckpointMismatchError(
                    f"checkpoint step {step}: {show(item, path)!r} was restored as "
                    f"{value.dtype}{list(value.shape)}, not {current.dtype}{list(current.shape)}"
                )
            updates.append((var, value))
    for var, value in updates:
        var.set_value(value)


def _entry(item: str, path: Path, var: nnx.Variable) -> tuple[Path, nnx.Variable, Any]:
    value = var.get_value()
    if not isinstance(value, jax.Array | np.ndarray):
        raise TypeError(
            f"Variable {show(item, path)!r} holds a {type(value).__name__}; only Variables "
            "holding a jax.Array or a numpy array can be checkpointed"
        )
    return path, var, value


def _describe(var: nnx.Variable, value: Any) -> dict[str, Any]:
    task = var.get_metadata(TASK_KEY, None)
    info: dict[str, Any] = {
        "type": type(var).__name__,
        "task": getattr(task, "name", None),
        "spec": None if task is None else str(var.get_metadata(SPEC_KEY, None)),
    }
    if is_key(value):
        info["key_impl"] = str(jax.random.key_impl(value))
    return info


def _compare(item: str, saved: Mapping[Path, Any], wanted: Mapping[Path, Any]) -> list[str]:
    """Every difference between a saved tree's metadata and the restore targets, model first."""
    problems = []
    for path, target in wanted.items():
        where = repr(show(item, path))
        meta = saved.get(path)
        if meta is None:
            problems.append(f"{where} is in the model but missing from the checkpoint")
            continue
        shape, dtype = getattr(meta, "shape", None), getattr(meta, "dtype", None)
        if shape is None or dtype is None:
            problems.append(f"{where} is a {type(meta).__name__} in the checkpoint, not an array")
        elif tuple(shape) != tuple(np.shape(target)):
            problems.append(
                f"{where} has shape {tuple(shape)} in the checkpoint but "
                f"{tuple(np.shape(target))} in the model"
            )
        elif np.dtype(dtype) != np.dtype(target.dtype):
            problems.append(
                f"{where} has dtype {np.dtype(dtype)} in the checkpoint but "
                f"{np.dtype(target.dtype)} in the model"
            )
    extra = [path for path in saved if path not in wanted]
    return problems + [
        f"{show(item, p)!r} is in the checkpoint but not in the model" for p in extra
    ]
