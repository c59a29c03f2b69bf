"""``tabulate``: a model summary with placement columns (task, PartitionSpec, bytes per device).

The forward pass is traced abstractly on a copy of the model whose arrays are shape-only, so a model
spread over several submeshes is summarised without running anything across them. Module classes are
never patched: the copy's modules get per-class recording subclasses instead, and a static attribute
holding their path, which the copies made by lifted transforms (``nnx.scan``, ``nnx.remat``) keep.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import itertools
import math
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from rich import box
from rich.table import Table

from mmnnx._nnx import variables_of
from mmnnx._tables import Tabulation, render
from mmnnx.mpmd.trace.trace_state import shapes_only
from mmnnx.sharding.place import SPEC_KEY, stack_of, task_of
from mmnnx.sharding.rules import Path, path_str
from mmnnx.sharding.specs import bytes_per_device, itemsize

_CALLS: contextvars.ContextVar[_Calls | None] = contextvars.ContextVar("mm_tabulate", default=None)
_RECORDING: dict[type, type] = {}
# Tags each module of the traced copy with its path: static data, so lifted transforms' copies
# carry it too
_PATH_ATTR = "_mm_tabulate_path"


class _Calls:
    """The first call of each module during one abstract trace: ``{path: (order, ins, outs)}``."""

    def __init__(self) -> None:
        self.order = itertools.count(1)
        self.first: dict[Path, tuple[int, str, str]] = {}

    def record(self, path: Path, order: int, args: tuple, kwargs: dict, out: Any) -> None:
        if path not in self.first or order < self.first[path][0]:
            self.first[path] = (order, _describe(args, kwargs), _describe(out))


def _recording_class(cls: type) -> type:
    """A subclass of ``cls`` whose ``__call__`` records its inputs and outputs."""
    sub = _RECORDING.get(cls)
    if sub is None:

        @functools.wraps(cls.__call__)
        def __call__(self, *args, **kwargs):
            calls = _CALLS.get()
            path = getattr(self, _PATH_ATTR, None)
            order = next(calls.order) if calls is not None else 0
            out = super(sub, self).__call__(*args, **kwargs)
            if calls is not None and path is not None:
                calls.record(path, order, args, kwargs, out)
            return out

        sub = type(
            cls.__name__,
            (cls,),
            {"__call__": __call__, "__module__": cls.__module__, "__qualname__": cls.__qualname__},
        )
        _RECORDING[cls] = sub
    return sub


def _describe(args: Any, kwargs: dict[str, Any] | None = None) -> str:
    """Shapes of ``args`` then ``name=...`` per keyword; graph nodes by their type name."""

    def text(tree: Any) -> str:
        leaves = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, nnx.Pytree))
        return ", ".join(_describe_leaf(leaf) for leaf in leaves)

    parts = [text(args)] + [f"{k}={text(v) or repr(v)}" for k, v in (kwargs or {}).items()]
    return ", ".join(p for p in parts if p) or "-"


def _describe_leaf(leaf: Any) -> str:
    if isinstance(leaf, nnx.Pytree):
        return type(leaf).__name__
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        return f"{leaf.dtype}[{','.join(str(d) for d in leaf.shape)}]"
    return repr(leaf)


def _abstract(x: Any) -> Any:
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)
    return x


def _trace_calls(
    model: Any, args: tuple, kwargs: dict[str, Any], method: str | Callable[..., Any]
) -> dict[Path, tuple]:
    """Runs ``model.<method>(...)`` abstractly; returns ``{module path: (order, ins, outs)}``."""
    graphdef, state = nnx.split(model)
    abstract_state = jax.tree.map(_abstract, state)
    names = list(kwargs)  # unflattening a dict would sort the keywords
    leaves, treedef = jax.tree.flatten((args, [kwargs[k] for k in names]))
    is_array = [hasattr(x, "shape") and hasattr(x, "dtype") for x in leaves]
    array_leaves = [_abstract(x) for x, a in zip(leaves, is_array, strict=True) if a]
    calls = _Calls()

    def run(state, array_leaves):
        copy = nnx.merge(graphdef, state)
        for path, node in nnx.iter_graph(copy):
            if isinstance(node, nnx.Module):
                setattr(node, _PATH_ATTR, path)
                if callable(node):
                    node.__class__ = _recording_class(type(node))
        it = iter(array_leaves)
        full = [next(it) if a else x for x, a in zip(leaves, is_array, strict=True)]
        args, values = jax.tree.unflatten(treedef, full)
        kwargs = dict(zip(names, values, strict=True))
        fn = getattr(copy, method) if isinstance(method, str) else functools.partial(method, copy)
        token = _CALLS.set(calls)
        try:
            out = fn(*args, **kwargs)
            if method != "__call__":
                calls.record((), -1, args, kwargs, out)
        finally:
            _CALLS.reset(token)
        return out

    with shapes_only():
        jax.eval_shape(run, abstract_state, array_leaves)
    return calls.first


def _check_method(
    model: Any, args: tuple, kwargs: dict[str, Any], method: str | Callable[..., Any]
) -> None:
    """Raises a clear error for a ``method`` that is not there or cannot take the inputs."""
    owner = type(model).__name__
    if isinstance(method, str):
        if not hasattr(model, method):
            raise AttributeError(f"tabulate: {owner} has no method {method!r}")
        fn, where = getattr(model, method), f"{owner}.{method}"
        if not callable(fn):
            raise TypeError(f"tabulate: {where} is not callable")
    elif callable(method):
        fn, where = functools.partial(method, model), f"method {method!r}"
    else:
        raise TypeError(f"tabulate: method must be a method name or a callable, got {method!r}")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to check against (a builtin)
        return
    try:
        signature.bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(
            f"tabulate: {where}{signature} cannot take the inputs given: {e} (depth, method and "
            "title are tabulate's own keywords; see tabulate's docstring to pass them on)"
        ) from None


def _path_key(path: Path) -> tuple:
    return tuple((0, p, "") if isinstance(p, int) else (1, 0, str(p)) for p in path)


def _fmt_bytes(n: int) -> str:
    return f"{n:,} B"


def _device_list(devices, *, runs: bool = True) -> str:
    """``devices`` by their indices in ``jax.devices()``, then any processes holding them."""
    devices = list(devices)
    position = {d: i for i, d in enumerate(jax.devices())}
    ids = sorted(position[d] for d in devices)
    if runs and ids == list(range(ids[0], ids[-1] + 1)) and len(ids) > 1:
        text = f"{ids[0]}-{ids[-1]}"
    else:
        text = ",".join(str(i) for i in ids)
    if jax.process_count() > 1:
        processes = sorted({d.process_index for d in devices})
        text += f" (process{'es' if len(processes) > 1 else ''} {', '.join(map(str, processes))})"
    return text


def _variable_info(path: Path, variable: nnx.Variable) -> dict:
    value = variable.get_value()
    shape, dtype = tuple(value.shape), value.dtype
    task = task_of(variable)
    stack = stack_of(variable)
    sharding = getattr(value, "sharding", None)
    elements, nbytes = math.prod(shape), math.prod(shape) * itemsize(dtype)
    shares = None
    if task is not None:
        spec = variable.get_metadata().get(SPEC_KEY, PartitionSpec())
        per_device = bytes_per_device(shape, dtype, spec, task.jax_mesh)
        where, spec_text, devices = task.name, str(spec), _device_list(task.jax_mesh.devices.flat)
    elif stack is not None:  # each task holds an equal chunk of the layers
        spec = variable.get_metadata().get(SPEC_KEY, PartitionSpec())
        k = len(stack.tasks)
        chunk = (shape[0] // k, *shape[1:])
        per_device = bytes_per_device(chunk, dtype, spec, stack.tasks[0].jax_mesh)
        where, spec_text, devices = stack.name, str(spec), _device_list(stack.jax_mesh.devices.flat)
        shares = [
            (t.name, _device_list(t.jax_mesh.devices.flat), elements // k, nbytes // k, per_device)
            for t in stack.tasks
        ]
    else:
        if sharding is not None:
            per_device = math.prod(sharding.shard_shape(shape)) * itemsize(dtype)
            devices = _device_list(sharding.device_set, runs=False)
        else:
            per_device = math.prod(shape) * itemsize(dtype)
            devices = "-"
        spec_text = str(sharding.spec) if isinstance(sharding, NamedSharding) else "-"
        where = "(unplaced)"
    return {
        "path": path,
        "experts": _expert_split(variable, shape, sharding),
        "type": type(variable).__name__,
        "shape": f"{dtype}[{','.join(str(d) for d in shape)}]",
        "elements": elements,
        "bytes": nbytes,
        "per_device": per_device,
        "task": where,
        "spec": spec_text,
        "devices": devices,
        "shares": shares or [(where, devices, elements, nbytes, per_device)],
    }


EXPERT = "expert"  # the logical name of a mixture's expert dimension (mmnnx.modules.experts)


def _expert_split(variable: nnx.Variable, shape: tuple, sharding: Any) -> tuple | None:
    """``(experts, mesh axes, EP size)`` of a Variable with an ``expert`` dimension, else None."""
    names = tuple(variable.get_metadata().get("out_sharding") or ())
    if EXPERT not in names or len(names) > len(shape):
        return None
    at = len(shape) - len(names) + names.index(EXPERT)
    home = task_of(variable) or stack_of(variable)
    if home is not None:
        spec, mesh = variable.get_metadata().get(SPEC_KEY, PartitionSpec()), home.jax_mesh
        if stack_of(variable) is not None:
            mesh = stack_of(variable).tasks[0].jax_mesh
    elif isinstance(sharding, NamedSharding):
        spec, mesh = sharding.spec, sharding.mesh
    else:
        return shape[at], (), 1
    entry = tuple(spec)[at] if at < len(tuple(spec)) else None
    axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    return shape[at], axes, math.prod(mesh.shape[a] for a in axes)


def _experts_table(infos: list[dict]) -> Table | None:
    """Per task, its mixtures' expert weights; ``None`` when the model has none."""
    by_task = _by_task([i for i in infos if i["experts"] is not None])
    if not by_task:
        return None
    table = Table(title="Experts per device", box=box.SQUARE)
    for name in ["task", "Variables", "experts", "split over", "experts/device", "bytes/device"]:
        table.add_column(name, justify="left" if name in ("task", "split over") else "right")
    for name, group in by_task:
        splits = {info["experts"] for info, _ in group}
        over = {f"{', '.join(axes)} (EP {n})" if axes else "none (EP 1)" for _, axes, n in splits}
        table.add_row(
            name,
            str(len(group)),
            _listed({e for e, _, _ in splits}),
            ", ".join(sorted(over)),
            _listed({e // n for e, _, n in splits}),
            _fmt_bytes(sum(share[4] for _, share in group)),
        )
    return table


def _by_task(infos: list[dict]) -> list[tuple[str, list[tuple[dict, tuple]]]]:
    """Per task, unplaced last, its ``(info, share)``: a stacked Variable has one on each task."""
    by_task: dict[str, list[tuple[dict, tuple]]] = {}
    for info in infos:
        for share in info["shares"]:
            by_task.setdefault(share[0], []).append((info, share))
    return sorted(by_task.items(), key=lambda item: (item[0] == "(unplaced)", item[0]))


def _listed(values: set[int]) -> str:
    return ", ".join(str(v) for v in sorted(values))


def tabulate(
    model: Any,
    *inputs: Any,
    depth: int | None = None,
    method: str | Callable[..., Any] = "__call__",
    title: str | None = None,
    **kwargs: Any,
) -> Tabulation:
    """Summarises ``model`` with a row per module and per Variable, and totals per task.

    Module rows show the path, type and the input and output shapes of
    ``model.<method>(*inputs, **kwargs)``, traced abstractly (leave the inputs out for a
    parameter-only table); arrays are traced, other values (``deterministic=True``) are passed as
    they are. Calls inside ``nnx.scan``, ``nnx.vmap`` or ``nnx.remat`` are recorded with the shapes
    the transform's body sees; stacked Variables keep their leading layer axis.
    ``mm.with_sharding_constraint`` in the model returns its input during this trace. Variable rows
    show the shape, **task, PartitionSpec and bytes per device**. With ``depth``, Variables below
    that depth are summed into one row per module at ``depth``. A model with mixtures of
    experts (Variables with an ``expert`` logical dimension) gets a third table, "Experts per
    device": per task, its expert Variables, experts per layer, the mesh axes splitting them
    (expert parallelism, EP), experts per device (``E / EP``) and those Variables' bytes per
    device. The result is a ``str`` (plain text
    unless stdout is a terminal) that renders as an HTML table in Jupyter.

    ``depth``, ``method`` and ``title`` are tabulate's own keywords, never passed to the model. To
    give the model an argument with one of those names, pass it positionally, or pass ``method``
    as a callable taking the model first: ``method=lambda m, x: m(x, depth=2)``.

    Example:
        >>> import jax.numpy as jnp
        >>> from mmnnx.sharding import Task, TaskMesh, place
        >>> class Net(nnx.Module):
        ...     def __init__(self, rngs: nnx.Rngs):
        ...         self.linear = nnx.Linear(4, 8, rngs=rngs)
        ...         self.drop = nnx.Dropout(0.5)
        ...     def __call__(self, x, *, deterministic: bool = False):
        ...         return self.drop(self.linear(x), deterministic=deterministic)
        >>> t = Task("t", mesh=TaskMesh(devices=range(2)))
        >>> model = place(Net(nnx.Rngs(0)), [(".*", t)])
        >>> text = tabulate(model, jnp.ones((2, 4)), deterministic=True)
        >>> "float32[2,8], deterministic=True" in text  # the inputs of model.drop
        True
    """
    if depth is not None and (not isinstance(depth, int) or depth < 0):
        raise ValueError(f"tabulate: depth must be a non-negative int, got {depth!r}")
    if not isinstance(model, nnx.Pytree):
        raise TypeError(f"tabulate: expected an NNX graph node, got {type(model).__name__}")
    traced = bool(inputs or kwargs)
    if traced:
        _check_method(model, inputs, kwargs, method)
    calls = _trace_calls(model, inputs, kwargs, method) if traced else {}
    modules = {p: m for p, m in nnx.iter_graph(model) if isinstance(m, nnx.Module) or p == ()}
    infos = [_variable_info(p, v) for p, v in variables_of(model)]
    order = sorted(
        (p for p in modules if depth is None or len(p) <= depth),
        key=lambda p: (calls[p][0] if p in calls else len(calls) + 1, _path_key(p)),
    )
    shown = set(order)

    def nearest(path: Path, among) -> Path:
        return next(path[:n] for n in range(len(path), -1, -1) if path[:n] in among)

    rows: dict[Path, list[dict]] = {p: [] for p in order}
    rolled: dict[Path, list[dict]] = {p: [] for p in order}
    for info in infos:
        owner = nearest(info["path"][:-1], modules)
        row = nearest(owner, shown)
        (rows if row == owner else rolled)[row].append(info)

    table = Table(title=title or f"{type(model).__name__} summary", box=box.SQUARE)
    for name in ["path", "type", "inputs", "outputs", "shape", "task", "PartitionSpec"]:
        table.add_column(name, no_wrap=True)
    table.add_column("bytes/device", justify="right", no_wrap=True)

    for mpath in order:
        _, ins, outs = calls.get(mpath, (0, "-", "-"))
        table.add_row(path_str(mpath) or "(root)", type(modules[mpath]).__name__, ins, outs)
        for info in sorted(rows[mpath], key=lambda i: _path_key(i["path"])):
            table.add_row(path_str(info["path"]), info["type"], "", "", info["shape"], info["task"],
                          info["spec"], _fmt_bytes(info["per_device"]))  # fmt: skip
        if rolled[mpath]:
            per_task: dict[str, int] = {}
            for i in rolled[mpath]:
                per_task[i["task"]] = per_task.get(i["task"], 0) + i["per_device"]
            table.add_row(
                f"{path_str(mpath) or '(root)'}/… ({len(rolled[mpath])} Variables)",
                "",
                "",
                "",
                f"{sum(i['elements'] for i in rolled[mpath]):,} elements",
                ", ".join(per_task),
                "",
                "; ".join(_fmt_bytes(b) for b in per_task.values()),
            )

    totals = Table(title="Totals per task", box=box.SQUARE)
    for name in ["task", "devices", "Variables", "elements", "bytes", "bytes/device"]:
        totals.add_column(name, justify="left" if name in ("task", "devices") else "right")
    for name, pairs in _by_task(infos):
        group = [share for _, share in pairs]
        devices = sorted({share[1] for share in group})
        totals.add_row(
            name,
            " ".join(devices),
            str(len(group)),
            f"{sum(share[2] for share in group):,}",
            _fmt_bytes(sum(share[3] for share in group)),
            _fmt_bytes(sum(share[4] for share in group)),
        )
    totals.add_row(
        "total",
        "",
        str(len(infos)),
        f"{sum(i['elements'] for i in infos):,}",
        _fmt_bytes(sum(i["bytes"] for i in infos)),
        "",
        style="bold",
    )
    experts = _experts_table(infos)
    return render(table, totals, *([] if experts is None else [experts]))
