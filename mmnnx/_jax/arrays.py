"""A ``jax.Array``'s per-device arrays and layouts, as JAX keeps them (``_arrays``,
``_addressable_device_assignment``): reading them and making an array from them without
re-checking each, the runtime's batched copy between devices, and the tests that tell a plain
array laid out as a program expects.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax._src import array as jax_array
from jax._src import core as jax_core
from jax._src import dispatch
from jax._src.array import ArrayImpl
from jax._src.lib import xla_client
from jax.sharding import SingleDeviceSharding


def copier(source: Any, target: Any, ndim: int, dtype: Any) -> Callable[[Any], Any] | None:
    """A function moving an array laid out as ``source`` to ``target`` with one runtime call,
    skipping ``jax.device_put``'s Python layers: the same slicing on other devices of this process,
    or a replicated value onto more devices."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return None
    if not target.is_fully_addressable or not source.is_fully_addressable:
        return None
    try:
        same = jax_array._sharding_indices_and_eq(source, target, ndim)
    except NotImplementedError:
        return None
    reuse = xla_client.ArrayCopySemantics.REUSE_INPUT
    batched = xla_client.batched_copy_array_to_devices_with_sharding
    if same:
        devices = target._internal_device_list.addressable_device_list

        def move(x: Any) -> Any:
            return batched([x], [devices], [target], [reuse])[0]

        return move
    if not (source.is_fully_replicated and target.is_fully_replicated):
        return None
    held = set(source._addressable_device_assignment)
    missing = [d for d in target._addressable_device_assignment if d not in held]
    alone = [SingleDeviceSharding(d) for d in missing]
    lists = [s._internal_device_list.addressable_device_list for s in alone]

    def spread(x: Any) -> Any:
        have = shards_by_device(x)
        if missing:
            whole = next(iter(have.values()))
            copies = batched([whole] * len(missing), lists, alone, [reuse] * len(missing))
            have.update(zip(missing, copies, strict=True))
        return array_from_shards(x.shape, target, have)

    return spread


_copier_of = functools.lru_cache(maxsize=1024)(copier)


def move_to(x: Any, target: Any) -> Any:
    """``x`` moved to ``target``: by :func:`copier` (decided once per pair of layouts), else by
    ``jax.device_put``."""
    source = getattr(x, "sharding", None)
    if source is not None:
        move = _copier_of(source, target, x.ndim, x.dtype)
        if move is not None:
            return move(x)
    return jax.device_put(x, target)


def array_from_shards(shape: Sequence[int], sharding: Any, by_device: dict[Any, Any]) -> Any:
    """``jax.make_array_from_single_device_arrays`` without its per-shard checks of dtype, device
    and order (several times the array's creation, every step for a stacked Variable's chunks)."""
    arrays = [by_device[d] for d in sharding._addressable_device_assignment]
    if not arrays or jax.dtypes.issubdtype(arrays[0].dtype, jax.dtypes.extended):
        return jax.make_array_from_single_device_arrays(tuple(shape), sharding, arrays)
    aval = _sharded_aval(tuple(shape), arrays[0].dtype, sharding)
    return jax_array.ArrayImpl(aval, sharding, arrays, committed=True, _skip_checks=True)


def shards_by_device(array: Any) -> dict[Any, Any]:
    """``{s.device: s.data for s in array.addressable_shards}`` without making a ``Shard`` per
    device (tens of microseconds each new array)."""
    arrays = getattr(array, "_arrays", None)
    if arrays is None:
        return {s.device: s.data for s in array.addressable_shards}
    return dict(zip(array.sharding._addressable_device_assignment, arrays, strict=True))


@functools.lru_cache(maxsize=4096)
def _sharded_aval(shape: tuple[int, ...], dtype: Any, sharding: Any) -> Any:
    return jax_core.update_aval_with_sharding(
        jax_core.ShapedArray(shape, dtype, weak_type=False), sharding
    )


def launchable_as(x: Any, sharding: Any) -> bool:
    """Whether ``x`` is a plain ``jax.Array`` a program expecting ``sharding`` reads as it is: the
    same slices on the same devices, listed in the same order."""
    if type(x) is not ArrayImpl:
        return False
    have = x.sharding
    return have == sharding or (
        have.is_equivalent_to(sharding, x.ndim)
        and have._addressable_device_assignment == sharding._addressable_device_assignment
    )


def is_plain_array(x: Any) -> bool:
    """Whether ``x`` is JAX's own array type (not a tracer, NumPy array or subclass)."""
    return type(x) is ArrayImpl


def all_plain_arrays(values: Sequence[Any]) -> bool:
    """Whether every one of ``values`` is JAX's own array type, ten times as fast as ``isinstance(x,
    jax.Array)``."""
    return all(type(x) is ArrayImpl for x in values)


def checks_special_values() -> bool:
    """Whether JAX checks results for NaN or infinity, which only its own call does."""
    return dispatch.needs_check_special()
