"""``stage_rules``: placement rules that cut a model's ``blocks`` into balanced pipeline stages."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import jax
from flax import nnx
from rich import box
from rich.console import Console
from rich.table import Table

from mmnnx._nnx import variables_of
from mmnnx.modules.attention import Attention
from mmnnx.modules.embed import Embed
from mmnnx.sharding import Task

BY = ("params", "flops")

LAST = ("norm", "head", "final_norm", "ln_f", "lm_head", "classifier")
"""The top-level attributes ``stage_rules`` puts on the last task by default: the final norm
and the output head as the library's GPT, Flax's Gemma and ViT examples, GPT-2 and Llama ports
name them."""


def _num_params(node: Any) -> int:
    return sum(math.prod(v.shape) for _, v in variables_of(node) if isinstance(v, nnx.Param))


def _matmul_params(node: Any) -> int:
    """Parameters that each cost 2 FLOPs per token: all but embedding tables (lookups)."""
    tables = {
        id(v)
        for _, m in nnx.iter_graph(node)
        if isinstance(m, Embed | nnx.Embed)
        for _, v in variables_of(m)
    }
    return sum(
        math.prod(v.shape)
        for _, v in variables_of(node)
        if isinstance(v, nnx.Param) and id(v) not in tables
    )


def _attention_dims(node: Any) -> int:
    """Sum of the query/key widths of the attention modules in ``node`` (``Attention`` and
    ``nnx.MultiHeadAttention``): each costs ``4 * seq * width`` FLOPs per token."""
    total = 0
    for _, m in nnx.iter_graph(node):
        if isinstance(m, Attention):
            total += m.num_heads * m.head_dim
        elif isinstance(m, nnx.MultiHeadAttention):
            total += m.qkv_features
    return total


def _split(costs: Sequence[int], k: int, first: int, last: int) -> list[int]:
    """Stage sizes cutting ``costs`` into ``k`` contiguous non-empty stages.

    Minimises the largest stage (``first`` is added to stage 0, ``last`` to stage ``k - 1``),
    then, among those optimal splits, the sum of squared stage costs (the most even one).
    """
    n = len(costs)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)

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


def _alternation(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else "(" + "|".join(items) + ")"


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
    blocks: str | None = None,
) -> list[tuple[str, Task]]:
    """Placement rules for ``mm.place`` / ``mm.init`` that pipeline ``model.blocks`` over ``tasks``.

    ``model.blocks`` (an ``nnx.List`` of modules) is cut into ``len(tasks)`` contiguous stages, one
    per task in order, minimising the largest stage (exact dynamic programming; ties go to the most
    even split). ``blocks`` names the attribute holding the layers when it is not ``blocks``; by
    default a model without ``blocks`` has its one top-level ``nnx.List`` (or ``nnx.Sequential``)
    of modules cut: the ``layers`` of Flax's Gemma example, the ``encoder`` of its ViT (an
    ``nnx.Sequential``, whose layers are at ``encoder/layers/<i>/``). The top-level attributes
    named in ``last`` (by default :data:`LAST`: the final norm and the head under their usual
    names) go on the last task, every other one (the embedding) on the first, and count towards
    those stages' costs.

    ``by="params"`` balances parameter counts. ``by="flops"`` balances estimated forward FLOPs of
    a step of ``tokens_per_step`` tokens (default: one sequence of ``seq_len``, itself by default
    ``model.config.max_seq_len``): per block ``2 * params * tokens``, plus ``4 * seq * dim *
    tokens`` per attention module in it (``Attention`` or ``nnx.MultiHeadAttention``: scores and
    values); ``2 * params * tokens`` for the head (``2 * dim * vocab * tokens``); nothing for
    embedding lookups. A tied head (``config.tie_embeddings``) runs ``embed.attend`` where the
    table lives, so its FLOPs count on the first task.

    Rules are one ``(regex, task)`` per task, anchored on the ``/``-joined path
    (``^embed/|^blocks/(0|1)/``), so ``blocks/1/`` never matches ``blocks/10/`` nor ``^norm/``
    ``blocks/0/norm1``. Stacked blocks (one module made with ``nnx.vmap``, as
    ``GPT(scan_layers=True)``) get one rule ``("^blocks/", tasks)`` splitting their layer axis
    into equal chunks, one per task in order (the depth must be a multiple of the task count).
    With ``report``, a table of the stages is printed: blocks, parameters,
    FLOPs, their shares, and the imbalance (largest stage / mean).

    ``virtual_stages=v`` cuts ``model.blocks`` into ``v * len(tasks)`` stages for the interleaved
    schedules, each task holding ``v`` of them: with ``order="loop"`` stage ``j`` goes on task
    ``j % len(tasks)`` (``interleaved-1f1b``, ``interleaved-gpipe``,
    ``interleaved-zero-bubble``); with ``order="v"`` (``v = 2``, for ``zero-bubble-v``) the stages
    go down the tasks and come back up, task ``i`` holding stage ``i`` and stage
    ``2 * len(tasks) - 1 - i``, the second on ``tasks[i].virtual_stage(1)``, so the embedding and
    the head share the first task's devices. Rules then come one per stage.

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
    attr = _blocks_attribute(model, blocks)
    where = f"{type(model).__name__}.{attr}"
    blocks = getattr(model, attr)
    prefix = re.escape(attr)
    if isinstance(blocks, nnx.Sequential):  # its layers, at <attr>/layers/<i>/
        blocks, prefix = blocks.layers, f"{prefix}/layers"
    stacked = isinstance(blocks, nnx.Module) and not isinstance(blocks, nnx.List)
    if stacked:
        depths = {v.shape[0] for _, v in variables_of(blocks) if v.shape}
        if len(depths) != 1:
            raise ValueError(
                f"stage_rules: the Variables of {where} (one stacked "
                f"module) do not share one leading layer axis (sizes {sorted(depths)})"
            )
        (n,) = depths
        if virtual_stages != 1:
            raise ValueError(
                f"stage_rules: virtual_stages={virtual_stages} needs the blocks as a list of "
                f"modules; {where} is one stacked module, whose layer axis "
                "is split into one contiguous chunk per task"
            )
        if n % len(tasks):
            raise ValueError(
                f"stage_rules: {n} stacked blocks cannot be split evenly over {len(tasks)} tasks "
                "(each task holds an equal chunk of a stacked Variable); use a depth divisible "
                f"by {len(tasks)}"
            )
    elif isinstance(blocks, nnx.List | list | tuple) and all(
        isinstance(b, nnx.Module) for b in blocks
    ):
        n = len(blocks)
    else:
        raise ValueError(
            f"stage_rules: {where} does not hold layers: expected an nnx.List of modules (as "
            f"GPT.blocks) or one module of stacked layers (nnx.vmap), got {type(blocks).__name__}"
        )
    k = len(tasks)
    if n < k:
        raise ValueError(
            f"stage_rules: {n} block(s) cannot fill {k} "
            f"{'tasks' if virtual_stages == 1 else f'stages ({virtual_stages} per task)'}; "
            "every stage needs at least one "
            "block (use fewer tasks or a deeper model)"
        )

    # top-level attributes holding Variables, in definition order: before / after the blocks
    tops: dict[str, bool] = {}  # name -> is a Variable itself (path of length 1)
    for path, _ in variables_of(model):
        tops.setdefault(str(path[0]), len(path) == 1)
    order = [name for name in vars(model) if name in tops]
    order += [name for name in tops if name not in order]
    last = LAST if last is None else last
    firsts = [name for name in order if name != attr and name not in last]
    lasts = [name for name in order if name != attr and name in last]

    config = getattr(model, "config", None)
    seq = seq_len or getattr(config, "max_seq_len", None) or getattr(model, "max_seq_len", None)
    tokens = tokens_per_step or seq
    tied = bool(getattr(config, "tie_embeddings", False))

    def flops(node: Any, *, head: bool = False) -> int | None:
        attention = _attention_dims(node)
        if tokens is None or (attention and seq is None):
            return None
        out = 2 * _matmul_params(node) * tokens + 4 * (seq or 0) * attention * tokens
        if head:  # a tied head: embed.attend costs a vocab x dim matmul on the table's task
            out += 2 * _num_params(node) * tokens
        return out

    def group_cost(names: Sequence[str], *, tied_head: bool = False) -> tuple[int, int | None]:
        nodes = [getattr(model, name) for name in names]
        params = sum(_num_params(node) for node in nodes)
        fl = [flops(node, head=tied_head and isinstance(node, Embed | nnx.Embed)) for node in nodes]
        return params, None if None in fl else sum(fl)

    if stacked:  # one module holds every layer's matmuls but one of each attention: count once
        per_layer = _num_params(blocks) // n
        whole = flops(blocks)
        attention = 4 * (seq or 0) * _attention_dims(blocks)
        one = None if whole is None else (2 * per_layer + attention) * tokens
        block_params, block_flops = [per_layer] * n, [one] * n
    else:
        block_params = [_num_params(b) for b in blocks]
        block_flops = [flops(b) for b in blocks]
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

    rules, rows, start = [], [], 0
    for s, (task, size) in enumerate(zip(tasks, sizes, strict=True)):
        idx = list(range(start, start + size))
        start += size
        parts = [f"^{re.escape(name)}{'$' if tops[name] else '/'}" for name in firsts if s == 0]
        if not stacked:
            parts.append(f"^{prefix}/{_alternation([str(i) for i in idx])}/")
        parts += [f"^{re.escape(name)}{'$' if tops[name] else '/'}" for name in lasts if s == k - 1]
        if parts:
            rules.append(("|".join(parts), task))
        params = sum(block_params[i] for i in idx)
        fl = None if None in block_flops else sum(block_flops[i] for i in idx)
        names = []
        if s == 0:
            params += first_params
            fl = None if fl is None or first_flops is None else fl + first_flops
            names += firsts
        if s == k - 1:
            params += last_params
            fl = None if fl is None or last_flops is None else fl + last_flops
            names += lasts
        label = f"{idx[0]}-{idx[-1]}" if size > 1 else str(idx[0])
        rows.append((task.name, label + (f" + {', '.join(names)}" if names else ""), params, fl))

    if stacked:
        rules.append((f"^{prefix}/", tasks))
    if report and jax.process_index() == 0:  # one report for a multi-process run
        _print_report(rows, n, by, tokens)
    return rules


