"""Rewriting the equations of a traced step, nested bodies included (``scan``, ``cond``,
``while``, ``remat``, calls): the one traversal behind :mod:`~mmnnx.mpmd.trace.callbacks` and
:mod:`~mmnnx.mpmd.trace.constraints`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jax.extend import core as jcore

Eqn = Any  # a jax.extend.core.JaxprEqn


def holds(jaxpr: jcore.Jaxpr, wanted: Callable[[Eqn], bool]) -> bool:
    """Whether ``jaxpr`` or one nested in it has an equation ``wanted`` picks."""
    for eqn in jaxpr.eqns:
        if wanted(eqn) or any(holds(j, wanted) for j in jcore.jaxprs_in_params(eqn.params)):
            return True
    return False


def rewrite(
    closed: jcore.ClosedJaxpr, wanted: Callable[[Eqn], bool], replace: Callable[[Eqn], Eqn]
) -> jcore.ClosedJaxpr:
    """``closed`` with every equation ``wanted`` picks, at any depth, replaced by
    ``replace(eqn)``; ``closed`` itself when there is none."""
    if not holds(closed.jaxpr, wanted):
        return closed
    return jcore.ClosedJaxpr(_rewrite(closed.jaxpr, wanted, replace), closed.consts)


def _rewrite(jaxpr: jcore.Jaxpr, wanted, replace) -> jcore.Jaxpr:
    eqns = []
    for eqn in jaxpr.eqns:
        params = {key: _param(value, wanted, replace) for key, value in eqn.params.items()}
        eqn = eqn.replace(params=params)
        eqns.append(replace(eqn) if wanted(eqn) else eqn)
    return jaxpr.replace(eqns=eqns)


def _param(value: Any, wanted, replace) -> Any:
    if isinstance(value, jcore.ClosedJaxpr):
        return rewrite(value, wanted, replace)
    if isinstance(value, jcore.Jaxpr):
        return _rewrite(value, wanted, replace) if holds(value, wanted) else value
    jaxprs = jcore.Jaxpr | jcore.ClosedJaxpr
    if isinstance(value, tuple) and any(isinstance(v, jaxprs) for v in value):
        return tuple(_param(v, wanted, replace) for v in value)
    return value
