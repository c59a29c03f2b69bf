"""The mesh a step is traced and compiled under: no ambient mesh, or (for a step written for
explicit mesh axes) a task's mesh with every axis explicit, and the abstract mesh each op was
traced under."""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import AxisType, Mesh, NamedSharding


def no_ambient_mesh():
    """A context without the ambient mesh: each fragment runs on its own task's mesh."""
    return jax.set_mesh(None)


# JAX's errors for explicit-axes APIs (``reshard``, ``out_sharding=P(...)``) used with no mesh
_NEEDS_MESH = ("not under a mesh context", "Reshard should only be used", "have a non-empty mesh")


def needs_explicit_axes(error: BaseException) -> bool:
    """Whether tracing failed because the step was written for explicit mesh axes."""
    return any(m in str(error) for m in _NEEDS_MESH)


@functools.cache
def explicit_twin(mesh: Mesh) -> Mesh:
    """``mesh`` with every axis explicit, for programs of a step traced with sharding in types."""
    return Mesh(
        mesh.devices, mesh.axis_names, axis_types=(AxisType.Explicit,) * len(mesh.axis_names)
    )


def auto_twin(x: Any, like: Any = None) -> Any:
    """``x`` on the same devices and spec with automatic axes, without a copy (as ``like`` if that
    lays it out alike); other values unchanged."""
    sharding = getattr(x, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    same_layout = isinstance(like, NamedSharding) and like.is_equivalent_to(sharding, x.ndim)
    if same_layout and like != sharding:
        return jax.device_put(x, like)
    if not isinstance(mesh, Mesh) or AxisType.Explicit not in mesh.axis_types:
        return x
    auto = Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))
    return jax.device_put(x, NamedSharding(auto, sharding.spec))


_explicit_trace: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "mm_explicit_trace", default=False
)


@contextlib.contextmanager
def explicit_tracing(mesh: Mesh):
    """Traces under ``mesh``'s shape with explicit axes, so that ``reshard`` and
    ``out_sharding=P(...)`` in a step mean the axes of whichever task runs them."""
    token = _explicit_trace.set(True)
    try:
        with jax.sharding.use_abstract_mesh(explicit_twin(mesh).abstract_mesh):
            yield
    finally:
        _explicit_trace.reset(token)


def typed_aval(shape: Sequence[int], dtype: Any, mesh: Mesh, spec: Any) -> Any:
    """An abstract input with sharding ``spec`` in its type, for :func:`explicit_tracing`."""
    return jax.ShapeDtypeStruct(
        shape, dtype, sharding=NamedSharding(explicit_twin(mesh).abstract_mesh, spec)
    )


def traced_mesh(eqn: Any) -> Any:
    """The abstract mesh ``eqn`` was traced under, if it has explicit axes, else ``None``."""
    mesh = getattr(eqn.ctx, "cur_abstract_mesh", None)
    if mesh is None or mesh.empty:
        return None
    return mesh if AxisType.Explicit in mesh.axis_types or _explicit_trace.get() else None
