"""Per-layer gradient scaling: rescale, trust ratio, weight-norm drift, norm balancing.

Each multiplies a layer's gradients by a factor from its own norm (``rescale``)
or from its weights. Parameters are not inputs of the backward graph: the
weight-reading rules get what they need (norms or values) through a custom op
that runs on the device inside the compiled backward; the optimizer has not
stepped yet, so the weights are the ones the gradients belong to.

    >>> import fxgrad
    >>> fxgrad.rescale(alpha=0.5, multipliers={"*.q_proj": 1.3})
    rescale(alpha=0.5, target='mean', multipliers={'*.q_proj': 1.3})
"""

from __future__ import annotations

import inspect
from typing import Callable, ClassVar, Mapping, Sequence

import torch

from fxgrad import _compat
from fxgrad.core import match, validate
from fxgrad.core.layers import WHAT_IS_A_LAYER, Layer
from fxgrad.core.rule import APPLY_TO, LayerGrads, Leaf, ScaleLeaf, apply_to_field, call_repr, field, rule
from fxgrad.runtime.context import RouteContext
from fxgrad.runtime.norm_math import Factor, NormStats, cast, group_norm, widen
from fxgrad.runtime.state import flat

Target = str | float | Callable[[float, Layer], float]
Multipliers = tuple[tuple[match.Key, float], ...]


def _target_text(target: Target) -> str:
    return getattr(target, "__name__", repr(target)) if callable(target) else repr(target)


def _multipliers_text(pairs: Multipliers) -> str:
    return "{" + ", ".join(f"{match.key_repr(key)}: {value!r}" for key, value in pairs) + "}"


