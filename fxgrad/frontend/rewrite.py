"""Record a policy into a graph: a :class:`~fxgrad.frontend.plan.GraphPlan` into a backward
graph (graph scope), or routes into the step program (step scope).

The routes run once, as plain torch code on the gradients' fake values, under
a :class:`~fxgrad.passes.record.GraphRecorder` that appends each op to the
graph. The recorded nodes are tagged with the route they belong to, so the
rewritten graph reads top to bottom in policy order::

    rewrite_backward(bw_gm, plan, passes.gradient_outputs(bw_gm, num_inputs))
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.fx

from fxgrad import _compat, passes
from fxgrad.core.rule import Route
from fxgrad.frontend.plan import GraphPlan
from fxgrad.passes.record import GraphRecorder
from fxgrad.runtime.context import Fold
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
    fold: Fold = None,
) -> None:
    """Insert the plan's rules before ``gm``'s output and return their results instead.

    ``store`` holds the transforms' device state; ``scaler`` is the GradScaler
    whose scale the gradients carry, if any; ``params(names)`` returns the
    parameters with those qualified names (for transforms that read weights);
    ``frame`` numbers the compiled frame (see :class:`~fxgrad.runtime.context.GraphContext`);
    ``fold`` leaves the global factor, or each layer's, to the optimizer (:meth:`fxgrad.Backend.fold`).
    """
    routes = [(i, route) for i, route in enumerate(plan.routes) if route.layers]
    if not routes:
        return
    signature = passes.output_signature(gm)
    nodes = {name: [outputs[slot] for slot in slots] for name, slots in plan.slots.items()}
    new, _ = record_policy(gm, routes, nodes, store, scaler, params, frame, fold=fold)
    passes.replace_gradient_outputs(
        gm, {slot: node for name, slots in plan.slots.items() for slot, node in zip(slots, new[name])}
    )
    passes.check_outputs(gm, signature)


def record_policy(
    gm: torch.fx.GraphModule,
    routes: Sequence[tuple[int, Route]],
    grads: dict[str, list[torch.fx.Node]],
    store: StateStore,
    scaler: Any = None,
    params: Callable[[Sequence[str]], list[torch.Tensor]] | None = None,
    frame: int = 0,
    fold: Fold = None,
    per_step: bool = False,
) -> tuple[dict[str, list[torch.fx.Node]], torch.fx.Node | None]:
    """Record ``routes`` over the gradient nodes ``grads`` (layer -> its gradients' nodes)
    before ``gm``'s output; the nodes holding each layer's new gradients, in the same order,
    and with ``fold="global"`` the node of the factor left to the optimizer. Recorded nodes whose values
    neither these nor a side effect use are left out. ``per_step``: the step program (step
    scope), not a backward graph."""
    values = [node.meta["val"] for nodes in grads.values() for node in nodes]
    recorder = GraphRecorder(gm, _compat.detect_fake_mode(values), _compat.inductor_decompositions())
    tensors = {name: [recorder.bind(node, name) for node in nodes] for name, nodes in grads.items()}
    with recorder.recording():
        folded = run_policy(
            routes,
            tensors,
            store,
            values[0].device,
            scaler,
            params,
            frame,
            set_label=lambda label: setattr(recorder, "label", label),
            fold=fold,
            per_step=per_step,
            replay=recorder.replay,
        )
    results = {name: [recorder.node(tensor) for tensor in new] for name, new in tensors.items()}
    recorder.eliminate_dead_code(node for nodes in results.values() for node in nodes)
    return results, None if folded is None else recorder.node(folded)
