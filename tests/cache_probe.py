"""One training step in a fresh process; prints the gradient norm and cache hits as JSON.

Used by test_cache.py: ``python cache_probe.py <max_norm | none>``.
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
    max_norm = None if sys.argv[1] == "none" else float(sys.argv[1])
    if max_norm is None:
        compiled = torch.compile(model)
    else:
        compiled = torch.compile(model, backend=fxgrad.backend(fxgrad.clip_by_global_norm(max_norm)))
    (compiled(x) ** 2).sum().backward()
    norm = torch.sqrt(sum((p.grad**2).sum() for p in model.parameters())).item()
    print(json.dumps({"norm": norm, "aot_cache_hits": counters["aot_autograd"]["autograd_cache_hit"]}))


if __name__ == "__main__":
    main()