@rule
class Rescale(ScaleLeaf):
    """Per-layer gradient rescaling: ``g <- m_l * (T_l / (n_l + 1e-7)) ** alpha * g``.

    ``n_l`` is the L2 norm of layer ``l``'s gradients (all its parameters together).

    * ``target="mean"``: ``T_l`` is the mean of ``n_l`` over the layers this
      transform applies to, in the same step. Layers with a small norm are
      amplified, those with a large norm damped.
    * ``target=<float>``: a constant ``T``.
    * ``target=<callable>``: ``T_l = target(depth, layer)``, with ``depth`` in
      [0, 1] the layer's position in forward order (0 = first layer, e.g. a
      ResNet stem) and ``layer`` a :class:`fxgrad.Layer`. It is evaluated once,
      at compile time.
    * ``multipliers``: ``{nn.Module type or pattern: m_l}``; the first
      matching key gives ``m_l`` (keys match as :mod:`fxgrad.core.match`
      says), default 1.

    ``alpha`` is in [0, 1]: each layer's norm becomes ``m_l * T_l**alpha * n_l**(1 - alpha)``.
    ``alpha=0`` leaves only the multipliers (without one other than 1 the rule would do
    nothing: ``ValueError``). Skipped (norm) layers are untouched.

    ``apply_to="update"`` multiplies each layer's optimizer update by the factor
    instead of its gradient: a per-layer learning-rate scale, which acts under
    Adam-type optimizers, where a steady gradient factor cancels (the rescaling
    article's "amplify the stem 3x" under AdamW; :mod:`fxgrad.frontend.update_factors`).

        >>> import fxgrad
        >>> fxgrad.rescale(alpha=0.3, multipliers={"*.q_proj": 1.3})
        rescale(alpha=0.3, target='mean', multipliers={'*.q_proj': 1.3})
        >>> fxgrad.rescale(alpha=0, multipliers={"stem": 3.0}, apply_to="update")
        rescale(alpha=0.0, target='mean', multipliers={'stem': 3.0}, apply_to='update')
    """

    name = "rescale"
    EPS: ClassVar[float] = 1e-7

    alpha: float = 0.5
    target: Target = field("mean", text=_target_text)
    multipliers: Multipliers = field(
        (), shown=lambda rule: bool(rule.multipliers), text=_multipliers_text, config="layer_keys"
    )
    every: int | None = field(None, kw_only=True, shown=lambda rule: rule.every is not None)
    decay: float = field(0.9, kw_only=True, shown=lambda rule: rule.target == "ema")
    apply_to: str = apply_to_field()

    def fixed_factor(self, layer: Layer) -> float | None:
        return self.multiplier(layer) if self.alpha == 0 and self.apply_to == "grad" else None

    def __post_init__(self) -> None:
        target = self.target
        if isinstance(target, str):
            if target not in ("mean", "ema"):
                raise ValueError(f"target must be 'mean', 'ema', a positive number or a callable, got {target!r}")
        elif callable(target):
            _check_target_signature(target)
        else:
            target = validate.positive("target", target, allow_inf=False)
        every = self.every
        if every is not None:
            every = validate.positive_int("every", every)
            if target not in ("mean", "ema"):
                raise ValueError("every re-estimates a 'mean' or 'ema' target; a fixed target has nothing to refresh")
        decay = validate.fraction("decay", self.decay)
        if decay != 0.9 and target != "ema":
            raise ValueError(f"decay is the EMA of target='ema'; target={target!r} has none, got decay={decay!r}")
        multipliers = {} if self.multipliers is None else self.multipliers
        if isinstance(multipliers, tuple):  # already pairs: dataclasses.replace() builds the rule again
            if not all(isinstance(pair, tuple) and len(pair) == 2 for pair in multipliers):
                raise TypeError(f"multipliers must be a mapping {{key: multiplier}}, got {multipliers!r}")
            keys = [key for key, _ in multipliers]
            twice = [key for i, key in enumerate(keys) if key in keys[:i]]
            if twice:
                raise ValueError(f"multipliers gives key {twice[0]!r} twice")
            multipliers = dict(multipliers)
        if not isinstance(multipliers, Mapping):
            raise TypeError(f"multipliers must be a mapping, got {type(multipliers).__name__}")
        pairs = tuple(
            (
                match.check_key("multipliers keys", key),
                validate.positive(f"multipliers[{key!r}]", value, allow_inf=False),
            )
            for key, value in multipliers.items()
        )
        alpha = validate.non_negative("alpha", self.alpha)
        if alpha > 1:
            raise ValueError(
                f"alpha must be in [0, 1], got {self.alpha!r}: a layer's norm becomes T**alpha * n**(1 - alpha), "
                "from its own (0) to T (1); beyond 1 the smaller norms end larger, and (T / 1e-7)**alpha for a "
                "layer without gradient overflows float32"
            )
        if alpha == 0 and all(value == 1 for _, value in pairs):
            raise ValueError(
                "alpha=0 leaves only the multipliers, and multipliers gives none other than 1: rescale would "
                "leave every gradient as it is; give alpha > 0 or a multiplier"
            )
        self.set(
            alpha=alpha,
            target=target,
            multipliers=pairs,
            every=every,
            decay=decay,
            apply_to=validate.choice("apply_to", self.apply_to, APPLY_TO),
        )

    @property
    def reach(self) -> str:  # type: ignore[override]
        # The mean target reduces across all the layers the transform is routed to.
        return "group" if self.target == "mean" else "layer"

    def on_layer(self, layer: Layer) -> str:
        """The call with this layer's own target and multiplier in place of the policy-wide ones:
        ``rescale(alpha=0.5, target='mean', multiplier=1.3)``."""
        values = self.shown_fields()
        if callable(self.target):
            values["target"] = self.layer_target(layer)
        if values.pop("multipliers", None) and self.multiplier(layer) != 1.0:
            values["multiplier"] = self.multiplier(layer)
        return call_repr(self.name, **values)

    def multiplier(self, layer: Layer) -> float:
        """``m_l``: the first matching multiplier, else 1."""
        found = match.first_match(self.multipliers, layer, key_of=lambda pair: pair[0])
        return 1.0 if found is None else found[1]

    def named(self, layers: Sequence[Layer]) -> list[set[str]]:
        groups, _ = match.route_by_first_match(self.multipliers, layers, key_of=lambda pair: pair[0])
        return [{layer.name for layer in group} for group in groups]

    def unmatched(self, layers: Sequence[Layer]) -> list[str]:
        rescaled = [layer for layer in layers if layer.skip_reason is None]
        return [
            f"rescale multiplier key {match.key_repr(key)} matches no layer it rescales ({WHAT_IS_A_LAYER})"
            for key, _ in self.multipliers
            if not any(match.matches(key, layer) for layer in rescaled)
        ]

    def idle(self, layers: Sequence[Layer]) -> str | None:
        if self.target == "mean" and self.every is None and len(layers) == 1 and self.multiplier(layers[0]) == 1:
            return "its 'mean' target is the mean norm of the layers it reaches, the layer's own, so its factor is 1"
        return None

    def layer_target(self, layer: Layer) -> float:
        """``T_l`` for a constant or callable target (not for ``"mean"``)."""
        if not callable(self.target):
            return float(self.target)
        with _compat.outside_dispatch_modes():  # user code, run at compile time on plain values
            value = self.target(layer.depth, layer)
        try:
            return validate.positive("target", value, allow_inf=False)
        except (TypeError, ValueError) as error:
            raise type(error)(f"target(depth, layer) for layer {layer.name!r}: {error}") from None

    def factors(self, stats: Sequence[NormStats], layers: Sequence[Layer], ctx: RouteContext) -> list[Factor]:
        layer_norms = [s.norm(2.0) for s in stats]
        targets = self._targets(layer_norms, layers, ctx)
        return [
            ctx.per_tensor(self._factor, norm, target, self.multiplier(layer))
            for layer, norm, target in zip(layers, layer_norms, targets)
        ]

    def _factor(self, norm: torch.Tensor, target: float | torch.Tensor, multiplier: float) -> torch.Tensor:
        factor = (target / (norm + self.EPS)) ** self.alpha
        return factor * multiplier if multiplier != 1.0 else factor

    def _targets(self, layer_norms: list[torch.Tensor], layers: Sequence[Layer], ctx: RouteContext) -> list:
        """``T_l`` per layer; state-backed for ``"mean"`` with ``every`` and for ``"ema"``."""
        if self.target == "mean":
            mean = sum(layer_norms[1:], layer_norms[0]) / len(layer_norms)
            if self.every is None:
                return [mean] * len(layers)
            state = ctx.state(shared={"target": ((), 0.0), "steps": ((), 0.0)})
            mean = mean.to(torch.float64)
            held = self._hold(mean, state["target"], state["steps"])
            ctx.save(state, finite=mean, target=held, steps=state["steps"] + 1)
            return [held] * len(layers)
        if self.target == "ema":
            current = flat(layer_norms)
            state = ctx.state(per_layer={"ema": 0.0, "target": 0.0, "steps": 0.0})
            first = state["steps"] == 0
            fresh = torch.where(first, current, state["ema"])
            ema = torch.where(first, current, self.decay * state["ema"] + (1 - self.decay) * current)
            held = fresh if self.every is None else self._hold(fresh, state["target"], state["steps"])
            ctx.save(state, finite=current, ema=ema, target=held, steps=state["steps"] + 1)
            return list(held.unbind())
        return [self.layer_target(layer) for layer in layers]

    def _hold(self, fresh: torch.Tensor, held: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        """``fresh`` on steps 0, every, 2*every, ...; ``held`` in between."""
        return torch.where(torch.remainder(steps, self.every) == 0, fresh, held)


def _check_target_signature(target: Callable) -> None:
    """A callable target must be a function of ``(depth, layer)`` returning a number (a class is
    callable too, but builds an object)."""
    if isinstance(target, type):
        raise TypeError(f"target must be a function target(depth, layer) -> float, got the class {target.__name__}")
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):  # some builtins have none: nothing to check
        return
    try:
        signature.bind(0.0, None)
    except TypeError as error:
        raise TypeError(f"target must be called as target(depth, layer), but {target!r} {error}") from None


