"""Per-layer gradient rescaling with a stem multiplier on a small ResNet.

Synthetic CIFAR-like data (32x32 RGB; each of 10 classes is a fixed random
template, samples add noise and a random shift), a 4-block ResNet, SGD with
momentum, both arms compiled with Inductor, same seed and data:

* baseline: no gradient policy;
* ``rescale(alpha=0.5, multipliers={"stem": 3.0})``: each layer's gradient is
  pulled towards the mean layer norm, and the stem (first conv) gets 3x.

Reports the steps each arm needs to reach a training loss of 0.5 (mean of the
last 10 steps) and saves ``examples/resnet_rescale.png``.

    make examples   # or: python examples/resnet_rescale.py
"""

import copy
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from tqdm import tqdm  # noqa: E402

import fxgrad  # noqa: E402

STEPS, LR, TARGET_LOSS = 200, 0.02, 0.5


class Block(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


class ResNet(nn.Module):
    def __init__(self, channels: int = 16, blocks: int = 4) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels)
        self.blocks = nn.Sequential(*[Block(channels) for _ in range(blocks)])
        self.head = nn.Linear(channels, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(torch.relu(self.bn(self.stem(x))))
        return self.head(x.mean(dim=(2, 3)))


TEMPLATES = torch.randn(10, 3, 32, 32, generator=torch.Generator().manual_seed(42))


def batch(step: int, size: int = 64):
    gen = torch.Generator().manual_seed(step)
    labels = torch.randint(0, 10, (size,), generator=gen)
    shift = torch.randint(-3, 4, (2,), generator=gen).tolist()
    images = torch.roll(TEMPLATES[labels], shifts=shift, dims=(2, 3))
    return images + torch.randn(size, 3, 32, 32, generator=gen), labels


def train(name, model, compiled):
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for step in tqdm(range(STEPS), desc=name):
        x, y = batch(step)
        loss = nn.functional.cross_entropy(compiled(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def steps_to(losses, target, window=10):
    for step in range(window, len(losses) + 1):
        if sum(losses[step - window : step]) / window <= target:
            return step
    return None


def main() -> None:
    torch.manual_seed(0)
    base = ResNet()
    plain = copy.deepcopy(base)
    baseline = train("baseline", plain, torch.compile(plain))
    rescaled_model = copy.deepcopy(base)
    policy = fxgrad.rescale(alpha=0.5, multipliers={"stem": 3.0})
    rescaled = train("rescale + stem x3", rescaled_model, fxgrad.backend(policy).compile(rescaled_model))

    for name, losses in (("baseline", baseline), ("rescale + stem x3", rescaled)):
        reached = steps_to(losses, TARGET_LOSS)
        print(f"{name}: loss {TARGET_LOSS} (10-step mean) reached at step "
              f"{reached if reached is not None else f'- (not within {STEPS})'}; "
              f"final 10-step mean {sum(losses[-10:]) / 10:.3f}")

    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(baseline, label="baseline")
    ax.plot(rescaled, label="fxgrad.rescale(alpha=0.5, multipliers={'stem': 3.0})")
    ax.axhline(TARGET_LOSS, color="gray", linestyle="--", label=f"target loss {TARGET_LOSS}")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("ResNet (4 blocks) on synthetic CIFAR-like data, same seed and data")
    ax.legend()
    fig.tight_layout()
    path = os.path.join(os.path.dirname(__file__), "resnet_rescale.png")
    fig.savefig(path, dpi=110)
    print(f"saved {path}")


if __name__ == "__main__":
    main()
