"""Apply a :class:`~fxgrad.plan.GraphPlan` to a backward graph.

The plan's routes run once, as plain torch code on the gradients' fake
values, under a :class:`~fxgrad.record.GraphRecorder` that appends each op to
the graph. The recorded nodes are tagged with the route they belong to, so the
rewritten graph reads top to bottom in policy order::

    rewrite_backward(bw_gm, plan, passes.gradient_outputs(bw_gm, num_inputs))
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.fx

from fxgrad import _compat, passes
from fxgrad.frontend.plan import GraphPlan
from fxgrad.passes.record import GraphRecorder
from fxgrad.runtime.executor import run_policy
from fxgrad.runtime.state import StateStore


def rewrite_backward(
    gm: torch.fx.GraphModule,
    plan: GraphPlan,
    outputs: list[torch.fx.Node | None],
    store: StateStore,
    scaler: Any = None,
    params: Callable[[Sequence[str]], list[torch.Tensor]] | None = None,
    frame: int = 0,
) -> None:
    """Insert the plan's rules before ``gm``'s output and return their results instead.

    ``store`` holds the transforms' device state; ``scaler`` is the GradScaler
    whose scale the gradients carry, if any; ``params(names)`` returns the
    parameters with those qualified names (for transforms that read weights);
    ``frame`` numbers the compiled frame (see :class:`~fxgrad.context.GraphContext`).
    """
    routes = [(i, route) for i, route in enumerate(plan.routes) if route.layers]
    if not routes:
        return
    signature = passes.output_signature(gm)
    values = [node.meta["val"] for node in outputs if node is not None]
    recorder = GraphRecorder(gm, _compat.detect_fake_mode(values), _compat.inductor_decompositions())
    grads = {name: [recorder.bind(outputs[slot]) for slot in slots] for name, slots in plan.slots.items()}
    with recorder.recording():
        run_policy(routes, grads, store, values[0].device, scaler, params, frame,
                   set_label=lambda label: setattr(recorder, "label", label))
    passes.replace_gradient_outputs(
        gm,
        {slot: recorder.node(grad) for name, slots in plan.slots.items() for slot, grad in zip(slots, grads[name])},
    )
    passes.check_outputs(gm, signature)
