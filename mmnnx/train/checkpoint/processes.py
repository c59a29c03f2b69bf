"""Work every process of a job does on a checkpoint together: :func:`together` (kept in
``mmnnx.distributed.gather``, where model export uses it too) and :func:`read_together`, the
reading of a step, whose outcome every process shares."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import jax

from mmnnx.distributed.gather import gather, together
from mmnnx.train.checkpoint.integrity import CheckpointCorruptError
from mmnnx.train.checkpoint.tree import CheckpointMismatchError

__all__ = ["read_together", "together"]

T = TypeVar("T")


def read_together(what: str, read: Callable[[], T]) -> T:
    """``read()``, this process's part of reading a step (a collective). A damaged file may
    fail one process only: every process then raises the first failure, a checkpoint's error as
    such (so that all pass over the same steps), any other as a ``RuntimeError`` naming it."""
    if jax.process_count() == 1:
        return read()
    error: Exception | None = None
    try:
        result = read()
    except Exception as e:
        error, result = e, None
    reports = gather(_report(error), what=what, timeout_s=3600.0)
    first = next((p for p, report in enumerate(reports) if report), None)
    if first is None:
        return result
    if first == jax.process_index():
        raise error  # type: ignore[misc]
    report = reports[first]
    if report["kind"] == "corrupt":
        raise CheckpointCorruptError.reported(report["error"]) from error
    if report["kind"] == "mismatch":
        raise CheckpointMismatchError(report["error"]) from error
    raise RuntimeError(f"{what} failed on process {first}: {report['error']}") from error


def _report(error: Exception | None) -> dict[str, Any] | None:
    if error is None:
        return None
    if isinstance(error, CheckpointCorruptError):
        return {"kind": "corrupt", "error": error.report()}
    if isinstance(error, CheckpointMismatchError):
        return {"kind": "mismatch", "error": str(error)}
    return {"kind": "other", "error": f"{type(error).__name__}: {error}"}
