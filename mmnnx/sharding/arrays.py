"""Arrays whose devices may belong to other processes: which processes hold one, a
placeholder for a value held elsewhere, and a ``device_put`` for layouts spanning processes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np


def processes_of(sharding: Any) -> frozenset[int]:
    """The processes whose devices hold part of an array laid out as ``sharding``."""
    return frozenset(d.process_index for d in sharding.device_set)


def slice_key(index: tuple) -> tuple:
    """A hashable key for a shard's index (a tuple of slices), equal for equal slices."""
    return tuple((s.start, s.stop, s.step) for s in index)


def placeholder(shape: Sequence[int], dtype: Any, sharding: Any) -> jax.Array:
    """An array of ``shape`` on other processes' devices only, holding no data here."""
    return jax.make_array_from_single_device_arrays(tuple(shape), sharding, [], dtype=dtype)


def put(value: Any, sharding: Any) -> jax.Array:
    """``jax.device_put`` for layouts spanning processes, each keeping its own part."""
    if sharding.is_fully_addressable:
        return jax.device_put(value, sharding)
    if isinstance(value, jax.Array) and value.sharding == sharding:
        return value
    if jax.process_index() not in processes_of(sharding):
        return placeholder(np.shape(value), value.dtype, sharding)
    host = np.asarray(value)
    return jax.make_array_from_callback(
        host.shape, sharding, lambda index: host[index], dtype=host.dtype
    )
