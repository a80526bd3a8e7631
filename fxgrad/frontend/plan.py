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


def _treatment(
    transform: Transform, graph: CapturedGraph, names: Sequence[str], order: Sequence[str], skip: Sequence[SkipEntry]
) -> tuple[list[Layer], list[dict[int, str]]]:
    """``graph``'s layers named as in ``names`` (one per slot of ``graph.params``), and per route,
    what its rule does to each layer it takes (:meth:`~fxgrad.core.rule.Leaf.on_layer`), by position."""
    rows = [ParamRow(name, p.name, p.module_type, p.numel) for name, p in zip(names, graph.params)]
    layers = build_layers(rows, order, skip)
    position = {layer.name: i for i, layer in enumerate(layers)}
    routes = transform.routes(layers)
    return layers, [{position[layer.name]: route.leaf.on_layer(layer) for layer in route.layers} for route in routes]


def misrouted(
    transform: Transform | None,
    graph: CapturedGraph,
    names: Sequence[str],
    order: Sequence[str],
    skip: Sequence[SkipEntry],
) -> list[str]:
    """The layers, named as in ``names`` (one per slot of ``graph.params``), that ``transform``
    treats otherwise than the layers ``graph`` was compiled for: Dynamo runs one graph for the
    parameters of several modules (a graph break inside a repeated block's forward), and its
    rewrite applies what the policy does to the first (``by_name`` keys, skip patterns, a
    multiplier or a target of the layer's name or depth)::

        misrouted(by_name({"blocks.1.*": clip_by_norm(1.0)}), graph_of_block_0, block_1_names, order, skip)
        # ['blocks.1.fc1', 'blocks.1.fc2']
    """
    if transform is None:
        return []
    _, compiled_for = _treatment(transform, graph, [p.layer for p in graph.params], order, skip)
    layers, now = _treatment(transform, graph, names, order, skip)
    changed = {
        i
        for before, after in zip(compiled_for, now)
        for i in before.keys() | after.keys()
        if before.get(i) != after.get(i)
    }
    return [layers[i].name for i in sorted(changed)]


def acted_on(
    transform: Transform | None, graph: CapturedGraph, order: Sequence[str], skip: Sequence[SkipEntry]
) -> set[str]:
    """The layers of ``graph`` that some route of ``transform`` takes."""
    if transform is None:
        return set()
    layers, treatment = _treatment(transform, graph, [p.layer for p in graph.params], order, skip)
    return {layers[i].name for taken in treatment for i in taken}
