"""``gather``: a small value from every process, JSON-encoded and compressed through the
coordination service's key-value store (arrays go through :func:`~mmnnx.distributed.fetch`)."""

from __future__ import annotations

import itertools
import json
import zlib
from collections.abc import Callable
from typing import Any

import jax

from mmnnx._jax import runtime
from mmnnx.distributed.exits import wait_for
from mmnnx.errors import MPMDError

_KEY = "mmnnx/gather/{}/{}"
_WAIT_S = 300.0
_rounds = itertools.count()


def gather(
    value: Any, *, to: int | None = None, what: str = "gather", timeout_s: float = _WAIT_S
) -> list[Any] | None:
    """Every process's ``value`` (small, JSON-serialisable) as a list in process order, on process
    ``to`` (``None``: on every process), ``None`` on the others; a collective. ``what`` names it in
    the error when a process sends nothing within ``timeout_s``. In one process: ``[value]``.

    Example:
        >>> from mmnnx.distributed.gather import gather
        >>> gather({"rank": 0, "seconds": 0.5})  # one process
        [{'rank': 0, 'seconds': 0.5}]
    """
    me, count = jax.process_index(), jax.process_count()
    if to is not None and not 0 <= to < count:
        raise ValueError(f"{what}: to={to!r} is not a process of this job (0 to {count - 1})")
    if count == 1:
        return [value]
    n = next(_rounds)
    runtime.key_value_set(_KEY.format(n, me), zlib.compress(json.dumps(value).encode()))
    if to is not None and me != to:
        return None
    values = []
    for peer in range(count):
        if peer == me:
            values.append(json.loads(json.dumps(value)))  # as the others see it
            continue
        try:
            raw = wait_for(_KEY.format(n, peer), peer, timeout_s, what)
        except TimeoutError as e:
            raise MPMDError(
                f"{what}: process {peer} did not send its part within {timeout_s:.0f} s "
                "(it failed, "
                "or runs other steps: every process must make the same calls in the same order)"
            ) from e
        values.append(json.loads(zlib.decompress(raw).decode()))
    if to is not None:  # only this process reads the round's keys
        for peer in range(count):
            runtime.key_value_delete(_KEY.format(n, peer))
    return values


def together(what: str, work: Callable[[], Any]) -> Any:
    """``work()``, collectively: raises on every process when it failed on any, naming it."""
    error: Exception | None = None
    try:
        result = work()
    except Exception as e:
        error, result = e, None
    failures = gather(
        "" if error is None else f"{type(error).__name__}: {error}", what=what, timeout_s=3600.0
    )
    bad = next((p for p, f in enumerate(failures) if f), None)
    if bad is not None:
        raise RuntimeError(f"{what} failed on process {bad}: {failures[bad]}") from error
    return result
