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
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

import fxgrad  # noqa: E402

STEPS, LOG_EVERY = 200, 10


def make_model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=128, n_positions=64, n_embd=64, n_layer=4, n_head=4,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def batch(step: int) -> torch.Tensor:
    """Arithmetic sequences mod 128: learnable, so norms change as the model learns."""
    gen = torch.Generator().manual_seed(step)
    start = torch.randint(0, 128, (16, 1), generator=gen)
    stride = torch.randint(1, 8, (16, 1), generator=gen)
    return (start + stride * torch.arange(32)) % 128


def main() -> None:
    model = make_model()
    policy = fxgrad.chain(
        fxgrad.monitor(ema=0.9),
        fxgrad.rescale(alpha=0.5, multipliers={"*.c_attn": 1.3}),
        fxgrad.clip_by_global_norm(1.0),
    )
    backend = fxgrad.backend(policy)
    compiled = backend.compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

    logged = []  # (step, stats snapshot moved to the CPU)
    for step in tqdm(range(STEPS), desc="training"):
        ids = batch(step)
        loss = compiled(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % LOG_EVERY == 0:
            # One device->host copy per log call, never per step; a real logger
            # takes the dict as is: wandb.log(backend.stats(), step=step).
            stats = {k: v.cpu() for k, v in backend.stats().items()}
            stats["loss"] = loss.detach().cpu()
            logged.append((step, stats))

    last = logged[-1][1]
    print(f"final loss {last['loss'].item():.3f}; total grad norm {last['grad_norm/total'].item():.3f} "
          f"-> {last['grad_norm/total_clipped'].item():.3f} after the policy")
    spikes = sum(v.item() for _, s in logged for k, v in s.items() if k.startswith("spike/"))
    print(f"spike flags raised in the logged steps: {int(spikes)}")
    plot(logged, os.path.join(os.path.dirname(__file__), "telemetry.png"))


def plot(logged, path: str) -> None:
    steps = [step for step, _ in logged]
    layers = [k[len("grad_norm/"):] for k in logged[0][1] if k.startswith("grad_norm/") and "total" not in k]
    heat = [[math.log10(max(s[f"grad_norm/{layer}"].item(), 1e-12)) for _, s in logged] for layer in layers]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 9), gridspec_kw={"height_ratios": [3, 1]})
    image = top.imshow(heat, aspect="auto", cmap="viridis",
                       extent=(steps[0], steps[-1], len(layers) - 0.5, -0.5))
    top.set_yticks(range(len(layers)), layers, fontsize=6)
    top.set_title("per-layer gradient norm (log10) before the policy, from backend.stats()")
    fig.colorbar(image, ax=top)
    bottom.plot(steps, [s["grad_norm/total"].item() for _, s in logged], label="total, before")
    bottom.plot(steps, [s["grad_norm/total_clipped"].item() for _, s in logged], label="total, after policy")
    bottom.set_xlabel("step")
    bottom.set_yscale("log")
    bottom.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"saved {path}")


if __name__ == "__main__":
    main()
