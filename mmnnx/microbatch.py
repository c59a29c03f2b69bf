"""``mm.microbatch``: split a step's batch into microbatches and combine the results."""

from __future__ import annotations

import functools
import re
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from mmnnx import _nnx
from mmnnx.errors import UnrolledMicrobatchWarning
from mmnnx.mpmd import primitives, schedules
from mmnnx.mpmd.ir import GROUP_PREFIX
from mmnnx.mpmd.trace import trace_state
from mmnnx.mpmd.trace.trace_state import MicrobatchGroup

_REDUCTIONS = ("sum", "mean", "concat", "stack")
_GATHERED = ("concat", "stack")  # every microbatch's value kept, in order


def _split_count(
    leaves: Sequence[Any], dim: int, num: int | None, size: int | None, argnums: tuple[int, ...]
) -> int:
    sizes = {}
    for path, leaf in leaves:
        if not hasattr(leaf, "shape") or leaf.ndim <= dim:
            raise ValueError(
                f"mm.microbatch: argument leaf {path} has no dimension {dim} to split "
                f"(shape {getattr(leaf, 'shape', None)}); the arguments at argnums={argnums} "
                "are split into microbatches: pass argnums= naming the batch arguments"
            )
        sizes.setdefault(leaf.shape[dim], path)
    if len(sizes) > 1:
        (n1, p1), (n2, p2) = list(sizes.items())[:2]
        raise ValueError(
            f"mm.microbatch: leaves differ in size along dimension {dim}: {p1} has {n1} and "
            f"{p2} has {n2}"
        )
    if not sizes:
        raise ValueError("mm.microbatch: the split arguments hold no arrays")
    total = next(iter(sizes))
    count = num if num is not None else total // size
    if size is not None and total % size:
        raise ValueError(
            f"mm.microbatch: microbatch size {size} does not divide the batch of {total} "
            f"along dimension {dim}"
        )
    if num is not None and total % num:
        raise ValueError(
            f"mm.microbatch: {num} microbatches do not divide the batch of {total} along "
            f"dimension {dim}; use a divisor of {total}"
        )
    return count


