"""``stage_rules``: placement rules that cut a model's layers (``blocks``, or any nested list of
modules) into balanced pipeline stages."""

from __future__ import annotations

import functools
import itertools
import math
import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
from flax import nnx
from rich import box
from rich.console import Console
from rich.table import Table

from mmnnx._nnx import Path, variables_of
from mmnnx.modules.attention import Attention
from mmnnx.modules.embed import Embed
from mmnnx.modules.moe import MoE
from mmnnx.sharding import Task

BY = ("params", "flops")

LAST = ("norm", "head", "final_norm", "ln_f", "lm_head", "classifier")
"""The names ``stage_rules`` puts on the last task by default: the final norm's and the head's."""


def _num_params(node: Any) -> int:
    return sum(math.prod(v.shape) for _, v in variables_of(node) if isinstance(v, nnx.Param))


def _matmul_params(node: Any) -> int:
    """Parameters costing 2 FLOPs per token: no embedding table, a ``MoE``'s experts' share."""
    share = {}
    for _, m in nnx.iter_graph(node):
        if isinstance(m, Embed | nnx.Embed):
            share.update((id(v), 0.0) for _, v in variables_of(m))
        elif isinstance(m, MoE):
            share.update((id(v), m.top_k / m.num_experts) for _, v in variables_of(m.experts))
    params = [v for _, v in variables_of(node) if isinstance(v, nnx.Param)]
    return round(sum(math.prod(v.shape) * share.get(id(v), 1.0) for v in params))


def _attention_dims(node: Any) -> int:
    """Sum of the query/key widths of ``node``'s attentions (``4 * seq * width`` FLOPs a token)."""
    return sum(
        m.num_heads * m.head_dim if isinstance(m, Attention) else m.qkv_features
        for _, m in nnx.iter_graph(node)
        if isinstance(m, Attention | nnx.MultiHeadAttention)
    )


def _split(costs: Sequence[int], k: int, first: int, last: int) -> list[int]:
    """Stage sizes of ``costs``: the least largest stage, then the least sum of squares."""
    n = len(costs)
    prefix = [0, *itertools.accumulate(costs)]

    def cost(j: int, i: int, stage: int) -> int:  # blocks j..i-1 as stage `stage`
        extra = (first if stage == 0 else 0) + (last if stage == k - 1 else 0)
        return prefix[i] - prefix[j] + extra

    def solve(combine, bound=None):
        # best[s][i]: best value of blocks 0..i-1 cut into s + 1 stages; arg[s][i]: last cut
        inf = float("inf")
        best = [[inf] * (n + 1) for _ in range(k)]
        arg = [[0] * (n + 1) for _ in range(k)]
        for i in range(1, n + 1):
            c = cost(0, i, 0)
            if bound is None or c <= bound:
                best[0][i] = combine(0, c)
        for s in range(1, k):
            for i in range(s + 1, n + 1):
                for j in range(s, i):
                    c = cost(j, i, s)
                    if best[s - 1][j] == inf or (bound is not None and c > bound):
                        continue
                    value = combine(best[s - 1][j], c)
                    if value < best[s][i]:
                        best[s][i], arg[s][i] = value, j
        sizes, i = [], n
        for s in range(k - 1, -1, -1):
            j = arg[s][i] if s else 0
            sizes.append(i - j)
            i = j
        return best[k - 1][n], sizes[::-1]

    minimax, _ = solve(lambda acc, c: max(acc, c))
    _, sizes = solve(lambda acc, c: acc + c * c, bound=minimax)
    return sizes


def _fmt_flops(x: float | None) -> str:
    if x is None:
        return "-"
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if x >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:.0f}"


def _share(part: float | None, total: float | None) -> str:
    return "-" if part is None or not total else f"{100 * part / total:.1f}"


def _imbalance(values: Sequence[float | None]) -> str:
    if any(v is None for v in values) or not sum(values):
        return "-"
    return f"{max(values) / (sum(values) / len(values)):.3f}"


