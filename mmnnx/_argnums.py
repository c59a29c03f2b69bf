"""A step's static and donated arguments checked against its signature when ``mm.jit`` is
applied, as ``jax.jit`` checks them (:func:`checked_argnums`)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import NamedTuple


class Argnums(NamedTuple):
    """A step's static and donated argument positions, counted from its first argument, and the
    names of its static arguments (either kind inferred from the other, as ``jax.jit`` does)."""

    static_argnums: tuple[int, ...]
    donate_argnums: tuple[int, ...]
    static_argnames: tuple[str, ...] = ()


def checked_argnums(
    fun: Callable,
    name: str,
    static_argnums: tuple[int, ...],
    static_argnames: tuple[str, ...],
    donate_argnums: tuple[int, ...],
) -> Argnums:
    """``static_argnums`` and ``donate_argnums`` of ``fun`` (called ``name`` in errors), negative
    positions counted from the end of its positional parameters, checked with ``static_argnames``
    against its signature. A signature with ``*args`` (or unreadable) leaves positions unchecked, as
    ``jax.jit`` does, and refuses negative ones. As with ``jax.jit``, when only one of
    ``static_argnums`` and ``static_argnames`` is given, the other is read from the signature, so a
    static argument stays static whether it is passed by position or by keyword.

    Raises:
        ValueError: a position the step does not have, a static name it does not take, an
            argument both static and donated, or a negative position without a signature.

    Example:
        >>> def step(model, opt, x, y): ...
        >>> checked_argnums(step, "step", (-1,), (), (0, 1))
        Argnums(static_argnums=(3,), donate_argnums=(0, 1), static_argnames=('y',))
        >>> checked_argnums(step, "step", (), ("y",), ()).static_argnums
        (3,)
        >>> checked_argnums(step, "step", (), (), (7,))
        Traceback (most recent call last):
        ...
        ValueError: mm.jit: step has donate_argnums=(7,), but only accepts 4 positional arguments
    """
    try:
        params = list(inspect.signature(fun).parameters.values())
    except (TypeError, ValueError):
        params = None
    count = None  # how many arguments the step takes by position (None: any number, or unknown)
    if params is not None and not any(p.kind is p.VAR_POSITIONAL for p in params):
        count = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)
    given = {"static_argnums": static_argnums, "donate_argnums": donate_argnums}
    resolved = {}
    for option, nums in given.items():
        if count is None:
            if any(i < 0 for i in nums):
                raise ValueError(
                    f"mm.jit: {name} has {option}={nums}; a negative position counts from the "
                    "end of the step's positional parameters, which mm.jit cannot read here "
                    "(a step taking *args, or without a signature): give positions from 0"
                )
        elif any(not -count <= i < count for i in nums):
            raise ValueError(
                f"mm.jit: {name} has {option}={nums}, but only accepts {count} positional arguments"
            )
        resolved[option] = tuple(sorted({i % count if count else i for i in nums}))
    if params is not None and not any(p.kind is p.VAR_KEYWORD for p in params):
        takes = {p.name for p in params if p.kind is not p.POSITIONAL_ONLY}
        invalid = sorted(set(static_argnames) - takes)
        if invalid:
            raise ValueError(
                f"mm.jit: {name} has invalid argnames {invalid} in static_argnames; it does "
                "not take these arguments"
            )
    static_names = tuple(static_argnames)
    if params is not None:
        by_either = [p for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
        if not static_names:
            static_names = tuple(
                p.name for i, p in enumerate(by_either) if i in resolved["static_argnums"]
            )
        elif not resolved["static_argnums"]:
            resolved["static_argnums"] = tuple(
                i for i, p in enumerate(by_either) if p.name in static_names
            )
    both = sorted(set(resolved["static_argnums"]) & set(resolved["donate_argnums"]))
    if both:
        raise ValueError(
            f"mm.jit: {name} has argument {both[0]} in both static_argnums and donate_argnums; "
            "a static argument is not an array, so it cannot be donated"
        )
    return Argnums(resolved["static_argnums"], resolved["donate_argnums"], static_names)
