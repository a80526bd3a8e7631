"""Per-layer clipping of a deep LSTM, inside the compiled backward.

A 3-layer LSTM on the adding problem (sequences of 50 (value, marker)
pairs; the target is 10x the sum of the two marked values), SGD with
momentum at a learning rate where gradients explode. Both arms are
compiled the same way, same seed and data:

* no clipping: ``torch.compile(model)``;
* ``by_type({nn.LSTM: clip_by_norm(0.5)}, default=clip_by_norm(1.0))`` in the backward.

On CPU both arms use ``aot_eager``: Inductor takes minutes to compile the
3-layer LSTM's graphs there.

Dynamo skips ``nn.LSTM`` unless ``torch._dynamo.config.allow_rnn = True``;
without it nothing is compiled and fxgrad reports that instead of silently
not clipping. Saves ``examples/lstm_clipping.png``.

    make examples   # or: python examples/lstm_clipping.py
"""

import copy
import math

import torch
import torch.nn as nn
from common import loss_figure, save, tail, train

import fxgrad

STEPS, LR, LENGTH, TARGET_SCALE = 200, 0.5, 50, 10.0


class AddingLSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(2, 32)
        self.lstm = nn.LSTM(32, 64, num_layers=3, batch_first=True)
        self.head = nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embed(x))
        return self.head(out[:, -1]).squeeze(-1)


def batch(step: int, size: int = 16):
    gen = torch.Generator().manual_seed(step)
    values = torch.rand(size, LENGTH, 1, generator=gen)
    marks = torch.zeros(size, LENGTH, 1)
    first = torch.randint(0, LENGTH // 2, (size,), generator=gen)
    second = torch.randint(LENGTH // 2, LENGTH, (size,), generator=gen)
    marks[torch.arange(size), first] = 1
    marks[torch.arange(size), second] = 1
    return torch.cat([values, marks], -1), (values * marks).sum(dim=(1, 2)) * TARGET_SCALE


def mse(compiled, step):
    x, y = batch(step)
    return nn.functional.mse_loss(compiled(x), y)


def run(name, model, compiled):
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    return train(name, compiled, optimizer, mse, STEPS, stop_if_nonfinite=True)


def main() -> None:
    torch._dynamo.config.allow_rnn = True  # let Dynamo trace nn.LSTM (off by default)
    compiler = "inductor" if torch.cuda.is_available() else "aot_eager"
    torch.manual_seed(0)
    base = AddingLSTM()
    plain = copy.deepcopy(base)
    unclipped = run("no clipping", plain, torch.compile(plain, backend=compiler))

    policy = fxgrad.by_type({nn.LSTM: fxgrad.clip_by_norm(0.5)}, default=fxgrad.clip_by_norm(1.0))
    clipped_model = copy.deepcopy(base)
    backend = fxgrad.backend(policy, compiler=compiler)
    clipped = run("fxgrad per-layer clip", clipped_model, backend.compile(clipped_model))

    chance = 2 / 12 * TARGET_SCALE**2  # variance of the target: predicting the mean
    if math.isfinite(unclipped[-1]):
        print(f"no clipping: final loss {unclipped[-1]:.1f}")
    else:
        print(f"no clipping: non-finite loss at step {len(unclipped) - 1}")
    print(
        f"fxgrad per-layer clip: loss {clipped[0]:.1f} -> {tail(clipped):.1f} "
        f"(mean of the last 20 steps; predicting the mean scores {chance:.1f})"
    )

    fig, ax = loss_figure(
        {
            "no clipping": [v if math.isfinite(v) else float("nan") for v in unclipped],
            "fxgrad: LSTM clip 0.5, others 1.0": clipped,
        },
        f"3-layer LSTM, adding problem (T={LENGTH}), SGD lr {LR}, same seed and data",
        ylabel="training loss (MSE)",
    )
    if not math.isfinite(unclipped[-1]):
        ax.axvline(len(unclipped) - 1, color="C0", linestyle=":", label="no clipping: loss became non-finite")
    ax.axhline(chance, color="gray", linestyle="--", label="predicting the mean")
    save(fig, "lstm_clipping.png")


if __name__ == "__main__":
    main()
