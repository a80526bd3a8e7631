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

import torch
import torch.nn as nn
from common import ResNet, loss_figure, save, tail, train

import fxgrad

STEPS, LR, TARGET_LOSS = 200, 0.02, 0.5

TEMPLATES = torch.randn(10, 3, 32, 32, generator=torch.Generator().manual_seed(42))


def batch(step: int, size: int = 64):
    gen = torch.Generator().manual_seed(step)
    labels = torch.randint(0, 10, (size,), generator=gen)
    shift = torch.randint(-3, 4, (2,), generator=gen).tolist()
    images = torch.roll(TEMPLATES[labels], shifts=shift, dims=(2, 3))
    return images + torch.randn(size, 3, 32, 32, generator=gen), labels


def cross_entropy(compiled, step):
    x, y = batch(step)
    return nn.functional.cross_entropy(compiled(x), y)


def run(name, model, compiled):
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    return train(name, compiled, optimizer, cross_entropy, STEPS)


def steps_to(losses, target, window=10):
    for step in range(window, len(losses) + 1):
        if sum(losses[step - window : step]) / window <= target:
            return step
    return None


def main() -> None:
    torch.manual_seed(0)
    base = ResNet(channels=16)
    plain = copy.deepcopy(base)
    baseline = run("baseline", plain, torch.compile(plain))
    rescaled_model = copy.deepcopy(base)
    policy = fxgrad.rescale(alpha=0.5, multipliers={"stem": 3.0})
    rescaled = run("rescale + stem x3", rescaled_model, fxgrad.backend(policy).compile(rescaled_model))

    for name, losses in (("baseline", baseline), ("rescale + stem x3", rescaled)):
        reached = steps_to(losses, TARGET_LOSS)
        print(
            f"{name}: loss {TARGET_LOSS} (10-step mean) reached at step "
            f"{reached if reached is not None else f'- (not within {STEPS})'}; "
            f"final 10-step mean {tail(losses, 10):.3f}"
        )

    fig, ax = loss_figure(
        {"baseline": baseline, "fxgrad.rescale(alpha=0.5, multipliers={'stem': 3.0})": rescaled},
        "ResNet (4 blocks) on synthetic CIFAR-like data, same seed and data",
    )
    ax.axhline(TARGET_LOSS, color="gray", linestyle="--", label=f"target loss {TARGET_LOSS}")
    save(fig, "resnet_rescale.png")


if __name__ == "__main__":
    main()