def stage_rules(
    model: Any,
    tasks: Sequence[Task],
    *,
    by: str = "params",
    tokens_per_step: int | None = None,
    report: bool = True,
    seq_len: int | None = None,
    last: Sequence[str] | None = None,
    virtual_stages: int = 1,
    order: str = "loop",
    blocks: str | Callable[[Path, Any], bool] | None = None,
) -> list[tuple[str, Task]]:
    """Placement rules for ``mm.place`` / ``mm.init`` that pipeline ``model.blocks`` over ``tasks``.

    ``model.blocks`` (an ``nnx.List`` of modules) is cut into ``len(tasks)`` contiguous stages, one
    per task in order, minimising the largest stage (exact dynamic programming; ties go to the most
    even split). ``blocks`` names the node holding the layers when it is not ``model.blocks``: a
    path of attribute names at any depth, ``"layers"``, ``"model.layers"`` or ``"model/layers"``
    (the ``model.layers`` of a Hugging Face-shaped ``CausalLM``), or a filter ``(path, node) ->
    bool`` called on every module below ``model`` (``path`` a tuple of keys as in
    ``nnx.iter_graph``: ``("model", "layers")``), which must match exactly one. By default a model
    without ``blocks`` has its shallowest ``nnx.List`` (or ``nnx.Sequential``) of modules cut,
    wherever it is: the ``layers`` of Flax's Gemma example, the ``encoder`` of its ViT (an
    ``nnx.Sequential``, whose layers are at ``encoder/layers/<i>/``), the ``model/layers`` of a
    ``CausalLM``; two at that depth is an error (pass ``blocks=``), and stacked layers are only
    found as ``model.blocks`` or through ``blocks=``. Every Variable outside the layers goes on
    the last task when a component of its path (off the layers' own path) is named in ``last``
    (by default :data:`LAST`: the final norm and the head under their usual names, so
    ``model/norm/`` and ``lm_head/``), else on the first (the embedding, ``model/embed_tokens/``),
    and counts towards that stage's cost.

    ``by="params"`` balances parameter counts. ``by="flops"`` balances estimated forward FLOPs of
    a step of ``tokens_per_step`` tokens (default: one sequence of ``seq_len``, itself by default
    ``model.config.max_seq_len``): per block ``2 * params * tokens`` (of a ``MoE``'s experts
    only the ``top_k / num_experts`` share a token runs), plus ``4 * seq * dim *
    tokens`` per attention module in it (``Attention`` or ``nnx.MultiHeadAttention``: scores and
    values); ``2 * params * tokens`` for the head (``2 * dim * vocab * tokens``); nothing for
    embedding lookups. A tied head (``config.tie_embeddings``) runs ``embed.attend`` where the
    table lives, so its FLOPs count on the first task.

    Rules are one ``(regex, task)`` per task, anchored on the ``/``-joined path
    (``^embed/|^blocks/(0|1)/``, ``^model/embed_tokens/|^model/layers/(0|1)/``), so
    ``blocks/1/`` never matches ``blocks/10/`` nor ``^norm/`` ``blocks/0/norm1``. Stacked blocks
    (one module made with ``nnx.vmap``, as ``GPT(scan_layers=True)``; a module whose Variables
    all share one leading axis is taken as one) get one rule ``("^blocks/", tasks)`` (or
    ``("^model/layers/", tasks)``) splitting their layer axis into equal chunks, one per task in
    order (the depth must be a multiple of the task count).
    With ``report``, a table of the stages is printed: blocks, parameters,
    FLOPs, their shares, and the imbalance (largest stage / mean).

    ``virtual_stages=v`` cuts ``model.blocks`` into ``v * len(tasks)`` stages for the interleaved
    schedules, each task holding ``v`` of them: with ``order="loop"`` stage ``j`` goes on task
    ``j % len(tasks)`` (on one task, its virtual stage ``j``) (``interleaved-1f1b``,
    ``interleaved-gpipe``, ``interleaved-zero-bubble``); with ``order="v"`` (``v = 2``, for
    ``zero-bubble-v``) the stages go down the tasks and come back up, task ``i`` holding stage
    ``i`` and stage ``2 * len(tasks) - 1 - i``, the second on ``tasks[i].virtual_stage(1)``, so
    the embedding and the head share the first task's devices. Rules then come one per stage.

    Example:
        >>> from mmnnx.models import GPT, GPTConfig
        >>> from mmnnx.sharding import TaskMesh
        >>> with nnx.use_eager_sharding(False):
        ...     model = GPT(GPTConfig(dim=32, depth=4), rngs=nnx.Rngs(0))
        >>> tasks = [Task(f"s{i}", mesh=TaskMesh(devices=[i])) for i in range(2)]
        >>> for regex, task in stage_rules(model, tasks, report=False):
        ...     print(task.name, regex)
        s0 ^embed/|^blocks/(0|1)/
        s1 ^blocks/(2|3)/|^norm/|^head/

        The same model one level down, its layers named by their path:

        >>> outer = nnx.Dict(model=model)
        >>> for regex, task in stage_rules(outer, tasks, blocks="model.blocks", report=False):
        ...     print(task.name, regex)
        s0 ^model/embed/|^model/blocks/(0|1)/
        s1 ^model/blocks/(2|3)/|^model/norm/|^model/head/
    """
    if by not in BY:
        raise ValueError(f"stage_rules: unknown by={by!r}; expected one of {BY}")
    tasks = list(tasks)
    if not tasks:
        raise ValueError("stage_rules: no tasks given")
    for t in tasks:
        if not isinstance(t, Task):
            raise TypeError(f"stage_rules: {t!r} is not an mm.Task")
    tasks = _stage_tasks(tasks, virtual_stages, order)
    found = find_layers(model, blocks, last)
    blocks, n, stacked, where = found.node, found.count, found.stacked, found.where
    if stacked:
        if virtual_stages != 1:
            raise ValueError(
                f"stage_rules: virtual_stages={virtual_stages} needs the blocks as a list of "
                f"modules; {where} is one stacked module, whose layer axis is split into one "
                "contiguous chunk per task"
            )
        if n % len(tasks):
            raise ValueError(
                f"stage_rules: {n} stacked blocks cannot be split evenly over {len(tasks)} tasks "
                "(each task holds an equal chunk of a stacked Variable); use a depth divisible "
                f"by {len(tasks)}"
            )
    k = len(tasks)
    _check_depth("stage_rules", n, k, virtual_stages)
    firsts, lasts = found.firsts, found.lasts

    config = getattr(model, "config", None)
    seq = seq_len or getattr(config, "max_seq_len", None) or getattr(model, "max_seq_len", None)
    tokens = tokens_per_step or seq

    def flops(node: Any, *, head: bool = False) -> int | None:
        attention = _attention_dims(node)
        if tokens is None or (attention and seq is None):
            return None
        out = 2 * _matmul_params(node) * tokens + 4 * (seq or 0) * attention * tokens
        if head:  # a tied head: embed.attend costs a vocab x dim matmul on the table's task
            out += 2 * _num_params(node) * tokens
        return out

    def group_cost(groups: Sequence[Path], *, tied_head: bool = False) -> tuple[int, int | None]:
        nodes = [functools.reduce(lambda n, k: getattr(n, str(k)), g, model) for g in groups]
        params = sum(_num_params(node) for node in nodes)
        fl = [flops(node, head=tied_head and isinstance(node, Embed | nnx.Embed)) for node in nodes]
        return params, None if None in fl else sum(fl)

    if stacked:  # one module holds every layer's matmuls but one of each attention: count once
        attention = 4 * (seq or 0) * _attention_dims(blocks)
        one = None if flops(blocks) is None else 2 * (_matmul_params(blocks) // n) + attention
        block_params = [_num_params(blocks) // n] * n
        block_flops = [None if one is None else one * tokens] * n
    else:
        block_params = [_num_params(b) for b in blocks]
        block_flops = [flops(b) for b in blocks]
    tied = bool(getattr(config, "tie_embeddings", False))
    first_params, first_flops = group_cost(firsts, tied_head=tied)
    last_params, last_flops = group_cost(lasts)
    if stacked:
        sizes = [n // k] * k
    elif by == "flops":
        if None in block_flops:
            raise ValueError(
                "stage_rules: by='flops' needs a sequence length: pass seq_len= (or give the "
                "model a config.max_seq_len), and tokens_per_step= if it is not one sequence"
            )
        sizes = _split(block_flops, k, first_flops, last_flops)
    else:
        sizes = _split(block_params, k, first_params, last_params)

    rules, rows, start = _rules(found, tasks, sizes), [], 0
    ends = ((0, first_params, first_flops, firsts), (k - 1, last_params, last_flops, lasts))
    for s, (task, size) in enumerate(zip(tasks, sizes, strict=True)):
        idx = list(range(start, start + size))
        start += size
        params = sum(block_params[i] for i in idx)
        fl = None if None in block_flops else sum(block_flops[i] for i in idx)
        names = []
        for end, end_params, end_flops, groups in ends:
            if s == end:
                params += end_params
                fl = None if fl is None or end_flops is None else fl + end_flops
                names += ["/".join(map(str, g)) for g in groups]
        label = f"{idx[0]}-{idx[-1]}" if size > 1 else str(idx[0])
        rows.append((task.name, label + (f" + {', '.join(names)}" if names else ""), params, fl))

    if report and jax.process_index() == 0:  # one report for a multi-process run
        _print_report(rows, n, by, tokens)
    return rules


class Layers(NamedTuple):
    """Where a model's layers are and what goes with the first and the last stage."""

    path: Path  # of the node holding the layers, from the model
    node: Any  # that node: a list of modules, or one module of stacked layers
    count: int  # the number of layers
    stacked: bool  # one module whose Variables have a leading layer axis
    firsts: list[Path]  # prefixes of the Variables outside the layers that go on the first stage
    lasts: list[Path]  # those that go on the last stage
    variables: frozenset[Path]  # the prefixes among those that are Variables themselves
    where: str  # the layers' node as one names it: "GPT.blocks"

    @property
    def ends(self) -> tuple[bool, bool]:
        """Whether the first and the last stage may hold no layer, but Variables of their own."""
        return bool(self.firsts), bool(self.lasts)


def find_layers(
    model: Any,
    blocks: str | Callable[[Path, Any], bool] | None = None,
    last: Sequence[str] | None = None,
    *,
    who: str = "stage_rules",
) -> Layers:
    """The layers of ``model`` and the groups going on the first and the last stage.

    Example:
        >>> from mmnnx.models import GPT, GPTConfig
        >>> with nnx.use_eager_sharding(False):
        ...     model = GPT(GPTConfig(dim=32, depth=3), rngs=nnx.Rngs(0))
        >>> found = find_layers(model)
        >>> found.where, found.count, found.firsts, found.lasts
        ('GPT.blocks', 3, [('embed',)], [('norm',), ('head',)])
    """
    path, node = _layers(model, blocks, who)
    where = ".".join([type(model).__name__, *map(str, path)])
    stacked = isinstance(node, nnx.Module) and not isinstance(node, nnx.List)
    if stacked:
        depths = {v.shape[0] for _, v in variables_of(node) if v.shape}
        if len(depths) != 1:
            raise ValueError(
                f"{who}: the Variables of {where} (one stacked module) do not share one leading "
                f"layer axis (sizes {sorted(depths)})"
            )
        (n,) = depths
    elif isinstance(node, nnx.List | list | tuple) and all(isinstance(b, nnx.Module) for b in node):
        n = len(node)
    else:
        raise ValueError(
            f"{who}: {where} does not hold layers: expected an nnx.List of modules (as "
            f"GPT.blocks) or one module of stacked layers (nnx.vmap), got {type(node).__name__}"
        )
    outside = [p for p, _ in variables_of(model) if p[: len(path)] != path]
    firsts, lasts = _groups(model, outside, path, LAST if last is None else last)
    return Layers(
        path=path,
        node=node,
        count=n,
        stacked=stacked,
        firsts=firsts,
        lasts=lasts,
        variables=frozenset(outside),
        where=where,
    )


def _check_depth(who: str, n: int, k: int, virtual_stages: int) -> None:
    if n < k:
        raise ValueError(
            f"{who}: {n} block(s) cannot fill {k} "
            f"{'tasks' if virtual_stages == 1 else f'stages ({virtual_stages} per task)'}; "
            "every stage needs at least one block (use fewer tasks or a deeper model)"
        )


def _rules(found: Layers, tasks: Sequence[Task], sizes: Sequence[int]) -> list[tuple[str, Any]]:
    """One rule per stage: ``sizes[s]`` layers on ``tasks[s]`` (stacked: one more, split)."""
    prefix = "/".join(re.escape(str(k)) for k in found.path)
    rules, start, k = [], 0, len(tasks)
    for s, (task, size) in enumerate(zip(tasks, sizes, strict=True)):
        idx = [str(i) for i in range(start, start + size)]
        start += size
        parts = [_anchored(g, g in found.variables) for g in found.firsts if s == 0]
        if not found.stacked and idx:
            parts.append(f"^{prefix}/{idx[0] if len(idx) == 1 else '(' + '|'.join(idx) + ')'}/")
        parts += [_anchored(g, g in found.variables) for g in found.lasts if s == k - 1]
        if parts:
            rules.append(("|".join(parts), task))
    if found.stacked:
        rules.append((f"^{prefix}/", list(tasks)))
    return rules


def _holds_layers(sizes: Sequence[int], ends: tuple[bool, bool]) -> bool:
    """Whether every stage holds a layer, but an end stage that ``ends`` lets hold none."""
    lowest = [1] * len(sizes)
    lowest[0] -= ends[0]
    lowest[-1] -= ends[1] if len(sizes) > 1 else 0
    return all(size >= low for size, low in zip(sizes, lowest, strict=True))


def split_rules(
    model: Any,
    tasks: Sequence[Task],
    sizes: Sequence[int],
    *,
    virtual_stages: int = 1,
    order: str = "loop",
    blocks: str | Callable[[Path, Any], bool] | None = None,
    last: Sequence[str] | None = None,
) -> list[tuple[str, Task]]:
    """Placement rules as :func:`stage_rules` gives them, for a split chosen by the caller:
    stage ``j`` holds the next ``sizes[j]`` layers (``len(tasks) * virtual_stages`` stages,
    on the tasks as ``order`` puts them; ``blocks``, ``last`` as :func:`stage_rules`).

    Example:
        >>> from mmnnx.models import GPT, GPTConfig
        >>> from mmnnx.sharding import TaskMesh
        >>> with nnx.use_eager_sharding(False):
        ...     model = GPT(GPTConfig(dim=32, depth=4), rngs=nnx.Rngs(0))
        >>> tasks = [Task(f"s{i}", mesh=TaskMesh(devices=[i])) for i in range(2)]
        >>> for regex, task in split_rules(model, tasks, [3, 1]):
        ...     print(task.name, regex)
        s0 ^embed/|^blocks/(0|1|2)/
        s1 ^blocks/3/|^norm/|^head/
        >>> [regex for regex, _ in split_rules(model, tasks, [4, 0])]  # the head alone
        ['^embed/|^blocks/(0|1|2|3)/', '^norm/|^head/']

    Raises:
        ValueError: the layers are stacked, or ``sizes`` is not one count >= 1 per stage
            (0 for the first or the last stage where it holds the embedding or the head)
            adding up to the number of layers.
    """
    tasks = _stage_tasks(list(tasks), virtual_stages, order, "split_rules")
    found = find_layers(model, blocks, last, who="split_rules")
    if found.stacked:
        raise ValueError(
            f"split_rules: {found.where} is one stacked module, whose layer axis is split into "
            "equal chunks (stage_rules); a split of its own needs the layers as a list"
        )
    good = (
        all(isinstance(x, int) and not isinstance(x, bool) for x in sizes)
        and len(sizes) == len(tasks)
        and _holds_layers(sizes, found.ends)
        and sum(sizes) == found.count
    )
    if not good:
        raise ValueError(
            f"split_rules: sizes {list(sizes)} must give each of the {len(tasks)} stages at "
            f"least one of the {found.count} layers of {found.where} (the first or the last "
            f"none, where it holds the embedding or the head), adding up to {found.count}"
        )
    return _rules(found, tasks, sizes)


def _layers(
    model: Any, blocks: str | Callable[[Path, Any], bool] | None, who: str = "stage_rules"
) -> tuple[Path, Any]:
    """The path and node of ``model``'s layers, found as :func:`stage_rules` says."""
    name = type(model).__name__
    if blocks is None and getattr(model, "blocks", None) is not None:
        blocks = "blocks"
    if isinstance(blocks, str):
        path, node = _resolve(model, blocks, who)
    elif callable(blocks):
        hits = [(p, n) for p, n in _modules(model) if blocks(p, n)]
        if len(hits) != 1:
            raise ValueError(
                f"{who}: the blocks= filter matches {len(hits)} modules of {name} ("
                f"{_joined([p for p, _ in hits]) or 'none'}); it must select the one holding the "
                "layers"
            )
        ((path, node),) = hits
    elif blocks is not None:
        raise TypeError(
            f"{who}: blocks= takes a path ('model.layers') or a filter "
            f"(path, node) -> bool, got {type(blocks).__name__}"
        )
    else:
        if not (lists := [(p, n) for p, n in _modules(model) if _is_list_of_modules(n)]):
            raise ValueError(
                f"{who}: {name} has no attribute 'blocks' holding its layers and no "
                "nnx.List of modules; expected model.blocks to be an nnx.List of modules (as "
                "GPT.blocks) or one module of stacked layers (nnx.vmap), or blocks= naming the "
                f"attribute that holds them (its attributes: {', '.join(_public(model)) or 'none'})"
            )
        depth = min(len(p) for p, _ in lists)
        shallowest = [(p, n) for p, n in lists if len(p) == depth]
        if len(shallowest) > 1:
            paths = [p for p, _ in shallowest]
            raise ValueError(
                f"{who}: {name} has several lists of modules ({_joined(paths)}); name the "
                f"one holding the layers to cut, e.g. blocks={_joined(paths[:1])!r}"
            )
        ((path, node),) = shallowest
    if isinstance(node, nnx.Sequential):  # its layers, at <path>/layers/<i>/
        return (*path, "layers"), node.layers
    return path, node


def _resolve(model: Any, spelled: str, who: str) -> tuple[Path, Any]:
    path, node = (), model
    for key in re.split(r"[./]", spelled):
        if not hasattr(node, key):
            where = ".".join([type(model).__name__, *map(str, path)])
            raise ValueError(
                f"{who}: {where} has no attribute {key!r} (blocks=) on the path "
                f"{spelled!r}; its attributes are {', '.join(_public(node)) or 'none'}"
            )
        path += (int(key) if isinstance(node, nnx.List) and key.isdigit() else key,)
        node = getattr(node, key)
    return path, node


def _modules(model: Any) -> list[tuple[Path, Any]]:
    found = [(p, n) for p, n in nnx.iter_graph(model) if p and isinstance(n, nnx.Module)]
    return sorted(found, key=lambda item: _definition_order(model, item[0]))


def _is_list_of_modules(node: Any) -> bool:
    layers = node.layers if isinstance(node, nnx.Sequential) else node
    return (
        isinstance(node, nnx.List | nnx.Sequential)
        and len(layers) > 0
        and all(isinstance(b, nnx.Module) for b in layers)
    )


def _groups(
    model: Any, paths: list[Path], layers: Path, last: Sequence[str]
) -> tuple[list[Path], list[Path]]:
    """Prefixes of ``paths`` for the first and the last stage: up to the first component named
    in ``last`` (off the layers' path), else the shortest holding no layers nor last group."""

    def on_layers_path(prefix: Path) -> bool:
        return layers[: len(prefix)] == prefix

    def last_prefix(p: Path) -> Path | None:
        for i, key in enumerate(p):
            if str(key) in last and not on_layers_path(p[: i + 1]):
                return p[: i + 1]
        return None

    lasts = {g for p in paths if (g := last_prefix(p)) is not None}
    firsts = {
        next(
            p[: i + 1]
            for i in range(len(p))
            if not on_layers_path(p[: i + 1]) and not any(g[: i + 1] == p[: i + 1] for g in lasts)
        )
        for p in paths
        if last_prefix(p) is None
    }
    order = functools.partial(_definition_order, model)
    return sorted(firsts, key=order), sorted(lasts, key=order)


def _definition_order(model: Any, path: Path) -> tuple[int, ...]:
    key, node = [], model
    for k in path:
        names = list(vars(node)) if hasattr(node, "__dict__") else []
        key.append(names.index(str(k)) if str(k) in names else len(names))
        node = getattr(node, str(k), None)
    return tuple(key)


def _anchored(path: Path, is_variable: bool) -> str:
    return "^" + "/".join(re.escape(str(k)) for k in path) + ("$" if is_variable else "/")


def _joined(paths: Sequence[Path], most: int = 6) -> str:
    names = ["/".join(map(str, p)) for p in paths[:most]]
    return ", ".join(names + ([f"... ({len(paths) - most} more)"] if len(paths) > most else []))


def _public(node: Any) -> list[str]:
    return [k for k in vars(node) if not k.startswith("_")] if hasattr(node, "__dict__") else []


def _stage_tasks(
    tasks: list[Task], virtual_stages: int, order: str, who: str = "stage_rules"
) -> list[Task]:
    """The task of each stage: ``tasks`` repeated ``virtual_stages`` times, looped or in a V."""
    if type(virtual_stages) is not int or virtual_stages < 1:
        raise ValueError(f"{who}: virtual_stages must be an int >= 1, got {virtual_stages!r}")
    if order == "loop" and len(tasks) == 1:  # one task: its stages would merge into one
        return [tasks[0].virtual_stage(k) for k in range(virtual_stages)]
    if order == "loop":
        return tasks * virtual_stages
    if order == "v":
        if virtual_stages != 2:
            raise ValueError(
                f"{who}: order='v' places two stages per task (down the tasks and back "
                f"up); pass virtual_stages=2, got {virtual_stages}"
            )
        return tasks + [t.virtual_stage(1) for t in reversed(tasks)]
    raise ValueError(f"{who}: unknown order={order!r}; expected 'loop' or 'v'")


def _print_report(rows: list, n: int, by: str, tokens: int | None) -> None:
    params, fl = [r[2] for r in rows], [r[3] for r in rows]
    total_p, total_f = sum(params), None if None in fl else sum(fl)
    table = Table(
        title=f"stage_rules: {n} blocks over {len(rows)} stages, balanced by {by}",
        box=box.SIMPLE,
    )
    for name in ("task", "blocks", "params", "share %", "FLOPs", "share %"):
        table.add_column(name, justify="left" if name in ("task", "blocks") else "right")
    for task, label, p, f in rows:
        table.add_row(task, label, f"{p:,}", _share(p, total_p), _fmt_flops(f), _share(f, total_f))
    imbalance = ("imbalance", "max stage / mean", "", _imbalance(params), "", _imbalance(fl))
    table.add_row(*imbalance, style="bold")
    per = f"; FLOPs per step of {tokens} tokens" if tokens else ""
    table.caption = f"imbalance = largest stage / mean stage{per}"
    Console(width=120).print(table)