def microbatch(
    fun: Callable,
    *,
    num: int | None = None,
    size: int | None = None,
    argnums: int | Sequence[int] = (1,),
    dim: int = 0,
    reduce: Any = "sum",
    schedule: str | schedules.Schedule = "1f1b",
    virtual_stages: int = 1,
) -> Callable:
    """Calls ``fun`` once per microbatch of the ``argnums`` arguments and combines the outputs.

    The arrays of the ``argnums`` arguments are split along ``dim`` into ``num`` microbatches (or
    microbatches of ``size`` rows); the outputs are combined leaf by leaf with ``reduce``:
    ``"sum"`` (multimesh's contract), ``"mean"``, ``"concat"`` (concatenated along ``dim`` in
    microbatch order, so per-example outputs such as logits or per-sample losses line up with
    the batch again), ``"stack"`` (one value per microbatch along a new leading axis), or a
    pytree of those that is a prefix of the output, e.g. ``(("mean", ("concat", "concat")),
    "mean")`` for ``nnx.value_and_grad(loss_fn, has_aux=True)`` returning per-sample losses and
    logits as its aux. In a pipeline, each microbatch writes its rows of a gathered output in
    place, on the task that makes it.
    ``schedule`` (a name from ``mm.schedules.names()`` or a ``Schedule``) and
    ``virtual_stages`` say how a pipeline runs the microbatches.

    Outside ``mm.jit`` the microbatches run as a plain loop. One microbatch is one call, not a
    pipeline (a ``UserWarning`` says so inside ``mm.jit`` when a schedule other than the default
    or ``virtual_stages`` was given). Inside it, ``fun`` is traced once and
    the engine runs its per-stage programs once per microbatch in the schedule's order, so the
    number of compiled programs does not depend on ``num``. RNG counts, batch statistics and
    sown values that ``fun`` updates are still traced once and equal the plain loop's; a
    ``fun`` that updates parameters or RNG keys is traced once per microbatch instead (with an
    ``mm.UnrolledMicrobatchWarning``), so the updates chain as in the plain loop.

    Example:
        >>> import jax.numpy as jnp
        >>> f = microbatch(lambda w, x: (w * x).sum(), num=4, reduce="sum")
        >>> float(f(2.0, jnp.arange(8.0)))
        56.0
        >>> g = microbatch(lambda w, x: (w * x, (w * x).sum()), num=4, reduce=("concat", "stack"))
        >>> [a.tolist() for a in g(2.0, jnp.arange(8.0))]
        [[0.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0], [2.0, 10.0, 18.0, 26.0]]
    """
    if (num is None) == (size is None):
        raise ValueError("mm.microbatch: give exactly one of num= and size=")
    count, which = (num, "num") if num is not None else (size, "size")
    if isinstance(count, bool) or not isinstance(count, int):
        raise TypeError(
            f"mm.microbatch: {which} must be an int, got {count!r} ({type(count).__name__})"
        )
    if count < 1:
        raise ValueError(f"mm.microbatch: {which} must be >= 1, got {count}")
    if not isinstance(virtual_stages, int) or virtual_stages < 1:
        raise ValueError(f"mm.microbatch: virtual_stages must be an int >= 1, got {virtual_stages}")
    if isinstance(schedule, str) and schedule not in schedules.names():
        raise ValueError(
            f"mm.microbatch: unknown schedule {schedule!r}; valid schedules are "
            f"{', '.join(schedules.names())} (or a Schedule object)"
        )
    if not isinstance(schedule, str | schedules.Schedule):
        raise TypeError(f"mm.microbatch: schedule {schedule!r} is not a name or a Schedule")
    for r in jax.tree.leaves(reduce):
        if r not in _REDUCTIONS:
            raise ValueError(f"mm.microbatch: reduce {r!r} is not one of {_REDUCTIONS}")
    split_args = (argnums,) if isinstance(argnums, int) else tuple(argnums)

    @functools.wraps(fun)
    def run(*args, **kwargs):
        for i in split_args:
            if i >= len(args):
                raise ValueError(
                    f"mm.microbatch: argnums names argument {i}, but only {len(args)} were given"
                )
        leaves = [
            (f"arg{i}{jax.tree_util.keystr(p)}", leaf)
            for i in split_args
            for p, leaf in jax.tree.leaves_with_path(args[i])
        ]
        m = _split_count(leaves, dim, num, size, split_args)
        try:
            return _run_split(args, kwargs, m)
        except (TypeError, ValueError) as e:
            total = leaves[0][1].shape[dim]
            hint = _unsplit_batch_hint(args, split_args, dim, total) or _whole_batch_shape_hint(
                e, dim, total, m
            )
            if hint is None:
                raise
            try:
                wrapped = type(e)(f"{e}\n{hint}")
            except Exception:  # an exception type with another constructor
                wrapped = ValueError(f"{e}\n{hint}")
            raise wrapped from e

    def _run_split(args, kwargs, m):
        trace = trace_state.current_trace()
        if trace is not None and m == 1 and (schedule != "1f1b" or virtual_stages != 1):
            warnings.warn(
                f"mm.microbatch: one microbatch is not pipelined: the step runs its stages "
                f"one after another, and schedule={getattr(schedule, 'name', schedule)!r}, "
                f"virtual_stages={virtual_stages} are neither used nor checked against the "
                "placement; pass num >= 2 to pipeline",
                UserWarning,
                stacklevel=3,
            )
        if trace is not None and m > 1:
            result = _traced_once(
                trace, fun, args, kwargs, split_args, dim, m, schedule, virtual_stages, reduce
            )
            if result is not None:
                return result

        def piece(tree, k):
            def cut(x):
                rows = x.shape[dim] // m
                return jax.lax.slice_in_dim(x, k * rows, (k + 1) * rows, axis=dim)

            return jax.tree.map(cut, tree)

        kinds, treedef, combined = None, None, []
        for k in range(m):
            call_args = [piece(a, k) if i in split_args else a for i, a in enumerate(args)]
            out = fun(*call_args, **kwargs)
            if kinds is None:
                kinds = _reductions(reduce, out, dim)
                leaves, treedef = jax.tree.flatten(out)
                combined = [
                    [x] if kind in _GATHERED else x for x, kind in zip(leaves, kinds, strict=True)
                ]
                continue
            for j, (x, kind) in enumerate(zip(treedef.flatten_up_to(out), kinds, strict=True)):
                if kind in _GATHERED:
                    combined[j].append(x)
                else:  # a running total: only one microbatch's output alive at a time
                    combined[j] = jnp.add(combined[j], x)
        finished = [
            jnp.stack(x)
            if kind == "stack"
            else jnp.concatenate(x, axis=dim)
            if kind == "concat"
            else (x / m if kind == "mean" and m > 1 else x)
            for x, kind in zip(combined, kinds, strict=True)
        ]
        return jax.tree.unflatten(treedef, finished)

    return run


