"""The graph layer: pure functions over AOTAutograd backward graphs.

Nothing here knows about fxgrad's policies; the functions take graphs and
plain data. What a rewrite must keep (one gradient slot per forward input,
each gradient's shape and dtype) and which of it is checked at run time is
written down once, in docs/design.md, "Graph invariants".
"""

from fxgrad.passes.invariants import OutputSignature, check_outputs, output_signature
from fxgrad.passes.locate import (
    GraphMismatchError,
    gradient_outputs,
    replace_gradient_outputs,
)
from fxgrad.passes.tags import PREFIX, TAG, inserted_nodes

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
