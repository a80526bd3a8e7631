"""Which kernels hold fxgrad's nodes, on this machine: ``fxgrad.explain(..., kernels=True)``
for an MLP under a global clip, graph scope then step scope (the step program).

On a GPU this shows what the CPU cannot: whether the norms of the gradients that matmuls
(cuBLAS) write run as kernels of their own, and how the step program's per-gradient
kernels are grouped into combo kernels.

    python bench/kernel_report.py --device cuda
"""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn

import fxgrad


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--blocks", type=int, default=4, help="Linear + ReLU blocks")
    options = parser.parse_args()
    torch.manual_seed(0)
    layers = [layer for _ in range(options.blocks) for layer in (nn.Linear(256, 256), nn.ReLU())]
    model = nn.Sequential(*layers, nn.Linear(256, 1)).to(options.device)
    x = torch.randn(64, 256, device=options.device)
    for scope in ("graph", "step"):
        backend = fxgrad.backend(fxgrad.clip_by_global_norm(1.0), scope=scope)
        report = fxgrad.explain(model, x, backend=backend, kernels=True)
        print(f"## scope={scope!r}\n\n{report.kernels_table()}\n", flush=True)


if __name__ == "__main__":
    main()
