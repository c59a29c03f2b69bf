"""What kind of computation an op is, by its primitive: a view of one value, data movement
cheap enough to recompute where it is needed, or a contraction too costly to repeat."""

from __future__ import annotations

from jax.extend import core as jcore

from mmnnx.mpmd.ir import Op

# Ops that only re-present one value (reshaped, broadcast, transposed, cast): a view of placed
# state still is that state, so an op reading it runs where the state lives.
_VIEW_NAMES = """
    reshape broadcast_in_dim transpose squeeze expand_dims convert_element_type copy
    reduce_precision mm_chain_in
"""
_VIEWS = frozenset(_VIEW_NAMES.split())

# Data movement (slicing a batch into inputs and labels): cheap enough to recompute in every
# fragment that reads it instead of sending it.
_SLICING = frozenset(
    {"dynamic_slice", "slice", "reshape", "squeeze", "expand_dims", "convert_element_type"}
)


def is_view(op: Op) -> bool:
    """Whether ``op`` only re-presents its operand (reshape, broadcast, transpose, cast)."""
    return is_view_name(op.name)


def is_view_name(name: str) -> bool:
    """Whether the primitive named ``name`` only re-presents its operand (:func:`is_view`)."""
    return name in _VIEWS


def is_slicing(op: Op) -> bool:
    """Whether ``op`` only cuts or re-presents data (cheap to recompute where it is needed)."""
    return op.name in _SLICING


COSTLY = frozenset({"dot_general", "conv_general_dilated", "ragged_dot_general"})
"""Ops too costly to repeat in every stage that reads their result (contractions); ops that run
a nested program (their cost is unknown) are not cheap either (:func:`is_cheap`)."""


def is_cheap(op: Op) -> bool:
    """Whether ``op`` is cheap enough to recompute where its result is needed: anything but a
    contraction or an op holding a nested program (scan, while, cond, custom derivatives)."""
    return op.name not in COSTLY and not any(
        isinstance(p, jcore.Jaxpr | jcore.ClosedJaxpr) for p in op.params.values()
    )