def _unsplit_batch_hint(args: tuple, split_args: tuple, dim: int, total: int) -> str | None:
    """Advice on ``argnums`` when ``fun`` failed: positional arguments not split that hold an array
    of the batch's size along ``dim``."""
    suspects = [
        i
        for i, a in enumerate(args)
        if i not in split_args
        and not any(_nnx.is_variable(v) for v in jax.tree.leaves(a, is_leaf=_nnx.is_variable))
        and any(
            getattr(leaf, "ndim", 0) > dim and leaf.shape[dim] == total
            for leaf in jax.tree.leaves(a)
        )
    ]
    if not suspects:
        return None
    wanted = tuple(sorted({*split_args, *suspects}))
    return (
        f"mm.microbatch: argument(s) {', '.join(map(str, suspects))} have the batch's size "
        f"{total} along dimension {dim} but are not split (argnums={split_args}); if they are "
        f"part of the batch, use argnums={wanted}"
    )


def _whole_batch_shape_hint(error: Exception, dim: int, total: int, m: int) -> str | None:
    """When ``fun`` failed on a shape naming the whole batch's size (``x.reshape(8, -1)``)."""
    message = str(error)
    if m == 1 or not re.search(r"reshape|broadcast", message):
        return None
    numbers = {int(n) for n in re.findall(r"\b\d+\b", message)}
    if total not in numbers:
        return None
    return (
        f"mm.microbatch: the batch's {total} rows along dimension {dim} are split into {m} "
        f"microbatches of {total // m}; a shape written with the whole batch's size {total} does "
        f"not fit one microbatch: take it from the input instead (e.g. x.shape[{dim}])"
    )


def _reductions(reduce: Any, out: Any, dim: int) -> list[str]:
    """The reduction of each leaf of ``out``; checks that each concatenated leaf can be."""
    with_paths = jax.tree_util.tree_flatten_with_path(out)[0]
    if isinstance(reduce, str):
        kinds = [reduce] * len(with_paths)
    else:
        try:
            per = jax.tree.map(lambda r, sub: [r] * len(jax.tree.leaves(sub)), reduce, out)
        except (TypeError, ValueError):
            raise ValueError(
                "mm.microbatch: the reduce pytree does not match the function's output: reduce "
                f"is {jax.tree.structure(reduce)}, the output is {jax.tree.structure(out)}; give "
                "one of 'sum', 'mean', 'concat', 'stack' per output leaf (or subtree), or a "
                "single string"
            ) from None
        lists = jax.tree.leaves(per, is_leaf=lambda x: isinstance(x, list))
        kinds = [k for ks in lists for k in ks]
    for (path, leaf), kind in zip(with_paths, kinds, strict=True):
        if not isinstance(leaf, (int, float, complex)) and not hasattr(leaf, "dtype"):
            raise TypeError(
                f"mm.microbatch: output {jax.tree_util.keystr(path) or '(the output)'} is a "
                f"{type(leaf).__name__}, not a number or an array, so its microbatches cannot be "
                f"combined with {kind!r}; return it outside the microbatched function"
            )
        if kind == "concat" and jnp.ndim(leaf) <= dim:
            raise ValueError(
                f"mm.microbatch: output {jax.tree_util.keystr(path) or '(the output)'} has no "
                f"dimension {dim} to concatenate the microbatches along (shape "
                f"{jnp.shape(leaf)}); reduce it with 'stack' (one value per microbatch), "
                "'sum' or 'mean'"
            )
    return kinds


