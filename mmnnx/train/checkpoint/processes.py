"""Work every process of a job does on a checkpoint together: :func:`together`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mmnnx.distributed.gather import gather


def together(what: str, work: Callable[[], Any]) -> Any:
    """``work()``, this process's part of a step every process takes (a collective); raises
    on every process when it failed on any, naming the first that failed."""
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
