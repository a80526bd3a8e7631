"""Leaf transforms and their factories.

Each factory validates its arguments and returns an immutable transform whose
``repr`` reads like the call that built it::

    >>> import fxgrad
    >>> fxgrad.chain(fxgrad.rescale(alpha=0.5), fxgrad.clip_by_global_norm(1.0))
    chain(rescale(alpha=0.5, target='mean'), clip_by_global_norm(max_norm=1.0))

The eager reference of each transform is given in its docstring and in the
README's semantics table.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import inspect
from typing import Callable, ClassVar, Mapping, Sequence

import torch
import torch.nn as nn

from fxgrad import _compat, _validate, norms
from fxgrad.base import LayerGrads, Leaf, ScaleLeaf
from fxgrad.context import RouteContext
from fxgrad.layers import WHAT_IS_A_LAYER, Layer
from fxgrad.norms import Factor, NormStats
from fxgrad.state import flat


def _call_repr(name: str, **kwargs) -> str:
    return f"{name}({', '.join(f'{key}={value!r}' for key, value in kwargs.items())})"


@dataclasses.dataclass(frozen=True, repr=False)
class ClipByGlobalNorm(ScaleLeaf):
    """See :func:`clip_by_global_norm`."""

    max_norm: float
    norm_type: float = 2.0

    scope = "group"
    per_layer = False
    name = "clip_by_global_norm"

    def __repr__(self) -> str:
        extra = {} if self.norm_type == 2.0 else {"norm_type": self.norm_type}
        return _call_repr("clip_by_global_norm", max_norm=self.max_norm, **extra)

    @property
    def norm_orders(self) -> tuple[float, ...]:
        return (self.norm_type,)

    def factors(self, stats: Sequence[NormStats], layers: Sequence[Layer], ctx: RouteContext) -> list[Factor]:
        total = norms.group_norm(stats, self.norm_type)
        coef = norms.clip_coefficient(total, self.max_norm)
        ctx.emit("grad_norm/total", total)
        ctx.emit("grad_norm/total_clipped", total * coef)
        ctx.emit("clip_coef", coef)
        return [coef] * len(stats)


@dataclasses.dataclass(frozen=True, repr=False)
class ClipByNorm(ScaleLeaf):
    """See :func:`clip_by_norm`."""

    max_norm: float
    norm_type: float = 2.0

    name = "clip_by_norm"

    def __repr__(self) -> str:
        extra = {} if self.norm_type == 2.0 else {"norm_type": self.norm_type}
        return _call_repr("clip_by_norm", max_norm=self.max_norm, **extra)

    @property
    def norm_orders(self) -> tuple[float, ...]:
        return (self.norm_type,)

    def factors(self, stats: Sequence[NormStats], layers: Sequence[Layer], ctx: RouteContext) -> list[Factor]:
        return [norms.clip_coefficient(s.norm(self.norm_type), self.max_norm) for s in stats]


@dataclasses.dataclass(frozen=True, repr=False)
class ClipByValue(Leaf):
    """See :func:`clip_by_value`."""

    clip_value: float

    scope = "element"
    name = "clip_by_value"

    def __repr__(self) -> str:
        return _call_repr("clip_by_value", clip_value=self.clip_value)

    def apply(self, grads: LayerGrads, layers: Sequence[Layer], ctx: RouteContext) -> LayerGrads:
        if ctx.scale is None:
            v = self.clip_value
            return [[g.clamp(-v, v) for g in group] for group in grads]
        bound = (ctx.scale * self.clip_value).float()  # the gradients in the graph are scaled
        return [[_clamp(g, bound) for g in group] for group in grads]


def _clamp(grad: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    wide = norms.widen(grad)
    return norms.cast(torch.minimum(torch.maximum(wide, -bound), bound), grad.dtype)


Target = str | float | Callable[[float, Layer], float]
MultiplierKey = type | str


@dataclasses.dataclass(frozen=True, repr=False)
class Rescale(ScaleLeaf):
    """See :func:`rescale`."""

    alpha: float = 0.5
    target: Target = "mean"
    multipliers: tuple[tuple[MultiplierKey, float], ...] = ()
    every: int | None = None
    decay: float = 0.9

    EPS: ClassVar[float] = 1e-7
    name = "rescale"

    @property
    def scope(self) -> str:  # type: ignore[override]
        # The mean target reduces across all the layers the transform is routed to.
        return "group" if self.target == "mean" else "layer"

    def __repr__(self) -> str:
        kwargs: dict = {"alpha": self.alpha, "target": self.target}
        if callable(self.target):
            kwargs["target"] = _Verbatim(getattr(self.target, "__name__", repr(self.target)))
        if self.multipliers:
            kwargs["multipliers"] = _Verbatim(_mapping_repr(self.multipliers))
        if self.every is not None:
            kwargs["every"] = self.every
        if self.target == "ema":
            kwargs["decay"] = self.decay
        return _call_repr("rescale", **kwargs)

    def multiplier(self, layer: Layer) -> float:
        """``m_l``: the first matching multiplier, else 1."""
        for key, factor in self.multipliers:
            if _layer_matches(key, layer):
                return factor
        return 1.0

    def unmatched(self, layers: Sequence[Layer]) -> list[str]:
        rescaled = [layer for layer in layers if layer.skip_reason is None]
        return [f"rescale multiplier key {_key_repr(key)} matches no layer it rescales ({WHAT_IS_A_LAYER})"
                for key, _ in self.multipliers if not any(_layer_matches(key, layer) for layer in rescaled)]

    def layer_target(self, layer: Layer) -> float:
        """``T_l`` for a constant or callable target (not for ``"mean"``)."""
        if not callable(self.target):
            return float(self.target)
        with _compat.outside_dispatch_modes():  # user code, run at compile time on plain values
            value = self.target(layer.depth, layer)
        try:
            return _validate.positive("target", value, allow_inf=False)
        except (TypeError, ValueError) as error:
            raise type(error)(f"target(depth, layer) for layer {layer.name!r}: {error}") from None

    def factors(self, stats: Sequence[NormStats], layers: Sequence[Layer], ctx: RouteContext) -> list[Factor]:
        layer_norms = [s.norm(2.0) for s in stats]
        targets = self._targets(layer_norms, layers, ctx)
        out: list[Factor] = []
        for layer, norm, target in zip(layers, layer_norms, targets):
            factor = (target / (norm + self.EPS)) ** self.alpha
            multiplier = self.multiplier(layer)
            out.append(factor * multiplier if multiplier != 1.0 else factor)
        return out

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



class _Verbatim(str):
    def __repr__(self) -> str:
        return str(self)


def _key_repr(key: MultiplierKey) -> str:
    return key.__name__ if isinstance(key, type) else repr(key)


def _mapping_repr(pairs) -> str:
    return "{" + ", ".join(f"{_key_repr(key)}: {value!r}" for key, value in pairs) + "}"


def _layer_matches(key: MultiplierKey, layer: Layer) -> bool:
    if isinstance(key, str):
        return fnmatch.fnmatchcase(layer.name, key)
    return layer.module_type is not None and issubclass(layer.module_type, key)


def _check_layer_key(argument: str, key) -> MultiplierKey:
    if isinstance(key, str) and key:
        return key
    if isinstance(key, type) and issubclass(key, nn.Module):
        return key
    raise TypeError(
        f"{argument} keys must be nn.Module subclasses or layer-name patterns, got {key!r}"
    )


# ---------------------------------------------------------------- factories


def clip_by_global_norm(max_norm: float, norm_type: float = 2.0) -> ClipByGlobalNorm:
    """Clip the norm of all gradients together, like ``clip_grad_norm_``.

    Eager reference::

        torch.nn.utils.clip_grad_norm_(every parameter with a gradient, max_norm, norm_type)

    i.e. every gradient is multiplied by ``min(1, max_norm / (total + 1e-6))``
    where ``total`` is the norm over all of them. It covers every layer,
    skipped (norm) layers included, as torch does. ``norm_type=float("inf")``
    uses the largest absolute value.

        >>> clip_by_global_norm(1.0)
        clip_by_global_norm(max_norm=1.0)
    """
    return ClipByGlobalNorm(
        _validate.positive("max_norm", max_norm), _validate.norm_type(norm_type)
    )


def clip_by_norm(max_norm: float, norm_type: float = 2.0) -> ClipByNorm:
    """Clip each layer's gradient norm to ``max_norm`` on its own.

    Eager reference: ``clip_grad_norm_(layer.parameters(recurse=False), max_norm,
    norm_type)`` for each layer not in the skip list.

        >>> clip_by_norm(0.5, norm_type=float("inf"))
        clip_by_norm(max_norm=0.5, norm_type=inf)
    """
    return ClipByNorm(_validate.positive("max_norm", max_norm), _validate.norm_type(norm_type))


def clip_by_value(clip_value: float) -> ClipByValue:
    """Clamp every gradient element to ``[-clip_value, clip_value]``.

    Eager reference: ``clip_grad_value_(layer.parameters(recurse=False), clip_value)``
    for each layer not in the skip list.

        >>> clip_by_value(0.1)
        clip_by_value(clip_value=0.1)
    """
    return ClipByValue(_validate.positive("clip_value", clip_value))


def rescale(
    alpha: float = 0.5,
    target: Target = "mean",
    multipliers: Mapping[MultiplierKey, float] | None = None,
    *,
    every: int | None = None,
    decay: float = 0.9,
) -> Rescale:
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
    * ``multipliers``: ``{nn.Module type or layer-name pattern: m_l}``; the
      first matching key gives ``m_l``, default 1.

    ``alpha=0`` leaves only the multipliers. Skipped (norm) layers are untouched.

        >>> rescale(alpha=0.3, multipliers={"*.q_proj": 1.3})
        rescale(alpha=0.3, target='mean', multipliers={'*.q_proj': 1.3})
    """
    alpha = _validate.non_negative("alpha", alpha)
    if isinstance(target, str):
        if target not in ("mean", "ema"):
            raise ValueError(f"target must be 'mean', 'ema', a positive number or a callable, got {target!r}")
    elif callable(target):
        _check_target_signature(target)
    else:
        target = _validate.positive("target", target, allow_inf=False)
    if every is not None:
        every = _validate.positive_int("every", every)
        if target not in ("mean", "ema"):
            raise ValueError("every re-estimates a 'mean' or 'ema' target; a fixed target has nothing to refresh")
    decay = _validate.fraction("decay", decay)
    if decay != 0.9 and target != "ema":
        raise ValueError(f"decay is the EMA of target='ema'; target={target!r} has none, got decay={decay!r}")
    if multipliers is None:
        multipliers = {}
    if not isinstance(multipliers, Mapping):
        raise TypeError(f"multipliers must be a mapping, got {type(multipliers).__name__}")
    pairs = tuple(
        (_check_layer_key("multipliers", key), _validate.positive(f"multipliers[{key!r}]", value, allow_inf=False))
        for key, value in multipliers.items()
    )
    return Rescale(alpha=alpha, target=target, multipliers=pairs, every=every, decay=decay)


def _check_target_signature(target: Callable) -> None:
    """A callable target must take ``(depth, layer)``."""
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):  # some builtins have none: nothing to check
        return
    try:
        signature.bind(0.0, None)
    except TypeError as error:
        raise TypeError(f"target must be called as target(depth, layer), but {target!r} {error}") from None


__all__ = [
    "ClipByGlobalNorm",
    "ClipByNorm",
    "ClipByValue",
    "Rescale",
    "clip_by_global_norm",
    "clip_by_norm",
    "clip_by_value",
    "rescale",
]

