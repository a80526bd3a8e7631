"""Gradient normalization: per-layer norms, multi-normalization, SinkGD's Sinkhorn.

    >>> import fxgrad
    >>> fxgrad.normalize("rms")
    normalize(norm='rms', scale=1.0, eps=1e-08)
    >>> fxgrad.sinkhorn(iters=5)
    sinkhorn(iters=5)

With a GradScaler the gradients in the graph are scaled; every transform here
computes on unscaled norms and returns values that ``unscale_`` maps to the
documented result.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Mapping, Sequence

import torch

from fxgrad.core import validate
from fxgrad.core.layers import Layer
from fxgrad.core.rule import LayerGrads, Leaf, ScaleLeaf, field, rule
from fxgrad.runtime.context import RouteContext
from fxgrad.runtime.norm_math import Factor, NormStats, cast, l2, widen
from fxgrad.runtime.state import flat

NORMS = ("l2", "linf", "rms")


def layer_norm_of(stats: NormStats, layer: Layer, norm: str) -> torch.Tensor:
    """A layer's gradient norm by name: ``l2``, ``linf`` or ``rms`` (= l2 / sqrt(numel))."""
    if norm == "linf":
        return stats.norm(math.inf)
    value = stats.norm(2.0)
    return value / math.sqrt(layer.numel) if norm == "rms" else value


def _orders(norms: Sequence[str]) -> tuple[float, ...]:
    return tuple(sorted({math.inf if n == "linf" else 2.0 for n in norms}))


@rule
class Normalize(ScaleLeaf):
    """Per layer: ``g <- scale * g / (||g|| + eps)``.

    ``norm`` is ``"l2"``, ``"linf"`` (max-abs) or ``"rms"`` (``||g||_2 / sqrt(numel)``),
    over all the layer's gradients together.

        >>> import fxgrad
        >>> fxgrad.normalize("linf", scale=0.1)
        normalize(norm='linf', scale=0.1, eps=1e-08)
    """

    name = "normalize"

    norm: str = "l2"
    scale: float = 1.0
    eps: float = 1e-8

    def __post_init__(self) -> None:
        self.set(
            norm=validate.choice("norm", self.norm, NORMS),
            scale=validate.positive("scale", self.scale, allow_inf=False),
            eps=validate.positive("eps", self.eps, allow_inf=False),
        )

    @property
    def norm_orders(self) -> tuple[float, ...]:
        return _orders((self.norm,))

    def factors(self, stats: Sequence[NormStats], layers: Sequence[Layer], ctx: RouteContext) -> list[Factor]:
        return [self.scale / (layer_norm_of(s, layer, self.norm) + self.eps) for s, layer in zip(stats, layers)]


# ---------------------------------------------------------------- multi_normalize

RANK = {"l2": 0, "rms": 0, "mix": 1, "linf": 2}
"""Strategies from dense to peaked gradients."""


Pieces = tuple[tuple[int, Any], ...]  # ((start_step, value), ...) from step 0, sorted