@rule
class TrustRatio(ScaleLeaf):
    """The LARS trust ratio per layer: ``g <- g * c * ||w|| / (||g|| + eps)``.

    Both norms are floored at ``min_norm``; the ratio is 1 when either is 0
    (as optax's ``scale_by_trust_ratio``, applied per layer rather than per
    tensor). ``trust_ratio/<layer>`` is in ``backend.stats()``. With
    ``apply_to="update"`` the ratio scales the layer's optimizer update (LARS-style
    per-layer learning rates under any optimizer) instead of its gradient.

    The ratio reads the gradient's norm, as LARS does; LAMB divides by the norm of
    the optimizer's update instead (Adam's step plus weight decay), so under AdamW
    ``apply_to="update"`` is not LAMB: it multiplies Adam's step by
    ``||w|| / ||g||``, which can be far larger than LAMB's ratio. LARS's weight
    decay term in the denominator (``||g|| + wd ||w||``) is left out; ``eps`` is a
    constant.

        >>> import fxgrad
        >>> fxgrad.scale_by_trust_ratio(0.001)
        scale_by_trust_ratio(trust_coefficient=0.001, eps=0.0, min_norm=0.0)
    """

    name = "scale_by_trust_ratio"

    trust_coefficient: float = 1.0
    eps: float = 0.0
    min_norm: float = 0.0
    apply_to: str = apply_to_field()

    def __post_init__(self) -> None:
        self.set(
            trust_coefficient=validate.positive("trust_coefficient", self.trust_coefficient, allow_inf=False),
            eps=validate.non_negative("eps", self.eps),
            min_norm=validate.non_negative("min_norm", self.min_norm),
            apply_to=validate.choice("apply_to", self.apply_to, APPLY_TO),
        )

    def factors(self, stats: Sequence[NormStats], layers: Sequence[Layer], ctx: RouteContext) -> list[Factor]:
        weight = ctx.weight_norms().clamp_min(self.min_norm)
        grad = flat(s.norm(2.0) for s in stats).clamp_min(self.min_norm)
        ratio = self.trust_coefficient * weight / (grad + self.eps)
        safe = torch.where((weight == 0) | (grad == 0), torch.ones_like(ratio), ratio)
        ctx.emit_per_layer("trust_ratio", safe)
        return list(safe.unbind())


