"""The JAX programs a step's actions compile to: a fragment's (or an overlapped pair's) program,
the program packing block weights and making zeroed running sums, and the compiler
lowering each distinct computation once and compiling the programs side by side."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import itertools
import os
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from mmnnx._jax import compile as compiles
from mmnnx._jax.compile import Recent, SharedCompiles
from mmnnx._jax.retarget import retarget
from mmnnx._jax.tracing import trace_context
from mmnnx.mpmd.evaluate import run_ops
from mmnnx.mpmd.ir import Graph
from mmnnx.mpmd.lower.alike import AlikeKeys
from mmnnx.mpmd.lower.lower import constraint_layout
from mmnnx.mpmd.lower.pack import slice_offsets
from mmnnx.mpmd.lower.program import Buffer, PackWeights, Run, Zeros
from mmnnx.mpmd.primitives import constraint_layouts
from mmnnx.mpmd.trace.mesh_context import explicit_twin


@dataclasses.dataclass
class _Part:
    """One fragment's share of a compiled program."""

    body: Callable[..., list]
    in_shardings: list[Any]
    out_shardings: list[Any]
    donate: tuple[int, ...]
    avals: list[Any]
    explicit: Any


def _part(graph: Graph, run: Run, in_shardings: Sequence[Any]) -> _Part:
    """``run``'s share of a program, taking :attr:`Run.args` laid out as ``in_shardings`` and
    returning :attr:`Run.results`. Packed members not ``fixed`` are sliced at their block's base, an
    argument (:func:`~mmnnx.mpmd.lower.pack.slice_offsets`), plus a distance fixed in the program:
    constant offsets would make each block's kernels distinct."""
    frag = run.fragment
    packing = run.packing
    n = len(frag.in_ids) if packing is None else len(packing.args)
    if packing is None:
        sums: list[tuple[Buffer | None, tuple[int, ...]]] = [(None, (i,)) for i in run.summed]
        buffers: dict[int, Buffer] = {}
        donated = list(run.donate)
    else:  # a packed member is not donated: its buffer holds other members too
        sums = [(s.buffer, s.positions) for s in packing.sums]
        buffers = dict(packing.buffers)
        reads = packing.reads
        donated = sorted({reads[p].arg for p in run.donate if reads[p].member is None})
    total_shardings = list(in_shardings[n : n + len(sums)])
    offsets = [] if packing is None else slice_offsets(packing.reads, buffers)
    offset_arg = {at: n + len(sums) + j for j, at in enumerate(offsets)}
    returned = run.returned
    packs = () if packing is None else packing.packs

    def inputs(args: Sequence[Any]) -> list:
        if packing is None:
            return list(args[:n])

        def member(k: int, at: int, shape: tuple[int, ...], size: int) -> Any:
            buffer = buffers[k]
            if buffer.fixed:  # at the same offset in every block: the blocks' kernels stay alike
                return jax.lax.slice(args[k], (at,), (at + size,)).reshape(shape)
            base = buffer.base_of(at)
            start = args[offset_arg[base]]
            if at != base:
                start = jax.lax.add(start, jnp.int32(at - base))
            # offsets are never negative: no ops to wrap them around
            member = jax.lax.dynamic_slice(args[k], (start,), (size,), allow_negative_indices=False)
            return member.reshape(shape)

        return [
            args[r.arg]
            if r.member is None
            else member(r.arg, r.member.offset, r.member.shape, r.member.size)
            for r in packing.reads
        ]

    def body(*args):
        outs = run_ops(frag.ops, frag.in_ids, frag.out_ids, inputs(args))

        def flat(positions: Sequence[int]) -> Any:
            return jnp.concatenate([jnp.ravel(outs[p]) for p in positions])

        totals = [
            total + (outs[at[0]] if buffer is None else flat(at))
            for total, (buffer, at) in zip(args[n : n + len(sums)], sums, strict=True)
        ]
        return [*(outs[i] for i in returned), *(flat(b.positions) for b in packs), *totals]

    out_shardings = [
        *(run.out_shardings[i] for i in returned),
        *(frag.task.sharding() for _ in packs),
        *total_shardings,
    ]
    explicit = None
    if graph.specs:  # traced with sharding in types: every program keeps the types
        explicit = explicit_twin(frag.task.jax_mesh)

        def typed(v: int) -> NamedSharding:
            return NamedSharding(explicit, graph.specs.get(v, PartitionSpec()))

        in_shardings = [typed(v) for v in frag.in_ids]
        in_shardings += [typed(frag.out_ids[i]) for i in run.summed]
        total_shardings = list(in_shardings[n:])
        out_shardings = [typed(frag.out_ids[i]) for i in returned] + total_shardings

    def aval(v: int | Buffer, s: Any) -> jax.ShapeDtypeStruct:
        if isinstance(v, Buffer):
            return jax.ShapeDtypeStruct((v.size,), v.dtype, sharding=s)
        return jax.ShapeDtypeStruct(graph.shapes[v], graph.dtypes[v], sharding=s)

    if packing is None:
        avals = [aval(v, s) for v, s in zip(frag.in_ids, in_shardings[:n], strict=True)]
    else:  # each unpacked argument: the value its first read takes
        first = list(zip(packing.reads, frag.in_ids, strict=True))[::-1]
        value_of = {r.arg: v for r, v in first}
        avals = [aval(buffers.get(k) or value_of[k], in_shardings[k]) for k in range(n)]
    avals += [
        aval(frag.out_ids[at[0]] if buffer is None else buffer, s)
        for (buffer, at), s in zip(sums, total_shardings, strict=True)
    ]
    avals += [
        jax.ShapeDtypeStruct((), jnp.int32, sharding=in_shardings[i]) for i in offset_arg.values()
    ]
    donate = (*donated, *range(n, n + len(total_shardings)))
    return _Part(
        body=body,
        in_shardings=list(in_shardings),
        out_shardings=out_shardings,
        donate=donate,
        avals=avals,
        explicit=explicit,
    )


