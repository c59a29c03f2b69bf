"""multimesh.jax.flax on stock JAX: Linen task modules, ``shard_axes``, ``parallelize_step``.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from flax import linen as nn
    >>> from multimesh_compat.jax import TaskMesh
    >>> Block = task(nn.Dense, mesh=TaskMesh(devices=range(4)), name="layer_0")
    >>> variables = Block(features=3).init(jax.random.key(0), jnp.ones((2, 5)))
    >>> jax.tree.map(jnp.shape, variables)["params"]["mod"]["params"]["kernel"]
    (5, 3)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import optax
from flax import linen as nn
from flax.core import meta
from flax.training.train_state import TrainState
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import mmnnx as mm
from multimesh_compat.jax import _context, _engine
from multimesh_compat.jax import task as _function_task
from multimesh_compat.jax._engine import with_sharding_constraint

__all__ = ["parallelize_step", "shard_axes", "task", "with_sharding_constraint"]


def task(
    model: type[nn.Module],
    name: str | None = None,
    *,
    task: mm.Task | None = None,
    **kwargs: Any,
) -> type[nn.Module]:
    """A subclass of the Linen module ``model``, named ``Task[<Model>]``, that runs as a task.

    It takes ``model``'s constructor arguments. Its one parameter, ``mod``, holds the
    variables of an inner ``model`` (so parameters nest as ``params/mod/params/...``); its
    ``__call__(xs)`` applies the inner module inside a task, placed by ``task=Task(...)``,
    ``Task`` fields, or the Gen-A arguments (``mesh``, ``devices``, ``device_axes``,
    ``logical_axes``) of :func:`multimesh_compat.jax.task`. Under ``ignore_transforms()``
    ``model`` is returned unchanged.

    Example:
        >>> import jax.numpy as jnp
        >>> DenseTask = task(nn.Dense, mesh=Mesh(np.array(jax.devices()[:4]).reshape(2, 2),
        ...                                          ("x", "y")))
        >>> DenseTask.__name__
        'Task[Dense]'
        >>> out = DenseTask(features=4).init_with_output(jax.random.key(0), jnp.ones((2, 3)))[0]
        >>> out.shape
        (2, 4)
    """
    if _context.transforms_ignored():
        return model
    options = dict(kwargs)
    if task is not None:
        options["task"] = task
    own = {"parent", "name"}

    def __call__(self, xs):
        fields = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(model)
            if f.init and f.name not in own
        }
        inner = model(**fields, parent=None)
        variables = self.param("mod", inner.init, xs)
        label = name if name is not None else (self.name or model.__name__)
        apply = _function_task(inner.apply, label, **options)
        return apply(variables, xs)

    cls = type(f"Task[{model.__name__}]", (model,), {"__call__": nn.compact(__call__)})
    cls.__qualname__ = cls.__name__
    return cls


def shard_axes(*names: str | None) -> Callable:
    """A kernel initializer (Xavier normal) carrying the logical axis ``names``.

    Example:
        >>> variables = nn.Dense(4, kernel_init=shard_axes("data", "model")).init(
        ...     jax.random.key(0), np.ones((2, 3)))
        >>> nn.get_partition_spec(variables)["params"]["kernel"]
        P('data', 'model')
    """
    return nn.with_partitioning(nn.initializers.xavier_normal(), names)


def _put_local(host_array: np.ndarray, devices: Sequence[jax.Device]) -> list[jax.Array]:
    pieces = np.split(np.asarray(host_array), len(devices), axis=0)
    return [jax.device_put(p, d) for p, d in zip(pieces, devices, strict=True)]


def parallelize_step(
    model: nn.Module,
    optimizer: optax.GradientTransformation,
    mesh: Mesh | None = None,
    global_batch: Any = None,
    local_batch: Any = None,
    replicate_inputs: bool = True,
):
    """A training step for a Linen model whose output is the loss, compiled across its tasks.

    The state is a ``TrainState`` of ``model.init(jax.random.key(42), batch)`` and
    ``optimizer``; the step constrains every variable to its logical partitioning (and, with
    ``replicate_inputs``, the inputs to ``P()``), takes ``value_and_grad`` of ``model.apply``
    and applies the gradients. It returns ``(step, state, mesh)`` for ``global_batch`` (arrays
    with their shardings) and ``(step, state, mesh, prepare_batch)`` for ``local_batch`` (this
    process's part: its leading dimension is split over ``mesh.local_devices``).
    ``step(state, batch)`` returns ``(loss, new_state)``. ``mesh`` defaults to all devices on
    one axis ``x``.

    Example:
        >>> import jax.numpy as jnp
        >>> class Loss(nn.Module):
        ...     @nn.compact
        ...     def __call__(self, x):
        ...         return (nn.Dense(2)(x) ** 2).sum()
        >>> step, state, mesh, prepare = parallelize_step(
        ...     Loss(), optax.sgd(0.1), local_batch=np.ones((8, 3), np.float32))
        >>> loss, state = step(state, prepare(np.ones((8, 3), np.float32)))
        >>> loss.shape
        ()
    """
    if mesh is None:
        mesh = Mesh(np.asarray(jax.devices()), ("x",))
    if global_batch is None and local_batch is None:
        raise ValueError("parallelize_step needs global_batch or local_batch")

    def init_fn(key, x):
        return TrainState.create(apply_fn=model.apply, params=model.init(key, x), tx=optimizer)

    num_loaders = mesh.devices.size // len(mesh.local_devices)
    if global_batch is not None:
        batch_avals = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), global_batch)
    else:

        def global_shape(x):
            x = np.asarray(x)
            if x.ndim == 0:
                return jax.ShapeDtypeStruct(x.shape, x.dtype)
            if x.shape[0] % len(mesh.local_devices):
                raise ValueError(
                    f"parallelize_step: the local batch's leading dimension {x.shape[0]} does not "
                    f"split evenly over the {len(mesh.local_devices)} local devices"
                )
            return jax.ShapeDtypeStruct((x.shape[0] * num_loaders, *x.shape[1:]), x.dtype)

        batch_avals = jax.tree.map(global_shape, local_batch)

    with _engine.logical():
        state_avals = jax.eval_shape(init_fn, jax.random.key(42), batch_avals)
    is_box = lambda x: isinstance(x, meta.AxisMetadata)
    grad_fn = jax.value_and_grad(model.apply)

    def step_fn(state, inputs):
        def label(x):
            if isinstance(x, nn.Partitioned):
                return x.replace_boxed(
                    jax.lax.with_sharding_constraint(x.unbox(), x.get_partition_spec())
                )
            return jax.lax.with_sharding_constraint(x, PartitionSpec())

        state = jax.tree.map(label, state, is_leaf=is_box)
        if replicate_inputs:
            inputs = jax.tree.map(lambda x: with_sharding_constraint(x, PartitionSpec()), inputs)
        loss, grads = grad_fn(state.params, inputs)
        # the new state keeps the state's layout, so the next step needs no resharding
        return loss, jax.tree.map(label, state.apply_gradients(grads=grads), is_leaf=is_box)

    with _engine.logical():
        jitted = mm.jit(_engine.stage(step_fn, _engine.default_placement(mesh=mesh)))
        compiled = _engine.ShardedFunction(step_fn, jitted, (state_avals, batch_avals))
    (state_sh, batch_sh), _ = compiled.input_shardings
    leaves_sh = jax.tree.leaves(state_sh, is_leaf=lambda s: isinstance(s, jax.sharding.Sharding))
    state_tree = jax.tree.structure(state_avals)

    if global_batch is not None:
        example = global_batch
    else:
        batch_shardings = jax.tree.map(
            lambda x: NamedSharding(mesh, PartitionSpec(mesh.axis_names[0])), local_batch
        )

        def prepare_batch(host_arrays):
            def one(x, sharding):
                x = np.asarray(x)
                shape = (x.shape[0] * num_loaders, *x.shape[1:])
                return jax.make_array_from_single_device_arrays(
                    shape, sharding, _put_local(x, mesh.local_devices)
                )

            return jax.tree.map(one, host_arrays, batch_shardings)

        example = prepare_batch(local_batch)
    key = jax.random.key(42)
    state = _engine._grouped_put(lambda: init_fn(key, example), leaves_sh, state_tree)
    if global_batch is not None:
        return compiled, state, mesh
    return compiled, state, mesh, prepare_batch
