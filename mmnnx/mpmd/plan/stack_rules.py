"""How ops act on a stacked Variable's leading (layer) axis when it is split over tasks
(``stack_split.py``), and the parameters and slices of a chunk."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from mmnnx._jax.scan import scan_counts
from mmnnx.mpmd.ir import Const, Op

_ELEMENTWISE_NAMES = """
    add sub mul div rem pow integer_pow max min neg sign floor ceil round is_finite exp exp2
    log log1p expm1 tanh logistic sin cos tan asin acos atan atan2 sinh cosh asinh acosh
    atanh sqrt rsqrt cbrt abs square erf erfc erf_inv lgamma digamma and or not xor eq ne lt
    le gt ge select_n clamp convert_element_type copy copy_p reduce_precision nextafter real
    imag conj shift_left shift_right_logical shift_right_arithmetic population_count clz
    mm_sharding_constraint mm_microbatch_accumulate mm_chain_in mm_chain_out mm_rng_base
    mm_rng_next
"""
_ELEMENTWISE = frozenset(_ELEMENTWISE_NAMES.split())
COMBINE = {  # the binary primitive that combines a reduction's partial results
    "reduce_sum": jax.lax.add_p,
    "reduce_max": jax.lax.max_p,
    "reduce_min": jax.lax.min_p,
    "reduce_prod": jax.lax.mul_p,
    "reduce_and": jax.lax.and_p,
    "reduce_or": jax.lax.or_p,
}


def stack_rule(op: Op, split: Sequence[bool], in_shapes: Sequence[tuple]) -> str | None:
    """How ``op`` can run chunk by chunk when the operands marked ``split`` are split along
    their leading axis: ``"map"``, ``"reduce"`` (partials, then combined), ``"scan"`` (one
    per chunk, the carry passed on), or ``None`` (it needs the whole array)."""
    name, p = op.name, op.params
    if name in _ELEMENTWISE:
        return "map"
    if name == "scan":
        first_x = sum(scan_counts(p))
        if any(split[:first_x]) or not any(split[first_x:]):
            return None
        return "scan"
    if name in COMBINE:
        return "reduce" if 0 in p["axes"] else "map"
    if name in ("argmax", "argmin", "cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"):
        axes = p["axes"] if "axes" in p else (p["axis"],)
        return None if 0 in axes else "map"
    if name == "broadcast_in_dim":
        dims = p["broadcast_dimensions"]
        return "map" if dims and dims[0] == 0 and in_shapes[0][0] == p["shape"][0] else None
    if name == "reshape":
        ok = p.get("dimensions") is None and p["new_sizes"][:1] == in_shapes[0][:1]
        return "map" if ok else None
    if name == "transpose":
        return "map" if p["permutation"][0] == 0 else None
    if name in ("squeeze", "rev"):
        return None if 0 in p["dimensions"] else "map"
    if name == "dot_general":
        (_, _), (lhs_batch, rhs_batch) = p["dimension_numbers"]
        return "map" if lhs_batch[:1] == (0,) and rhs_batch[:1] == (0,) else None
    return None


def is_constant_broadcast(op: Op) -> bool:
    """Whether ``op`` fills an array with one constant (``jnp.zeros``, ``jnp.full``)."""
    return op.name == "broadcast_in_dim" and all(
        isinstance(x, Const) and np.ndim(x.value) == 0 for x in op.ins
    )


def chunk_params(op: Op, size: int) -> dict:
    """``op``'s parameters for a chunk of ``size`` along the leading axis."""
    params = dict(op.params)
    if op.name == "broadcast_in_dim":
        params["shape"] = (size, *params["shape"][1:])
    elif op.name == "reshape":
        params["new_sizes"] = (size, *params["new_sizes"][1:])
    elif op.name == "scan":
        params["length"] = size
    return params


def slice_leading(shape: Sequence[int], start: int, stop: int) -> tuple[Any, dict]:
    """The primitive and parameters slicing ``[start:stop]`` of an array's leading axis."""
    return jax.lax.slice_p, {
        "start_indices": (start, *(0 for _ in shape[1:])),
        "limit_indices": (stop, *shape[1:]),
        "strides": None,
    }
