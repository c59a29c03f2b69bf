"""A lowered program moved to other devices without lowering it again (``retarget``).

Lowering one computation for two submeshes of one shape gives the same module: the devices are
only in the device assignment and the shardings JAX keeps beside it, which ``retarget`` replaces.
It refuses (``None``) what it cannot move safely; the caller then lowers the program itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax._src import dispatch, sharding_impls
from jax._src.interpreters import pxla
from jax._src.lib import xla_client
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding


def lowers_without_devices(primitive: Any) -> bool:
    """Whether ``primitive`` lowers without reading the program's devices."""
    return primitive not in dispatch.prim_requires_devices_during_lowering


def retarget(lowered: Any, devices: Mapping[Any, Any]) -> Any | None:
    """``lowered`` for other devices: each device ``d`` replaced by ``devices[d]``, the module
    shared. ``None`` where not safe: host callbacks, a profiler, constants on devices, several
    processes, or an unknown kind of sharding.

    Example:
        >>> import numpy as np
        >>> one, two = jax.devices()[:2]
        >>> on = lambda d: jax.sharding.SingleDeviceSharding(d)
        >>> first = jax.jit(lambda x: x + 1, in_shardings=on(one)).lower(np.float32(0))
        >>> moved = retarget(first, {one: two})
        >>> out = moved.compile()(jax.device_put(np.float32(1), on(two)))
        >>> float(out), out.devices() == {two}
        (2.0, True)
        >>> echo = lambda x: jax.pure_callback(lambda v: v, jax.typeof(x), x)
        >>> retarget(jax.jit(echo, in_shardings=on(one)).lower(np.float32(0)), {one: two}) is None
        True
    """
    computation = getattr(lowered, "_lowering", None)
    if not isinstance(computation, pxla.MeshComputation) or computation._device_list is None:
        return None
    args = computation.compile_args
    if (
        args["host_callbacks"]
        or args.get("pgle_profiler") is not None
        or any(isinstance(c, jax.Array) for c in computation.const_args)
        or len({d.process_index for d in computation._device_list}) > 1
    ):
        return None
    move = _Mover(devices)
    try:
        device_list = xla_client.DeviceList(tuple(devices[d] for d in computation._device_list))
        moved = dict(
            args,
            in_shardings=tuple(move.sharding(s) for s in args["in_shardings"]),
            out_shardings=tuple(move.sharding(s) for s in args["out_shardings"]),
        )
        if args.get("intermediate_shardings") is not None:
            moved["intermediate_shardings"] = [
                move.sharding(s) for s in args["intermediate_shardings"]
            ]
        if isinstance(args.get("context_mesh"), Mesh):
            moved["context_mesh"] = move.mesh(args["context_mesh"])
    except _CannotMove:
        return None
    again = pxla.MeshComputation(
        computation._name,
        computation._hlo,
        computation.const_args,
        computation._donated_invars,
        computation._platforms,
        computation._compiler_options_kvs,
        device_list,
        **moved,
    )
    return jax.stages.Lowered(again, *stage_args(lowered))


def stage_args(lowered: Any) -> tuple:
    """What ``jax.stages.Lowered`` and ``Compiled`` take after the computation, from ``lowered``."""
    names = ("args_info", "out_tree", "_no_kwargs", "_in_types", "_out_types")
    return tuple(getattr(lowered, name) for name in names)


class _CannotMove(Exception):
    """A device or sharding ``retarget`` does not know how to move."""


class _Mover:
    """Shardings and meshes with their devices replaced (each mesh moved once)."""

    def __init__(self, devices: Mapping[Any, Any]):
        self._devices = devices
        self._meshes: dict[Any, Mesh] = {}

    def device(self, device: Any) -> Any:
        try:
            return self._devices[device]
        except KeyError:
            raise _CannotMove from None

    def mesh(self, mesh: Mesh) -> Mesh:
        if mesh.empty:
            return mesh
        moved = self._meshes.get(mesh)
        if moved is None:
            devices = np.empty(mesh.devices.shape, dtype=object)
            devices.flat[:] = [self.device(d) for d in mesh.devices.flat]
            moved = self._meshes[mesh] = Mesh(devices, mesh.axis_names, axis_types=mesh.axis_types)
        return moved

    def sharding(self, sharding: Any) -> Any:
        if sharding is None or isinstance(sharding, sharding_impls.UnspecifiedValue):
            return sharding
        if type(sharding) is NamedSharding:
            if not isinstance(sharding.mesh, Mesh):  # abstract: no devices in it
                return sharding
            return NamedSharding(
                self.mesh(sharding.mesh),
                sharding.spec,
                memory_kind=sharding._memory_kind,
                _logical_device_ids=sharding._logical_device_ids,
            )
        if type(sharding) is SingleDeviceSharding:
            return SingleDeviceSharding(
                self.device(sharding._device), memory_kind=sharding._memory_kind
            )
        if type(sharding) is sharding_impls.GSPMDSharding:
            devices = [self.device(d) for d in sharding._devices]
            return sharding_impls.GSPMDSharding(
                devices, sharding._hlo_sharding, memory_kind=sharding._memory_kind
            )
        raise _CannotMove