def _gathered(x: Any, kind: str, m: int, dim: int) -> Any:
    """A gathered output's ``(m, ...)`` buffer as ``kind`` returns it."""
    if kind == "stack":
        return x
    x = jnp.moveaxis(x, 0, dim)  # (..., m, rows, ...): merge the two
    return x.reshape(*x.shape[:dim], x.shape[dim] * x.shape[dim + 1], *x.shape[dim + 2 :])


def _unrolled_reason(args, kwargs, changed, m: int) -> str:
    """Names the Variables whose update keeps ``fun`` from being pipelined."""
    names = {}
    for where, node in [*((f"arg{i}", a) for i, a in enumerate(args)), *kwargs.items()]:
        found = [((), node)] if _nnx.is_variable(node) else _nnx.variables_of(node)
        for path, v in found:
            names.setdefault(id(v), "/".join(map(str, (where, *path))))
    shown = [names.get(id(v), type(v).__name__) for v in changed]
    more = f" and {len(shown) - 3} more" if len(shown) > 3 else ""
    return (
        "mm.microbatch: the microbatched function updates "
        f"{', '.join(repr(n) for n in shown[:3])}{more}, so its "
        f"{m} microbatches run as an unrolled loop (traced {m} times, one program per "
        "microbatch), not as a pipeline"
    )


def _variables(args: Sequence[Any], kwargs: dict) -> list[Any]:
    """The distinct Variables reachable from the arguments, in order."""
    return list(
        {
            id(v): v
            for a in (*args, *kwargs.values())
            for v in jax.tree.leaves(a, is_leaf=_nnx.is_variable)
            if _nnx.is_variable(v)
        }.values()
    )


def _snapshot(value: Any) -> Any:
    """A sown value's containers copied (``nnx.capture`` adds to its dicts in place)."""
    if isinstance(value, dict):
        return {k: _snapshot(v) for k, v in value.items()}
    return value


def _with_every_microbatch(before: Any, after: Any, collect: Callable) -> Any | None:
    """``after`` (a sown value as one microbatch left it) with what that microbatch appended
    replaced by every microbatch's; ``None`` if it did more than append (its own ``reduce_fn``)."""
    if after is before:
        return after
    if isinstance(after, tuple) and isinstance(before, tuple):
        kept = after[: len(before)]
        if len(kept) == len(before) and all(a is b for a, b in zip(kept, before, strict=True)):
            return collect(after[len(before) :])
        return None
    if isinstance(after, dict) and isinstance(before, dict) and before.keys() <= after.keys():
        merged = {}
        for k, v in after.items():
            merged[k] = _with_every_microbatch(before.get(k, ()), v, collect)
            if merged[k] is None:
                return None
        return merged
    return None


def _in_row(x: Any, index: Any, m: int) -> Any:
    """``x`` in row ``index`` of an ``(m, ...)`` buffer of zeros, which the runtime sums over the
    microbatches."""
    return jax.lax.dynamic_update_index_in_dim(jnp.zeros((m, *jnp.shape(x)), x.dtype), x, index, 0)


