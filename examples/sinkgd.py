"""SinkGD (SGD + in-graph Sinkhorn normalization) versus AdamW on a small GPT-2.

SinkGD (Scetbon et al. 2025) normalizes each weight gradient by alternating
row and column L2 normalization and then takes a plain SGD step, so the
optimizer keeps no state. Here the normalization runs inside the compiled
backward (``fxgrad.sinkhorn``) and the optimizer is ``torch.optim.SGD``
without momentum. Both arms train the same GPT-2 (transformers, random
weights, same seed and data) on a synthetic next-token task; the script
reports optimizer-state memory and loss, and saves ``examples/sinkgd.png``.

    make examples   # or: python examples/sinkgd.py
"""

import copy
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

import fxgrad  # noqa: E402

STEPS, LR = 300, 3e-3


def batch(step: int) -> torch.Tensor:
    """Arithmetic sequences mod 128 with a random start and stride."""
    gen = torch.Generator().manual_seed(step)
    start = torch.randint(0, 128, (16, 1), generator=gen)
    stride = torch.randint(1, 8, (16, 1), generator=gen)
    return (start + stride * torch.arange(32)) % 128


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(v.numel() * v.element_size() for s in optimizer.state.values()
               for v in s.values() if isinstance(v, torch.Tensor))


def train(name, model, compiled, optimizer):
    losses = []
    for step in tqdm(range(STEPS), desc=name):
        ids = batch(step)
        loss = compiled(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())  # one sync per step is fine in an example
    return losses


def main() -> None:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=128, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    base = GPT2LMHeadModel(config)
    params = sum(p.numel() for p in base.parameters())

    adam_model = copy.deepcopy(base)
    adam = torch.optim.AdamW(adam_model.parameters(), lr=LR)
    adam_losses = train("AdamW", adam_model, torch.compile(adam_model), adam)

    # Every parameter is normalized (skip=()): 2-D weights by Sinkhorn, 1-D ones to RMS 1.
    sink_model = copy.deepcopy(base)
    backend = fxgrad.backend(fxgrad.sinkhorn(iters=5), skip=())
    sgd = torch.optim.SGD(sink_model.parameters(), lr=LR)
    sink_losses = train("SinkGD", sink_model, backend.compile(sink_model), sgd)

    def tail(losses):
        return sum(losses[-20:]) / 20

    print(f"parameters: {params:,}")
    print(f"optimizer state: AdamW {state_bytes(adam) / 2**20:.2f} MiB, SinkGD {state_bytes(sgd) / 2**20:.2f} MiB")
    print(f"mean loss over the last 20 steps: AdamW {tail(adam_losses):.3f}, SinkGD {tail(sink_losses):.3f}")

    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(adam_losses, label=f"AdamW (state {state_bytes(adam) / 2**20:.2f} MiB)")
    ax.plot(sink_losses, label="SGD + fxgrad.sinkhorn (state 0 MiB)")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_yscale("log")
    ax.set_title(f"GPT-2 ({params:,} parameters), same seed and data, lr {LR}")
    ax.legend()
    fig.tight_layout()
    path = os.path.join(os.path.dirname(__file__), "sinkgd.png")
    fig.savefig(path, dpi=110)
    print(f"saved {path}")


if __name__ == "__main__":
    main()
