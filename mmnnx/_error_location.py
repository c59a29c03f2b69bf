"""Points an error raised while tracing a user's step at the user's own code: the innermost line
of theirs it came through, and the model path of the innermost NNX module it was raised in.

JAX's shape and dtype errors ("dot_general requires contracting dimensions to have the same shape")
name neither; a model with forty ``Linear`` layers needs both.

Example:
    >>> from flax import nnx
    >>> import jax.numpy as jnp
    >>> rngs = nnx.Rngs(0)
    >>> model = nnx.Sequential(nnx.Linear(4, 8, rngs=rngs), nnx.Linear(4, 2, rngs=rngs))
    >>> try:
    ...     model(jnp.ones((1, 4)))
    ... except TypeError as e:
    ...     print(where(e, [model]).splitlines()[0])
    raised in module layers/1 (Linear: kernel (4, 2), bias (2,))
"""

from __future__ import annotations

import linecache
import pathlib
import sysconfig
import traceback
from collections.abc import Sequence
from typing import Any

import flax
import jax
import numpy as np
from flax import nnx

_LIBRARIES = tuple(
    str(pathlib.Path(p).resolve())
    for p in (
        pathlib.Path(jax.__file__).parent,
        pathlib.Path(flax.__file__).parent,
        pathlib.Path(np.__file__).parent,
        pathlib.Path(__file__).parent,  # mmnnx
        sysconfig.get_paths()["stdlib"],
    )
)


def _path_in(root: Any, target: Any) -> str | None:
    try:
        for path, node in nnx.graph.iter_graph(root):
            if node is target:
                return "/".join(map(str, path))
    except Exception:  # not a graph
        return None
    return None


def _describe(module: nnx.Module) -> str:
    own = [
        f"{name} {tuple(getattr(value, 'shape', ()))}"
        for name, value in vars(module).items()
        if isinstance(value, nnx.Variable)
    ]
    return f"{type(module).__name__}" + (f": {', '.join(own)}" if own else "")


def where(error: BaseException, roots: Sequence[Any]) -> str | None:
    """Lines naming the module (by its path under ``roots``) and the user's line that ``error``
    was raised in, or ``None`` when neither is known."""
    origin = error
    while origin.__cause__ is not None:  # a wrapper raised `from` the error: its frames go deeper
        origin = origin.__cause__
    frames = [frame for frame, _ in traceback.walk_tb(origin.__traceback__)]
    lines = []
    # Transforms (nnx.grad, nnx.scan, ...) call copies of the user's modules: the failing module
    # is named by its path under the outermost module the traceback passes through.
    modules = [f.f_locals.get("self") for f in frames]
    modules = [m for m in modules if isinstance(m, nnx.Module)]
    if modules:
        outer, inner = modules[0], modules[-1]
        path = _path_in(outer, inner)
        prefix = next((p for r in roots if (p := _path_in(r, outer)) is not None), None)
        if path is not None:
            full = "/".join(x for x in (prefix, path) if x)
            if not full:
                lines.append(f"raised in the model ({_describe(inner)})")
            else:
                owner = f" of {type(outer).__name__}" if prefix is None else ""
                lines.append(f"raised in module {full}{owner} ({_describe(inner)})")
    for frame in reversed(frames):
        filename = frame.f_code.co_filename
        try:
            library = str(pathlib.Path(filename).resolve()).startswith(_LIBRARIES)
        except (OSError, ValueError):
            library = True
        if not library and not filename.startswith("<"):
            code = linecache.getline(filename, frame.f_lineno).strip()
            lines.append(f"at {filename}:{frame.f_lineno}: {code}")
            break
    return "\n".join(lines) or None


def with_location(error: BaseException, roots: Sequence[Any]) -> BaseException:
    """``error`` again, of its own type where that type can be built from a message, with
    :func:`where`'s lines appended; ``error`` itself when there is nothing to add."""
    lines = where(error, roots)
    if lines is None or lines in str(error):
        return error
    try:
        located = type(error)(f"{error}\n{lines}")
    except Exception:  # an exception type with another constructor
        return error
    located.__cause__ = error
    return located
