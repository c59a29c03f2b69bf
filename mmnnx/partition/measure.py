"""Timing one piece of a model (:mod:`mmnnx.partition.pieces`) on a task's devices: its forward
(returning ``jax.vjp``'s closure), its backward and the two halves of a split backward (each a
program applied to that closure), and the bytes it holds, sends on and keeps as state.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from mmnnx.partition.pieces import Piece, _abstract
from mmnnx.sharding import Task
from mmnnx.sharding.place import plan_placement
from mmnnx.sharding.task import axes_of


@dataclasses.dataclass(frozen=True)
class Timing:
    """One piece measured on one task at one microbatch size."""

    forward: float  # F, keeping the residuals (each pass: its work, less a program's launch)
    backward: float  # B: input and weight gradients in one program
    input_grad: float  # I: the gradient with respect to the inputs (0 without any)
    weight_grad: float  # W: the gradient with respect to the Variables differentiated
    held_bytes: int  # residuals kept from the forward to the backward, per microbatch
    output_bytes: int  # the floating arrays it returns (what the next stage receives)
    state_bytes: int  # its Variables
    optimizer_bytes: int  # its optimizer state


def shardings_on(model: Any, task: Task) -> dict[tuple, NamedSharding]:
    """Where ``mm.place(model, [(".*", task)])`` would put each Variable (moves nothing)."""
    return {a.path: a.sharding for a in plan_placement(model, [(".*", task)])}


def measure(
    piece: Piece,
    task: Task,
    shardings: dict[tuple, NamedSharding],
    rows: int,
    *,
    optimizer: Any = None,
    repeats: int = 5,
    launch: float = 0.0,
) -> Timing:
    """``piece``'s :class:`Timing` on ``task`` (per call over ``repeats`` calls, less
    ``launch``)."""
    rng = np.random.default_rng(0)
    params = _placed(piece.params, shardings, rng)
    other = _placed(piece.other, shardings, rng)
    inputs = tuple(_input(a, task, rows, rng) for a in piece.inputs)
    grads = piece.grads

    def forward(params: Any, other: Any, inputs: Sequence) -> Any:
        def f(params: Any, diff: list) -> tuple:
            it = iter(diff)
            full = [next(it) if g else x for x, g in zip(inputs, grads, strict=True)]
            return piece.fn(params, other, full)

        return jax.vjp(f, params, [x for x, g in zip(inputs, grads, strict=True) if g])

    fwd = jax.jit(forward)
    out, vjp = fwd(params, other, inputs)
    cotangent = jax.jit(lambda o: jax.tree.map(jnp.ones_like, o))(out)
    args = (vjp, cotangent)

    def work(fn: Callable, args: tuple) -> float:
        return max(_seconds(fn, args, repeats) - launch, 0.0)

    return Timing(
        forward=work(fwd, (params, other, inputs)),
        backward=work(jax.jit(lambda v, c: v(c)), args),
        input_grad=work(jax.jit(lambda v, c: v(c)[1]), args) if any(grads) else 0.0,
        weight_grad=work(jax.jit(lambda v, c: v(c)[0]), args) if jax.tree.leaves(params) else 0.0,
        held_bytes=_held_bytes(forward, (params, other, inputs), vjp, len(jax.tree.leaves(out))),
        output_bytes=sum(_device_bytes(x) for x in jax.tree.leaves(out)),
        state_bytes=sum(_device_bytes(x) for x in jax.tree.leaves((params, other))),
        optimizer_bytes=_optimizer_bytes(optimizer, params),
    )


def launch_seconds(task: Task, repeats: int = 5) -> float:
    """The time a program doing next to nothing takes on ``task`` as :func:`measure` times one."""
    x = jax.device_put(jnp.zeros((8,), jnp.float32), task.sharding())
    return _seconds(jax.jit(lambda x: x + 1), (x,), repeats)


def _seconds(fn: Callable, args: tuple, repeats: int, samples: int = 5) -> float:
    """Seconds per call of ``fn(*args)``: the median of ``samples`` runs of ``repeats`` calls."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        out = None
        for _ in range(repeats):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / repeats)
    return statistics.median(times)


def _device_bytes(x: Any) -> int:
    """The bytes of ``x`` on each of its devices."""
    if not isinstance(x, jax.Array):
        return 0
    return math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize


def _held_bytes(forward: Callable, args: tuple, vjp: Any, num_out: int) -> int:
    """The bytes per device of ``vjp``'s residuals but the Variables it reads as they are."""
    closed = jax.make_jaxpr(forward)(*args)
    state_vars = closed.jaxpr.invars[: len(jax.tree.leaves(args[:2]))]
    residuals = closed.jaxpr.outvars[num_out:]
    return sum(
        _device_bytes(value)
        for var, value in zip(residuals, jax.tree.leaves(vjp), strict=True)
        if not any(var is v for v in state_vars)
    )


def _optimizer_bytes(optimizer: Any, params: Any) -> int:
    """The bytes per device of ``optimizer``'s state for ``params``, laid out as they are."""
    leaves = jax.tree.leaves(params)
    if optimizer is None or not leaves:
        return 0
    state = jax.eval_shape(optimizer.init, _abstract(params))
    whole = sum(math.prod(x.shape) * x.dtype.itemsize for x in leaves)
    held = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(state))
    per_device = sum(_device_bytes(x) for x in leaves)
    return round(held * per_device / whole) if whole else 0


def _placed(state: Any, shardings: dict[tuple, NamedSharding], rng: np.random.Generator) -> Any:
    """``state`` with every Variable's value (abstract ones drawn) on its sharding."""
    flat = []
    for path, variable in nnx.to_flat_state(state):
        value = variable.get_value()
        if not isinstance(value, jax.Array | np.ndarray):
            value = _drawn(value, rng, scale=0.02)
        flat.append((path, variable.replace(jax.device_put(value, shardings[path]))))
    return nnx.from_flat_state(flat)


def _input(aval: Any, task: Task, rows: int, rng: np.random.Generator) -> jax.Array:
    """An input on ``task``, split over its ``batch`` axis where its leading axis is ``rows``."""
    value = aval if isinstance(aval, jax.Array | np.ndarray) else _drawn(aval, rng, scale=1.0)
    spec = PartitionSpec()
    if aval.ndim and aval.shape[0] == rows:
        batch = task.spec(("batch",) + (None,) * (aval.ndim - 1))
        shards = math.prod(task.jax_mesh.shape[a] for a in axes_of(batch[0] if batch else None))
        if rows % shards == 0:
            spec = batch
    return jax.device_put(value, task.sharding(spec))


def _drawn(aval: Any, rng: np.random.Generator, *, scale: float) -> Any:
    """Values of ``aval``'s shape and dtype: normal times ``scale``, ones, or zeros."""
    dtype = aval.dtype
    if jnp.issubdtype(dtype, jnp.floating):
        drawn = rng.standard_normal(aval.shape, dtype=np.float32) * scale
        return jnp.asarray(drawn, dtype)
    if jnp.issubdtype(dtype, jnp.bool_):
        return np.ones(aval.shape, bool)
    return jnp.zeros(aval.shape, dtype)