@rule
class MultiNormalize(ScaleLeaf):
    """Per layer, normalize by a norm chosen from the layer's own gradient shape.

    Selection rule, per layer and step:

    1. The *peakedness* ``rho = 1 - (pi/2) ||g||_1^2 / (numel ||g||_2^2)``, clamped
       to [0, 1]. ``||g||_1^2 / (numel ||g||_2^2)`` is the fraction of entries
       that carry the gradient (``2/pi`` for Gaussian entries of any size,
       ``k/numel`` for ``k`` equal spikes), so ``rho`` is 0 for dense,
       Gaussian-like gradients and near 1 when a few entries hold the mass.
    2. The candidates are ``norms`` plus ``"mix"`` (the geometric mean of those
       norms) when there are several, sorted from dense to peaked:
       ``l2``/``rms``, ``mix``, ``linf``. With K candidates, ``rho`` in
       ``[j/K, (j+1)/K)`` picks candidate j.
    3. Hysteresis: the layer keeps its current choice until ``rho`` moves by more
       than ``switching_threshold`` relative to its value at the last switch
       (``|rho - rho_ref| > threshold * max(rho_ref, 1e-3)``), or the choice
       leaves the allowed set. The first step always chooses.
    4. ``g <- scale * g / (||g||_choice + eps)``.

    ``schedule={0: ("l2",), 1000: ("l2", "linf")}`` changes the allowed norms at
    those steps, and ``threshold_schedule={0: 0.2, 500: 0.1, 2000: 0.05}`` the
    threshold (a curriculum); both are evaluated on the device, so they never
    recompile. ``norm_choice/<layer>`` in ``backend.stats()`` is an index into
    ``multi_normalize(...).candidates``; ``peakedness/<layer>`` is ``rho``.

        >>> import fxgrad
        >>> t = fxgrad.multi_normalize(("l2", "linf"), 0.1)
        >>> t, t.candidates
        (multi_normalize(norms=('l2', 'linf'), switching_threshold=0.1), ('l2', 'linf', 'mix'))
    """

    name = "multi_normalize"
    norm_orders = (1.0, 2.0, math.inf)

    # `norms` is short for schedule={0: norms}, `switching_threshold` for threshold_schedule={0: ...}.
    # After construction both schedules hold ((start_step, value), ...) pieces from step 0, and repr
    # writes a one-piece schedule as the short argument.
    norms: tuple[str, ...] = field(("l2", "linf"), shown=lambda rule: len(rule.schedule) == 1)
    switching_threshold: float = field(0.1, shown=lambda rule: len(rule.thresholds) == 1)
    schedule: Pieces | None = field(
        None, shown=lambda rule: len(rule.schedule) > 1, text=lambda v: repr(dict(v)), config="step_keys"
    )
    threshold_schedule: Pieces | None = field(
        None,
        kw_only=True,
        shown=lambda rule: len(rule.thresholds) > 1,
        text=lambda v: repr(dict(v)),
        config="step_keys",
    )
    scale: float = field(1.0, kw_only=True, shown=lambda rule: rule.scale != 1.0)
    eps: float = field(1e-8, kw_only=True, shown=lambda rule: rule.eps != 1e-8)

    def __post_init__(self) -> None:
        schedule = _piecewise(
            "schedule",
            {0: self.norms} if self.schedule is None else self.schedule,
            _norm_list,
            "norms" if self.schedule is None else None,
        )
        threshold = validate.non_negative("switching_threshold", self.switching_threshold)
        thresholds = _piecewise(
            "threshold_schedule",
            {0: threshold} if self.threshold_schedule is None else self.threshold_schedule,
            lambda name, v: validate.non_negative(name, v),
        )
        # a short argument other than its default, and a schedule that says otherwise from step 0
        if self.schedule is not None and _norm_list("norms", self.norms) not in (("l2", "linf"), schedule[0][1]):
            raise ValueError("norms: schedule sets the norms too (from step 0); give one of norms and schedule")
        if self.threshold_schedule is not None and self.switching_threshold not in (0.1, thresholds[0][1]):
            raise ValueError("switching_threshold: threshold_schedule sets it too (from step 0); give one of them")
        self.set(
            norms=schedule[0][1],
            switching_threshold=thresholds[0][1],
            schedule=schedule,
            threshold_schedule=thresholds,
            scale=validate.positive("scale", self.scale, allow_inf=False),
            eps=validate.positive("eps", self.eps, allow_inf=False),
        )

    @property
    def thresholds(self) -> Pieces:
        """The switching threshold by start step: ``((0, 0.2), (500, 0.1), ...)``."""
        return self.threshold_schedule

    @property
    def candidates(self) -> tuple[str, ...]:
        """Every strategy this transform can pick; ``norm_choice/<layer>`` indexes it."""
        names = list(dict.fromkeys(n for _, norms in self.schedule for n in norms))
        if any(len(norms) > 1 for _, norms in self.schedule):
            names.append("mix")
        return tuple(names)

    def ladder(self, norms: Sequence[str]) -> list[int]:
        """The candidate indices one schedule segment picks from, dense to peaked."""
        allowed = list(norms) + (["mix"] if len(norms) > 1 else [])
        return [self.candidates.index(n) for n in sorted(allowed, key=RANK.__getitem__)]

    def factors(self, stats: Sequence[NormStats], layers: Sequence[Layer], ctx: RouteContext) -> list[Factor]:
        used = dict.fromkeys(n for _, norms in self.schedule for n in norms)  # ordered: stable graphs
        values = {n: flat(layer_norm_of(s, layer, n) for s, layer in zip(stats, layers)) for n in used}
        peaked = flat(_peakedness(s, layer) for s, layer in zip(stats, layers))
        state = ctx.state(per_layer={"choice": 0.0, "reference": 0.0, "steps": 0.0})
        steps, choice, reference = state["steps"], state["choice"], state["reference"]
        segment = sum(((steps >= start).to(torch.float64) for start, _ in self.schedule[1:]), torch.zeros_like(steps))
        fresh = torch.zeros_like(steps)
        allowed = torch.zeros_like(steps, dtype=torch.bool)
        threshold = torch.full_like(steps, self.thresholds[0][1])
        for start, value in self.thresholds[1:]:
            threshold = torch.where(steps >= start, value, threshold)
        for k, (_, norms) in enumerate(self.schedule):
            ladder = self.ladder(norms)
            position = torch.clamp(torch.floor(peaked * len(ladder)), 0, len(ladder) - 1)
            pick = sum(((position == j).to(torch.float64) * c for j, c in enumerate(ladder)), torch.zeros_like(steps))
            here = segment == k
            fresh = torch.where(here, pick, fresh)
            member = sum(((choice == c) for c in ladder[1:]), choice == ladder[0])
            allowed = torch.where(here, member, allowed)
        changed = (peaked - reference).abs() > threshold * reference.clamp_min(1e-3)
        switch = (steps == 0) | changed | ~allowed
        new_choice = torch.where(switch, fresh, choice)
        ctx.save(
            state, finite=peaked, choice=new_choice, reference=torch.where(switch, peaked, reference), steps=steps + 1
        )
        ctx.emit_per_layer("norm_choice", new_choice)
        ctx.emit_per_layer("peakedness", peaked)
        divisor = torch.zeros_like(steps)
        for index, name in enumerate(self.candidates):
            value = self._mix(values, segment) if name == "mix" else values[name].to(torch.float64)
            divisor = torch.where(new_choice == index, value, divisor)
        return list((self.scale / (divisor + self.eps)).unbind())

    def _mix(self, values: dict[str, torch.Tensor], segment: torch.Tensor) -> torch.Tensor:
        """The geometric mean of the segment's norms."""
        out = torch.zeros_like(segment)
        for k, (_, norms) in enumerate(self.schedule):
            logs = sum(values[n].to(torch.float64).clamp_min(1e-30).log() for n in norms) / len(norms)
            out = torch.where(segment == k, logs.exp(), out)
        return out


