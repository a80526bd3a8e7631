"""How inserted nodes are marked.

fxgrad records its rules straight into the backward graph (see
``fxgrad/record.py``); every node it adds is named with ``PREFIX`` and carries
``node.meta[TAG]``, a label naming the transform and the layers it acts on::

    [n.meta[TAG] for n in inserted_nodes(bw_gm)]
"""

from __future__ import annotations

import torch.fx

TAG = "fxgrad"
"""``node.meta`` key that marks the nodes fxgrad inserted; its value is a label."""

PREFIX = "fxgrad_"
"""Name prefix of inserted nodes."""


def inserted_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The nodes fxgrad inserted, in graph order."""
    return [n for n in gm.graph.nodes if TAG in n.meta]
