"""Apply a :class:`~fxgrad.plan.GraphPlan` to a backward graph.

The plan's routes run once, as plain torch code on the gradients' fake
values, under a :class:`~fxgrad.record.GraphRecorder` that appends each op to
the graph. The recorded nodes are tagged with the route they belong to, so the
rewritten graph reads top to bottom in policy order::

    rewrite_backward(bw_gm, plan, passes.gradient_outputs(bw_gm, num_inputs))
"""

from __future__ import annotations

import torch.fx

import passes
from fxgrad import _compat
from fxgrad.execute import execute
from fxgrad.plan import GraphPlan
from fxgrad.record import GraphRecorder


def rewrite_backward(
    gm: torch.fx.GraphModule, plan: GraphPlan, outputs: list[torch.fx.Node | None]
) -> None:
    """Insert the plan's rules before ``gm``'s output and return their results instead."""
    routes = plan.active_routes()
    if not routes:
        return
    signature = passes.output_signature(gm)
    values = [node.meta["val"] for node in outputs if node is not None]
    recorder = GraphRecorder(gm, _compat.detect_fake_mode(values), _compat.inductor_decompositions())
    grads = {name: [recorder.bind(outputs[slot]) for slot in slots] for name, slots in plan.slots.items()}
    with recorder.recording():
        execute(routes, grads, lambda label: setattr(recorder, "label", label))
    passes.replace_gradient_outputs(
        gm,
        {slot: recorder.node(grad) for name, slots in plan.slots.items() for slot, grad in zip(slots, grads[name])},
    )
    passes.check_outputs(gm, signature)
