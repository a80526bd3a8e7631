"""What the examples share: their models, a synthetic task, a training loop and figure saving.

The models are defined once, in ``bench/models.py``, for the benchmarks and the examples.
"""

import math
import os
import sys

import matplotlib

matplotlib.use("Agg")  # write PNGs, no display needed
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the repository root, for bench/models.py
from bench.models import ResNet, gpt2_lm  # noqa: E402

__all__ = ["HERE", "ResNet", "gpt2", "loss_figure", "plt", "save", "sequences", "tail", "train"]


def gpt2(layers: int = 2):
    """A small GPT-2 (random weights) for the ``sequences`` task: 128 tokens, width 64."""
    return gpt2_lm(layers, width=64, vocab=128, positions=64)


def sequences(seed: int, size: int = 16, length: int = 32) -> torch.Tensor:
    """Arithmetic sequences mod 128 with a random start and stride: a learnable next-token task."""
    gen = torch.Generator().manual_seed(seed)
    start = torch.randint(0, 128, (size, 1), generator=gen)
    stride = torch.randint(1, 8, (size, 1), generator=gen)
    return (start + stride * torch.arange(length)) % 128


def train(name, compiled, optimizer, loss_at, steps, on_step=None, stop_if_nonfinite=False):
    """Runs ``steps`` optimizer steps and returns each step's loss as a float.

    ``loss_at(compiled, step)`` returns the loss, or a dict of named losses whose sum is
    minimized; then the result is a dict of lists, one per name. ``on_step(step, loss)``
    runs after each step. Losses are copied to the host once, at the end, unless
    ``stop_if_nonfinite`` checks each step's (and stops after the first non-finite one).
    """
    recorded = []
    for step in tqdm(range(steps), desc=name):
        parts = loss_at(compiled, step)
        named = parts if isinstance(parts, dict) else {"loss": parts}
        loss = sum(named.values())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        recorded.append({key: value.detach() for key, value in named.items()})
        if on_step is not None:
            on_step(step, loss)
        if stop_if_nonfinite and not math.isfinite(loss.item()):
            break
    curves = {key: torch.stack([r[key] for r in recorded]).tolist() for key in named}
    return curves if isinstance(parts, dict) else curves["loss"]


def tail(values, n: int = 20) -> float:
    """The mean of the last ``n`` values."""
    return sum(values[-n:]) / n


def loss_figure(curves: dict, title: str, ylabel: str = "training loss"):
    """One log-scale axes with a line per ``{label: losses}``; returns ``(fig, ax)`` for ``save``."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, losses in curves.items():
        ax.plot(losses, label=label)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    return fig, ax


def save(fig, name: str) -> None:
    """Adds a legend to each axes with labelled lines and writes ``examples/<name>``."""
    for ax in fig.axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.tight_layout()
    path = os.path.join(HERE, name)
    fig.savefig(path, dpi=110)
    print(f"saved {path}")
