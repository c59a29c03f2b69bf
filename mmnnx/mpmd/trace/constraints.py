"""A bare ``jax.lax.with_sharding_constraint(x, PartitionSpec(...))`` inside ``mm.jit``, traced
under an abstract mesh of the tasks' axes and made an ``mm.with_sharding_constraint``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from jax.extend import core as jcore
from jax.sharding import AbstractMesh, AxisType, NamedSharding

from mmnnx.mpmd.primitives import constraint_p
from mmnnx.mpmd.trace.rewrite import rewrite

_NO_MESH = "requires a non-empty mesh in context"


def needs_a_mesh(error: BaseException) -> bool:
    """Whether tracing failed because a bare ``PartitionSpec`` needed a mesh in context."""
    while error is not None:
        if _NO_MESH in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


def abstract_mesh_of(meshes: Iterable[Any]) -> AbstractMesh:
    """An abstract mesh holding every axis of ``meshes`` (a task's, or a placed array's; its size on
    the first that has it), automatic axes."""
    sizes: dict[str, int] = {}
    for mesh in meshes:
        for name, size in mesh.shape.items():
            sizes.setdefault(name, size)
    return AbstractMesh(
        tuple(sizes.values()), tuple(sizes), axis_types=(AxisType.Auto,) * len(sizes)
    )


def _on_abstract_mesh(eqn: Any) -> bool:
    sharding = eqn.params.get("sharding")
    return (
        eqn.primitive.name == "sharding_constraint"
        and isinstance(sharding, NamedSharding)
        and isinstance(sharding.mesh, AbstractMesh)
    )


def on_tasks(closed: jcore.ClosedJaxpr) -> jcore.ClosedJaxpr:
    """``closed`` with each ``sharding_constraint`` on an abstract mesh, at any depth, made an
    ``mm.with_sharding_constraint`` of the same spec."""
    return rewrite(
        closed,
        _on_abstract_mesh,
        lambda eqn: eqn.replace(
            primitive=constraint_p, params={"names": tuple(eqn.params["sharding"].spec)}
        ),
    )
