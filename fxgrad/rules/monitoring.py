"""Per-layer gradient-norm monitoring on the device: ``fxgrad.monitor``.

policy = fxgrad.chain(fxgrad.monitor(), fxgrad.rescale(), fxgrad.clip_by_norm(1.0))
...
backend.stats()["grad_norm/fc1"]          # before the transforms after monitor
backend.stats()["grad_norm_clipped/fc1"]  # after the whole policy
"""

from __future__ import annotations

from typing import Sequence

import torch

from fxgrad.core import validate
from fxgrad.core.layers import Layer
from fxgrad.core.rule import ScaleLeaf, field, rule
from fxgrad.runtime.context import RouteContext
from fxgrad.runtime.norm_math import Factor, NormStats
from fxgrad.runtime.state import flat


@rule
class Monitor(ScaleLeaf):
    """Per-layer gradient L2-norm telemetry, kept on the device.

    Place it first in a chain. Each step, for every layer (norm layers
    included) it records in ``backend.stats()``:

    * ``grad_norm/<layer>``: the norm where ``monitor`` sits (before the
      transforms after it), and ``grad_norm_clipped/<layer>`` after the whole
      policy; ``grad_norm/total`` and ``grad_norm/total_clipped`` are derived;
    * ``grad_norm_ema/<layer>``, ``grad_norm_std/<layer>``: an exponentially
      weighted mean and standard deviation (decay ``ema``);
    * ``spike/<layer>``: 1.0 when ``(norm - ema_mean) / ema_std > spike_z``,
      against the statistics before this step, once the layer has ``warmup``
      steps of history;
    * ``weight_norm/<layer>`` with ``weights=True``: the parameters' L2 norm,
      for spotting norm drift between layers (read on the device);
    * ``rank_mismatch`` with ``check_ranks=True``: 1.0 when the ranks of a
      ``torch.distributed`` job disagree on these norms (a checksum of them
      differs beyond a relative 1e-6), which the exact modes (step scope) rule
      out: a rank whose gradients went out of sync. One all-reduce of 2 values
      per step; 0.0 in a single process; ``scope="graph"`` in a multi-process
      job raises ``ValueError`` (each rank sees its own gradient there).

    With a GradScaler, the norms are unscaled. A step with any non-finite norm
    (an overflow step, which a GradScaler skips) is reported but leaves every
    layer's EMA statistics as they were. It changes no gradient.

        >>> import fxgrad
        >>> fxgrad.monitor(ema=0.99, weights=True)
        monitor(ema=0.99, spike_z=3.0, warmup=10, weights=True)
        >>> fxgrad.monitor(check_ranks=True)  # backend.stats()["rank_mismatch"]
        monitor(ema=0.9, spike_z=3.0, warmup=10, check_ranks=True)
    """

    name = "monitor"
    per_layer = False  # watches every layer, norm layers included
    folds = "identity"

    ema: float = 0.9
    spike_z: float = 3.0
    warmup: int = field(10, kw_only=True)
    weights: bool = field(False, kw_only=True, shown=lambda rule: rule.weights)
    check_ranks: bool = field(False, kw_only=True, shown=lambda rule: rule.check_ranks)

    def __post_init__(self) -> None:
        for name in ("weights", "check_ranks"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        self.set(
            ema=validate.fraction("ema", self.ema),
            spike_z=validate.positive("spike_z", self.spike_z, allow_inf=False),
            warmup=validate.positive_int("warmup", self.warmup),
        )

    def factors(self, stats: Sequence[NormStats], layers: Sequence[Layer], ctx: RouteContext) -> list[Factor]:
        norm = flat(s.norm(2.0) for s in stats)
        state = ctx.state(per_layer={"mean": 0.0, "var": 0.0, "count": 0.0})
        mean, var, count = state["mean"], state["var"], state["count"]
        z = (norm - mean) / (var.sqrt() + 1e-12)
        spike = (count >= self.warmup) & (z > self.spike_z)
        # exponentially weighted mean and variance (Finch 2009), seeded by the first norm
        rate = 1.0 - self.ema
        diff = norm - mean
        first = count == 0
        new_mean = torch.where(first, norm, mean + rate * diff)
        new_var = torch.where(first, torch.zeros_like(var), (1 - rate) * (var + rate * diff * diff))
        saved = ctx.save(state, finite=norm, mean=new_mean, var=new_var, count=count + 1)
        ctx.emit_per_layer("grad_norm", norm)
        ctx.emit_per_layer("grad_norm_ema", saved["mean"])  # an overflow step's are the kept ones
        ctx.emit_per_layer("grad_norm_std", saved["var"].sqrt())
        ctx.emit_per_layer("spike", spike.to(torch.float64))
        if self.weights:
            ctx.emit_per_layer("weight_norm", ctx.weight_norms())
        if self.check_ranks:  # weighted by position: two layers' norms swapped also differ
            position = torch.arange(1, len(stats) + 1, dtype=norm.dtype, device=norm.device)
            ctx.emit("rank_mismatch", ctx.ranks_differ((norm * position).sum()))
        ctx.after_policy(lambda final: ctx.emit_per_layer("grad_norm_clipped", flat(s.norm(2.0) for s in final)))
        return [1.0] * len(stats)
