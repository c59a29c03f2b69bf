"""The ``scan`` primitive's parameters in each JAX version: 0.10 counts its operand groups
(``num_consts``, ``num_carry``, ``linear``), 0.11 holds them as flat trees (``ft_in``,
``ft_out``)."""

from __future__ import annotations

from typing import Any


def scan_counts(params: dict) -> tuple[int, int]:
    """``(constants, carries)``: how many of a scan's operands are each (the scanned ones
    follow).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> f = lambda c, xs: jax.lax.scan(lambda c, x: (c + x, c * x), c, xs)
        >>> scan_counts(jax.make_jaxpr(f)(jnp.ones(2), jnp.ones((3, 2))).eqns[0].params)
        (0, 1)
    """
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)


def scan_params(params: dict, jaxpr: Any, num_consts: int, num_carry: int, num_xs: int) -> dict:
    """``params`` of a scan remade to run ``jaxpr`` (a ``ClosedJaxpr``) over ``num_consts``
    constants, ``num_carry`` carries and ``num_xs`` scanned operands, each result its own (no
    result forwarded from an operand)."""
    if "num_consts" in params:
        out = {**params, "jaxpr": jaxpr, "num_consts": num_consts, "num_carry": num_carry}
        if "linear" in out:
            out["linear"] = (False,) * (num_consts + num_carry + num_xs)
        return out
    from jax._src import flattree as ft  # noqa: PLC0415  (JAX 0.11 and newer)

    num_ys = len(jaxpr.out_avals) - num_carry
    return {
        **params,
        "jaxpr": jaxpr,
        "ft_in": ft.pack((ft.nones(num_consts), ft.nones(num_carry), ft.nones(num_xs))),
        "ft_out": ft.pack((ft.nones(num_carry), ft.nones(num_ys))),
    }
