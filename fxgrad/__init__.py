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
from fxgrad.normalize import multi_normalize, normalize, sinkhorn
from fxgrad.telemetry import monitor
from fxgrad.transforms import clip_by_global_norm, clip_by_norm, clip_by_value, rescale
from fxgrad.weights import adaptive_grad_clip, balance_norms, scale_by_trust_ratio, weight_norm_drift

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
    "adaptive_grad_clip",
    "autoclip",
    "backend",
    "balance_norms",
    "by_name",
    "by_type",
    "chain",
    "clip_by_global_norm",
    "clip_by_norm",
    "clip_by_value",
    "explain",
    "from_config",
    "monitor",
    "multi_normalize",
    "normalize",
    "rescale",
    "scale_by_trust_ratio",
    "sinkhorn",
    "skip_nonfinite",
    "step_if_finite",
    "weight_norm_drift",
    "zclip",
    "zero_nonfinite",
]