def _peakedness(stats: NormStats, layer: Layer) -> torch.Tensor:
    """``1 - (pi/2) ||g||_1^2 / (numel ||g||_2^2)``, clamped to [0, 1].

    ``||g||_1^2 / (numel ||g||_2^2)`` is the fraction of entries that carry the
    gradient: 1 when all have the same magnitude, ``2/pi`` for Gaussian
    entries whatever the size, ``k/numel`` for ``k`` equal spikes. Scaled so a
    Gaussian-like or flat gradient reads 0 and a few spikes read close to 1.
    """
    l1, l2 = stats.norm(1.0), stats.norm(2.0)
    # (l1 / l2)^2, not l1^2 / l2^2, which underflows in float32; a zero or empty gradient carries nothing
    # (reads 1), a non-finite one stays NaN (so the step leaves the state alone)
    carrying = torch.where(l2 == 0, 0.0, (l1 / l2) ** 2 / max(layer.numel, 1))
    return (1.0 - (math.pi / 2) * carrying).clamp(0.0, 1.0)


def _norm_list(name: str, norms) -> tuple[str, ...]:
    if isinstance(norms, str) or not isinstance(norms, Sequence) or not norms:
        raise TypeError(f"{name} must be a non-empty tuple (or list) of norm names, got {norms!r}")
    return tuple(dict.fromkeys(validate.choice(f"{name} entries", norm, NORMS) for norm in norms))


