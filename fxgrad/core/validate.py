"""Argument checks shared by the transform factories.

Every check raises ``TypeError`` or ``ValueError`` whose message starts with
the argument's name, at construction time.
"""

from __future__ import annotations

import math
import numbers
from typing import Any


def real_number(name: str, value: Any) -> float:
    """``value`` as a float; ``TypeError`` for bools, strings, tensors, ..."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {value!r} ({type(value).__name__})")
    try:
        result = float(value)
    except OverflowError:
        raise ValueError(f"{name} is too large for a float, got {value!r}") from None
    if math.isnan(result):
        raise ValueError(f"{name} must not be NaN")
    return result


def positive(name: str, value: Any, *, allow_inf: bool = True) -> float:
    """A number > 0 (``inf`` allowed unless ``allow_inf=False``)."""
    result = real_number(name, value)
    if result <= 0 or (not allow_inf and math.isinf(result)):
        bound = "a positive finite number" if not allow_inf else "a positive number"
        raise ValueError(f"{name} must be {bound}, got {value!r}")
    return result


def non_negative(name: str, value: Any) -> float:
    """A finite number >= 0."""
    result = real_number(name, value)
    if result < 0 or math.isinf(result):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return result


def norm_type(value: Any) -> float:
    """A p-norm order: any p > 0, or ``inf``."""
    return positive("norm_type", value)


# Step counters live on the device in float64, which counts exactly up to 2**53.
MAX_STEP = 2**53


def positive_int(
    name: str, value: Any, maximum: int = MAX_STEP, why: str = "steps are counted in float64", minimum: int = 1
) -> int:
    """An int in ``[minimum, maximum]`` (bools refused); ``why`` explains the upper bound."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    if value > maximum:
        raise ValueError(f"{name} must be <= {maximum} ({why}), got {value!r}")
    return int(value)


def step(name: str, value: Any) -> int:
    """A training step number in ``[0, MAX_STEP]`` (a schedule key)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= value <= MAX_STEP:
        raise ValueError(f"{name} keys must be steps in [0, 2**53], got {value!r}")
    return int(value)


def choice(name: str, value: Any, options: tuple[str, ...]) -> str:
    """One of ``options`` (strings)."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a string, one of {', '.join(map(repr, options))}, got {value!r}")
    if value not in options:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, options))}, got {value!r}")
    return str(value)  # numpy.str_('l2') as 'l2': the repr evaluates back


def fraction(name: str, value: Any) -> float:
    """A number strictly between 0 and 1 (an EMA decay)."""
    result = real_number(name, value)
    if not 0 < result < 1:
        raise ValueError(f"{name} must be in (0, 1), got {value!r}")
    return result
