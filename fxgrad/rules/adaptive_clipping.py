"""Adaptive clipping with state on the device: AutoClip and ZClip.

Both clip the global gradient norm (all layers, norm layers included, as
``clip_by_global_norm``) to a threshold learned from past norms. The
threshold is computed inside the compiled backward from device state, so it
changes every step with no host sync and no recompile.

    >>> import fxgrad
    >>> fxgrad.autoclip(percentile=90, history=100, blend=0.1)
    autoclip(percentile=90.0, history=100, blend=0.1)
    >>> fxgrad.zclip()
    zclip(alpha=0.97, z_thresh=2.5, max_norm=1.0, warmup=25)
"""

from __future__ import annotations

from typing import ClassVar, Sequence

import torch

from fxgrad.core import validate
from fxgrad.core.layers import Layer
from fxgrad.core.rule import ScaleLeaf, rule
from fxgrad.runtime import norm_math
from fxgrad.runtime.context import RouteContext
from fxgrad.runtime.norm_math import Factor, NormStats

BUFFER_MAX = 10**6  # entries of a history kept on the device


def _report(ctx: RouteContext, total: torch.Tensor, coef: torch.Tensor) -> None:
    ctx.emit("grad_norm/total", total)
    ctx.emit("grad_norm/total_clipped", total * coef)
    ctx.emit("clip_coef", coef)


@rule
class AutoClip(ScaleLeaf):
    """Adaptive percentile clipping (AutoClip, Seetharaman et al. 2020), on the device.

    Each backward: the global norm ``n`` (before clipping) is pushed into a
    ring buffer of the last ``history`` norms; the threshold becomes
    ``tau <- (1 - blend) * tau + blend * percentile(buffer, percentile)``
    (``tau`` is the percentile itself on the first step); then the global norm
    is clipped to ``tau`` as ``clip_grad_norm_`` would. The percentile
    interpolates linearly, like ``numpy.percentile``'s default. A non-finite
    norm is not pushed (it still propagates to the gradients).

    Statistics: ``autoclip/threshold``, ``grad_norm/total``,
    ``grad_norm/total_clipped``, ``clip_coef``.

        >>> import fxgrad
        >>> fxgrad.autoclip(percentile=10, history=1000)
        autoclip(percentile=10.0, history=1000, blend=0.1)
    """

    name = "autoclip"
    reach = "group"
    per_layer = False

    percentile: float = 90.0
    history: int = 100
    blend: float = 0.1

    def __post_init__(self) -> None:
        percentile = validate.real_number("percentile", self.percentile)
        if not 0 <= percentile <= 100:
            raise ValueError(f"percentile must be in [0, 100], got {percentile!r}")
        blend = validate.real_number("blend", self.blend)
        if not 0 < blend <= 1:
            raise ValueError(f"blend must be in (0, 1], got {blend!r}")
        history = validate.positive_int("history", self.history, BUFFER_MAX, "a buffer on the device, sorted every step")
        self.set(percentile=percentile, history=history, blend=blend)

    def factors(self, stats: Sequence[NormStats], layers: Sequence[Layer], ctx: RouteContext) -> list[Factor]:
        total = norm_math.group_norm(stats, 2.0).to(torch.float64)
        size = self.history
        state = ctx.state(shared={"history": ((size,), 0.0), "count": ((), 0.0), "threshold": ((), 0.0)})
        count, history = state["count"], state["history"]
        finite = torch.isfinite(total)
        slots = torch.arange(size, device=total.device)
        write = (slots == torch.remainder(count, size)) & finite
        history = torch.where(write, total, history)
        seen = torch.clamp_max(count + finite.to(torch.float64), float(size))
        ranked = torch.sort(torch.where(slots < seen, history, float("inf"))).values
        # numpy's default ("linear") percentile over the `seen` values
        position = (seen - 1).clamp_min(0) * (self.percentile / 100.0)
        low = position.floor()
        high = torch.minimum(low + 1, (seen - 1).clamp_min(0))
        low_value = ranked.gather(0, low.long().reshape(1))[0]
        high_value = ranked.gather(0, high.long().reshape(1))[0]
        value = low_value + (high_value - low_value) * (position - low)
        blended = torch.where(count == 0, value, (1 - self.blend) * state["threshold"] + self.blend * value)
        threshold = torch.where(finite, blended, state["threshold"])
        ctx.save(state, history=history, count=count + finite.to(torch.float64), threshold=threshold)
        coef = norm_math.clip_coefficient_tensor(total, threshold)
        ctx.emit("autoclip/threshold", threshold)
        _report(ctx, total, coef)
        return [coef] * len(stats)


