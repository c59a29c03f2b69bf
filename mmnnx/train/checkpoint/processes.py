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
    """``read()``, this process's part of reading a step that every process reads (a
    collective; with one process, just ``read()``). Each process reads the slices its own
    devices hold, so a damaged file may fail the read on one process only: when it fails on
    any, every process raises the error of the first that failed, a
    :class:`CheckpointCorruptError` or :class:`CheckpointMismatchError` as such (so that every
    process passes over the same steps), any other as a ``RuntimeError`` naming it."""
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
    """``error`` as JSON, for the other processes to raise (``None``: no error)."""
    if error is None:
        return None
    if isinstance(error, CheckpointCorruptError):
        return {"kind": "corrupt", "error": error.report()}
    if isinstance(error, CheckpointMismatchError):
        return {"kind": "mismatch", "error": str(error)}
    return {"kind": "other", "error": f"{type(error).__name__}: {error}"}
