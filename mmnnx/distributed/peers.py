"""The peers of one compiled step (:class:`~mmnnx.mpmd.run.peers.Peers`) across processes:
layouts only the compiler knows go through the coordination service under the round of the
plan's check, arrays through this process's transfer server."""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from mmnnx._jax import runtime
from mmnnx.distributed import exits
from mmnnx.distributed.agree import check_same_everywhere
from mmnnx.distributed.exits import wait_for
from mmnnx.distributed.transport import transport
from mmnnx.errors import MPMDError
from mmnnx.sharding import Task

_LAYOUT_KEY = "mmnnx/layout/{}/{}"
_LAYOUT_WAIT_S = 600.0


def _spec_of(sharding: Any, task: Task) -> PartitionSpec:
    if isinstance(sharding, NamedSharding):
        return sharding.spec
    if isinstance(sharding, SingleDeviceSharding) and sharding.device_set == set(
        task.jax_mesh.devices.flat
    ):  # the one device of a one-device task
        return PartitionSpec()
    raise MPMDError(
        f"mm.jit: a result on task {task.name!r} has layout {sharding}, which cannot be sent to "
        "another process; pin it with mm.with_sharding_constraint"
    )


class StepPeers:
    """The other processes of the step described by ``lines`` (named ``name`` in messages): made on
    every process at once, after checking they all planned the same step."""

    def __init__(self, name: str, lines: list[str]):
        self.round = check_same_everywhere(f"mm.jit: the plan of {name}", lines)

    def publish_layout(self, slot: int, task: Task, sharding: Any) -> None:
        key = _LAYOUT_KEY.format(self.round, slot)
        runtime.key_value_set(key, pickle.dumps(_spec_of(sharding, task)))

    def layout(self, slot: int, task: Task) -> NamedSharding:
        first = min(d.process_index for d in task.jax_mesh.devices.flat)
        key = _LAYOUT_KEY.format(self.round, slot)
        try:
            data = wait_for(key, first, _LAYOUT_WAIT_S, f"mm.jit: a layout of task {task.name!r}")
        except TimeoutError as e:
            raise MPMDError(
                f"mm.jit: process {first} did not publish the layout of a value of task "
                f"{task.name!r} within {_LAYOUT_WAIT_S:.0f} s"
            ) from e
        return task.sharding(pickle.loads(data))

    def send(self, peer: int, arrays: Sequence[jax.Array]) -> None:
        transport().send(peer, arrays)

    def receive(self, peer: int, specs: Sequence[jax.ShapeDtypeStruct]) -> list[jax.Array]:
        """The arrays, once arrived (the runner waits anyway); a failed transfer names ``peer``."""
        arrays = transport().receive(peer, specs)
        try:
            for array in arrays:
                array.block_until_ready()
        except jax.errors.JaxRuntimeError as e:
            exits.lost(peer)
            raise MPMDError(
                f"mm.jit: receiving a value from process {peer} failed (the process ended or "
                f"its host is unreachable): {e}"
            ) from e
        return arrays