@rule
class ZClip(ScaleLeaf):
    """ZClip (Kumar et al. 2025): z-score clipping against an EMA of the global norm.

    * Warm-up (the first ``warmup`` steps): norms are collected and the global
      norm is clipped to ``max_norm``. The last warm-up step sets the EMA mean
      and variance to the collected norms' mean and (population) variance.
    * Then, with ``z = (n - mu) / (sigma + 1e-6)``: when ``z > z_thresh`` the
      threshold is ``mu + z_thresh * sigma / (z / z_thresh)``, else ``n``; the
      gradient is clipped to ``min(threshold, max_norm)`` (scaled by
      ``threshold / (n + 1e-6)`` only when ``n`` exceeds it).
    * The EMA (``mu <- alpha mu + (1 - alpha) x``, then
      ``sigma^2 <- alpha sigma^2 + (1 - alpha)(x - mu)^2``) is updated with
      ``x``, the threshold on a spike and ``n`` otherwise.

    ``max_norm=None`` disables the cap. A non-finite norm leaves the state
    alone (it still propagates to the gradients). Statistics: ``zclip/z``,
    ``zclip/mean``, ``zclip/std``, ``grad_norm/total``,
    ``grad_norm/total_clipped``, ``clip_coef``.

        >>> import fxgrad
        >>> fxgrad.zclip(z_thresh=3.0, max_norm=None)
        zclip(alpha=0.97, z_thresh=3.0, max_norm=None, warmup=25)
    """

    name = "zclip"
    reach = "group"
    per_layer = False
    EPS: ClassVar[float] = 1e-6

    alpha: float = 0.97
    z_thresh: float = 2.5
    max_norm: float | None = 1.0
    warmup: int = 25

    def __post_init__(self) -> None:
        alpha = validate.real_number("alpha", self.alpha)
        if not 0 < alpha < 1:
            raise ValueError(f"alpha must be in (0, 1), got {alpha!r}")
        self.set(alpha=alpha, z_thresh=validate.positive("z_thresh", self.z_thresh, allow_inf=False),
                 max_norm=None if self.max_norm is None else validate.positive("max_norm", self.max_norm),
                 warmup=validate.positive_int("warmup", self.warmup, BUFFER_MAX,
                                              "its norms are kept in a buffer on the device"))

    def factors(self, stats: Sequence[NormStats], layers: Sequence[Layer], ctx: RouteContext) -> list[Factor]:
        total = norm_math.group_norm(stats, 2.0).to(torch.float64)
        state = ctx.state(shared={"warmup_norms": ((self.warmup,), 0.0), "count": ((), 0.0),
                                  "mean": ((), 0.0), "var": ((), 0.0)})
        count, mean, var = state["count"], state["mean"], state["var"]
        finite = torch.isfinite(total)
        warming = count < self.warmup
        cap = float("inf") if self.max_norm is None else self.max_norm

        # Warm-up: collect norms, clip to max_norm; the last one initialises the EMA.
        slots = torch.arange(self.warmup, device=total.device)
        collected = torch.where((slots == count) & finite, total, state["warmup_norms"])
        first_mean = collected.mean()
        first_var = ((collected - first_mean) ** 2).mean()
        warm_coef = norm_math.clip_coefficient_tensor(total, torch.full_like(total, cap))

        # After warm-up: z-score against the EMA; outliers get the reciprocal threshold.
        std = var.sqrt()
        z = (total - mean) / (std + self.EPS)
        spike = z > self.z_thresh
        adaptive = mean + (self.z_thresh * std) / (z / self.z_thresh)
        effective = torch.clamp_max(torch.where(spike, adaptive, total), cap)
        coef_after = torch.where(total > effective, effective / (total + 1e-6), torch.ones_like(total))
        observed = torch.where(spike, adaptive, total)
        new_mean = self.alpha * mean + (1 - self.alpha) * observed
        new_var = self.alpha * var + (1 - self.alpha) * (observed - new_mean) ** 2

        initialise = warming & (count == self.warmup - 1)
        update = finite  # a non-finite norm propagates to the gradients but not into the state
        mean_out = torch.where(update, torch.where(warming, torch.where(initialise, first_mean, mean), new_mean), mean)
        var_out = torch.where(update, torch.where(warming, torch.where(initialise, first_var, var), new_var), var)
        ctx.save(state, warmup_norms=collected, count=count + finite.to(torch.float64),
                 mean=mean_out, var=var_out)
        coef = torch.where(warming, warm_coef, coef_after)
        ctx.emit("zclip/z", torch.where(warming, torch.zeros_like(z), z))
        ctx.emit("zclip/mean", mean_out)
        ctx.emit("zclip/std", var_out.sqrt())
        _report(ctx, total, coef)
        return [coef] * len(stats)
