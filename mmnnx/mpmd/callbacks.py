"""Host callbacks that never raise into XLA: a step's ``jax.debug.callback``, ``pure_callback``
and ``io_callback`` (also inside ``scan``/``cond``/``while`` bodies and checkpointed code) are
rewritten to catch their own exceptions, record them in the step's :class:`CallbackFailures`
and return normally (zeros for results), so that the step's programs finish and ``mm.jit``
raises ``StepError`` from the recorded exception before anything is written back.

Why: a callback that raises inside a program spanning several devices fails that device's part
of the program while the others wait for it in a collective, and XLA:CPU aborts the whole
process after 40 s (measured on 2 x 2 tasks, jax 0.10.2).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
from jax.extend import core as jcore

CALLBACK_PRIMITIVES = frozenset({"debug_callback", "pure_callback", "io_callback"})


class CallbackFailures:
    """The exceptions a step's host callbacks raised since they were last taken (callbacks run
    on XLA's threads).

    Example:
        >>> failures = CallbackFailures()
        >>> failures.record(ValueError("bad batch"))
        >>> [str(e) for e in failures.take()], failures.take()
        (['bad batch'], [])
    """

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


def calls_back(jaxpr: jcore.Jaxpr) -> bool:
    """Whether ``jaxpr`` (or one nested in it) holds a host callback."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in CALLBACK_PRIMITIVES:
            return True
        if any(calls_back(inner) for inner in _inner_jaxprs(eqn.params)):
            return True
    return False


def catch_callbacks(closed: jcore.ClosedJaxpr, failures: CallbackFailures) -> jcore.ClosedJaxpr:
    """``closed`` with every host callback in it (nested ones too) recording its exceptions in
    ``failures`` instead of raising them; ``closed`` itself when it holds none."""
    if not calls_back(closed.jaxpr):
        return closed
    return jcore.ClosedJaxpr(_rewrite(closed.jaxpr, failures), closed.consts)


def _inner_jaxprs(params: dict) -> list[jcore.Jaxpr]:
    found = []
    for value in params.values():
        for item in value if isinstance(value, tuple | list) else (value,):
            if isinstance(item, jcore.ClosedJaxpr):
                found.append(item.jaxpr)
            elif isinstance(item, jcore.Jaxpr):
                found.append(item)
    return found


def _rewrite(jaxpr: jcore.Jaxpr, failures: CallbackFailures) -> jcore.Jaxpr:
    eqns = []
    for eqn in jaxpr.eqns:
        params = {key: _rewrite_param(value, failures) for key, value in eqn.params.items()}
        if eqn.primitive.name in CALLBACK_PRIMITIVES and callable(params.get("callback")):
            params["callback"] = _Caught(params["callback"], params.get("result_avals"), failures)
        eqns.append(eqn.replace(params=params))
    return jaxpr.replace(eqns=eqns)


def _rewrite_param(value: Any, failures: CallbackFailures) -> Any:
    if isinstance(value, jcore.ClosedJaxpr):
        if not calls_back(value.jaxpr):
            return value
        return jcore.ClosedJaxpr(_rewrite(value.jaxpr, failures), value.consts)
    if isinstance(value, jcore.Jaxpr):
        return _rewrite(value, failures) if calls_back(value) else value
    jaxprs = jcore.Jaxpr | jcore.ClosedJaxpr
    if isinstance(value, tuple) and any(isinstance(v, jaxprs) for v in value):
        return tuple(_rewrite_param(v, failures) for v in value)
    return value


class _Caught:
    """A callback that records its exception and returns zeros of its results' shapes (none for
    ``jax.debug.callback``) rather than raising into the running program."""

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
