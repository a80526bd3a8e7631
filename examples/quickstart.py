"""Quickstart: a gradient policy compiled into the backward graph.

Trains a small MLP with LayerNorms on a synthetic regression task with
    rescale(alpha=0.5)  ->  clip_by_global_norm(1.0)
running inside the Inductor-compiled backward. Prints fxgrad's per-layer
decisions and the nodes it inserted, checks the first step against eager
PyTorch, then trains. Run with ``make demo``.
"""

import copy

import torch
import torch.nn as nn

import fxgrad


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, 128),
        nn.LayerNorm(128),
        nn.GELU(),
        nn.Linear(128, 128),
        nn.LayerNorm(128),
        nn.GELU(),
        nn.Linear(128, 1),
    )


def eager_reference_step(model, x, y, alpha=0.5, max_norm=1.0):
    """The same policy written by hand after backward(), for comparison."""
    nn.functional.mse_loss(model(x), y).backward()
    layers = [m for m in model if isinstance(m, nn.Linear)]  # LayerNorms are skipped
    norms = [torch.sqrt(sum(p.grad.pow(2).sum() for p in m.parameters())) for m in layers]
    target = sum(norms) / len(norms)
    for m, n in zip(layers, norms):
        for p in m.parameters():
            p.grad.mul_((target / (n + 1e-7)) ** alpha)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


def main() -> None:
    policy = fxgrad.chain(fxgrad.rescale(alpha=0.5), fxgrad.clip_by_global_norm(1.0))
    backend = fxgrad.backend(policy)
    torch.manual_seed(1)
    x, w = torch.randn(512, 32), torch.randn(32, 1)
    y = torch.sin(x @ w) + 0.1 * torch.randn(512, 1)

    model = make_model()
    print(fxgrad.explain(model, x[:64], backend=backend))

    reference = copy.deepcopy(model)
    compiled = backend.compile(model)
    nn.functional.mse_loss(compiled(x[:64]), y[:64]).backward()
    eager_reference_step(reference, x[:64], y[:64])
    worst = max(
        ((p.grad - q.grad).abs().max() / q.grad.abs().max()).item()
        for p, q in zip(model.parameters(), reference.parameters())
    )
    print(f"\nfirst step vs eager reference: max relative difference {worst:.1e}")

    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    optimizer.zero_grad()
    for step in range(201):
        batch = torch.randint(0, 512, (64,))
        loss = nn.functional.mse_loss(compiled(x[batch]), y[batch])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 50 == 0:
            print(f"step {step:3d}  loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
