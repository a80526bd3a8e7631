"""Non-finite gradients: replace them, or skip the whole step.

By default fxgrad never hides a NaN or an Inf: it propagates, as in eager
PyTorch. These transforms handle them explicitly, inside the backward::

    policy = fxgrad.chain(fxgrad.skip_nonfinite(), fxgrad.clip_by_global_norm(1.0))
    ...
    loss.backward()
    fxgrad.step_if_finite(optimizer, backend)    # one host sync, see below
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import torch

from fxgrad.core import validate
from fxgrad.core.layers import Layer
from fxgrad.core.rule import LayerGrads, Leaf, field, rule
from fxgrad.runtime.context import RouteContext
from fxgrad.runtime.norm_math import abs_max, like, over_shards
from fxgrad.runtime.state import flat


@rule
class ZeroNonfinite(Leaf):
    """Replace NaN and Inf gradient elements with 0, in every layer.

    Statistics: ``nonfinite_elements`` (this step) and ``nonfinite/<layer>``.
    Place it first in a chain so later transforms see finite values.

        >>> import fxgrad
        >>> fxgrad.zero_nonfinite()
        zero_nonfinite()
    """

    name = "zero_nonfinite"
    reach = "element"
    local_shards = True
    per_layer = False
    hides_nonfinite = True

    def apply(self, grads: LayerGrads, layers: Sequence[Layer], ctx: RouteContext) -> LayerGrads:
        counts, out = [], []
        for group in grads:
            bad = [~torch.isfinite(g) for g in group]
            counts.append(sum(b.sum() for b in bad))
            out.append([g.masked_fill(b, 0) for g, b in zip(group, bad)])
        per_layer = flat(over_shards(counts))
        ctx.emit_per_layer("nonfinite", per_layer)
        ctx.emit("nonfinite_elements", per_layer.sum())
        return out


@rule
class SkipNonfinite(Leaf):
    """If any gradient of the step has a NaN or Inf, make every gradient zero.

    Statistics: ``nonfinite_step`` (1.0 when this step was zeroed) and
    ``nonfinite_steps`` (how many so far).

    The stateful rules after it in the policy (``autoclip``'s history, ``zclip``'s and
    ``monitor``'s statistics, ``adagc``'s EMAs, ...) leave their state alone on a step it
    zeroed, as on an overflow step.

    Zero gradients are not a skipped step for every optimizer: plain SGD does
    nothing, but Adam-type optimizers still decay their moments and move the
    weights by ``lr * m / (sqrt(v) + eps)``, and weight decay still applies.
    To really skip, use :func:`step_if_finite`.

    ``backoff`` is the threshold half of the clipping article's recipe for a
    non-finite step ("roll back, then lower the clip threshold by 20%"): each
    non-finite step multiplies the thresholds of the clipping rules after it in
    the policy (``clip_by_global_norm``, ``clip_by_norm``, ``clip_by_value``,
    ``adaptive_grad_clip``'s ``clipping``) by ``backoff``, on the device. With
    ``growth_interval=N``, after N finite steps in a row (which clip at the lowered
    thresholds) they are divided by ``backoff`` again, up to the thresholds as
    configured, the way ``GradScaler`` grows its scale back. The factor a step
    applies is the statistic ``threshold_scale`` (a non-finite step, whose gradients
    are zeroed, reports the lowered one); ``state_dict()`` keeps the next step's.
    The rollback half is the training loop's: see ``examples/rollback.py``.

        >>> import fxgrad
        >>> fxgrad.skip_nonfinite()
        skip_nonfinite()
        >>> fxgrad.chain(fxgrad.skip_nonfinite(backoff=0.8, growth_interval=100), fxgrad.clip_by_global_norm(1.0))
        chain(skip_nonfinite(backoff=0.8, growth_interval=100), clip_by_global_norm(max_norm=1.0))
    """

    name = "skip_nonfinite"
    reach = "group"
    per_layer = False
    hides_nonfinite = True
    local_shards = True

    backoff: float | None = field(None, shown=lambda rule: rule.backoff is not None)
    growth_interval: int | None = field(None, shown=lambda rule: rule.growth_interval is not None)

    def __post_init__(self) -> None:
        if self.backoff is not None:
            self.set(backoff=validate.fraction("backoff", self.backoff))
        if self.growth_interval is not None:
            if self.backoff is None:
                raise ValueError("growth_interval grows the thresholds back after a backoff: give backoff= too")
            self.set(growth_interval=validate.positive_int("growth_interval", self.growth_interval))

    def check_followers(self, later: Sequence[Leaf]) -> None:
        if self.backoff is not None and not any(leaf.backs_off for leaf in later):
            raise ValueError(
                f"backoff: {self!r} lowers the thresholds of the clipping rules after it in the policy "
                "(clip_by_global_norm, clip_by_norm, clip_by_value, adaptive_grad_clip), and none follows it"
            )

    def apply(self, grads: LayerGrads, layers: Sequence[Layer], ctx: RouteContext) -> LayerGrads:
        finite = [torch.isfinite(m) for m in over_shards([abs_max(g) for group in grads for g in group], "max")]
        bad = ~functools.reduce(torch.logical_and, finite)
        if self.backoff is None:
            state = ctx.state(shared={"steps": ((), 0.0)})
            steps = state["steps"] + bad.to(torch.float64)
            ctx.save(state, steps=steps)
        else:
            state = ctx.state(shared={"steps": ((), 0.0), "threshold_scale": ((), 1.0), "finite_run": ((), 0.0)})
            steps = state["steps"] + bad.to(torch.float64)
            scale = torch.where(bad, state["threshold_scale"] * self.backoff, state["threshold_scale"])
            run = torch.where(bad, torch.zeros_like(state["finite_run"]), state["finite_run"] + 1)
            after = scale  # the next step's: grown back after this step, as GradScaler.update() grows
            if self.growth_interval is not None:
                grow = run >= self.growth_interval
                after = torch.where(grow, torch.clamp_max(scale / self.backoff, 1.0), scale)
                run = torch.where(grow, torch.zeros_like(run), run)
            ctx.save(state, steps=steps, threshold_scale=after, finite_run=run)
            ctx.lower_thresholds(scale)
            ctx.emit("threshold_scale", scale)
        ctx.skip_state_updates(bad)
        ctx.emit("nonfinite_step", bad.to(torch.float64))
        ctx.emit("nonfinite_steps", steps)
        return [[g.masked_fill(like(g, bad), 0) for g in group] for group in grads]


def step_if_finite(optimizer: Any, backend: Any) -> bool:
    """``optimizer.step()`` unless the last backward hit a non-finite gradient.

    Needs ``skip_nonfinite()`` in the backend's policy. It reads one flag from
    the device, which **costs one host sync** per call: the price of deciding
    on the host whether to step. Returns whether it stepped.
    """
    if isinstance(optimizer, type) or not callable(getattr(optimizer, "step", None)):
        raise TypeError(f"optimizer must be an optimizer, with step(), got {type(optimizer).__name__}")
    if not hasattr(backend, "store") or not callable(getattr(backend, "current_scope", None)):
        raise TypeError(f"backend must be an fxgrad.backend(...), got {type(backend).__name__}")
    if backend.transform is None or not any(leaf.name == SkipNonfinite.name for leaf in backend.transform.leaves()):
        raise ValueError("step_if_finite needs fxgrad.skip_nonfinite() in the backend's policy")
    if backend.current_scope() == "step":
        backend.step()  # the policy runs now, so the flag below is this step's
    flag = backend.store.values(stats=True).get("nonfinite_step")  # a live view: no copy of every stat
    if flag is None:
        raise RuntimeError(
            "step_if_finite: the policy has not run yet (no backward through the backend's compiled graphs), "
            "so there is no non-finite flag to read"
        )
    if flag.item() != 0:  # the documented host sync: the host decides whether to step
        backend.store.commit()  # a step all the same to the backward's state: its backoff, its counts
        return False
    optimizer.step()
    return True