def _blocks_attribute(model: Any, name: str | None) -> str:
    """The attribute of ``model`` holding its layers: ``name``, else ``blocks``, else its one
    top-level ``nnx.List`` or ``nnx.Sequential`` of modules."""
    if name is not None:
        if not isinstance(name, str) or not hasattr(model, name):
            raise ValueError(
                f"stage_rules: {type(model).__name__} has no attribute {name!r} (blocks=); "
                f"its attributes are {', '.join(_public(model)) or 'none'}"
            )
        return name
    if getattr(model, "blocks", None) is not None:
        return "blocks"
    lists = [
        k
        for k, v in vars(model).items()
        if isinstance(v, nnx.List | nnx.Sequential)
        and len(layers := v.layers if isinstance(v, nnx.Sequential) else v)
        and all(isinstance(b, nnx.Module) for b in layers)
    ]
    if len(lists) == 1:
        return lists[0]
    if lists:
        raise ValueError(
            f"stage_rules: {type(model).__name__} has several lists of modules "
            f"({', '.join(lists)}); name the one holding the layers to cut, e.g. "
            f"blocks={lists[0]!r}"
        )
    raise ValueError(
        f"stage_rules: {type(model).__name__} has no attribute 'blocks' holding its layers and "
        "no nnx.List of modules; expected model.blocks to be an nnx.List of modules (as "
        "GPT.blocks) or one module of stacked layers (nnx.vmap), or blocks= naming the "
        f"attribute that holds them (its attributes: {', '.join(_public(model)) or 'none'})"
    )


