"""TaskMesh: a submesh named by integer indices into ``jax.devices()``."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh


def check_axes(axis_sizes: Sequence[int], axis_names: Sequence[str], device_count: int, what: str):
    """Validates mesh axes against a device count; raises ``ValueError`` naming the fault."""
    if len(axis_sizes) != len(axis_names):
        raise ValueError(
            f"{what}: axis_sizes {tuple(axis_sizes)} and axis_names {tuple(axis_names)} "
            "have different lengths"
        )
    for name in axis_names:
        if not isinstance(name, str):
            raise TypeError(f"{what}: axis name {name!r} is not a str")
    dupes = [name for i, name in enumerate(axis_names) if name in axis_names[:i]]
    if dupes:
        raise ValueError(f"{what}: duplicate axis name {dupes[0]!r} in {tuple(axis_names)}")
    for size in axis_sizes:
        if not isinstance(size, int | np.integer) or size < 1:
            raise ValueError(f"{what}: axis size {size!r} must be a positive int")
    if math.prod(axis_sizes) != device_count:
        raise ValueError(
            f"{what}: axis_sizes {tuple(axis_sizes)} (product {math.prod(axis_sizes)}) "
            f"do not match the {device_count} devices given"
        )


def resolve_axes(
    axis_sizes: Sequence[int] | None, axis_names: Sequence[str] | None, count: int, what: str
) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Fills in the defaults (one axis ``"x"`` over all devices) and validates the axes."""
    sizes = tuple(int(s) for s in axis_sizes) if axis_sizes is not None else (count,)
    if axis_names is None:
        if len(sizes) != 1:
            raise ValueError(
                f"{what}: axis_names are required for the {len(sizes)}-d axis_sizes {sizes}"
            )
        axis_names = ("x",)
    names = tuple(axis_names)
    check_axes(sizes, names, count, what)
    return sizes, names


def device_ids(devices: Iterable, what: str) -> np.ndarray:
    """Converts an iterable of device indices (or ``jax.Device`` objects) to an int array."""
    ids = []
    all_devices = None
    for d in devices:
        if isinstance(d, jax.Device):
            all_devices = all_devices if all_devices is not None else jax.devices()
            if d not in all_devices:
                raise ValueError(f"{what}: device {d} is not in jax.devices()")
            ids.append(all_devices.index(d))
        elif isinstance(d, int | np.integer) and not isinstance(d, bool):
            ids.append(int(d))
        else:
            raise TypeError(f"{what}: device {d!r} is neither an int index nor a jax.Device")
    if not ids:
        raise ValueError(f"{what}: no devices given")
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise ValueError(f"{what}: device index {dupes[0]} appears more than once")
    negative = [i for i in ids if i < 0]
    if negative:
        raise ValueError(f"{what}: device index {negative[0]} is negative")
    return np.asarray(ids, dtype=int)


def resolve_devices(ids: np.ndarray, what: str) -> np.ndarray:
    """Maps device indices to ``jax.Device`` objects; raises if an index is out of range."""
    available = jax.devices()
    for i in ids.flat:
        if i >= len(available):
            raise ValueError(
                f"{what}: device index {int(i)} is outside jax.devices() "
                f"(which has {len(available)} devices: 0..{len(available) - 1})"
            )
    return np.asarray([available[i] for i in ids.flat], dtype=object).reshape(ids.shape)


class TaskMesh:
    """A submesh: named axes laid over a set of devices given as indices into ``jax.devices()``.

    Example:
        >>> tm = TaskMesh(devices=range(4, 8), axis_sizes=(2, 2), axis_names=("data", "model"))
        >>> tm.size, tm.axis_names
        (4, ('data', 'model'))
        >>> tm.mesh.devices.shape
        (2, 2)
    """

    def __init__(
        self,
        *,
        devices: Iterable[int],
        axis_sizes: Sequence[int] | None = None,
        axis_names: Sequence[str] | None = None,
        abstract: AbstractMesh | None = None,
    ):
        ids = device_ids(devices, "TaskMesh")
        if abstract is not None:
            for field, given in (("axis_sizes", axis_sizes), ("axis_names", axis_names)):
                theirs = tuple(getattr(abstract, field))
                if given is not None and tuple(given) != theirs:
                    raise ValueError(
                        f"TaskMesh: {field} {tuple(given)} disagree with the abstract mesh's "
                        f"{theirs}"
                    )
            axis_sizes, axis_names = abstract.axis_sizes, abstract.axis_names
        axis_sizes, axis_names = resolve_axes(axis_sizes, axis_names, ids.size, "TaskMesh")
        self._ids = ids.reshape(axis_sizes)
        self._ids.setflags(write=False)
        self._axis_sizes = axis_sizes
        self._axis_names = axis_names
        self._abstract = abstract

    @property
    def devices(self) -> np.ndarray:
        """Device indices into ``jax.devices()``, shaped ``axis_sizes``."""
        return self._ids

    @property
    def axis_names(self) -> tuple[str, ...]:
        return self._axis_names

    @property
    def axis_sizes(self) -> tuple[int, ...]:
        return self._axis_sizes

    @property
    def shape(self) -> dict[str, int]:
        return dict(zip(self._axis_names, self._axis_sizes, strict=True))

    @property
    def size(self) -> int:
        return int(self._ids.size)

    @property
    def abstract_mesh(self) -> AbstractMesh:
        if self._abstract is not None:
            return self._abstract
        return AbstractMesh(
            self._axis_sizes, self._axis_names, axis_types=(AxisType.Auto,) * len(self._axis_names)
        )

    @functools.cached_property
    def mesh(self) -> Mesh:
        """The concrete ``jax.sharding.Mesh`` over these devices, with Auto axis types."""
        devs = resolve_devices(self._ids, f"TaskMesh{self._ids.flatten().tolist()}")
        return Mesh(devs, self._axis_names, axis_types=(AxisType.Auto,) * len(self._axis_names))

    def place(self, devices: Iterable[int]) -> TaskMesh:
        """Returns a TaskMesh with the same axes over other devices.

        Example:
            >>> TaskMesh(devices=range(4)).place(range(4, 8)).devices.tolist()
            [4, 5, 6, 7]
        """
        return TaskMesh(devices=devices, axis_sizes=self._axis_sizes, axis_names=self._axis_names)

    def _key(self):
        return (tuple(self._ids.flat), self._axis_sizes, self._axis_names)

    def __eq__(self, other):
        return isinstance(other, TaskMesh) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def __repr__(self):
        return (
            f"TaskMesh(devices={self._ids.flatten().tolist()}, axis_sizes={self._axis_sizes}, "
            f"axis_names={self._axis_names})"
        )
