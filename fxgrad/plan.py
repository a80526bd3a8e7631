"""Policy + layers -> plan: which traced rule runs on which backward outputs.

    plan = plan_graph(policy, graph, has_grad={0, 1, 3}, order=[...], skip=DEFAULT_SKIP)
    for route in plan.active_routes():
        slots, rule = plan.rule(route)   # rule: list[Tensor] -> list[Tensor]
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import torch.nn as nn

from fxgrad.base import Route, Transform
from fxgrad.capture import CapturedGraph
from fxgrad.layers import Layer, ParamRow, SkipEntry, build_layers, parameter_owners

Rule = Callable[[list], list]


@dataclasses.dataclass(frozen=True)
class GraphPlan:
    """The layers of one backward graph and the routes of the policy over them."""

    layers: tuple[Layer, ...]
    slots: dict[str, tuple[int, ...]]  # layer name -> backward output slots, as layer.params
    routes: tuple[Route, ...]

    def active_routes(self) -> list[Route]:
        return [route for route in self.routes if route.layers]

    def rule(self, route: Route) -> tuple[list[int], Rule]:
        """The output slots a route reads and writes, and its rule over them."""
        counts = [len(self.slots[layer.name]) for layer in route.layers]
        slots = [slot for layer in route.layers for slot in self.slots[layer.name]]

        def rule(flat: list) -> list:
            groups, start = [], 0
            for count in counts:
                groups.append(flat[start : start + count])
                start += count
            return [g for group in route.leaf.apply(groups, route.layers) for g in group]

        return slots, rule


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


def model_rows(model: nn.Module, prefix: str) -> tuple[list[ParamRow], list[ParamRow]]:
    """``(trainable, frozen)`` parameter rows of a model, in ``named_modules`` order."""
    trainable, frozen = [], []
    for owner in parameter_owners(model, prefix).values():
        row = ParamRow(owner.layer, owner.param, type(owner.module), owner.tensor.numel())
        (trainable if owner.tensor.requires_grad else frozen).append(row)
    return trainable, frozen
