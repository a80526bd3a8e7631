"""The clipping article's recipe for a non-finite step: roll back, then lower the threshold.

fxgrad does the threshold half on the device: ``skip_nonfinite(backoff=0.8)`` zeroes
a non-finite step's gradients and multiplies the clipping thresholds after it by 0.8
(``growth_interval`` grows them back). The rollback half is the loop's:
``fxgrad.step_if_finite`` tells it (one host sync) that the step was skipped, and it
restores the last good checkpoint of the model and the optimizer. The backend's state
is not rolled back: it holds the lowered threshold.

Two corrupted batches (a NaN in the input) arrive at steps 37 and 38.

    python examples/rollback.py
"""

import copy

import torch
import torch.nn as nn

import fxgrad

STEPS, CHECKPOINT_EVERY, CORRUPTED = 80, 20, (37, 38)


def batch(step: int):
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(step))
    if step in CORRUPTED:
        x[0, 0] = float("nan")
    return x, x.sin().sum(-1, keepdim=True)


def main() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
    policy = fxgrad.chain(fxgrad.skip_nonfinite(backoff=0.8, growth_interval=100), fxgrad.clip_by_global_norm(1.0))
    backend = fxgrad.backend(policy, compiler="aot_eager")
    compiled = torch.compile(model, backend=backend)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    good = None
    for step in range(STEPS):
        if step % CHECKPOINT_EVERY == 0:
            good = step, copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
        x, y = batch(step)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(compiled(x), y)
        loss.backward()
        if not fxgrad.step_if_finite(optimizer, backend):
            saved_at, weights, optimizer_state = good
            model.load_state_dict(weights)
            optimizer.load_state_dict(optimizer_state)
            scale = backend.stats()["threshold_scale"].item()
            print(f"step {step}: non-finite loss; rolled back to step {saved_at}, clip threshold now {scale:.2f}")
        elif step % 20 == 19:
            print(f"step {step}: loss {loss.item():.4f}")
    print(f"non-finite steps: {backend.stats()['nonfinite_steps'].item():.0f}")


if __name__ == "__main__":
    main()
