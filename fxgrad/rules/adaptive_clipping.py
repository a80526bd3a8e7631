"""Adaptive clipping with state on the device: AutoClip, ZClip and AdaGC.

AutoClip and ZClip clip the global gradient norm, AdaGC each parameter
tensor's norm; all cover every layer, norm layers included, as
``clip_by_global_norm`` does, with thresholds learned from past norms. The
thresholds are computed inside the compiled backward from device state, so
they change every step with no host sync and no recompile.

    >>> import fxgrad
    >>> fxgrad.autoclip(percentile=90, history=100, blend=0.1)
    autoclip(percentile=90.0, history=100, blend=0.1)
    >>> fxgrad.zclip()
    zclip(alpha=0.97, z_thresh=2.5, max_norm=1.0, warmup=25)
    >>> fxgrad.adagc()
    adagc(lambda_abs=1.0, lambda_rel=1.04, beta=0.99, warmup=100, eps=1e-06)
"""

from __future__ import annotations

from typing import ClassVar, Sequence

import torch

from fxgrad.core import validate
from fxgrad.core.layers import Layer
from fxgrad.core.rule import LayerGrads, Leaf, ScaleLeaf, rule
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

    Each step: the global norm ``n`` (before clipping) is pushed into a
    ring buffer of the last ``history`` norms; the threshold becomes
    ``tau <- (1 - blend) * tau + blend * percentile(buffer, percentile)``
    (``tau`` is the percentile itself on the first step); then the global norm
    is clipped to ``tau`` as ``clip_grad_norm_`` would. The percentile
    interpolates linearly, like ``numpy.percentile``'s default. A non-finite
    norm is not pushed (it still propagates to the gradients).

    The paper's algorithm takes the percentile of every norm seen so far, unsmoothed,
    at ``percentile=10``: ``blend`` and the ``history`` window are fxgrad's additions
    (a threshold that moves less per step, and state of a fixed size).
    ``autoclip(percentile=10, history=N, blend=1.0)`` with ``N`` at least the number
    of steps is the paper's (tested against it).

    Statistics: ``autoclip/threshold``, ``grad_norm/total``,
    ``grad_norm/total_clipped``, ``clip_coef``.

        >>> import fxgrad
        >>> fxgrad.autoclip(percentile=10, history=1000)
        autoclip(percentile=10.0, history=1000, blend=0.1)
    """

    name = "autoclip"
    clips = True
    reach = "group"
    per_layer = False
    folds = "global"

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
        history = validate.positive_int(
            "history", self.history, BUFFER_MAX, "a buffer on the device, sorted every step"
        )
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
        saved = ctx.save(state, history=history, count=count + finite.to(torch.float64), threshold=threshold)
        threshold = saved["threshold"]  # the kept one: on a step skip_nonfinite zeroed, the one before it
        coef = norm_math.clip_coefficient(total, threshold)
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
    clips = True
    reach = "group"
    per_layer = False
    folds = "global"
    EPS: ClassVar[float] = 1e-6

    alpha: float = 0.97
    z_thresh: float = 2.5
    max_norm: float | None = 1.0
    warmup: int = 25

    def __post_init__(self) -> None:
        alpha = validate.real_number("alpha", self.alpha)
        if not 0 < alpha < 1:
            raise ValueError(f"alpha must be in (0, 1), got {alpha!r}")
        self.set(
            alpha=alpha,
            z_thresh=validate.positive("z_thresh", self.z_thresh, allow_inf=False),
            max_norm=None if self.max_norm is None else validate.positive("max_norm", self.max_norm),
            warmup=validate.positive_int(
                "warmup", self.warmup, BUFFER_MAX, "its norms are kept in a buffer on the device"
            ),
        )

    def factors(self, stats: Sequence[NormStats], layers: Sequence[Layer], ctx: RouteContext) -> list[Factor]:
        total = norm_math.group_norm(stats, 2.0).to(torch.float64)
        state = ctx.state(
            shared={"warmup_norms": ((self.warmup,), 0.0), "count": ((), 0.0), "mean": ((), 0.0), "var": ((), 0.0)}
        )
        count, mean, var = state["count"], state["mean"], state["var"]
        finite = torch.isfinite(total)
        warming = count < self.warmup
        cap = float("inf") if self.max_norm is None else self.max_norm

        # Warm-up: collect norms, clip to max_norm; the last one initialises the EMA.
        slots = torch.arange(self.warmup, device=total.device)
        collected = torch.where((slots == count) & finite, total, state["warmup_norms"])
        first_mean = collected.mean()
        first_var = ((collected - first_mean) ** 2).mean()
        warm_coef = norm_math.clip_coefficient(total, torch.full_like(total, cap))

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
        saved = ctx.save(
            state, warmup_norms=collected, count=count + finite.to(torch.float64), mean=mean_out, var=var_out
        )
        coef = torch.where(warming, warm_coef, coef_after)
        ctx.emit("zclip/z", torch.where(warming, torch.zeros_like(z), z))
        ctx.emit("zclip/mean", saved["mean"])  # the kept EMAs: on a step skip_nonfinite zeroed, those before it
        ctx.emit("zclip/std", saved["var"].sqrt())
        _report(ctx, total, coef)
        return [coef] * len(stats)


@rule
class AdaGC(Leaf):
    """AdaGC (Wang et al. 2025, arXiv 2502.11034): clips each parameter tensor
    against an EMA of its own past clipped norms.

    Per parameter tensor ``i`` (each ``nn.Parameter`` with a gradient, norm
    layers included) AdaGC keeps ``gamma_i``; each step ``t = 1, 2, ...``:

    * Warm-up, ``t <= warmup``: every gradient is clipped together, as
      ``clip_grad_norm_(max_norm=lambda_abs)`` (scaled by
      ``lambda_abs / (G + eps)`` when that is below 1, ``G`` the global norm);
      then ``gamma_i`` becomes the tensor's norm after that clip on the first
      step, and the minimum of ``gamma_i`` and that norm after.
    * Then, with ``n_i`` the tensor's norm: when ``n_i > lambda_rel * gamma_i``
      its gradient is scaled by ``lambda_rel * gamma_i / (n_i + eps)`` and
      ``n_i`` is taken as ``lambda_rel * gamma_i``; then
      ``gamma_i <- beta * gamma_i + (1 - beta) * n_i``. A tensor first seen
      after warm-up starts from ``gamma_i = n_i``.

    This is the update of the authors' released code (github.com/lishuai-97/AdaGC,
    ``megatron/optimizer/clip_grads.py``, class ``AdaGC``), whose defaults
    these are (``--clip-ratio 1.04``, ``--clip-beta 0.99``, 100 warm-up steps,
    ``eps`` 1e-6, ``--clip-grad 1.0``); the paper's v1 gives ``lambda_rel=1.05``
    and ``beta=0.98``. AdaGC replaces the global clip: don't chain it with
    ``clip_by_global_norm``.

    **Zero gradients**: a tensor whose gradient is exactly zero on a warm-up
    step (or on the first step it is seen) gets ``gamma_i = 0``; every later
    gradient of it is then scaled to zero, for good. The official code does the
    same and fxgrad follows it. It happens to parameters of a branch gated or
    masked off on that step and, in ``scope="step"``, to an unused parameter
    whose ``.grad`` was zero-filled (``zero_grad(set_to_none=False)``). Look
    for zero ``gamma`` entries in ``backend.state_dict()`` after warm-up.

    A step where any tensor's norm is non-finite (an overflow step a GradScaler
    skips) leaves ``gamma`` and the step count alone; the non-finite values still
    propagate to the gradients. The official code has no such guard: it counts
    the step and may store a NaN, or a zero ``gamma`` for the finite tensors of
    an overflow step in warm-up. With a GradScaler, norms and thresholds are in
    unscaled units. State (``backend.state_dict()``): ``<i>.adagc/step`` and
    ``<i>.adagc/gamma/<parameter>``, where ``-1`` means not seen yet.
    Statistics: ``grad_norm/total`` and ``grad_norm/total_clipped`` (the
    global norm before and after), ``adagc/clipped`` (how many tensors were
    scaled down: all of them on a warm-up step whose global clip engaged).

        >>> import fxgrad
        >>> fxgrad.adagc(lambda_rel=1.05, beta=0.98, warmup=50)
        adagc(lambda_abs=1.0, lambda_rel=1.05, beta=0.98, warmup=50, eps=1e-06)
    """

    name = "adagc"
    clips = True
    keeps_signs = True  # positive factors
    reach = "group"  # the warm-up clips the global norm
    local_shards = True
    per_layer = False

    lambda_abs: float = 1.0
    lambda_rel: float = 1.04
    beta: float = 0.99
    warmup: int = 100
    eps: float = 1e-6

    def __post_init__(self) -> None:
        beta = validate.real_number("beta", self.beta)
        if not 0 <= beta < 1:
            raise ValueError(f"beta must be in [0, 1), got {self.beta!r}")
        self.set(
            lambda_abs=validate.positive("lambda_abs", self.lambda_abs),
            lambda_rel=validate.positive("lambda_rel", self.lambda_rel, allow_inf=False),
            beta=beta,
            warmup=validate.positive_int("warmup", self.warmup, minimum=0),
            eps=validate.positive("eps", self.eps, allow_inf=False),
        )

    def apply(self, grads: LayerGrads, layers: Sequence[Layer], ctx: RouteContext) -> LayerGrads:
        flat_grads = [g for group in grads for g in group]
        # one norm per tensor, unscaled, as a float64 vector
        inverse = None if ctx.scale is None else 1.0 / ctx.scale
        sums = torch.stack(norm_math.over_shards([norm_math.power_sum([g], 2.0, inverse) for g in flat_grads]))
        norms = sums.to(torch.float64).sqrt()
        state = ctx.state(shared={"step": ((), 0.0)}, per_param={"gamma": -1.0})
        step, gamma = state["step"], state["gamma"]
        unset = gamma < 0

        # Warm-up: a global clip to lambda_abs; gamma_i <- min of the clipped norms.
        total = norms.square().sum().sqrt()
        global_coef = torch.clamp_max(self.lambda_abs / (total + self.eps), 1.0)  # clip_grad_norm_'s
        clipped_norms = norms * global_coef
        warm_gamma = torch.where(unset, clipped_norms, torch.minimum(gamma, clipped_norms))

        # After: each tensor against lambda_rel times its EMA; the EMA takes the clipped norm.
        previous = torch.where(unset, norms, gamma)
        threshold = self.lambda_rel * previous
        spike = norms > threshold
        coef_after = torch.where(spike, threshold / (norms + self.eps), torch.ones_like(norms))
        ema = self.beta * previous + (1 - self.beta) * torch.where(spike, threshold, norms)

        warming = step < self.warmup
        coef = torch.where(warming, global_coef.expand_as(norms), coef_after)
        ctx.save(state, finite=norms, step=step + 1, gamma=torch.where(warming, warm_gamma, ema))
        ctx.emit("grad_norm/total", total)
        ctx.emit("grad_norm/total_clipped", (norms * coef).square().sum().sqrt())
        ctx.emit("adagc/clipped", (coef < 1).sum().to(torch.float64))
        factors = iter(coef.unbind())
        return [[norm_math.scaled([g], next(factors))[0] for g in group] for group in grads]