@rule
class WeightNormDrift(ScaleLeaf):
    """Per layer: ``g <- g / (1 + log(||W_t|| / ||W_0||))``, refreshed every ``every`` steps.

    ``W_0`` is captured at the layer's first step; the factor is recomputed on
    steps 0, every, 2*every, ... and held in between (on the device). A layer
    whose weights grew gets a smaller step, one that shrank a larger one.

    Guard: ``1 + log r`` reaches 0 at ``r = 1/e`` and is negative below, where
    the formula would blow up or flip the gradient. The denominator is clamped
    at ``min_denominator`` (0.1 by default), so the factor never exceeds 10 and
    never flips sign; that clamp starts at ``r = exp(min_denominator - 1)``
    (0.41). A layer with ``||W_0|| = 0`` keeps factor 1.

    The operator-norm article writes this factor as a per-layer learning rate
    ``eta_l``: ``apply_to="update"`` applies it so, to the optimizer's update,
    where an Adam-type optimizer does not divide it out.

        >>> import fxgrad
        >>> fxgrad.weight_norm_drift(every=100)
        weight_norm_drift(every=100, min_denominator=0.1)
    """

    name = "weight_norm_drift"

    every: int = 10
    min_denominator: float = 0.1
    apply_to: str = apply_to_field()

    def __post_init__(self) -> None:
        self.set(
            every=validate.positive_int("every", self.every),
            min_denominator=validate.positive("min_denominator", self.min_denominator, allow_inf=False),
            apply_to=validate.choice("apply_to", self.apply_to, APPLY_TO),
        )

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


@rule
class BalanceNorms(Leaf):
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

        >>> import fxgrad
        >>> fxgrad.balance_norms(k=3)
        balance_norms(k=3, lam=0.01, every=100, entropy_drop=0.05)
    """

    name = "balance_norms"
    reach = "group"

    k: int = 5
    lam: float = 0.01
    every: int = 100
    entropy_drop: float = 0.05

    def __post_init__(self) -> None:
        self.set(
            k=validate.positive_int("k", self.k, why="a number of layers"),
            lam=validate.positive("lam", self.lam, allow_inf=False),
            every=validate.positive_int("every", self.every),
            entropy_drop=validate.non_negative("entropy_drop", self.entropy_drop),
        )

    def idle(self, layers: Sequence[Layer]) -> str | None:
        if len(layers) < 2:
            return "it moves weight norm from its top layers to its bottom ones, and needs two layers"
        return None

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
            order = torch.sort(norms, stable=True).indices  # ties: two topk calls could pick one layer twice
            top, bottom = order[-k:], order[:k]
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
        for c, group, values in zip(coef, grads, weights):  # a 0-dim float64 c keeps w's dtype
            out.append([cast(widen(g) + c * w, g.dtype) for g, w in zip(group, values)])
        return out
