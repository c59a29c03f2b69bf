"""The value checks of the component configs, raising ``ValueError`` naming the field."""

from __future__ import annotations

import math
import numbers


def is_int(value: object, minimum: int = 0) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= minimum


def is_positive(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and 0 < value < math.inf


def check(ok: bool, field: str, expected: str, value: object) -> None:
    """Raises ``ValueError("{field} must be {expected}, got {value!r}")`` unless ``ok``."""
    if not ok:
        raise ValueError(f"{field} must be {expected}, got {value!r}")
