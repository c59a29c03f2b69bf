"""The value checks of the component configs, raising ``ValueError`` naming the field."""

from __future__ import annotations

import math
import numbers


def is_int(value: object, minimum: int = 0) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= minimum


def is_positive(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and 0 < value < math.inf


def check(ok: bool, field: str, expected: str, value: object) -> None:
    """Raises ``ValueError("{field} must be {expected}, got {value!r}")`` unless ``ok``.

    Example:
    >>> check(is_int(0, minimum=1), "MLPConfig.hidden", "an int >= 1", 0)
    Traceback (most recent call last):
    ...
    ValueError: MLPConfig.hidden must be an int >= 1, got 0
    """
    if not ok:
        raise ValueError(f"{field} must be {expected}, got {value!r}")
