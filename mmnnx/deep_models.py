"""Steering deep models to stacked layers: a warning when a step's argument holds many equal
blocks unrolled, whose tracing and compiling grow with their number."""

from __future__ import annotations

import inspect
import os
import sys
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from flax import nnx

from mmnnx._nnx import variables_of
from mmnnx.errors import UnrolledLayersWarning

UNROLLED_BLOCKS_WARN_AT = 32
"""More equal blocks than this in one list of modules: :func:`warn_unrolled_blocks` warns."""


def _signature(block: nnx.Module) -> Any:
    """Type and each Variable's path, kind, shape and dtype (not metadata: placement)."""
    return type(block), tuple(
        (path, type(var), np.shape(var.get_value()), str(getattr(var.get_value(), "dtype", "")))
        for path, var in variables_of(block)
    )


def equal_blocks(node: Any, at_least: int = UNROLLED_BLOCKS_WARN_AT + 1) -> list[tuple[str, int]]:
    """The path of each list in ``node`` of at least ``at_least`` equal blocks, and how many.

    Example:
        >>> from flax import nnx
        >>> class Deep(nnx.Module):
        ...     def __init__(self, rngs):
        ...         self.blocks = nnx.List([nnx.Linear(2, 2, rngs=rngs) for _ in range(40)])
        >>> equal_blocks(Deep(nnx.Rngs(0)))
        [('blocks', 40)]
    """
    found = []
    for path, child in nnx.iter_graph(node):
        if not isinstance(child, (list, tuple, nnx.List)) or len(child) < at_least:
            continue
        modules = [x for x in child if isinstance(x, nnx.Module)]
        if len(modules) < at_least:
            continue
        count = Counter(_signature(m) for m in modules).most_common(1)[0][1]
        if count >= at_least:
            found.append(("/".join(str(p) for p in path), count))
    return found


def warn_unrolled_blocks(fun: Callable, args: Sequence[Any], kwargs: dict, step: str) -> None:
    """Warns per list of many equal blocks among the arguments of ``fun``, naming ``step``."""
    names = [*_parameter_names(fun, len(args)), *kwargs]
    seen: set[int] = set()
    for arg, name in zip([*args, *kwargs.values()], names, strict=False):
        if not isinstance(arg, nnx.Module) or id(arg) in seen:
            continue
        seen.add(id(arg))
        for path, count in equal_blocks(arg):
            where = f"{name}.{path.replace('/', '.')}" if path else name
            warnings.warn(
                f"{step}: {where} holds {count} equal blocks unrolled; tracing, planning and "
                "compiling grow with their number. Stack them (nnx.vmap) and run them with "
                "nnx.scan: GPTConfig(scan_layers=True), `mmnnx train --scan-layers`, and a "
                "placement rule naming a list of tasks splits the stack into stages "
                "(docs/pipelining.md, Scanned layers)",
                UnrolledLayersWarning,
                stacklevel=user_frame(),
            )


def user_frame() -> int:
    """The ``stacklevel``, for its caller's ``warnings.warn``, of the first frame outside mmnnx."""
    package = os.path.dirname(os.path.abspath(__file__))
    frame, level = sys._getframe(2), 2
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def _parameter_names(fun: Callable, count: int) -> list[str]:
    """The names of ``fun``'s first ``count`` positional parameters (``arg<i>`` where unknown)."""
    try:
        params = inspect.signature(fun).parameters.values()
        names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        names = []
    return [names[i] if i < len(names) else f"arg{i}" for i in range(count)]
