"""Policy + layers -> plan: the layers of one backward graph and the routes over them.

plan = plan_graph(policy, graph, has_grad={0, 1, 3}, order=[...], skip=DEFAULT_SKIP)
plan.slots["fc1"]        # backward output slots of fc1's gradients
plan.active_routes()     # the routes that select at least one layer
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from fxgrad.core.layers import Layer, ParamRow, SkipEntry, build_layers
from fxgrad.core.rule import Route, Transform
from fxgrad.passes.capture import CapturedGraph


@dataclasses.dataclass(frozen=True)
class GraphPlan:
    """The layers of one backward graph and the routes of the policy over them."""

    layers: tuple[Layer, ...]
    slots: dict[str, tuple[int, ...]]  # layer name -> backward output slots, as layer.params
    routes: tuple[Route, ...]

    def active_routes(self) -> list[Route]:
        return [route for route in self.routes if route.layers]


def plan_graph(
    transform: Transform | None,
    graph: CapturedGraph,
    has_grad: set[int],
    order: Sequence[str],
    skip: Sequence[SkipEntry],
) -> GraphPlan:
    """Plan the rewrite of ``graph``'s backward; ``has_grad`` holds the slots with a gradient."""
    with_grad = [p for p in graph.params if p.index in has_grad]
    rows = [ParamRow(p.layer, p.name, p.module_type, p.numel) for p in with_grad]
    layers = build_layers(rows, order, skip)
    slots: dict[str, tuple[int, ...]] = {}
    for p in with_grad:
        slots[p.layer] = slots.get(p.layer, ()) + (p.index,)
    routes = transform.routes(layers) if transform is not None else []
    return GraphPlan(tuple(layers), slots, tuple(routes))
