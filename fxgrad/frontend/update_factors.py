"""Update-level factors: a rule's per-layer factor on the optimizer's update, not the gradient.

An Adam-type update divides each gradient by its running RMS, so a per-layer
gradient factor that holds across steps cancels: ``rescale(alpha=0,
multipliers={"0": 3.0})`` moved an MLP's weights by 5e-7 under AdamW in 50 steps.
With ``apply_to="update"`` (``rescale``, ``weight_norm_drift``,
``scale_by_trust_ratio``) the factor ``f`` multiplies what the step changes
instead, ``w <- w_before + f * (w_after - w_before)``: a per-layer learning-rate
scale, weight decay included, under any optimizer that makes one update per
``step()`` (not ``LBFGS``, whose step evaluates its closure several times: refused,
``ValueError``). Under an optimizer that wraps another and calls its ``step()``
(Lookahead, ``ZeroRedundancyOptimizer``), the inner update is scaled, once. Under
plain SGD without weight decay it equals the gradient-level factor; so it does
under momentum while the factor is constant::

    policy = fxgrad.rescale(alpha=0, multipliers={"stem": 3.0}, apply_to="update")
    model = torch.compile(model, backend=fxgrad.backend(policy))
    optimizer = torch.optim.AdamW(model.parameters())  # the stem now steps 3x as far

The policy (either scope) writes each layer's factor as the statistic
``update_factor/<layer>``, on the device. Before the step, once the policy
ran (the backend's ``optimizer.step()`` pre-hook), the weights of those layers
that the optimizer steps and that have a gradient are copied; a global
post-hook scales the change. One copy of those layers' weights during the
step is the cost, and nothing syncs. A step a GradScaler skips runs neither
hook (or, fused, changes nothing to scale).
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch
import torch.nn as nn

from fxgrad.core.layers import ModelParameters, parameter_owners
from fxgrad.core.warn import warn
from fxgrad.frontend.step_check import optimizer_post_hook
from fxgrad.runtime.state import StateStore

STATISTIC = "update_factor"

ROUNDED = (
    "fxgrad: apply_to='update' scales what optimizer.step() changed in {dtype} weights, after the optimizer "
    "rounded them to {dtype}: a change smaller than half the weights' precision is already lost, and the "
    "factor cannot bring it back (a factor of 3 under AdamW at lr=1e-4 moved bfloat16 weights a quarter as "
    "far as lr=3e-4 does). Train with float32 weights (autocast for the compute), or give those layers a "
    "parameter group with their learning rate times the factor."
)


class UpdateFactors:
    """Applies a backend's ``update_factor/<layer>`` statistics to the optimizer steps of its models.

    ``models()`` lists ``(model, layer prefix)`` pairs, as step scope's do; the backend calls
    :meth:`before_step` before each step of its models' optimizers, after the policy ran.
    """

    def __init__(self, store: StateStore, models: Callable[[], list[tuple[nn.Module, str]]]) -> None:
        self.store, self.models = store, models
        self._walk = ModelParameters()
        self._layers: tuple[tuple, dict[int, str]] = ((None, None), {})  # (walk, layers), id(parameter) -> layer
        self._before: weakref.WeakKeyDictionary[torch.optim.Optimizer, list] = weakref.WeakKeyDictionary()
        self._checked: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()  # for low-precision weights
        optimizer_post_hook(self, UpdateFactors.after_step)

    def forget(self) -> None:
        """Drop the kept walk of the parameters (a model died)."""
        self._walk, self._layers = ModelParameters(), ((None, None), {})

    def before_step(self, optimizer: torch.optim.Optimizer, models: list[tuple[nn.Module, str]] | None = None) -> None:
        """Copy the weights ``optimizer`` is about to step that have an update factor
        (``models``: where to find their layers, the backend's models by default)."""
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ValueError(
                "optimizer: LBFGS evaluates its closure several times within one step(), and an update-level "
                "factor (apply_to='update') would scale only the last of those moves; use apply_to='grad', "
                "or an optimizer that makes one update per step()"
            )
        layer_of = self._layer_of(self.models() if models is None else models)
        copies = [
            (p, layer_of[id(p)], p.detach().clone())
            for group in optimizer.param_groups
            for p in group["params"]
            if id(p) in layer_of and p.grad is not None
        ]
        if not copies:
            return
        if optimizer not in self._checked:  # at its first step with factors
            self._checked.add(optimizer)
            low = next((p.dtype for p, _, _ in copies if p.dtype in (torch.bfloat16, torch.float16)), None)
            if low is not None:
                warn(ROUNDED.format(dtype=str(low).removeprefix("torch.")), RuntimeWarning)
        # A step inside another optimizer's (a wrapper's: Lookahead, ZeroRedundancyOptimizer): the
        # inner update is the one the factor scales; the wrapper leaves these weights alone.
        ids = {id(p) for p, _, _ in copies}
        for other, held in list(self._before.items()):
            if other is not optimizer:
                self._before[other] = [copy for copy in held if id(copy[0]) not in ids]
        self._before[optimizer] = copies

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        copies = self._before.pop(optimizer, None)
        if not copies:
            return
        factors: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for param, layer, before in copies:
                factor = factors.get(layer)
                if factor is None:
                    factor = factors[layer] = self.store.stat(f"{STATISTIC}/{layer}")
                param.sub_(before).mul_(factor).add_(before)

    def _layer_of(self, models: list[tuple[nn.Module, str]]) -> dict[int, str]:
        """``id(parameter) -> layer`` for the parameters of layers with an update factor so far."""
        params = self._walk([model for model, _ in models])
        layers = self.store.stat_layers(STATISTIC)
        walk, known = self._layers[0]
        if walk is not params or known != layers:
            owners = {}
            for model, prefix in models:
                for key, owner in parameter_owners(model, prefix).items():
                    if owner.layer in layers:
                        owners.setdefault(key, owner.layer)
            self._layers = (params, layers), owners
        return self._layers[1]