def lower_fragments(
    graph: Graph, runs: Sequence[Run], in_shardings: Sequence[Sequence[Any]]
) -> Any:
    """Lowers the fragments of ``runs`` (on one task) as one program taking their arguments and
    returning their results run after run: one fragment, or an overlapped pair."""
    parts = [_part(graph, run, s) for run, s in zip(runs, in_shardings, strict=True)]
    bounds = list(itertools.pairwise([0, *itertools.accumulate(len(p.avals) for p in parts)]))

    def body(*args):
        return [
            out
            for part, (lo, hi) in zip(parts, bounds, strict=True)
            for out in part.body(*args[lo:hi])
        ]

    jitted = jax.jit(
        body,
        in_shardings=[s for part in parts for s in part.in_shardings],
        out_shardings=[s for part in parts for s in part.out_shardings],
        donate_argnums=tuple(
            lo + i for part, (lo, _) in zip(parts, bounds, strict=True) for i in part.donate
        ),
    )
    explicit = parts[0].explicit
    with (
        constraint_layouts(functools.partial(constraint_layout, runs[0].task)),
        jax.set_mesh(explicit) if explicit is not None else contextlib.nullcontext(),
    ):
        return jitted.lower(*(a for part in parts for a in part.avals))


def lower_packing(
    buffers: Sequence[Buffer], shardings: Sequence[Any], task: Any, zeros: Zeros | None = None
) -> Any:
    """One program concatenating step inputs into each of ``buffers``, flat on ``task``, then making
    the running sums of ``zeros`` (if any), lowered."""
    layouts = iter(shardings)
    avals = [
        jax.ShapeDtypeStruct(m.shape, buffer.dtype, sharding=next(layouts))
        for buffer in buffers
        for m in buffer.members
    ]
    made = () if zeros is None else tuple(zip(zeros.shapes, zeros.dtypes, strict=True))

    def pack(*members):
        out, at = [], 0
        for buffer in buffers:
            taken = members[at : at + len(buffer.members)]
            out.append(jnp.concatenate([jnp.ravel(m) for m in taken]))
            at += len(buffer.members)
        return out + [jnp.zeros(shape, dtype) for shape, dtype in made]

    out_shardings = [task.sharding()] * len(buffers) + list(zeros.shardings if zeros else ())
    return jax.jit(pack, out_shardings=out_shardings).lower(*avals)