def _public(model: Any) -> list[str]:
    return [k for k in vars(model) if not k.startswith("_")]


def _stage_tasks(tasks: list[Task], virtual_stages: int, order: str) -> list[Task]:
    """The task of each stage: ``tasks`` repeated ``virtual_stages`` times, looped or in a V."""
    if (
        not isinstance(virtual_stages, int)
        or isinstance(virtual_stages, bool)
        or (virtual_stages < 1)
    ):
        raise ValueError(f"stage_rules: virtual_stages must be an int >= 1, got {virtual_stages!r}")
    if order == "loop":
        return tasks * virtual_stages
    if order == "v":
        if virtual_stages != 2:
            raise ValueError(
                f"stage_rules: order='v' places two stages per task (down the tasks and back "
                f"up); pass virtual_stages=2, got {virtual_stages}"
            )
        return tasks + [t.virtual_stage(1) for t in reversed(tasks)]
    raise ValueError(f"stage_rules: unknown order={order!r}; expected 'loop' or 'v'")


def _print_report(rows: list, n: int, by: str, tokens: int | None) -> None:
    params = [r[2] for r in rows]
    fl = [r[3] for r in rows]
    total_p = sum(params)
    total_f = None if None in fl else sum(fl)
    table = Table(
        title=f"stage_rules: {n} blocks over {len(rows)} stages, balanced by {by}",
        box=box.SIMPLE,
    )
    for name in ("task", "blocks", "params", "share %", "FLOPs", "share %"):
        table.add_column(name, justify="left" if name in ("task", "blocks") else "right")
    for task, label, p, f in rows:
        table.add_row(task, label, f"{p:,}", _share(p, total_p), _fmt_flops(f), _share(f, total_f))
    table.add_row(
        "imbalance",
        "max stage / mean",
        "",
        _imbalance(params),
        "",
        _imbalance(fl),
        style="bold",
    )
    per = f"; FLOPs per step of {tokens} tokens" if tokens else ""
    table.caption = f"imbalance = largest stage / mean stage{per}"
    Console(width=120).print(table)
