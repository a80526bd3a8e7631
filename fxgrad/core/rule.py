"""The transform protocol: what a policy is, how it picks layers, and the rule registry.

A policy is a tree of transforms. Composite transforms (``chain``, ``by_type``,
``by_name``) only route; *leaf* transforms do the math. Routing a policy over a
model's layers yields an ordered list of :class:`Route` s, each a leaf and the
layers it acts on::

    >>> import fxgrad
    >>> from fxgrad.core.layers import Layer
    >>> layers = [Layer("fc", None, ("fc.weight",), 4), Layer("ln", None, ("ln.weight",), 2,
    ...           skip_reason="is a LayerNorm")]
    >>> [(repr(r.leaf), r.names) for r in fxgrad.clip_by_norm(1.0).routes(layers)]
    [('clip_by_norm(max_norm=1.0)', ('fc',))]

Most leaves only multiply each layer's gradients by a factor computed from
layer norms (:class:`ScaleLeaf`); the others transform gradients directly
(:class:`Leaf`). See :mod:`fxgrad.runtime.executor` for how they run.

A leaf is defined once, in its family's module under ``fxgrad/rules/``, and
registered there with :func:`rule`: that makes it a frozen dataclass, gives it
a ``repr`` that reads like its construction, and registers it under ``<name>`` for
config files (``fxgrad.<name>`` too, for the rules fxgrad ships; a rule in a user's
own module is its class, see docs/adding-a-rule.md). Validation runs in
``__post_init__``, so every construction validates::

    @rule
    class ClipByNorm(ScaleLeaf):
        # the docstring: what it computes, its eager reference, a doctest
        name = "clip_by_norm"
        max_norm: float
        norm_type: float = field(2.0, shown=lambda rule: rule.norm_type != 2.0)

        def __post_init__(self) -> None:
            self.set(max_norm=validate.positive("max_norm", self.max_norm))

        def factors(self, stats, layers, ctx): ...

docs/adding-a-rule.md walks through the contracts and the tests a rule needs.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Literal, Sequence, TypeVar

import torch

from fxgrad.core import match
from fxgrad.core.layers import Layer

if TYPE_CHECKING:
    from fxgrad.runtime.context import RouteContext
    from fxgrad.runtime.norm_math import Factor, NormStats

Reach = Literal["element", "layer", "group"]
LayerGrads = list[list[torch.Tensor]]


class Transform:
    """Base class of all policies. Instances are immutable and validated."""

    def routes(self, layers: Sequence[Layer]) -> list[Route]:
        """The leaves this transform applies, in order, each with its layers.

        A route is returned even when it selects no layer, so the routes of the
        same policy over two layer lists line up index by index.
        """
        raise NotImplementedError

    def leaves(self) -> list[Leaf]:
        """Every leaf of the policy, in order."""
        return [route.leaf for route in self.routes(())]

    def unrouted_leaves(self) -> list[Leaf]:
        """The leaves that see every layer: not under ``by_type`` or ``by_name``, which hand
        each of their leaves some layers only."""
        return self.leaves()

    def reduces_across_layers(self) -> bool:
        """Whether a leaf reduces over several layers (``reach == "group"``: a global norm), so
        that it must see every gradient at once."""
        return any(leaf.reach == "group" for leaf in self.leaves())

    def changes_gradients(self) -> bool:
        """Whether a leaf changes gradients: not ``monitor`` alone, which reads them, nor
        update-level factors (``apply_to="update"``), which scale the optimizer's step."""
        return any(leaf.folds != "identity" and leaf.apply_to == "grad" for leaf in self.leaves())

    def unmatched(self, layers: Sequence[Layer]) -> list[str]:
        """Why routing keys (``by_type``, ``by_name``) that reach none of ``layers`` do not."""
        return []

    def named(self, layers: Sequence[Layer]) -> list[set[str]]:
        """The names of ``layers`` each key of the policy chose, one set per key (a
        ``by_type``/``by_name`` key, a ``rescale`` multiplier): a key that chose frozen layers
        alone is a target the user named that gets no gradient, where a rule over every layer (or
        a router's default) simply finds none on them, as ``clip_grad_norm_`` does."""
        return []


