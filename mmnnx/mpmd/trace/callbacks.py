"""Host callbacks that never raise into XLA: each records its exception in the step's
:class:`CallbackFailures` and returns zeros, so that every device's program finishes (XLA:CPU aborts
a process left waiting in a collective) and ``mm.jit`` raises ``StepError``."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
from jax.extend import core as jcore

from mmnnx.mpmd.trace.rewrite import rewrite

CALLBACK_PRIMITIVES = frozenset({"debug_callback", "pure_callback", "io_callback"})


class CallbackFailures:
    """The exceptions a step's host callbacks raised since they were last taken (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._errors: list[BaseException] = []

    def record(self, error: BaseException) -> None:
        with self._lock:
            self._errors.append(error)

    def take(self) -> list[BaseException]:
        """The exceptions recorded so far, in order; forgets them."""
        with self._lock:
            errors, self._errors = self._errors, []
        return errors


def _is_callback(eqn: Any) -> bool:
    return eqn.primitive.name in CALLBACK_PRIMITIVES and callable(eqn.params.get("callback"))


def catch_callbacks(closed: jcore.ClosedJaxpr, failures: CallbackFailures) -> jcore.ClosedJaxpr:
    """``closed`` with every host callback in it (nested ones too) recording its exceptions in
    ``failures`` instead of raising them; ``closed`` itself when it holds none."""

    def caught(eqn: Any) -> Any:
        params = dict(eqn.params)
        params["callback"] = _Caught(params["callback"], params.get("result_avals"), failures)
        return eqn.replace(params=params)

    return rewrite(closed, _is_callback, caught)


class _Caught:
    """A callback recording its exception and returning zeros of its results' shapes."""

    def __init__(self, callback: Callable, result_avals: Any, failures: CallbackFailures):
        self._callback, self._result_avals, self._failures = callback, result_avals, failures

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self._callback(*args, **kwargs)
        except Exception as error:
            self._failures.record(error)
            if self._result_avals is None:
                return ()
            return [np.zeros(a.shape, a.dtype) for a in self._result_avals]

    def __getattr__(self, name: str) -> Any:  # what JAX reads of the callback it wraps
        return getattr(self._callback, name)
