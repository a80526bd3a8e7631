"""Norm and scaling helpers over lists of gradients, as plain torch code.

These are what the leaf transforms trace into the backward graph. Norms
accumulate in float32 (or wider, for float64 gradients) whatever the gradient
dtype; scaled gradients go back to their own dtype.

    >>> import torch
    >>> total_norm([torch.ones(4), torch.ones(5)], 2.0)
    tensor(3.)
"""

from __future__ import annotations

import math
from typing import Sequence

import torch


def accumulation_dtype(tensor: torch.Tensor) -> torch.dtype:
    return torch.promote_types(tensor.dtype, torch.float32)


def total_norm(tensors: Sequence[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The ``norm_type``-norm of all elements of ``tensors`` together (a 0-dim tensor).

    Equals ``torch.linalg.vector_norm(torch.stack([vector_norm(t, p) for t in tensors]), p)``,
    the quantity ``clip_grad_norm_`` computes.
    """
    wide = [t.to(accumulation_dtype(t)) for t in tensors]
    if math.isinf(norm_type):
        return _combine([t.abs().amax() for t in wide], torch.maximum)
    if norm_type == 2.0:
        return _combine([(t * t).sum() for t in wide], torch.add).sqrt()
    powered = _combine([t.abs().pow(norm_type).sum() for t in wide], torch.add)
    return powered.pow(1.0 / norm_type)


def _combine(values: list[torch.Tensor], op) -> torch.Tensor:
    result = values[0]
    for value in values[1:]:
        result = op(result, value)
    return result


def scaled(tensors: Sequence[torch.Tensor], factor: torch.Tensor) -> list[torch.Tensor]:
    """``t * factor`` for each tensor, computed in float32 and cast back."""
    return [(t.to(accumulation_dtype(t)) * factor).to(t.dtype) for t in tensors]


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``min(1, max_norm / (norm + 1e-6))``, as ``clip_grad_norm_`` computes it."""
    return (max_norm / (norm + 1e-6)).clamp(max=1.0)