class Leaf(Transform):
    """A transform that computes something.

    Class attributes a rule sets where it differs from the default:

    * ``name``: its public name (``fxgrad.<name>``, config files); it also
      namespaces its state and statistics.
    * ``reach``: how far its reductions reach: ``"element"`` (none),
      ``"layer"`` (each layer on its own) or ``"group"`` (across all the layers
      it is routed to, e.g. a global norm).
    * ``per_layer``: ``True`` leaves never touch skipped layers; the others
      (global clipping) cover every layer.
    * ``hides_nonfinite``: it replaces Inf/NaN, which a GradScaler must see,
      so a backend with a scaler refuses it.
    * ``backs_off``: its threshold reads ``ctx.threshold(...)``, which
      ``skip_nonfinite(backoff=...)`` earlier in the policy lowers.
    * ``folds``: how :meth:`fxgrad.Backend.fold` can leave its factor to the
      optimizer's update: ``"global"`` (one factor for every gradient: a fused
      optimizer's ``grad_scale`` takes it), ``"identity"`` (it changes no
      gradient), ``None`` (not yet: the gradients are scaled in a pass).
    * ``local_shards``: it computes on each rank's shard of FSDP2's gradients what it
      computes on the whole gradients: each reduction over a gradient covers all of it
      and goes through :func:`~fxgrad.runtime.norm_math.over_shards` (which all-reduces
      it), the rest is elementwise or per layer, and it reads weights only as whole-layer
      norms (``ctx.weight_norms()``). Step scope then runs it in the compiled program over
      the local shards; a policy with another leaf runs eagerly on the DTensors.
    * ``apply_to``: ``"grad"``, or ``"update"`` when the leaf's factors multiply the
      optimizer's update instead of the gradient (a per-layer learning-rate scale, see
      :mod:`fxgrad.frontend.update_factors`). Scale rules that offer both declare it
      as a field with :func:`apply_to_field`.
    * ``clips``: it bounds the gradients (a norm or the elements) by a threshold, so a
      policy with it replaces a trainer's own clipping (the Hugging Face Trainer's
      ``max_grad_norm``: :func:`fxgrad.integrations.transformers.prepare`).
    * ``keeps_signs``: it only multiplies gradient elements by factors ``> 0`` (clamps
      included), so an update that reads the signs alone (``Rprop``) never sees it, and
      fxgrad warns. ``False`` unless the rule says so (a :class:`ScaleLeaf` does).
    """

    reach: ClassVar[Reach] = "layer"
    per_layer: ClassVar[bool] = True
    hides_nonfinite: ClassVar[bool] = False
    backs_off: ClassVar[bool] = False
    folds: ClassVar[Literal["global", "identity"] | None] = None
    local_shards: ClassVar[bool] = False
    apply_to: ClassVar[Literal["grad", "update"]] = "grad"
    keeps_signs: ClassVar[bool] = False
    clips: ClassVar[bool] = False
    name: ClassVar[str] = "leaf"

    def fixed_factor(self, layer: Layer) -> float | None:
        """The factor it multiplies ``layer``'s gradient by on every step, when that is one
        constant (``rescale(alpha=0)``'s multiplier), which an Adam-type update divides out;
        ``None`` when the factor may change from step to step."""
        return None

    def check_followers(self, later: Sequence[Leaf]) -> None:
        """Raise ``ValueError`` if this leaf needs something of the leaves after it in the policy."""

    def idle(self, layers: Sequence[Layer]) -> str | None:
        """Why this leaf changes no gradient of ``layers`` (the trainable layers routed to it),
        whatever their values; ``None`` when it may. Compiling a model warns for each such route
        (:func:`fxgrad.frontend.coverage.policy_misses`)."""
        return None

    def __repr__(self) -> str:
        return call_repr(self.name, **self.shown_fields())

    def shown_fields(self) -> dict[str, Any]:
        """The fields ``repr`` writes, by name, each as ``repr`` writes it (see :func:`field`)."""
        shown = {}
        for f in dataclasses.fields(self):
            if f.repr and f.metadata.get("shown", lambda rule: True)(self):
                value = getattr(self, f.name)
                shown[f.name] = _Verbatim(f.metadata["text"](value)) if "text" in f.metadata else value
        return shown

    def on_layer(self, layer: Layer) -> str:
        """What this rule does to ``layer``, with the values that apply to it (for :func:`fxgrad.explain`).

        The rule's own ``repr`` unless its values differ per layer (``rescale``'s multipliers).
        """
        return repr(self)

    def set(self, **values: Any) -> None:
        """Replace fields with their validated values, in ``__post_init__`` (rules are frozen)."""
        for key, value in values.items():
            object.__setattr__(self, key, value)

    def routes(self, layers: Sequence[Layer]) -> list[Route]:
        if self.per_layer:
            layers = [layer for layer in layers if layer.skip_reason is None]
        return [Route(self, tuple(layers))]

    def apply(self, grads: LayerGrads, layers: Sequence[Layer], ctx: RouteContext) -> LayerGrads:
        """Transform ``grads[i]`` (the gradients of ``layers[i]``); same structure out.

        ``ctx`` gives device-side state, the loss scale and statistics.
        """
        raise NotImplementedError


