"""fxgrad: gradient policies compiled into the backward graph.

    import torch, fxgrad

    policy = fxgrad.chain(fxgrad.rescale(alpha=0.5), fxgrad.clip_by_global_norm(1.0))
    model = torch.compile(model, backend=fxgrad.backend(policy))
    print(fxgrad.explain(eager_model, x, backend=fxgrad.backend(policy)))

Every rule (``fxgrad.clip_by_global_norm``, ``fxgrad.rescale``, ...) comes from
the registry in :mod:`fxgrad.core.rule`; the modules under ``fxgrad/rules/``
define them.
"""

from fxgrad.core.layers import DEFAULT_SKIP, Layer
from fxgrad.core.rule import Leaf, Route, Transform
from fxgrad.frontend.backend import Backend, backend
from fxgrad.frontend.config import from_config
from fxgrad.frontend.coverage import CoverageError, CoverageWarning
from fxgrad.frontend.explain import LayerDecision, Report, explain
from fxgrad.frontend.named import backend_for
from fxgrad.rules import RULES
from fxgrad.rules.composition import chain
from fxgrad.rules.nonfinite import step_if_finite
from fxgrad.rules.selection import by_name, by_type

globals().update(RULES)

__all__ = [
    "Backend",
    "CoverageError",
    "CoverageWarning",
    "DEFAULT_SKIP",
    "Layer",
    "LayerDecision",
    "Leaf",
    "Report",
    "Route",
    "Transform",
    "backend",
    "backend_for",
    "by_name",
    "by_type",
    "chain",
    "explain",
    "from_config",
    "step_if_finite",
]
__all__ += sorted(RULES)
