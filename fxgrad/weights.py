"""Transforms that read the weights: AGC, trust ratio, norm drift, norm balancing.

Parameters are not inputs of the backward graph. These transforms read what
they need (norms, row norms, or values) through a custom op that runs on the
device inside the compiled backward; the optimizer has not stepped yet, so
the weights are the ones the gradients belong to.

    >>> import fxgrad
    >>> fxgrad.adaptive_grad_clip(0.01)
    adaptive_grad_clip(clipping=0.01, eps=0.001)
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from fxgrad import _validate
from fxgrad.base import LayerGrads, Leaf, ScaleLeaf
from fxgrad.context import RouteContext
from fxgrad.layers import Layer
from fxgrad.norms import Factor, NormStats, cast, group_norm, l2, widen
from fxgrad.state import flat


@dataclasses.dataclass(frozen=True)
class AdaptiveGradClip(Leaf):
    """See :func:`adaptive_grad_clip`."""

    clipping: float = 0.01
    eps: float = 1e-3

    scope = "element"  # unit-wise: each output row on its own
    name = "adaptive_grad_clip"

    def __repr__(self) -> str:
        return f"adaptive_grad_clip(clipping={self.clipping!r}, eps={self.eps!r})"

    def apply(self, grads: LayerGrads, layers: Sequence[Layer], ctx: RouteContext) -> LayerGrads:
        weight_norms = ctx.weight_row_norms()
        inverse = None if ctx.scale is None else 1.0 / ctx.scale
        out = []
        for group, layer_norms in zip(grads, weight_norms):
            out.append([self._one(g, w, inverse) for g, w in zip(group, layer_norms)])
        return out

    def _one(self, grad: torch.Tensor, weight_norm: torch.Tensor, inverse: torch.Tensor | None) -> torch.Tensor:
        g = widen(grad)
        if g.dim() <= 1:
            norm = l2(g)
        else:
            norm = l2(g, dim=tuple(range(1, g.dim())), keepdim=True)
        if inverse is not None:
            norm = norm * inverse.to(norm.dtype)
        bound = weight_norm.to(norm.dtype).clamp_min(self.eps) * self.clipping
        clipped = g * (bound / norm.clamp_min(1e-6))
        return cast(torch.where(norm < bound, g, clipped), grad.dtype)


def adaptive_grad_clip(clipping: float = 0.01, eps: float = 1e-3) -> AdaptiveGradClip:
    """Unit-wise adaptive gradient clipping (AGC, Brock et al. 2021), as in timm.

    The unit is an output row: norms reduce over dims 1.. for parameters with
    2 or more dimensions, over the whole tensor otherwise. With
    ``bound = clipping * max(||W_unit||, eps)`` and ``||G_unit||`` floored at
    1e-6, each unit becomes ``G`` if ``||G|| < bound`` else ``G * bound / ||G||``.
    Skipped (norm) layers are untouched; add e.g. ``"lm_head"`` to ``skip`` to
    exclude a classifier, as the paper does.

        >>> adaptive_grad_clip(clipping=0.02, eps=1e-3)
        adaptive_grad_clip(clipping=0.02, eps=0.001)
    """
    return AdaptiveGradClip(_validate.positive("clipping", clipping, allow_inf=False),
                            _validate.positive("eps", eps, allow_inf=False))


@dataclasses.dataclass(frozen=True)
class TrustRatio(ScaleLeaf):
    """See :func:`scale_by_trust_ratio`."""

    trust_coefficient: float = 1.0
    eps: float = 0.0
    min_norm: float = 0.0

    name = "scale_by_trust_ratio"

    def __repr__(self) -> str:
        return (f"scale_by_trust_ratio(trust_coefficient={self.trust_coefficient!r}, eps={self.eps!r}, "
                f"min_norm={self.min_norm!r})")

    def factors(self, stats: Sequence[NormStats], layers: Sequence[Layer], ctx: RouteContext) -> list[Factor]:
        weight = ctx.weight_norms().clamp_min(self.min_norm)
        grad = flat(s.norm(2.0) for s in stats).clamp_min(self.min_norm)
        ratio = self.trust_coefficient * weight / (grad + self.eps)
        safe = torch.where((weight == 0) | (grad == 0), torch.ones_like(ratio), ratio)
        ctx.emit_per_layer("trust_ratio", safe)
        return list(safe.unbind())


def scale_by_trust_ratio(trust_coefficient: float = 1.0, eps: float = 0.0, min_norm: float = 0.0) -> TrustRatio:
    """The LAMB/LARS trust ratio per layer: ``g <- g * c * ||w|| / (||g|| + eps)``.

    Both norms are floored at ``min_norm``; the ratio is 1 when either is 0
    (as optax's ``scale_by_trust_ratio``, applied per layer rather than per
    tensor). ``trust_ratio/<layer>`` is in ``backend.stats()``.

        >>> scale_by_trust_ratio(0.001)
        scale_by_trust_ratio(trust_coefficient=0.001, eps=0.0, min_norm=0.0)
    """
    return TrustRatio(_validate.positive("trust_coefficient", trust_coefficient, allow_inf=False),
                      _validate.non_negative("eps", eps), _validate.non_negative("min_norm", min_norm))


@dataclasses.dataclass(frozen=True)
class WeightNormDrift(ScaleLeaf):
    """See :func:`weight_norm_drift`."""

    every: int = 10
    min_denominator: float = 0.1

    name = "weight_norm_drift"

    def __repr__(self) -> str:
        return f"weight_norm_drift(every={self.every!r}, min_denominator={self.min_denominator!r})"

    def factors(self, stats: Sequence[NormStats], layers: Sequence[Layer], ctx: RouteContext) -> list[Factor]:
        weight = ctx.weight_norms()
        state = ctx.state(per_layer={"initial": 0.0, "factor": 1.0, "steps": 0.0})
        steps = state["steps"]
        initial = torch.where(steps == 0, weight, state["initial"])
        ratio = weight / initial
        fresh = 1.0 / (1.0 + ratio.log()).clamp_min(self.min_denominator)
        fresh = torch.where(initial > 0, fresh, torch.ones_like(fresh))  # ||W_0|| = 0: no reference
        factor = torch.where(torch.remainder(steps, self.every) == 0, fresh, state["factor"])
        # an overflow step (GradScaler) is skipped: it does not count towards `every`
        ctx.save(state, finite=group_norm(stats, 2.0), initial=initial, factor=factor, steps=steps + 1)
        ctx.emit_per_layer("drift_factor", factor)
        return list(factor.unbind())


def weight_norm_drift(every: int = 10, min_denominator: float = 0.1) -> WeightNormDrift:
    """Per layer: ``g <- g / (1 + log(||W_t|| / ||W_0||))``, refreshed every ``every`` steps.

    ``W_0`` is captured at the layer's first step; the factor is recomputed on
    steps 0, every, 2*every, ... and held in between (on the device). A layer
    whose weights grew gets a smaller step, one that shrank a larger one.

    Guard: ``1 + log r`` reaches 0 at ``r = 1/e`` and is negative below, where
    the formula would blow up or flip the gradient. The denominator is clamped
    at ``min_denominator`` (0.1 by default), so the factor never exceeds 10 and
    never flips sign; that clamp starts at ``r = exp(min_denominator - 1)``
    (0.41). A layer with ``||W_0|| = 0`` keeps factor 1.

        >>> weight_norm_drift(every=100)
        weight_norm_drift(every=100, min_denominator=0.1)
    """
    return WeightNormDrift(_validate.positive_int("every", every),
                           _validate.positive("min_denominator", min_denominator, allow_inf=False))


@dataclasses.dataclass(frozen=True)
class BalanceNorms(Leaf):
    """See :func:`balance_norms`."""

    k: int = 5
    lam: float = 0.01
    every: int = 100
    entropy_drop: float = 0.05

    scope = "group"
    name = "balance_norms"

    def __repr__(self) -> str:
        return (f"balance_norms(k={self.k!r}, lam={self.lam!r}, every={self.every!r}, "
                f"entropy_drop={self.entropy_drop!r})")

    def apply(self, grads: LayerGrads, layers: Sequence[Layer], ctx: RouteContext) -> LayerGrads:
        norms = ctx.weight_norms()
        state = ctx.state(shared={"entropy": ((), 0.0), "steps": ((), 0.0)})
        steps = state["steps"]
        share = norms / norms.sum()
        entropy = -torch.where(share > 0, share * share.clamp_min(1e-30).log(), torch.zeros_like(share)).sum()
        check = torch.remainder(steps, self.every) == 0
        act = check & (steps > 0) & (state["entropy"] - entropy > self.entropy_drop)
        k = min(self.k, len(layers) // 2)
        coef = torch.zeros_like(norms)
        if k > 0:
            top = torch.topk(norms, k).indices
            bottom = torch.topk(-norms, k).indices
            delta = (norms[top].sum() - norms[bottom].sum()) / (2 * k)
            push = 2 * self.lam * delta  # d/dW of lam * delta * ||W||^2
            coef = coef.index_put((top,), push.expand(k)).index_put((bottom,), (-push).expand(k))
            coef = torch.where(act, coef, torch.zeros_like(coef))
        ctx.save(state, entropy=torch.where(check, entropy, state["entropy"]), steps=steps + 1)
        ctx.emit("balance/entropy", entropy)
        ctx.emit("balance/applied", act.to(torch.float64))
        if ctx.scale is not None:  # the gradients in the graph are scaled
            coef = coef * ctx.scale
        weights = ctx.weights()
        out = []
        for i, (group, values) in enumerate(zip(grads, weights)):
            c = coef[i].to(torch.float32)
            out.append([cast(widen(g) + c * w, g.dtype) for g, w in zip(group, values)])
        return out


def balance_norms(k: int = 5, lam: float = 0.01, every: int = 100, entropy_drop: float = 0.05) -> BalanceNorms:
    """Cross-layer weight-norm balancing, decided on the device.

    Every ``every`` steps (0, every, ...): with ``p_l = ||W_l|| / sum ||W||``
    over the layers it is routed to, compute ``H = -sum p_l log p_l``. When
    ``H`` dropped by more than ``entropy_drop`` (nats) since the last check,
    take the ``k`` layers with the largest weight norm and the ``k`` with the
    smallest (``k`` is capped at half the layers), let
    ``Delta = (sum_top ||W|| - sum_bottom ||W||) / 2k``, and add
    ``2 lam Delta W`` (the gradient of ``lam Delta ||W||^2``) to each top layer's
    gradient and subtract it from each bottom layer's. Other steps add nothing.

    It reads every routed weight each step (a copy of their values), so it
    costs one extra pass over those parameters. Statistics:
    ``balance/entropy``, ``balance/applied``.

        >>> balance_norms(k=3)
        balance_norms(k=3, lam=0.01, every=100, entropy_drop=0.05)
    """
    return BalanceNorms(_validate.positive_int("k", k), _validate.positive("lam", lam, allow_inf=False),
                        _validate.positive_int("every", every),
                        _validate.non_negative("entropy_drop", entropy_drop))
