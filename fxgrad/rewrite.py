"""Apply a :class:`~fxgrad.plan.GraphPlan` to a backward graph.

Each active route is traced and spliced in order, so the graph reads top to
bottom in policy order, each inserted node tagged with its route's label::

    rewrite_backward(bw_gm, plan, passes.gradient_outputs(bw_gm, num_inputs))
"""

from __future__ import annotations

import torch.fx

import passes
from fxgrad import _compat
from fxgrad.plan import GraphPlan


def rewrite_backward(
    gm: torch.fx.GraphModule, plan: GraphPlan, outputs: list[torch.fx.Node | None]
) -> None:
    """Insert the plan's rules before ``gm``'s output and return their results instead."""
    routes = plan.active_routes()
    if not routes:
        return
    signature = passes.output_signature(gm)
    current = {i: node for i, node in enumerate(outputs) if node is not None}
    fake_mode = _compat.detect_fake_mode([node.meta["val"] for node in current.values()])
    decompositions = _compat.inductor_decompositions()
    for route in routes:
        slots, rule = plan.rule(route)
        results = passes.splice_rule(
            gm,
            [current[slot] for slot in slots],
            rule,
            label=route.label,
            decompositions=decompositions,
            fake_mode=fake_mode,
        )
        current.update(zip(slots, results))
    passes.replace_gradient_outputs(gm, current)
    passes.check_outputs(gm, signature)
