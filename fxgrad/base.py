"""The transform protocol: what a policy is, and how it picks layers.

A policy is a tree of transforms. Composite transforms (``chain``, ``by_type``,
``by_name``) only route; *leaf* transforms do the math. Routing a policy over a
model's layers yields an ordered list of :class:`Route` s, each a leaf and the
layers it acts on::

    >>> import fxgrad
    >>> from fxgrad.layers import Layer
    >>> layers = [Layer("fc", None, ("fc.weight",), 4), Layer("ln", None, ("ln.weight",), 2,
    ...           skip_reason="is a LayerNorm")]
    >>> [(repr(r.leaf), r.names) for r in fxgrad.clip_by_norm(1.0).routes(layers)]
    [('clip_by_norm(max_norm=1.0)', ('fc',))]

Most leaves only multiply each layer's gradients by a factor computed from
layer norms (:class:`ScaleLeaf`); the others transform gradients directly
(:class:`Leaf`). See ``fxgrad/execute.py`` for how they run.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, ClassVar, Literal, Sequence

import torch

from fxgrad.layers import Layer
from fxgrad.norms import Factor, NormStats

if TYPE_CHECKING:
    from fxgrad.context import RouteContext

Scope = Literal["element", "layer", "group"]
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

    def unmatched(self, layers: Sequence[Layer]) -> list[str]:
        """Why routing keys (``by_type``, ``by_name``) that reach none of ``layers`` do not."""
        return []


class Leaf(Transform):
    """A transform that computes something.

    ``scope`` says how far its reductions reach: ``"element"`` (none),
    ``"layer"`` (each layer on its own) or ``"group"`` (across all the layers
    it is routed to, e.g. a global norm). ``per_layer`` leaves never touch
    skipped layers; the others (global clipping) cover every layer.
    """

    scope: ClassVar[Scope] = "layer"
    per_layer: ClassVar[bool] = True
    name: ClassVar[str] = "leaf"  # the factory's name; namespaces state and statistics

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