def _traced_once(trace, fun, args, kwargs, split_args, dim, m, schedule, virtual_stages, reduce):
    """Traces ``fun`` once on microbatch ``index`` and returns its outputs combined as ``reduce``
    says. RNG counts start each microbatch at its own draws, other state chains from the previous
    microbatch, sown values are collected from every microbatch. ``None`` (the arguments left as
    they were) when ``fun`` updates a parameter or an RNG key, or sows with its own
    ``reduce_fn``."""
    group = len(trace.microbatches)
    variables = _variables(args, kwargs)
    before = [_snapshot(v.get_raw_value()) for v in variables]
    kinds = [
        "sown" if isinstance(b, tuple | dict) else _nnx.state_kind(v)  # dicts: nnx.capture
        for v, b in zip(variables, before, strict=True)
    ]
    with jax.named_scope(f"{GROUP_PREFIX}{group}"):
        index = primitives.microbatch_index(group)
        for slot, (v, b, kind) in enumerate(zip(variables, before, kinds, strict=True)):
            if kind == "count":
                v.set_raw_value(primitives.rng_base(b, index, group, slot))
            elif kind == "chained":
                v.set_raw_value(primitives.chain_in(b, group, slot))
        start = [v.get_raw_value() for v in variables]

        def piece(x):
            rows = x.shape[dim] // m
            return jax.lax.dynamic_slice_in_dim(x, index * rows, rows, axis=dim)

        call_args = [jax.tree.map(piece, a) if i in split_args else a for i, a in enumerate(args)]
        out = fun(*call_args, **kwargs)
        reductions = _reductions(reduce, out, dim)
        leaves, treedef = jax.tree.flatten(out)
        leaves = [
            _in_row(x, index, m) if kind in _GATHERED else x
            for x, kind in zip(leaves, reductions, strict=True)
        ]
    after = [v.get_raw_value() for v in variables]
    known = {id(v) for v in variables}
    added = [v for v in _variables(args, kwargs) if id(v) not in known]

    def collect(items: tuple) -> tuple | None:
        """One microbatch's appended values -> every microbatch's, interleaved as the unrolled
        loop appends them (``None`` if one is not an array)."""
        if not all(hasattr(x, "shape") and hasattr(x, "dtype") for x in items):
            return None
        with jax.named_scope(f"{GROUP_PREFIX}{group}"):
            rows = [_in_row(x, index, m) for x in items]
        every = [primitives.accumulate(r, group, gathered=True) for r in rows]
        return tuple(e[k] for k in range(m) for e in every)

    sown = {}
    for v, b, a, kind in zip(variables, before, after, kinds, strict=True):
        if kind == "sown":
            sown[id(v)] = _with_every_microbatch(b, a, collect)
    for v in added:
        sown[id(v)] = _with_every_microbatch((), v.get_raw_value(), collect)
    fixed = [
        v
        for v, s, a, kind in zip(variables, start, after, kinds, strict=True)
        if a is not s and kind == "fixed"
    ] + [v for v in (*variables, *added) if id(v) in sown and sown[id(v)] is None]
    if fixed:
        for v, b in zip(variables, before, strict=True):
            v.set_raw_value(b)
        why = _unrolled_reason(args, kwargs, fixed, m)
        _nnx.remove_variables([*args, *kwargs.values()], added)
        trace.unrolled.append(why)
        warnings.warn(why, UnrolledMicrobatchWarning, stacklevel=4)
        return None
    for v in added:
        v.set_raw_value(sown[id(v)])
    for slot, (v, b, s, a, kind) in enumerate(
        zip(variables, before, start, after, kinds, strict=True)
    ):
        if id(v) in sown:
            v.set_raw_value(sown[id(v)])
        elif a is s or kind == "fixed":
            v.set_raw_value(b)
        elif kind == "count":
            v.set_raw_value(primitives.rng_next(a, group, slot))
        else:
            v.set_raw_value(primitives.chain_out(a, group, slot))
    rows = jax.tree.leaves([args[i] for i in split_args])[0].shape[dim]
    trace.microbatches[group] = MicrobatchGroup(
        num_microbatches=m, schedule=schedule, virtual_stages=virtual_stages, batch_size=rows
    )
    totals = [
        primitives.accumulate(x, group, gathered=kind in _GATHERED)
        for x, kind in zip(leaves, reductions, strict=True)
    ]
    return jax.tree.unflatten(
        treedef,
        [
            _gathered(x, kind, m, dim) if kind in _GATHERED else x / m if kind == "mean" else x
            for x, kind in zip(totals, reductions, strict=True)
        ],
    )
