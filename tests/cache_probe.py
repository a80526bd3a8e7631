"""Training steps in a fresh process; prints the gradient norm, the policy's statistics and
the cache hits as JSON.

Used by test_cache.py: ``python cache_probe.py <max_norm | step:max_norm | none | stateful |
detached>`` (``step:``: ``scope="step"``, the policy applied at ``optimizer.step()``). A global
clip at ``max_norm`` runs one step; ``stateful`` (monitor and ZClip, whose device state carries
from step to step) runs three; ``detached`` monitors a model whose last layer requires grad
but gets no gradient.
"""

import json
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

import fxgrad


class Detached(nn.Module):
    """``model`` with its last layer's weights read detached: they get no gradient."""

    def __init__(self, model: nn.Sequential) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        last = self.model[-1]
        return F.linear(self.model[:-1](x), last.weight.detach(), last.bias.detach())


def main() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    x = torch.randn(8, 16)
    scope, _, policy = sys.argv[1].rpartition(":")
    backend, steps = None, 1
    if policy == "none":
        compiled = torch.compile(model)
    else:
        if policy == "stateful":
            transform, steps = fxgrad.chain(fxgrad.monitor(), fxgrad.zclip(warmup=2)), 3
        elif policy == "detached":
            model, transform = Detached(model), fxgrad.monitor()
        else:
            transform = fxgrad.clip_by_global_norm(float(policy))
        backend = fxgrad.backend(transform, scope=scope or "graph")
        compiled = torch.compile(model, backend=backend)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1 if steps > 1 else 0.0)
    for _ in range(steps):
        optimizer.zero_grad()
        (compiled(x) ** 2).sum().backward()
        optimizer.step()  # step scope applies the policy here
    norm = torch.sqrt(sum((p.grad**2).sum() for p in model.parameters() if p.grad is not None)).item()
    stats = {} if backend is None else {key: value.item() for key, value in backend.stats().items()}
    hits = {"aot_cache_hits": counters["aot_autograd"]["autograd_cache_hit"], "stats": stats}
    hits["aot_cache_saved"] = counters["aot_autograd"]["autograd_cache_saved"]
    hits["fx_graph_cache_hits"] = counters["inductor"]["fxgraph_cache_hit"]
    print(json.dumps({"norm": norm, **hits}))


if __name__ == "__main__":
    main()
