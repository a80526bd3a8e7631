"""The policy applied to ``.grad`` after backward: ``fxgrad.backend(..., scope="step")``.

A backward graph only holds the gradients of one graph, of one micro-batch,
before the data-parallel all-reduce. When the policy must see more (a global
clip across graph breaks, the gradient accumulated over micro-batches, the
all-reduced gradient of DDP, FSDP2's sharded gradients), apply it once per
optimizer step instead::

    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1.0), scope="step")
    model = backend.compile(model)            # the backward graphs are left alone
    for micro_batch in micro_batches:
        loss_fn(model(micro_batch)).backward()
    backend.step()                            # once, on the accumulated gradient
    optimizer.step()

The same plain-torch rules run eagerly on the real gradients, state and
statistics included; nothing syncs with the host. FSDP2's DTensor gradients
work: norms are reduced over the shards (DTensor all-reduces the partial sums).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn as nn

from fxgrad.base import Transform
from fxgrad.context import GraphContext
from fxgrad.execute import Executor
from fxgrad.layers import ParamRow, SkipEntry, build_layers, parameter_owners
from fxgrad.state import StateStore


def apply_to_grads(
    transform: Transform,
    models: Sequence[tuple[nn.Module, str]],
    skip: Sequence[SkipEntry],
    store: StateStore,
    scaler: Any = None,
    order: Sequence[str] = (),
) -> None:
    """Apply ``transform`` to the ``.grad`` of ``models``' parameters, in place.

    ``models`` pairs each model with its layer-name prefix; ``order`` is the
    forward order of layers (for depth), named-module order when empty.
    """
    owners = {}
    for model, prefix in models:
        for key, owner in parameter_owners(model, prefix).items():
            owners.setdefault(key, owner)  # a parameter reachable from two models counts once
    with_grad = [o for o in owners.values() if o.tensor.grad is not None]
    if not with_grad:
        return
    rows = [ParamRow(o.layer, o.param, type(o.module), o.tensor.numel()) for o in with_grad]
    layers = build_layers(rows, order or list(dict.fromkeys(o.layer for o in owners.values())), skip)
    routes = [(i, route) for i, route in enumerate(transform.routes(layers)) if route.layers]
    params: dict[str, list[nn.Parameter]] = {}
    for owner in with_grad:
        params.setdefault(owner.layer, []).append(owner.tensor)
    grads = {layer: [p.grad for p in ps] for layer, ps in params.items()}
    by_name = {o.param: o.tensor for o in with_grad}
    with torch.no_grad():
        graph = GraphContext(store, with_grad[0].tensor.grad.device, scaler, lambda names: [by_name[n] for n in names])
        Executor(grads, graph, lambda label: None).run(routes)
        graph.finish()
        for layer, ps in params.items():
            for param, grad in zip(ps, grads[layer]):
                if grad is not param.grad:
                    param.grad.copy_(grad)