_LOWERED = Recent(64)  # (JAX's trace context, alike key) -> (the first lowered, its task)


def clear_caches() -> None:
    """Forgets the programs ``mm.jit`` steps lowered and compiled in this process (a later step
    of equal programs takes them instead of lowering and compiling its own), and JAX's caches
    (``jax.clear_caches``). Steps already compiled keep their programs; JAX's persistent
    compilation cache, if on, still serves the next compiles.

    Example (not run by the doctests: in a test process it would throw away what every later
    test would reuse; tests/test_pipeline.py calls it):
        >>> import mmnnx as mm
        >>> mm.clear_caches()  # doctest: +SKIP
    """
    _LOWERED.clear()
    compiles.clear()
    jax.clear_caches()


class Compiler:
    """Lowers and compiles a step's programs. A program alike one already lowered in this process
    (:class:`~mmnnx.mpmd.lower.alike.AlikeKeys`) reuses that lowering moved to its own devices
    (:func:`~mmnnx._jax.retarget.retarget`). Programs compile side by side on a pool of threads.
    ``moved``: the ids of the ``Lowered`` programs moved rather than lowered (kept alive, so that no
    other object takes their ids)."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.shared = SharedCompiles()
        self.moved: set[int] = set()
        self._moved: list[Any] = []  # the Lowered objects of ``moved``, alive
        self._keys = AlikeKeys(graph)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max(1, min(8, cores or 1)), thread_name_prefix="mmnnx-compile"
        )

    def lower_fragments(self, runs: Sequence[Run], in_shardings: Sequence[Sequence[Any]]) -> Any:
        """:func:`lower_fragments` of the step's graph, or an alike program's lowering moved."""
        return self._lower(
            self._keys.program(runs, in_shardings),
            runs[0].task,
            functools.partial(lower_fragments, self.graph, runs, in_shardings),
        )

    def lower_zeros(self, zeros: Zeros) -> Any:
        """The program of a :class:`Zeros` action: :meth:`lower_packing` packing nothing."""
        return self.lower_packing(PackWeights(task=zeros.task, buffers=(), zeros=zeros), ())

    def lower_packing(self, pack: PackWeights, shardings: Sequence[Any]) -> Any:
        """:func:`lower_packing` for a :class:`PackWeights` action, or an alike one's moved."""
        zeros = pack.zeros
        what = (
            "pack",
            tuple(b.layout for b in pack.buffers),
            zeros and (zeros.shapes, zeros.dtypes, self._keys.layouts(pack.task, zeros.shardings)),
        )
        return self._lower(
            self._keys.start(pack.task, what, shardings),
            pack.task,
            functools.partial(lower_packing, pack.buffers, shardings, pack.task, zeros),
        )

    def _lower(self, key: Hashable | None, task: Any, lower: Callable[[], Any]) -> Any:
        """The program ``lower()`` lowers for ``task``, or the first of ``key`` moved to
        ``task``."""
        if key is not None:
            key = (trace_context(), key)
        first = _LOWERED.get(key) if key is not None else None
        if first is not None:
            lowered, on = first
            devices = dict(zip(on.jax_mesh.devices.flat, task.jax_mesh.devices.flat, strict=True))
            moved = retarget(lowered, devices)
            if moved is not None:
                self.moved.add(id(moved))
                self._moved.append(moved)
                return moved
        lowered = lower()
        if key is not None:
            _LOWERED.put(key, (lowered, task))
        return lowered

    def submit(self, lowered: Any) -> concurrent.futures.Future:
        return self.shared.submit(lowered, self._pool)

    def output_shardings(self, lowered: Any, compiling: concurrent.futures.Future) -> list:
        """The program's output layouts: pinned ones without waiting for its compilation."""
        shardings = [leaf.sharding for leaf in jax.tree.leaves(lowered.out_info)]
        if all(s is not None for s in shardings):
            return shardings
        return list(compiling.result().output_shardings)

    def __enter__(self) -> Compiler:
        return self

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
