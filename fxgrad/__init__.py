"""fxgrad: gradient policies compiled into the backward graph.

    import torch, fxgrad

    policy = fxgrad.chain(fxgrad.rescale(alpha=0.5), fxgrad.clip_by_global_norm(1.0))
    model = torch.compile(model, backend=fxgrad.backend(policy))
    print(fxgrad.explain(eager_model, x, backend=fxgrad.backend(policy)))
"""

from fxgrad.adaptive import autoclip, zclip
from fxgrad.backend import Backend, backend
from fxgrad.base import Leaf, Route, Transform
from fxgrad.compose import by_name, by_type, chain
from fxgrad.config import from_config
from fxgrad.coverage import CoverageError, CoverageWarning
from fxgrad.explain import LayerDecision, Report, explain
from fxgrad.layers import DEFAULT_SKIP, Layer
from fxgrad.nonfinite import skip_nonfinite, step_if_finite, zero_nonfinite
from fxgrad.telemetry import monitor
from fxgrad.transforms import clip_by_global_norm, clip_by_norm, clip_by_value, rescale

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
    "autoclip",
    "backend",
    "by_name",
    "by_type",
    "chain",
    "clip_by_global_norm",
    "clip_by_norm",
    "clip_by_value",
    "explain",
    "from_config",
    "monitor",
    "rescale",
    "skip_nonfinite",
    "step_if_finite",
    "zclip",
    "zero_nonfinite",
]
