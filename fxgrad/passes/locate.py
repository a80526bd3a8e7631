"""Find the gradient outputs of an AOTAutograd backward graph.

The backward graph returns one value per forward input, in the order of the
forward graph's inputs, with ``None`` where an input gets no gradient::

    outs = gradient_outputs(bw_gm, num_forward_inputs=4)
    # [grad_of_input0, None, grad_of_input2, grad_of_input3]
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch.fx


class GraphMismatchError(RuntimeError):
    """The backward graph does not have one output per forward input."""


def gradient_outputs(gm: torch.fx.GraphModule, num_forward_inputs: int) -> list[torch.fx.Node | None]:
    """One entry per forward input: the node holding its gradient, or ``None``.

    Raises :class:`GraphMismatchError` when the counts differ (AOTAutograd can
    merge duplicate inputs or add synthetic bases; the mapping is then unsafe).
    """
    outputs = list(gm.graph.output_node().args[0])
    if len(outputs) != num_forward_inputs:
        raise GraphMismatchError(
            f"the backward graph returns {len(outputs)} values but its forward graph "
            f"has {num_forward_inputs} inputs; cannot tell which gradient belongs to "
            "which parameter"
        )
    return [node if isinstance(node, torch.fx.Node) else None for node in outputs]


def replace_gradient_outputs(gm: torch.fx.GraphModule, replacements: Mapping[int, torch.fx.Node]) -> None:
    """Make output slot ``i`` return ``replacements[i]``; other slots stay as they are."""
    output = gm.graph.output_node()
    values: Sequence = output.args[0]
    new_values = [replacements.get(i, value) for i, value in enumerate(values)]
    output.args = (type(values)(new_values),) + tuple(output.args[1:])
    gm.recompile()
