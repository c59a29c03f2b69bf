"""PartitionSpec checks against a mesh and an array shape, and per-device byte counts."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec


def _entry_axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    if isinstance(entry, tuple) and all(isinstance(a, str) for a in entry):
        return entry
    raise TypeError(f"PartitionSpec entry {entry!r} must be an axis name, a tuple of them, or None")


def check_spec(spec: PartitionSpec, shape: Sequence[int], mesh: Mesh, where: str) -> PartitionSpec:
    """Checks that ``spec`` can shard an array of ``shape`` on ``mesh``; returns it."""
    if not isinstance(spec, PartitionSpec):
        raise TypeError(f"{where}: spec {spec!r} is not a jax.sharding.PartitionSpec")
    if len(spec) > len(shape):
        raise ValueError(
            f"{where}: spec {spec} has {len(spec)} entries but the array has rank {len(shape)} "
            f"(shape {tuple(shape)})"
        )
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    used: dict[str, int] = {}
    for dim, entry in enumerate(spec):
        try:
            axes = _entry_axes(entry)
        except TypeError as e:
            raise TypeError(f"{where}: {e}") from None
        for axis in axes:
            if axis not in sizes:
                raise ValueError(
                    f"{where}: spec {spec} names axis {axis!r}, which the mesh lacks; "
                    f"its axes are {tuple(mesh.axis_names)}"
                )
            if axis in used:
                raise ValueError(
                    f"{where}: spec {spec} uses axis {axis!r} for dimensions {used[axis]} and {dim}"
                )
            used[axis] = dim
        split = math.prod(sizes[a] for a in axes)
        if shape[dim] % split:
            raise ValueError(
                f"{where}: dimension {dim} of size {shape[dim]} is not divisible by mesh axes "
                f"{axes} of total size {split} (spec {spec}, shape {tuple(shape)})"
            )
    return spec


def bytes_per_device(shape: Sequence[int], dtype, spec: PartitionSpec, mesh: Mesh) -> int:
    """Bytes one device holds of an array sharded by ``spec`` on ``mesh``.

    Example:
        >>> import jax, numpy as np
        >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
        >>> bytes_per_device((4, 8), np.float32, PartitionSpec("x"), mesh)
        128
    """
    out = list(shape)
    for dim, entry in enumerate(spec):
        out[dim] //= math.prod(mesh.shape[a] for a in _entry_axes(entry))
    return math.prod(out) * itemsize(dtype)


@functools.cache
def itemsize(dtype) -> int:
    """Bytes per element, including extended dtypes such as PRNG keys (stored as key data)."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct((), dtype))
        return math.prod(data.shape) * np.dtype(data.dtype).itemsize
    return np.dtype(dtype).itemsize
