"""Argument checks shared by the transform factories.

Every check raises ``TypeError`` or ``ValueError`` whose message starts with
the argument's name, at construction time.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch
from torch import nn

# The factories' finite numbers scale or divide float32 on the device, where they must stay
# finite and nonzero: normalize(scale=1e308) was inf there, normalize(eps=1e-50) was 0.
FLOAT32 = torch.finfo(torch.float32)


def module(name: str, value: Any, hint: str = "") -> nn.Module:
    """``value`` if it is an ``nn.Module``; ``TypeError`` otherwise (``hint``: what to pass instead)."""
    if not isinstance(value, nn.Module):
        raise TypeError(f"{name} must be an nn.Module, got {type(value).__name__}{hint}")
    return value


def optimizer(name: str, value: Any) -> torch.optim.Optimizer:
    """``value`` if it is a ``torch.optim.Optimizer``; ``TypeError`` otherwise."""
    if not isinstance(value, torch.optim.Optimizer):
        raise TypeError(f"{name} must be a torch.optim.Optimizer, got {type(value).__name__}")
    return value


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
    """A normal float32 number > 0, or ``inf`` unless ``allow_inf=False``: 1e-300 was 0 on the
    device (a threshold that clipped every gradient to 0), 1e39 overflowed at the first step."""
    result = real_number(name, value)
    if allow_inf and result == math.inf:
        return result
    if not FLOAT32.tiny <= result <= FLOAT32.max:
        raise ValueError(
            f"{name} must be {'inf or ' if allow_inf else ''}a positive finite number float32 holds, from "
            f"{FLOAT32.tiny:.4g} to {FLOAT32.max:.4g}, got {value!r}"
        )
    return result


def non_negative(name: str, value: Any) -> float:
    """A finite number >= 0, at most float32's largest."""
    result = real_number(name, value)
    if not 0 <= result <= FLOAT32.max:
        raise ValueError(f"{name} must be a finite number >= 0, at most {FLOAT32.max:.4g} (float32's), got {value!r}")
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
