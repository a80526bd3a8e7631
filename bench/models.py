"""Benchmark models, sized for a CPU: a GPT-2, a small ResNet, a deep MLP."""

from __future__ import annotations

import torch
import torch.nn as nn


def gpt2_lm(layers: int, width: int, vocab: int, positions: int, heads: int = 4):
    """A GPT-2 language model from transformers: random weights, no dropout. The benchmarks
    and the examples (examples/common.py) build theirs here, each at its own size."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=vocab,
        n_positions=positions,
        n_embd=width,
        n_layer=layers,
        n_head=heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return _causal_lm(GPT2LMHeadModel(config))


def gpt2(scale: float = 1.0):
    """GPT-2 from transformers, random weights; returns (model, batch) and the loss function."""
    ids = torch.randint(0, 2048, (8, 64))
    return gpt2_lm(max(1, round(4 * scale)), width=128, vocab=2048, positions=128), (ids,), {"labels": ids}


def _causal_lm(model):
    """``model`` with its loss named: without it transformers logs a warning inside
    ``forward``, which Dynamo cannot trace (a graph break before the loss)."""
    model.loss_type = "ForCausalLM"
    return model


class _Block(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(x + self.bn2(self.conv2(y)))


class ResNet(nn.Module):
    """A small ResNet for 32x32 RGB images (the benchmarks' and examples/resnet_rescale.py's)."""

    def __init__(self, channels: int = 32, blocks: int = 4, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels)
        self.blocks = nn.Sequential(*[_Block(channels) for _ in range(blocks)])
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(torch.relu(self.bn(self.stem(x))))
        return self.head(x.mean(dim=(2, 3)))


def resnet(scale: float = 1.0):
    return ResNet(blocks=max(1, round(4 * scale))), (torch.randn(16, 3, 32, 32),), {}


def deep_mlp(scale: float = 1.0):
    """Many small tensors: the launch-bound case."""
    depth = max(2, round(48 * scale))
    layers = [nn.Linear(64, 64) if i % 2 == 0 else nn.GELU() for i in range(2 * depth)]
    return nn.Sequential(*layers, nn.Linear(64, 1)), (torch.randn(32, 64),), {}


def wide_mlp(scale: float = 1.0):
    """Few large tensors (8 x Linear(4096): 134M parameters, 512 MiB), for bench/memory.py:
    on the CPU one copy of the gradients stands out of the process's resident set."""
    width = max(64, round(4096 * scale))
    layers = [nn.Linear(width, width) if i % 2 == 0 else nn.GELU() for i in range(16)]
    return nn.Sequential(*layers), (torch.randn(32, width),), {}


def gpt2_124m(scale: float = 1.0):
    """GPT-2 small (124M parameters: 12 layers, d=768) at full size; ``scale`` < 1 shrinks
    depth and width (the CPU dry run of bench/gpu.sh)."""
    layers, width = max(1, round(12 * scale)), max(64, round(768 * scale) // 64 * 64)
    ids = torch.randint(0, 50257, (8, 512 if scale >= 1.0 else 64))
    model = gpt2_lm(layers, width=width, vocab=50257, positions=1024, heads=width // 64)
    return model, (ids,), {"labels": ids}


MODELS = {"gpt2": gpt2, "resnet": resnet, "deep_mlp": deep_mlp, "gpt2_124m": gpt2_124m, "wide_mlp": wide_mlp}


def loss_of(output) -> torch.Tensor:
    loss = getattr(output, "loss", None)
    return loss if loss is not None else output.float().pow(2).mean()
