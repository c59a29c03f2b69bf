"""How one value moves between two tasks whose devices belong to different processes.

A :class:`RoutePlan`, made once per :class:`~mmnnx.mpmd.lower.program.Route` at compile, matches
source and target shards by the slice they hold, so a value keeps its layout on the way; with
no match, the value is gathered on the source, sent whole and resharded on the target. Shards
within one process are copied locally, the others go through the step's
:class:`~mmnnx.mpmd.run.peers.Peers`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from mmnnx._jax.arrays import shards_by_device
from mmnnx.mpmd.run.peers import Peers
from mmnnx.sharding.arrays import processes_of, slice_key


def _pairs(source: Any, target: Any, shape: tuple[int, ...]) -> list[tuple[Any, Any]] | None:
    """(source device, target device) per target device holding the same slice, a source of the
    target's own process first; ``None`` if some slice has no source."""
    holders: dict[tuple, list[Any]] = {}
    for device, index in source.devices_indices_map(shape).items():
        holders.setdefault(slice_key(index), []).append(device)
    pairs, used = [], dict.fromkeys(holders, 0)
    for device, index in target.devices_indices_map(shape).items():
        candidates = holders.get(slice_key(index))
        if candidates is None:
            return None
        local = [c for c in candidates if c.process_index == device.process_index]
        if local:
            pairs.append((local[0], device))
        else:  # spread the copies of one slice over the devices holding it
            k = used[slice_key(index)]
            used[slice_key(index)] = k + 1
            pairs.append((candidates[k % len(candidates)], device))
    return pairs


@functools.cache
def _reshard(sharding: Any) -> Any:
    return jax.jit(lambda x: x, out_shardings=sharding)


@dataclasses.dataclass
class RoutePlan:
    """The shard-by-shard plan of one cross-process transfer, from process ``me``'s side."""

    shape: tuple[int, ...]
    dtype: Any
    source_wire: Any  # the layout the value is sent in (the source's own, or gathered)
    target_wire: Any  # the layout it arrives in
    target: Any  # the layout the step wants on the target
    pairs: list[tuple[Any, Any]]
    sends: bool  # this process holds part of the source
    receives: bool  # this process holds part of the target
    me: int
    # the value is gathered on a source spanning processes before it is sent: a program with
    # collectives between them, which every process of the source runs at this route's turn
    gathers: bool = False

    @classmethod
    def plan(cls, shape: tuple, dtype: Any, source: Any, target: Any, me: int) -> RoutePlan:
        source_wire, target_wire = source, target
        pairs = _pairs(source, target, shape)
        gathers = False
        if pairs is None:
            source_wire = NamedSharding(source.mesh, PartitionSpec())
            target_wire = NamedSharding(target.mesh, PartitionSpec())
            pairs = _pairs(source_wire, target_wire, shape)
            gathers = len(processes_of(source)) > 1
        return cls(
            tuple(shape),
            dtype,
            source_wire,
            target_wire,
            target,
            pairs,
            me in processes_of(source),
            me in processes_of(target),
            me,
            gathers,
        )

    def __post_init__(self) -> None:
        """This process's part: which shards go to and come from which peer, which stay local."""
        me = self.me
        self._outgoing: dict[int, list[Any]] = {}
        self._incoming: dict[int, list[Any]] = {}
        for src, dst in self.pairs:
            if src.process_index == me and dst.process_index != me:
                self._outgoing.setdefault(dst.process_index, []).append(src)
            elif dst.process_index == me and src.process_index != me:
                self._incoming.setdefault(src.process_index, []).append(dst)
        self._outgoing = dict(sorted(self._outgoing.items()))
        self._specs = {
            peer: [self._shard_spec(d) for d in devices]
            for peer, devices in sorted(self._incoming.items())
        }
        self._mine = [(src, dst) for src, dst in self.pairs if dst.process_index == me]

    @property
    def outgoing_peers(self) -> tuple[int, ...]:
        """The processes this process sends shards of the value to."""
        return tuple(self._outgoing)

    def __call__(self, value: Any, port: Peers) -> Any:
        """Sends this process's shards of ``value`` through ``port``; returns the target array where
        this process holds part of it, else ``None``."""
        shards: dict[Any, Any] = {}
        if self.sends:
            if value.sharding != self.source_wire:
                value = _reshard(self.source_wire)(value)
            shards = shards_by_device(value)
            for peer, devices in self._outgoing.items():
                port.send(peer, [shards[d] for d in devices])
        if not self.receives:
            return None
        received: dict[Any, Any] = {}
        for peer, specs in self._specs.items():
            received.update(zip(self._incoming[peer], port.receive(peer, specs), strict=True))
        local = [
            received[dst] if dst in received else jax.device_put(shards[src], dst)
            for src, dst in self._mine
        ]
        out = jax.make_array_from_single_device_arrays(self.shape, self.target_wire, local)
        if self.target_wire != self.target:
            out = _reshard(self.target)(out)
        return out

    def _shard_spec(self, device: Any) -> jax.ShapeDtypeStruct:
        shape = self.target_wire.shard_shape(self.shape)
        return jax.ShapeDtypeStruct(shape, self.dtype, sharding=SingleDeviceSharding(device))
