"""``mm.distributed.fetch``: a step's result, as numpy, on every process."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

from mmnnx._jax.arrays import shards_by_device
from mmnnx.distributed.transport import transport
from mmnnx.sharding.arrays import processes_of, slice_key


def _fetch_array(array: jax.Array, to: int | None) -> np.ndarray | None:
    if isinstance(array.sharding, SingleDeviceSharding) and array.is_fully_addressable:
        return np.asarray(array)  # a process's own value (each process has one)
    holders = processes_of(array.sharding)
    me, port = jax.process_index(), transport()
    owners: dict[tuple, tuple[Any, tuple]] = {}  # the first device holding each distinct slice
    for device, index in array.sharding.devices_indices_map(array.shape).items():
        owners.setdefault(slice_key(index), (device, index))
    by_process: dict[int, list[tuple[Any, tuple]]] = {}
    for device, index in owners.values():
        by_process.setdefault(device.process_index, []).append((device, index))
    mine = shards_by_device(array)
    wanted = range(jax.process_count()) if to is None else (to,)
    for peer in wanted:  # every process that wants it and does not hold it all
        if peer != me and holders != {peer} and me in by_process:
            port.send(peer, [mine[d] for d, _ in by_process[me]])
    if me not in wanted:
        return None
    if holders == {me}:
        return np.asarray(array)
    out = np.empty(array.shape, array.dtype)
    here = SingleDeviceSharding(jax.local_devices()[0])
    shape = array.sharding.shard_shape(array.shape)
    for owner, shards in sorted(by_process.items()):
        if owner == me:
            datas = [mine[d] for d, _ in shards]
        else:
            specs = [jax.ShapeDtypeStruct(shape, array.dtype, sharding=here)] * len(shards)
            datas = port.receive(owner, specs)
        for (_, index), data in zip(shards, datas, strict=True):
            out[index] = np.asarray(data)
    return out


def fetch(tree: Any, *, to: int | None = None) -> Any:
    """Every array leaf of ``tree`` as a numpy array on every process (only on process ``to`` when
    given, the others getting ``None`` leaves): a collective, for a step's loss or metrics held by
    another process. A value on one device of this process outside any task is its own and comes
    back as it is; in one process this is ``jax.device_get``.

    Example:
        >>> import jax.numpy as jnp, mmnnx as mm
        >>> float(mm.distributed.fetch({"loss": jnp.float32(0.5)})["loss"])
        0.5
    """
    if jax.process_count() == 1:
        return jax.device_get(tree)
    return jax.tree.map(lambda x: _fetch_array(x, to) if isinstance(x, jax.Array) else x, tree)
