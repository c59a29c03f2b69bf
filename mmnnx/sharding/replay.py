"""Building a traced constructor's values (``mm.init``): a traced function of no arguments,
replayed on a device output by output, equal initializers sharing one compiled program."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as jcore

from mmnnx._jax.tracing import debug_info


def replay(
    closed: jcore.ClosedJaxpr, wanted: Sequence[int], device: Any, put: Callable[[int, Any], None]
) -> None:
    """Computes on ``device`` the outputs ``wanted`` of ``closed`` (a function of no arguments) and
    hands each to ``put(index, value)`` as soon as it is made."""
    jaxpr = closed.jaxpr
    keep = sorted(set(wanted))
    owner = _owners(jaxpr, [(i, jaxpr.outvars[i]) for i in keep])
    shared: list[jcore.JaxprEqn] = []
    cones: dict[int, list[jcore.JaxprEqn]] = {}
    for e in jaxpr.eqns:
        who = _owner_of(e, owner)
        if who is _SHARED:
            shared.append(e)
        elif who is not None:  # None: no wanted output reads it
            cones.setdefault(who, []).append(e)
    made_at = {v: -1 for v in (*jaxpr.constvars, *jaxpr.invars)}  # the shared op making it
    last_read: dict[Any, int] = {}
    for n, e in enumerate(shared):
        made_at.update((v, n) for v in e.outvars)
        last_read.update((a, n) for a in e.invars if not isinstance(a, jcore.Literal))
    # Each output is made right after the last shared op its cone reads: by a program of
    # what it reads, or (``None``) as the shared value it is.
    due: dict[int, list[tuple[int, Callable | None, list]]] = {}
    for i in keep:
        v = jaxpr.outvars[i]
        if isinstance(v, jcore.Literal):
            program, reads = (lambda value=v.val: value), []
        elif v in made_at:
            program, reads = None, [v]
        else:
            program, reads = _cone_program(cones[i], v)
        at = max((made_at[a] for a in reads), default=-1)
        due.setdefault(at, []).append((i, program, reads))
        last_read.update((a, max(last_read.get(a, -1), at)) for a in reads)
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, closed.consts, strict=True))

    def finish(n: int) -> None:
        for i, program, reads in due.get(n, ()):
            ins = [env[a] for a in reads]
            value = ins[0] if program is None else program(*ins)
            put(i, value if isinstance(value, jax.Array) else jax.device_put(value, device))
        for v in [v for v in env if last_read.get(v, -1) <= n]:
            del env[v]

    with jax.default_device(device):
        finish(-1)
        for n, e in enumerate(shared):
            ins = [a.val if isinstance(a, jcore.Literal) else env[a] for a in e.invars]
            with e.ctx.manager:
                out = e.primitive.bind(*ins, **e.primitive.get_bind_params(e.params))
            outs = out if e.primitive.multiple_results else [out]
            env.update(zip(e.outvars, outs, strict=True))
            finish(n)


# The owner of a value several wanted outputs (or an op with side effects) read.
_SHARED = object()


def _owner_of(eqn: jcore.JaxprEqn, owner: dict[Any, Any]) -> Any:
    """The output ``eqn`` computes for: ``_SHARED`` where several (or effects), else ``None``."""
    if eqn.effects or not eqn.outvars:
        return _SHARED
    owners = {owner[v] for v in eqn.outvars if v in owner}
    return owners.pop() if len(owners) == 1 else (_SHARED if owners else None)


def _owners(jaxpr: jcore.Jaxpr, outputs: Sequence[tuple[int, Any]]) -> dict[Any, Any]:
    """Maps each value ``outputs`` need to the one output reading it, or ``_SHARED``."""
    owner: dict[Any, Any] = {}

    def claim(v: Any, who: Any) -> None:
        if not isinstance(v, jcore.Literal):
            have = owner.get(v)
            owner[v] = who if have is None or have == who else _SHARED

    for i, v in outputs:
        claim(v, i)
    for e in reversed(jaxpr.eqns):
        who = _owner_of(e, owner)
        if who is not None:
            for a in e.invars:
                claim(a, who)
    return owner


# Initializer programs by structure (ops, shapes, literals): equal layers share one.
_CONE_PROGRAMS: dict[tuple, Callable] = {}
_CONE_PROGRAMS_KEPT = 1024


def _cone_program(eqns: Sequence[jcore.JaxprEqn], out: Any) -> tuple[Callable, list]:
    """A jitted function computing ``out`` by ``eqns`` from the values it reads, and those."""
    made = {o for e in eqns for o in e.outvars}
    reads = list(
        dict.fromkeys(
            a for e in eqns for a in e.invars if not isinstance(a, jcore.Literal) and a not in made
        )
    )
    number = {v: k for k, v in enumerate(reads)}
    key: list[Any] = [tuple(_aval_key(v.aval) for v in reads)]
    for e in eqns:
        ins = tuple(
            ("literal", _aval_key(a.aval), np.asarray(a.val).tobytes())
            if isinstance(a, jcore.Literal)
            else number[a]
            for a in e.invars
        )
        first = len(number)
        number.update((v, first + k) for k, v in enumerate(e.outvars))
        key.append((e.primitive, _params_key(e.params), ins))
    key.append(number[out])
    program = _CONE_PROGRAMS.get(tuple(key))
    if program is None:
        if len(_CONE_PROGRAMS) >= _CONE_PROGRAMS_KEPT:
            _CONE_PROGRAMS.clear()
        info = debug_info("mm.init", "a Variable's initializer")
        jaxpr = jcore.Jaxpr([], reads, [out], list(eqns), debug_info=info)
        fun = jcore.jaxpr_as_fun(jcore.ClosedJaxpr(jaxpr, []))
        program = _CONE_PROGRAMS[tuple(key)] = jax.jit(lambda *args: fun(*args)[0])
    return program, reads


def _aval_key(aval: Any) -> tuple:
    return aval.shape, aval.dtype, getattr(aval, "weak_type", False)


def _params_key(params: dict) -> Any:
    key = tuple(sorted(params.items()))
    try:
        hash(key)
    except TypeError:  # a list or dict among the params
        return repr(key)
    return key
