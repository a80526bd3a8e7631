"""Trace a rule over gradients and splice it into a backward graph.

A *rule* is plain torch code over a list of tensors that returns a list of
tensors of the same shapes and dtypes::

    def halve(grads):
        return [g * 0.5 for g in grads]

    new_nodes = splice_rule(bw_gm, [grad_a, grad_b], halve, label="halve",
                            decompositions=table, fake_mode=mode)

The rule is traced with ``make_fx`` under the graph's own fake mode and with the
compiler's decomposition table, so the inserted nodes are the ops the compiler
expects. They go right before the graph's output node, are named with the
``fxgrad_`` prefix, and carry ``meta["fxgrad"] = label`` and a ``stack_trace``
line naming the label (``gm.print_readable(include_stack_trace=True)`` shows it).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import make_fx

TAG = "fxgrad"
"""``node.meta`` key that marks the nodes fxgrad inserted; its value is a label."""

PREFIX = "fxgrad_"
"""Name prefix of inserted nodes."""

Rule = Callable[[list[torch.Tensor]], list[torch.Tensor]]


def splice_rule(
    gm: torch.fx.GraphModule,
    values: Sequence[torch.fx.Node],
    rule: Rule,
    *,
    label: str,
    decompositions: dict,
    fake_mode: Any,
) -> list[torch.fx.Node]:
    """Insert ``rule(values)`` before the output; return the nodes of its results.

    ``values[i].meta["val"]`` must hold fake tensors of ``fake_mode``. Results
    that the rule returns unchanged come back as the same input node.
    """
    fakes = [node.meta["val"] for node in values]
    with fake_mode:
        traced = make_fx(rule, decomposition_table=decompositions)(fakes)
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    env: dict[torch.fx.Node, torch.fx.Node] = dict(zip(placeholders, values))
    results: list[torch.fx.Node] = []
    output = gm.graph.output_node()
    with gm.graph.inserting_before(output):
        for node in traced.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                results = [env[r] for r in node.args[0]]
                continue
            if node.op == "get_attr":
                raise ValueError(
                    f"rule {label!r} created a tensor constant ({node.target}); use Python "
                    "scalars in rules, or pass tensors as graph inputs"
                )
            node.name = PREFIX + node.name
            copy = gm.graph.node_copy(node, lambda arg: env[arg])
            copy.meta[TAG] = label
            copy.meta["stack_trace"] = f"fxgrad: {label}\n"
            env[node] = copy
    if len(results) != len(values):
        raise ValueError(f"rule {label!r} returned {len(results)} tensors for {len(values)} inputs")
    return results


def inserted_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The nodes fxgrad inserted, in graph order."""
    return [n for n in gm.graph.nodes if TAG in n.meta]