def _piecewise(name: str, mapping, check, argument: str | None = None) -> Pieces:
    """``{start_step: value}`` as sorted pieces from step 0, each value checked; ``argument`` names
    the value in messages when the mapping stands for a plain argument (``norms``)."""
    if isinstance(mapping, tuple) and all(isinstance(piece, tuple) and len(piece) == 2 for piece in mapping):
        mapping = dict(mapping)  # already pieces: dataclasses.replace() builds the rule again
    if not isinstance(mapping, Mapping) or not mapping:
        raise TypeError(f"{name} must be a non-empty dict {{start_step: value}}, got {mapping!r}")
    steps = sorted((validate.step(name, start), value) for start, value in mapping.items())
    items = [(start, check(argument or f"{name}[{start}]", value)) for start, value in steps]
    if items[0][0] != 0:
        raise ValueError(f"{name} must start at step 0, got {items[0][0]}")
    return tuple(items)


# ---------------------------------------------------------------- sinkhorn


@rule
class Sinkhorn(Leaf):
    """SinkGD's SR-Sinkhorn normalization (Scetbon et al. 2025), per parameter.

    For a 2-D gradient ``X`` (m x n), ``iters`` times: scale each row to L2
    norm ``sqrt(n)``, then each column to ``sqrt(m)``. A parameter with more
    dimensions is folded to ``(shape[0], prod(shape[1:]))`` (output channels x
    the rest) and unfolded after. A 1-D or 0-D gradient is scaled to RMS 1
    (norm ``sqrt(numel)``). A tiny ``1e-8`` keeps zero rows finite. With plain
    SGD this is SinkGD: a stateless optimizer.

        >>> import fxgrad
        >>> fxgrad.sinkhorn(iters=3)
        sinkhorn(iters=3)
    """

    name = "sinkhorn"
    keeps_signs = True  # positive factors
    reach = "element"  # each parameter on its own
    EPS: ClassVar[float] = 1e-8

    iters: int = 5

    def __post_init__(self) -> None:
        unrolled = "each iteration is unrolled into the backward graph"
        self.set(iters=validate.positive_int("iters", self.iters, 100, unrolled))

    def apply(self, grads: LayerGrads, layers: Sequence[Layer], ctx: RouteContext) -> LayerGrads:
        return [[ctx.per_tensor(self._one, g, ctx.scale) for g in group] for group in grads]

    def _one(self, grad: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        x = widen(grad)
        if scale is not None:  # unscaled first, as after unscale_: its EPS and norms see unscaled values
            x = x * (1.0 / scale).to(x.dtype)
        if x.numel() == 0:  # a (0, n) parameter: nothing to normalize, and no rows to divide by
            return grad
        if x.dim() >= 2:
            rows, cols = x.shape[0], x.numel() // x.shape[0]
            y = x.reshape(rows, cols)
            for _ in range(self.iters):
                y = y * (math.sqrt(cols) / (l2(y, dim=1, keepdim=True) + self.EPS))
                y = y * (math.sqrt(rows) / (l2(y, dim=0, keepdim=True) + self.EPS))
            out = y.reshape(x.shape)
        else:
            out = x * (math.sqrt(x.numel()) / (l2(x) + self.EPS))
        if scale is not None:  # the result is scale-free; unscale_ will divide by the scale
            out = out * scale.to(out.dtype)
        return cast(out, grad.dtype)
