"""Each benchmarked policy, as an fxgrad transform and as its eager equivalent.

The eager equivalents are what people write today, run after the compiled
model's ``backward()``: ``clip_grad_norm_(foreach=True)``, and per-layer loops.
Rescaling is also measured the way the rescaling article does it, with module
backward hooks (:class:`HookRescaled`).
"""

from __future__ import annotations

import torch
import torch.nn as nn

import fxgrad
from fxgrad.frontend.fold import not_factors, per_layer

NORM_LAYERS = (nn.LayerNorm, nn.BatchNorm2d)


def layer_modules(model: nn.Module) -> list[nn.Module]:
    """The modules that hold parameters themselves, norm layers excepted."""
    return [
        m for m in model.modules() if not isinstance(m, NORM_LAYERS) and any(True for _ in m.parameters(recurse=False))
    ]


def layers_of(model: nn.Module) -> list[list[torch.Tensor]]:
    """Parameters per non-norm layer (tied weights counted once, with their first layer)."""
    seen: set[int] = set()
    out = []
    for module in layer_modules(model):
        params = [p for p in module.parameters(recurse=False) if id(p) not in seen]
        seen.update(id(p) for p in params)
        if params:
            out.append(params)
    return out


def eager_global_clip(model: nn.Module, layers) -> None:
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)


def eager_per_layer_clip(model: nn.Module, layers) -> None:
    for params in layers:
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)


def eager_rescale(model: nn.Module, layers, alpha: float = 0.5) -> None:
    norms = torch.stack(
        [torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params])) for params in layers]
    )
    factors = (norms.mean() / (norms + 1e-7)) ** alpha
    for params, factor in zip(layers, factors):
        torch._foreach_mul_([p.grad for p in params], factor)


class HookRescaled(nn.Module):
    """``model`` with the article's module-hook rescaling: a ``register_full_backward_hook``
    on each non-norm layer scales the gradient flowing into the layer by
    ``(1 / ||g||)^alpha``.

    This is the article's formulation, not fxgrad's ``rescale`` (which scales each layer's
    parameter gradients by ``(mean norm / ||g||)^alpha``): the same work per layer, one norm
    and one scale, but it changes the gradients of the layers below too. Under
    ``torch.compile`` the hooks only run with compiled autograd on. The wrapper gives the
    compiled forward its own code object: Dynamo does not guard on backward hooks, and would
    otherwise reuse an un-hooked copy's graph, silently without hooks (pytorch#117265).

        >>> model = HookRescaled(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)))
    """

    def __init__(self, model: nn.Module, alpha: float = 0.5) -> None:
        super().__init__()
        self.model, self.alpha = model, alpha
        for module in layer_modules(model):
            module.register_full_backward_hook(self._rescale)

    def forward(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def _rescale(self, module: nn.Module, grad_input, grad_output):
        return tuple(
            None if g is None else g * (1.0 / (torch.linalg.vector_norm(g) + 1e-7)) ** self.alpha for g in grad_input
        )


class EagerMonitor:
    """Per-layer norms, EMA mean/variance and spike flags, on the device (no .item())."""

    def __init__(self, ema: float = 0.9, spike_z: float = 3.0) -> None:
        self.ema, self.spike_z, self.mean, self.var = ema, spike_z, None, None

    def __call__(self, model: nn.Module, layers) -> None:
        norms = torch.stack(
            [torch.linalg.vector_norm(torch.stack(torch._foreach_norm([p.grad for p in params]))) for params in layers]
        )
        if self.mean is None:
            self.mean, self.var = norms, torch.zeros_like(norms)
        self.spikes = (norms - self.mean) / (self.var.sqrt() + 1e-12) > self.spike_z
        diff = norms - self.mean
        self.mean = self.mean + (1 - self.ema) * diff
        self.var = self.ema * (self.var + (1 - self.ema) * diff * diff)


def eager_full(monitor: EagerMonitor):
    def full(model: nn.Module, layers) -> None:
        monitor(model, layers)
        eager_rescale(model, layers)
        eager_per_layer_clip(model, layers)

    return full


def eager_agc(model: nn.Module, layers, clipping: float = 0.01, eps: float = 1e-3) -> None:
    """timm's adaptive_clip_grad, unit-wise, in place."""
    for params in layers:
        for p in params:
            dims = tuple(range(1, p.dim())) if p.dim() > 1 else None
            bound = torch.linalg.vector_norm(p.detach(), dim=dims, keepdim=True).clamp_(min=eps).mul_(clipping)
            norm = torch.linalg.vector_norm(p.grad, dim=dims, keepdim=True)
            p.grad.copy_(torch.where(norm < bound, p.grad, p.grad * (bound / norm.clamp(min=1e-6))))


def eager_sinkhorn(model: nn.Module, layers, iters: int = 5) -> None:
    for params in layers:
        for p in params:
            g = p.grad
            if g.dim() >= 2:
                y = g.reshape(g.shape[0], -1)
                m, n = y.shape
                for _ in range(iters):
                    y = y * (n**0.5 / (torch.linalg.vector_norm(y, dim=1, keepdim=True) + 1e-8))
                    y = y * (m**0.5 / (torch.linalg.vector_norm(y, dim=0, keepdim=True) + 1e-8))
                g.copy_(y.reshape(g.shape))
            else:
                g.mul_(g.numel() ** 0.5 / (torch.linalg.vector_norm(g) + 1e-8))


POLICIES = {
    "global_clip": (fxgrad.clip_by_global_norm(1.0), lambda: eager_global_clip),
    "per_layer_clip": (fxgrad.clip_by_norm(1.0), lambda: eager_per_layer_clip),
    "rescale": (fxgrad.rescale(alpha=0.5), lambda: eager_rescale),
    "monitor": (fxgrad.monitor(), EagerMonitor),
    "agc": (fxgrad.adaptive_grad_clip(0.01), lambda: eager_agc),
    "sinkhorn": (fxgrad.sinkhorn(iters=5), lambda: eager_sinkhorn),
    "full": (
        fxgrad.chain(fxgrad.monitor(), fxgrad.rescale(alpha=0.5), fxgrad.clip_by_norm(1.0)),
        lambda: eager_full(EagerMonitor()),
    ),
}
"""name -> (fxgrad transform, factory of its eager equivalent ``f(model, layers)``)."""


OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-4),
    "adamw-fused": lambda params: torch.optim.AdamW(params, lr=1e-4, fused=True),
}


def fold_scopes(transform: fxgrad.Transform, optimizer_name: str) -> tuple[str, ...]:
    """The scopes in which ``backend.fold`` folds the policy into the optimizer ``optimizer_name``:
    any into the update the step program runs (step scope); in graph scope factors per layer
    into the update a program runs, and a single global factor into a fused optimizer's
    ``grad_scale``."""
    leaves = transform.leaves()
    if not optimizer_name.endswith("-fused"):
        return ()
    if per_layer(transform):
        return ("step",) if not_factors(transform) else ("step", "graph")
    if all(leaf.folds is not None for leaf in leaves) and any(leaf.folds == "global" for leaf in leaves):
        return ("step", "graph")
    return ()
