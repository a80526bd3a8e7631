"""Per-layer gradient-norm telemetry from inside the compiled backward.

Trains a small GPT-2 (transformers, random weights) on a synthetic
next-token task with

    chain(monitor(), rescale(alpha=0.5, multipliers={"*.c_attn": 1.3}), clip_by_global_norm(1.0))

and logs ``backend.stats()`` every 10 steps: per-layer norms before and
after the policy, their EMAs and spike flags, all computed on the device
with no host sync in the step. Saves ``examples/telemetry.png``: a heatmap
of per-layer gradient norms over training and the total norm before and
after the policy.

    make examples   # or: python examples/telemetry.py
"""

import math

import torch
from common import gpt2, plt, save, sequences, train

import fxgrad

STEPS, LOG_EVERY = 200, 10


def next_token_loss(compiled, step):
    ids = sequences(step)  # learnable, so norms change as the model learns
    return compiled(ids, labels=ids).loss


def main() -> None:
    torch.manual_seed(0)
    model = gpt2(layers=4)
    policy = fxgrad.chain(
        fxgrad.monitor(ema=0.9),
        fxgrad.rescale(alpha=0.5, multipliers={"*.c_attn": 1.3}),
        fxgrad.clip_by_global_norm(1.0),
    )
    backend = fxgrad.backend(policy)
    compiled = backend.compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

    logged = []  # (step, stats snapshot moved to the CPU)

    def log(step, loss):
        if step % LOG_EVERY == 0:
            # One device->host copy per log call, never per step; a real logger
            # takes the dict as is: wandb.log(backend.stats(), step=step).
            stats = {k: v.cpu() for k, v in backend.stats().items()}
            stats["loss"] = loss.detach().cpu()
            logged.append((step, stats))

    train("training", compiled, optimizer, next_token_loss, STEPS, on_step=log)

    last = logged[-1][1]
    print(
        f"final loss {last['loss'].item():.3f}; total grad norm {last['grad_norm/total'].item():.3f} "
        f"-> {last['grad_norm/total_clipped'].item():.3f} after the policy"
    )
    spikes = sum(v.item() for _, s in logged for k, v in s.items() if k.startswith("spike/"))
    print(f"spike flags raised in the logged steps: {int(spikes)}")
    plot(logged)


def plot(logged) -> None:
    steps = [step for step, _ in logged]
    layers = [k[len("grad_norm/") :] for k in logged[0][1] if k.startswith("grad_norm/") and "total" not in k]
    heat = [[math.log10(max(s[f"grad_norm/{layer}"].item(), 1e-12)) for _, s in logged] for layer in layers]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 9), gridspec_kw={"height_ratios": [3, 1]})
    image = top.imshow(heat, aspect="auto", cmap="viridis", extent=(steps[0], steps[-1], len(layers) - 0.5, -0.5))
    top.set_yticks(range(len(layers)), layers, fontsize=6)
    top.set_title("per-layer gradient norm (log10) before the policy, from backend.stats()")
    fig.colorbar(image, ax=top)
    bottom.plot(steps, [s["grad_norm/total"].item() for _, s in logged], label="total, before")
    bottom.plot(steps, [s["grad_norm/total_clipped"].item() for _, s in logged], label="total, after policy")
    bottom.set_xlabel("step")
    bottom.set_yscale("log")
    save(fig, "telemetry.png")


if __name__ == "__main__":
    main()
