"""multimesh.jax's ``microbatch`` on ``mm.microbatch``: sum over slices, remainder dropped."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

import mmnnx as mm
from multimesh_compat.jax import _context

# multimesh schedule names that mmnnx knows by another name
_ALIASES = {
    "fill-drain": "gpipe",
    "breadth-first": "gpipe",
    "wavefront": "1f1b",
    "prefetch-wavefront": "1f1b",  # no loop-increment prefetching in mmnnx: plain 1F1B
    "zero-bubble-h2": "zero-bubble-h1",  # used where the registry has no ZB-H2
    "custom": "custom",
}
# with interleave=v > 1: the schedule that runs v stages per rank in the same pattern
_INTERLEAVED = {"1f1b": "interleaved-1f1b", "gpipe": "interleaved-gpipe"}


class _ScheduleNames(Mapping):
    """multimesh schedule name -> mmnnx schedule name: every name in mmnnx's schedule registry
    (``mm.schedules.names()``, read at each look-up) as itself, then multimesh's aliases."""

    def _table(self) -> dict[str, str]:
        registered = mm.schedules.names()
        table = {name: name for name in registered}
        for alias, target in _ALIASES.items():
            table.setdefault(alias, target)
        return table

    def __getitem__(self, name: str) -> str:
        return self._table()[name]

    def __iter__(self):
        return iter(self._table())

    def __len__(self) -> int:
        return len(self._table())

    def __repr__(self) -> str:
        return repr(self._table())


SCHEDULES = _ScheduleNames()


def _custom_table(custom_schedule: Sequence[Sequence[Any]], num: int) -> mm.schedules.Schedule:
    """A ``custom_schedule`` (one row per pipeline mesh, entries task names or
    ``(microbatch, name)`` pairs) as an mmnnx schedule: row r is stage r; a name ending in
    ``_bwd`` is that stage's backward pass, any other name its forward pass."""
    rows = []
    for stage, row in enumerate(custom_schedule):
        counts: dict[str, int] = {}
        entries = []
        for entry in row:
            if isinstance(entry, str):
                mb = counts.get(entry, 0)
                counts[entry] = mb + 1
                entries.append((mb, entry))
            else:
                mb, name = entry
                counts[name] = counts.get(name, 0) + 1
                entries.append((int(mb), name))
        tasks = sorted({name.removesuffix("_bwd") for name in counts})
        if len(tasks) > 1:
            raise ValueError(
                f"custom_schedule row {stage} names tasks {', '.join(tasks)}: a row is one "
                "pipeline stage, its task's forward passes (NAME) and backward passes (NAME_bwd)"
            )
        for name, c in counts.items():
            if c != num:
                raise ValueError(
                    f"task {name} has {c} microbatches, but there are {num} microbatches"
                )
        rows.append(
            [f"{'B' if name.endswith('_bwd') else 'F'}{stage}.{mb}" for mb, name in entries]
        )
    return mm.schedules.custom(rows)


def microbatch(
    fun: Callable,
    dim: int,
    size: int,
    argnum: int = 0,
    interleave: int | None = None,
    num_stages: int | None = None,
    schedule: str | None = None,
    unrolling: int | None = None,
    arg_shardings: Any = None,
    custom_schedule: Sequence[Sequence[Any]] | None = None,
) -> Callable:
    """Runs ``fun`` on slices of length ``size`` along ``dim`` of argument ``argnum`` and sums
    the outputs leaf by leaf.

    ``x.shape[dim] // size`` microbatches run; a remainder is dropped. With one microbatch
    ``fun`` is called directly. Inside this layer's programs the microbatches are pipelined by
    mmnnx's engine with the schedule named (see the docs for how multimesh's schedule names map
    to mmnnx's); ``num_stages`` and ``unrolling`` are hints that mmnnx does not need, and
    ``interleave=v > 1`` selects mmnnx's interleaved 1F1B (or, for the GPipe family, interleaved
    GPipe) with ``v`` virtual stages.

    Example:
        >>> import jax.numpy as jnp
        >>> f = microbatch(lambda x, w: (x * w).sum(), dim=0, size=2)
        >>> float(f(jnp.arange(7.0), 1.0))  # slices [0,1], [2,3], [4,5]; row 6 is dropped
        15.0
    """
    if custom_schedule is not None:
        if schedule not in (None, "custom"):
            raise ValueError(
                f"microbatch: custom_schedule given with schedule={schedule!r}; use "
                "schedule='custom' or leave it unset"
            )
        schedule = "custom"
    if _context.transforms_ignored():
        return fun

    @functools.wraps(fun)
    def run(*args, **kwargs):
        if schedule is not None and schedule not in SCHEDULES:
            raise jax.errors.JaxRuntimeError(
                f"INVALID_ARGUMENT: unknown microbatch schedule {schedule!r}; valid schedules: "
                f"{', '.join(SCHEDULES)}"
            )
        from multimesh_compat.jax._engine import with_sharding_constraint

        target = args[argnum]
        if arg_shardings is not None:
            if isinstance(arg_shardings, jax.sharding.PartitionSpec):
                target = jax.tree.map(lambda x: with_sharding_constraint(x, arg_shardings), target)
            else:
                target = jax.tree.map(
                    lambda s, sub: sub if s is None else with_sharding_constraint(sub, s),
                    arg_shardings,
                    target,
                    is_leaf=lambda s: s is None or isinstance(s, jax.sharding.PartitionSpec),
                )
        leaves = jax.tree.leaves(target)
        lengths = {x.shape[dim] for x in leaves}
        if len(lengths) > 1:
            raise ValueError("dimensions not the same across all microbatched tensors")
        total = lengths.pop()
        num = total // size
        if num < 1:
            raise ValueError(
                f"microbatch: microbatch size {size} is larger than the batch of {total}"
            )
        if num * size != total:
            target = jax.tree.map(
                lambda x: jax.lax.slice_in_dim(x, 0, num * size, axis=dim), target
            )
        call_args = list(args)
        call_args[argnum] = target
        if num == 1:
            return fun(*call_args, **kwargs)
        name = SCHEDULES[schedule] if schedule is not None else "gpipe"
        virtual = 1
        if name == "custom":
            sched: Any = _custom_table(custom_schedule, num)
        elif interleave and interleave > 1 and name in _INTERLEAVED:
            sched, virtual = _INTERLEAVED[name], int(interleave)
        else:
            sched = name
        micro = mm.microbatch(
            fun,
            num=num,
            argnums=(argnum,),
            dim=dim,
            reduce="sum",
            schedule=sched,
            virtual_stages=virtual,
        )
        return micro(*call_args, **kwargs)

    return run
