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

import torch
from common import gpt2, loss_figure, save, sequences, tail, train

import fxgrad

STEPS, LR = 300, 3e-3


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(
        v.numel() * v.element_size()
        for s in optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    )


def next_token_loss(compiled, step):
    ids = sequences(step)
    return compiled(ids, labels=ids).loss


def main() -> None:
    torch.manual_seed(0)
    base = gpt2(layers=2)
    params = sum(p.numel() for p in base.parameters())

    adam_model = copy.deepcopy(base)
    adam = torch.optim.AdamW(adam_model.parameters(), lr=LR)
    adam_losses = train("AdamW", torch.compile(adam_model), adam, next_token_loss, STEPS)

    # Every parameter is normalized (skip=()): 2-D weights by Sinkhorn, 1-D ones to RMS 1.
    sink_model = copy.deepcopy(base)
    backend = fxgrad.backend(fxgrad.sinkhorn(iters=5), skip=())
    sgd = torch.optim.SGD(sink_model.parameters(), lr=LR)
    sink_losses = train("SinkGD", backend.compile(sink_model), sgd, next_token_loss, STEPS)

    print(f"parameters: {params:,}")
    print(f"optimizer state: AdamW {state_bytes(adam) / 2**20:.2f} MiB, SinkGD {state_bytes(sgd) / 2**20:.2f} MiB")
    print(f"mean loss over the last 20 steps: AdamW {tail(adam_losses):.3f}, SinkGD {tail(sink_losses):.3f}")

    fig, _ = loss_figure(
        {
            f"AdamW (state {state_bytes(adam) / 2**20:.2f} MiB)": adam_losses,
            "SGD + fxgrad.sinkhorn (state 0 MiB)": sink_losses,
        },
        f"GPT-2 ({params:,} parameters), same seed and data, lr {LR}",
    )
    save(fig, "sinkgd.png")


if __name__ == "__main__":
    main()
