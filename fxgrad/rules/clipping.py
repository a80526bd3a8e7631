"""Clipping to fixed or weight-relative thresholds: global, per layer, by value, AGC.

    >>> import fxgrad
    >>> fxgrad.chain(fxgrad.clip_by_value(5.0), fxgrad.clip_by_global_norm(1.0))
    chain(clip_by_value(clip_value=5.0), clip_by_global_norm(max_norm=1.0))

Thresholds learned from past norms (AutoClip, ZClip, AdaGC) are in
:mod:`fxgrad.rules.adaptive_clipping`.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from fxgrad.core import validate
from fxgrad.core.layers import Layer
from fxgrad.core.rule import LayerGrads, Leaf, ScaleLeaf, field, rule
from fxgrad.runtime import norm_math
from fxgrad.runtime.context import RouteContext
from fxgrad.runtime.norm_math import Factor, NormStats, cast, l2, like, widen


@dataclasses.dataclass(frozen=True, repr=False)
class _NormClip(ScaleLeaf):
    """What the global and the per-layer norm clip share: a threshold and a p-norm."""

    backs_off = True
    clips = True

    max_norm: float
    norm_type: float = field(2.0, shown=lambda rule: rule.norm_type != 2.0)

    def __post_init__(self) -> None:
        self.set(max_norm=validate.positive("max_norm", self.max_norm), norm_type=validate.norm_type(self.norm_type))

    @property
    def norm_orders(self) -> tuple[float, ...]:
        return (self.norm_type,)


@rule
class ClipByGlobalNorm(_NormClip):
    """Clip the norm of all gradients together, like ``clip_grad_norm_``.

    Eager reference::

        torch.nn.utils.clip_grad_norm_(every parameter with a gradient, max_norm, norm_type)

    i.e. every gradient is multiplied by ``min(1, max_norm / (total + 1e-6))``
    where ``total`` is the norm over all of them. It covers every layer,
    skipped (norm) layers included, as torch does. ``norm_type=float("inf")``
    uses the largest absolute value.

        >>> import fxgrad
        >>> fxgrad.clip_by_global_norm(1.0)
        clip_by_global_norm(max_norm=1.0)
    """

    name = "clip_by_global_norm"
    reach = "group"
    per_layer = False
    folds = "global"

    def factors(self, stats: Sequence[NormStats], layers: Sequence[Layer], ctx: RouteContext) -> list[Factor]:
        total = norm_math.group_norm(stats, self.norm_type)
        coef = norm_math.clip_coefficient(total, ctx.threshold(self.max_norm))
        ctx.emit("grad_norm/total", total)
        ctx.emit("grad_norm/total_clipped", total * coef)
        ctx.emit("clip_coef", coef)
        return [coef] * len(stats)


@rule
class ClipByNorm(_NormClip):
    """Clip each layer's gradient norm to ``max_norm`` on its own.

    Eager reference: ``clip_grad_norm_(layer.parameters(recurse=False), max_norm,
    norm_type)`` for each layer not in the skip list.

        >>> import fxgrad
        >>> fxgrad.clip_by_norm(0.5, norm_type=float("inf"))
        clip_by_norm(max_norm=0.5, norm_type=float('inf'))
    """

    name = "clip_by_norm"

    def factors(self, stats: Sequence[NormStats], layers: Sequence[Layer], ctx: RouteContext) -> list[Factor]:
        max_norm = ctx.threshold(self.max_norm)
        return [ctx.per_tensor(norm_math.clip_coefficient, s.norm(self.norm_type), max_norm) for s in stats]


@rule
class ClipByValue(Leaf):
    """Clamp every gradient element to ``[-clip_value, clip_value]``.

    Eager reference: ``clip_grad_value_(layer.parameters(recurse=False), clip_value)``
    for each layer not in the skip list.

        >>> import fxgrad
        >>> fxgrad.clip_by_value(0.1)
        clip_by_value(clip_value=0.1)
    """

    name = "clip_by_value"
    clips = True
    keeps_signs = True  # clamps each element
    reach = "element"
    local_shards = True
    backs_off = True

    clip_value: float

    def __post_init__(self) -> None:
        self.set(clip_value=validate.positive("clip_value", self.clip_value))

    def apply(self, grads: LayerGrads, layers: Sequence[Layer], ctx: RouteContext) -> LayerGrads:
        v = ctx.threshold(self.clip_value)
        if ctx.scale is None and not isinstance(v, torch.Tensor):
            return [[g.clamp(-v, v) for g in group] for group in grads]
        bound = v if ctx.scale is None else ctx.scale * v  # float64; the gradients in the graph are scaled
        dtypes = {norm_math.accumulation_dtype(g) for group in grads for g in group}
        bounds = {dtype: norm_math.cast(bound, dtype) for dtype in dtypes}  # float64 for float64 gradients
        return [[_clamp(g, bounds[norm_math.accumulation_dtype(g)]) for g in group] for group in grads]


def _clamp(grad: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    wide = norm_math.widen(grad)
    return norm_math.cast(torch.minimum(torch.maximum(wide, -bound), bound), grad.dtype)


@rule
class AdaptiveGradClip(Leaf):
    """Unit-wise adaptive gradient clipping (AGC, Brock et al. 2021), as in timm.

    The unit is an output row: norms reduce over dims 1.. for parameters with
    2 or more dimensions, over the whole tensor otherwise. With
    ``bound = clipping * max(||W_unit||, eps)`` and ``||G_unit||`` floored at
    1e-6, each unit becomes ``G`` if ``||G|| < bound`` else ``G * bound / ||G||``.
    Skipped (norm) layers are untouched; add e.g. ``"lm_head"`` to ``skip`` to
    exclude a classifier, as the paper does. The weights are read on the
    device, inside the backward, before the optimizer steps.

        >>> import fxgrad
        >>> fxgrad.adaptive_grad_clip(clipping=0.02, eps=1e-3)
        adaptive_grad_clip(clipping=0.02, eps=0.001)
    """

    name = "adaptive_grad_clip"
    clips = True
    keeps_signs = True  # positive factors
    reach = "element"  # unit-wise: each output row on its own
    backs_off = True

    clipping: float = 0.01
    eps: float = 1e-3

    def __post_init__(self) -> None:
        self.set(
            clipping=validate.positive("clipping", self.clipping, allow_inf=False),
            eps=validate.positive("eps", self.eps, allow_inf=False),
        )

    def apply(self, grads: LayerGrads, layers: Sequence[Layer], ctx: RouteContext) -> LayerGrads:
        weight_norms = ctx.weight_row_norms()
        inverse = None if ctx.scale is None else 1.0 / ctx.scale
        clipping = ctx.threshold(self.clipping)
        out = []
        for group, layer_norms in zip(grads, weight_norms):
            out.append([ctx.per_tensor(self._one, g, w, inverse, clipping) for g, w in zip(group, layer_norms)])
        return out

    def _one(
        self,
        grad: torch.Tensor,
        weight_norm: torch.Tensor,
        inverse: torch.Tensor | None,
        clipping: float | torch.Tensor,
    ) -> torch.Tensor:
        g = widen(grad)
        unscaled = g if inverse is None else g * inverse.to(g.dtype)  # a norm of scaled rows can overflow
        if g.dim() <= 1:
            norm = l2(unscaled)
        else:
            norm = l2(unscaled, dim=tuple(range(1, g.dim())), keepdim=True)
        bound = like(g, weight_norm.to(norm.dtype).clamp_min(self.eps) * clipping)
        clipped = g * (bound / norm.clamp_min(1e-6))
        return cast(torch.where(norm < bound, g, clipped), grad.dtype)
