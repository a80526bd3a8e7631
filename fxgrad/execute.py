"""Run a plan's routes over per-layer gradients, as plain torch code.

Consecutive :class:`~fxgrad.base.ScaleLeaf` routes form a *run*: the
gradients are read once for their norms, each route computes its factors
from the (already scaled) norms, and every gradient is multiplied once by the
product of its factors. So ``chain(rescale(), clip_by_norm(1.0),
clip_by_global_norm(1.0))`` costs one read and one write per gradient, and
matches applying the three one after the other up to float rounding.

    grads = {"fc": [w_grad, b_grad], "ln": [...]}
    execute(routes, grads, set_label=lambda text: None)   # updates grads in place
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from fxgrad import norms
from fxgrad.base import Route, ScaleLeaf


def execute(
    routes: Sequence[Route], grads: dict[str, list[torch.Tensor]], set_label: Callable[[str], None]
) -> None:
    """Apply ``routes`` in order to ``grads`` (layer name -> its gradients), in place.

    ``set_label`` is told which route (or shared step) the following ops belong to.
    """
    start = 0
    while start < len(routes):
        end = start + 1
        if isinstance(routes[start].leaf, ScaleLeaf):
            while end < len(routes) and isinstance(routes[end].leaf, ScaleLeaf):
                end += 1
            _scale_run(routes[start:end], grads, set_label)
        else:
            route = routes[start]
            set_label(route.label)
            new = route.leaf.apply([grads[name] for name in route.names], route.layers)
            grads.update(zip(route.names, new))
        start = end


def _scale_run(
    run: Sequence[Route], grads: dict[str, list[torch.Tensor]], set_label: Callable[[str], None]
) -> None:
    orders = sorted({p for route in run for p in route.leaf.norm_orders})
    last_use = {name: i for i, route in enumerate(run) for name in route.names}
    set_label("layer norms for " + ", ".join(repr(route.leaf) for route in run))
    stats = {name: norms.NormStats.of(grads[name], orders) for name in last_use}
    factors: dict[str, norms.Factor] = {}
    for i, route in enumerate(run):
        set_label(route.label)
        for name, factor in zip(route.names, route.leaf.factors([stats[n] for n in route.names], route.layers)):
            factors[name] = factor if name not in factors else factors[name] * factor
            if last_use[name] > i:
                stats[name] = stats[name].scaled(factor)
    set_label("scale gradients")
    for name, factor in factors.items():
        grads[name] = norms.scaled(grads[name], factor)
