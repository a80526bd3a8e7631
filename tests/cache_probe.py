"""One training step in a fresh process; prints the gradient norm and cache hits as JSON.

Used by test_cache.py: ``python cache_probe.py <max_norm | step:max_norm | none>`` (``step:``:
``scope="step"``, the policy applied at ``optimizer.step()``).
"""

import json
import sys

import torch
import torch.nn as nn
from torch._dynamo.utils import counters

import fxgrad


def main() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    x = torch.randn(8, 16)
    scope, _, max_norm = sys.argv[1].rpartition(":")
    if max_norm == "none":
        compiled = torch.compile(model)
    else:
        backend = fxgrad.backend(fxgrad.clip_by_global_norm(float(max_norm)), scope=scope or "graph")
        compiled = torch.compile(model, backend=backend)
    (compiled(x) ** 2).sum().backward()
    torch.optim.SGD(model.parameters(), lr=0.0).step()  # step scope applies the policy here
    norm = torch.sqrt(sum((p.grad**2).sum() for p in model.parameters())).item()
    hits = {"aot_cache_hits": counters["aot_autograd"]["autograd_cache_hit"]}
    hits["fx_graph_cache_hits"] = counters["inductor"]["fxgraph_cache_hit"]
    print(json.dumps({"norm": norm, **hits}))


if __name__ == "__main__":
    main()