class ScaleLeaf(Leaf):
    """A leaf that multiplies each layer's gradients by one factor ``>= 0``.

    The factor depends on the layer norms only. ``norm_orders`` lists the
    p-norms ``factors`` reads; consecutive scale leaves share one pass over
    the gradients and a single multiplication per gradient.
    """

    norm_orders: tuple[float, ...] = (2.0,)
    local_shards = True  # its factors see whole-layer norms only
    keeps_signs = True

    def factors(self, stats: Sequence[NormStats], layers: Sequence[Layer], ctx: RouteContext) -> list[Factor]:
        """One factor per layer, from ``stats[i]``, the (unscaled) norms of ``layers[i]``.

        A factor is a 0-dim tensor or a Python float; ``1.0`` costs nothing.
        """
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class Route:
    """One leaf and the layers it acts on."""

    leaf: Leaf
    layers: tuple[Layer, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(layer.name for layer in self.layers)

    @property
    def label(self) -> str:
        """A short description used to tag the nodes this route inserts."""
        names = self.names
        shown = ", ".join(names[:4]) + (f", ... ({len(names)} layers)" if len(names) > 4 else "")
        return f"{self.leaf!r} on [{shown}]"


def check_transform(argument: str, value: Any, optional: bool = False) -> Transform | None:
    """``value`` if it is a transform (or ``None`` when ``optional``); ``TypeError`` naming ``argument`` otherwise."""
    if optional and value is None:
        return None
    if not isinstance(value, Transform) or type(value).routes is Transform.routes:  # the base class itself
        raise TypeError(
            f"{argument} must be an fxgrad transform (e.g. fxgrad.clip_by_norm(1.0)){' or None' if optional else ''}, "
            f"got {value!r} ({type(value).__name__})"
        )
    return value


def call_repr(name: str, **kwargs: Any) -> str:
    """``name(key=value, ...)`` as a call that builds it again (``float('inf')`` for an infinite norm)."""
    shown = (
        f"float('{value}')" if isinstance(value, float) and not math.isfinite(value) else repr(value)
        for value in kwargs.values()
    )
    return f"{name}({', '.join(f'{key}={value}' for key, value in zip(kwargs, shown))})"


def listed(items: Sequence[str], limit: int) -> str:
    """The first ``limit`` of ``items`` for a message, and how many more there are::

    >>> listed(["a", "b", "c"], 2)
    'a, b and 1 more'
    """
    return ", ".join(items[:limit]) + (f" and {len(items) - limit} more" if len(items) > limit else "")


class _Verbatim(str):
    def __repr__(self) -> str:
        return str(self)


RULES: dict[str, type[Leaf]] = {}
"""Every registered rule by name: ``fxgrad.<name>``, and the names config files use."""

L = TypeVar("L", bound=type)


def rule(cls: L) -> L:
    """Make ``cls`` a frozen dataclass and register it under ``cls.name`` (config files and the
    named backend find it there; ``fxgrad.<name>`` for the rules fxgrad ships). The same class
    defined again (its module reloaded, a notebook cell run twice) replaces itself."""
    if cls.__dict__.get("name") in (None, Leaf.name):
        raise TypeError(f"rule {cls.__name__} must set its public name: name = '...'")
    taken = RULES.get(cls.name)
    if taken is not None and (taken.__module__, taken.__qualname__) != (cls.__module__, cls.__qualname__):
        raise TypeError(f"rule name {cls.name!r} is taken by {match.key_repr(taken)}")
    cls = dataclasses.dataclass(frozen=True, repr=False)(cls)
    cls.__init__.__qualname__ = cls.name  # "clip_by_norm() missing 1 required positional argument: 'max_norm'"
    RULES[cls.name] = cls
    return cls


def apply_to_field() -> Any:
    """The ``apply_to`` field of a scale rule that can act on the optimizer's update:
    ``"grad"`` (the default: the factor multiplies the gradient) or ``"update"`` (it
    multiplies what ``optimizer.step()`` changes in the layer's weights). Its
    ``__post_init__`` checks the value with ``validate.choice("apply_to", ...)``."""
    return field("grad", kw_only=True, shown=lambda rule: rule.apply_to != "grad")


APPLY_TO = ("grad", "update")


def field(
    default: Any = dataclasses.MISSING,
    *,
    shown: Callable[[Any], bool] | None = None,
    text: Callable[[Any], str] | None = None,
    config: str | None = None,
    kw_only: bool = False,
) -> Any:
    """A rule field with a default.

    ``shown(rule)`` says whether ``repr`` prints it (always by default);
    ``text(value)`` writes it (``repr(value)`` by default). ``config`` marks
    values a config file spells differently: ``"layer_keys"`` (a mapping keyed
    by module types written ``"type:torch.nn.Conv2d"``) or ``"step_keys"`` (a
    mapping keyed by step numbers, which JSON writes as strings).
    """
    metadata = {key: value for key, value in (("shown", shown), ("text", text), ("config", config)) if value}
    return dataclasses.field(default=default, metadata=metadata, kw_only=kw_only)
