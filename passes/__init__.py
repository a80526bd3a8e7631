"""Pure graph -> graph passes over AOTAutograd backward graphs.

Nothing here knows about fxgrad's policies. The passes take plain data (output
slots, callables over lists of tensors, decomposition tables) and return graph
nodes. They keep the invariants listed in ``README.md``:

* the backward graph's output count and order stay the same;
* every inserted node has ``meta["val"]`` and is tagged with ``meta["fxgrad"]``;
* no inserted node aliases an input or another output;
* every gradient keeps its shape and dtype.
"""

from passes.invariants import OutputSignature, check_outputs, output_signature
from passes.locate import gradient_outputs, replace_gradient_outputs
from passes.splice import TAG, inserted_nodes, splice_rule

__all__ = [
    "TAG",
    "OutputSignature",
    "check_outputs",
    "gradient_outputs",
    "inserted_nodes",
    "output_signature",
    "replace_gradient_outputs",
    "splice_rule",
]
