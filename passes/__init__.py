"""Pure graph functions over AOTAutograd backward graphs.

Nothing here knows about fxgrad's policies; the functions take graphs and
plain data. They guard the invariants listed in ``README.md``:

* the backward graph's output count and order stay the same;
* every gradient keeps its shape and dtype;
* every inserted node has ``meta["val"]`` and is tagged with ``meta["fxgrad"]``.
"""

from passes.invariants import OutputSignature, check_outputs, output_signature
from passes.locate import GraphMismatchError, gradient_outputs, replace_gradient_outputs
from passes.tags import PREFIX, TAG, inserted_nodes

__all__ = [
    "PREFIX",
    "TAG",
    "GraphMismatchError",
    "OutputSignature",
    "check_outputs",
    "gradient_outputs",
    "inserted_nodes",
    "output_signature",
    "replace_gradient_outputs",
]
