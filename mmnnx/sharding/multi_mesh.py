"""MultiMesh: the global device mesh, with named slices that become task submeshes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh

from mmnnx.sharding.task_mesh import TaskMesh, device_ids, resolve_axes, resolve_devices

_ACTIVE: list[MultiMesh] = []


def current_multimesh() -> MultiMesh | None:
    """The innermost MultiMesh entered as a context manager, or ``None``.

    Example:
        >>> with MultiMesh(axis_sizes=(2, 4), axis_names=("stage", "data")) as mesh:
        ...     assert current_multimesh() is mesh
    """
    return _ACTIVE[-1] if _ACTIVE else None


class MultiMesh:
    """The global mesh, sliced by named axes into task submeshes. Entering it sets the global mesh
    (``jax.set_mesh``) and turns Flax's eager sharding off, so logical names stay logical until
    ``mm.place``.

    Example:
        >>> mesh = MultiMesh(axis_sizes=(2, 2, 2), axis_names=("stage", "data", "model"))
        >>> mesh.slice(stage=1).devices.shape          # the sliced axis kept, size 1
        (1, 2, 2)
        >>> mesh.task_mesh(stage=1).devices.tolist()  # the sliced axis dropped
        [[4, 5], [6, 7]]
    """

    def __init__(
        self,
        *,
        axis_sizes: Sequence[int] | None = None,
        axis_names: Sequence[str] | None = None,
        devices: Iterable | None = None,
        global_mesh: Mesh | None = None,
    ):
        if global_mesh is not None:
            if devices is not None or axis_sizes is not None or axis_names is not None:
                raise ValueError(
                    "MultiMesh: give either global_mesh or axis_sizes/axis_names/devices, not both"
                )
            if not isinstance(global_mesh, Mesh):
                raise TypeError(
                    f"MultiMesh: global_mesh must be a jax.sharding.Mesh, got {type(global_mesh)}"
                )
            self._mesh = global_mesh
        else:
            ids = device_ids(range(len(jax.devices())) if devices is None else devices, "MultiMesh")
            sizes, names = resolve_axes(axis_sizes, axis_names, ids.size, "MultiMesh")
            devs = resolve_devices(ids.reshape(sizes), "MultiMesh")
            self._mesh = Mesh(devs, names, axis_types=(AxisType.Auto,) * len(names))
        self._contexts: list[contextlib.ExitStack] = []

    @property
    def mesh(self) -> Mesh:
        """The global ``jax.sharding.Mesh``."""
        return self._mesh

    def __getattr__(self, name):
        # Forwards the rest of the Mesh API (devices, shape, size, axis_types, ...).
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._mesh, name)

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(self._mesh.axis_names)

    @property
    def axis_sizes(self) -> tuple[int, ...]:
        return tuple(self._mesh.axis_sizes)

    def _index(self, slices: dict[str, int], keep_dims: bool):
        if not slices:
            raise ValueError("MultiMesh.slice: name at least one axis, e.g. slice(stage=0)")
        index = []
        for name in slices:
            if name not in self.axis_names:
                raise ValueError(
                    f"MultiMesh.slice: unknown axis {name!r}; the mesh has axes {self.axis_names}"
                )
        for name, size in zip(self.axis_names, self.axis_sizes, strict=True):
            if name not in slices:
                index.append(slice(None))
                continue
            i = slices[name]
            if not isinstance(i, int | np.integer) or not 0 <= i < size:
                raise ValueError(
                    f"MultiMesh.slice: index {i!r} for axis {name!r} is outside 0..{size - 1}"
                )
            index.append(slice(i, i + 1) if keep_dims else int(i))
        return tuple(index)

    def slice(self, **slices: int) -> Mesh:
        """The devices at the given index of each named axis, as a Mesh with those axes of size 1.

        Example:
            >>> dict(MultiMesh(axis_sizes=(2, 4), axis_names=("stage", "x")).slice(stage=0).shape)
            {'stage': 1, 'x': 4}
        """
        devs = self._mesh.devices[self._index(slices, keep_dims=True)]
        return Mesh(devs, self.axis_names, axis_types=self._mesh.axis_types)

    def task_mesh(self, **slices: int) -> TaskMesh:
        """The devices at the given index of each named axis, as a TaskMesh without those axes.

        Example:
            >>> MultiMesh(axis_sizes=(2, 4), axis_names=("stage", "x")).task_mesh(stage=1).devices
            array([4, 5, 6, 7])
        """
        devs = np.asarray(self._mesh.devices[self._index(slices, keep_dims=False)], dtype=object)
        all_devices = jax.devices()
        ids = np.asarray([all_devices.index(d) for d in devs.flat], dtype=int)
        kept = [
            (n, s) for n, s in zip(self.axis_names, self.axis_sizes, strict=True) if n not in slices
        ]
        return TaskMesh(
            devices=ids,
            axis_sizes=tuple(s for _, s in kept),
            axis_names=tuple(n for n, _ in kept),
        )

    def single_slice_devices(self, **slices: int) -> np.ndarray:
        """The ``jax.Device`` objects of ``slice(**slices)``, as an array."""
        return self.slice(**slices).devices

    def single_slice_ids(self, **slices: int) -> list[int]:
        """The device ids of ``slice(**slices)``, as a flat list."""
        return [d.id for d in self.slice(**slices).devices.flat]

    def __enter__(self) -> MultiMesh:
        stack = contextlib.ExitStack()
        stack.enter_context(jax.set_mesh(self._mesh))
        stack.enter_context(nnx.use_eager_sharding(False))
        self._contexts.append(stack)
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc_info):
        _ACTIVE.pop()
        self._contexts.pop().close()
        return False

    def __eq__(self, other):
        return isinstance(other, MultiMesh) and self._mesh == other._mesh

    def __hash__(self):
        return hash(self._mesh)

    def __repr__(self):
        return f"MultiMesh({self._mesh!r})"
