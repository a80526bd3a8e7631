"""Small real architectures for parity tests, with a batch builder for each.

Every builder returns ``(model, args)``; dropout is off so eager and compiled
runs see the same function.
"""

from __future__ import annotations

import torch
import torch.nn as nn


class MLP(nn.Module):
    def __init__(self, sizes=(16, 64, 64, 32, 4)) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
            layers.append(nn.Linear(a, b))
            if i < len(sizes) - 2:
                layers += [nn.LayerNorm(b), nn.GELU()]
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class CNN(nn.Module):
    """A small ResNet-style network: stem, one residual block, head."""

    def __init__(self, channels: int = 8, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1, bias=False)
        self.bn0 = nn.BatchNorm2d(channels)
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn0(self.stem(x)))
        y = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(x + self.bn2(self.conv2(y)))
        return self.head(x.mean(dim=(2, 3)))


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class Transformer(nn.Module):
    """A tiny decoder-style transformer with tied input/output embeddings."""

    def __init__(self, vocab: int = 50, d: int = 32, heads: int = 4, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(16, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(depth))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.pos[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class LSTMNet(nn.Module):
    """Embedding -> 2-layer LSTM -> linear head."""

    def __init__(self, vocab: int = 20, hidden: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.lstm = nn.LSTM(hidden, hidden, num_layers=2, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embed(ids))
        return self.head(out)


def mlp():
    return MLP(), (torch.randn(8, 16),)


def cnn():
    return CNN(), (torch.randn(4, 3, 8, 8),)


def parametrized():
    """The MLP with parametrized weights: ``weight_norm`` on the first Linear, a custom
    parametrization (a fixed diagonal scale, with its own trainable parameter) on the last."""
    model = MLP()
    nn.utils.parametrizations.weight_norm(model.net[0])
    nn.utils.parametrize.register_parametrization(model.net[-1], "weight", _Scaled(model.net[-1].out_features))
    return model, (torch.randn(8, 16),)


class _Scaled(nn.Module):
    """``W -> diag(s) W``, with ``s`` a trainable parameter of the parametrization itself."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.linspace(0.5, 1.5, rows).unsqueeze(1))

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return self.s * weight


def transformer():
    return Transformer(), (torch.randint(0, 50, (2, 12)),)


def lstm():
    return LSTMNet(), (torch.randint(0, 20, (3, 10)),)


def _hf_ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 12))


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=64,
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    ids = _hf_ids(64)
    return GPT2LMHeadModel(config), (ids,), {"labels": ids}


def bert():
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    ids = _hf_ids(64)
    return BertForMaskedLM(config), (ids,), {"labels": ids}


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    ids = _hf_ids(64)
    return LlamaForCausalLM(config), (ids,), {"labels": ids}


def t5():
    """An encoder-decoder: cross-attention, a relative position bias, T5LayerNorm (skipped by name)."""
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=64,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=1,
        num_decoder_layers=1,
        num_heads=4,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    ids = _hf_ids(64)
    return T5ForConditionalGeneration(config), (ids,), {"labels": _hf_ids(64)}


def mobilebert():
    """NoNorm, an elementwise affine in LayerNorm's place, stored as ``...LayerNorm``: the
    default skip list's patterns match it by name (docs/transforms.md, "The skip list")."""
    from transformers import MobileBertConfig, MobileBertForMaskedLM

    config = MobileBertConfig(
        vocab_size=64,
        hidden_size=32,
        embedding_size=16,
        true_hidden_size=16,
        intra_bottleneck_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        num_feedforward_networks=2,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    ids = _hf_ids(64)
    return MobileBertForMaskedLM(config), (ids,), {"labels": ids}


BUILDERS = {
    "mlp": mlp,
    "cnn": cnn,
    "parametrized": parametrized,
    "transformer": transformer,
    "lstm": lstm,
    "gpt2": gpt2,
    "bert": bert,
    "llama": llama,
    "t5": t5,
    "mobilebert": mobilebert,
}


def build(name: str, seed: int = 0):
    """``(model, args, kwargs)`` for a named architecture, in train mode."""
    torch.manual_seed(seed)
    built = BUILDERS[name]()
    model, args = built[0], built[1]
    kwargs = built[2] if len(built) > 2 else {}
    return model.train(), args, kwargs


def loss_of(output) -> torch.Tensor:
    """HF outputs carry ``.loss``; plain models are scored with a fixed quadratic."""
    loss = getattr(output, "loss", None)
    if loss is not None:
        return loss
    return (output.float() ** 2).mean()
