"""Eager reference implementations, written independently of fxgrad.

They act in place on ``param.grad`` after a plain eager backward, using
``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_`` where torch has
them and float64 loops elsewhere.
"""

from __future__ import annotations

import fnmatch

import torch
import torch.nn as nn

NORM_TYPES = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def is_norm_layer(module: nn.Module) -> bool:
    name = type(module).__name__
    return isinstance(module, NORM_TYPES) or "LayerNorm" in name or "RMSNorm" in name


def layers(model: nn.Module) -> list[tuple[str, nn.Module, list[nn.Parameter]]]:
    """Modules that own parameters directly; a shared parameter goes to its first owner."""
    seen: set[int] = set()
    out = []
    for name, module in model.named_modules():
        own = []
        for p in module.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                own.append(p)
        if own:
            out.append((name, module, own))
    return out


def trainable_layers(model, skip_norm=True):
    """``(name, module, params with a gradient)`` for layers per-layer transforms touch."""
    out = []
    for name, module, params in layers(model):
        if skip_norm and is_norm_layer(module):
            continue
        with_grad = [p for p in params if p.grad is not None]
        if with_grad:
            out.append((name, module, with_grad))
    return out


def forward_order(model: nn.Module, *args, **kwargs) -> list[str]:
    """Layer names in the order the forward first calls them (by forward hooks)."""
    order: list[str] = []
    owners = {name for name, _, _ in layers(model)}
    handles = []
    for name, module in model.named_modules():
        if name in owners:
            handles.append(module.register_forward_pre_hook(
                lambda m, a, name=name: order.append(name) if name not in order else None))
    with torch.no_grad():
        model(*args, **kwargs)
    for h in handles:
        h.remove()
    return order


def clip_global(model, max_norm, norm_type=2.0):
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None],
                                   max_norm, norm_type)


def clip_per_layer(model, max_norm, norm_type=2.0, select=lambda name, module: True):
    for name, module, params in trainable_layers(model):
        if select(name, module):
            torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)


def clip_value(model, clip_value):
    for _, _, params in trainable_layers(model):
        torch.nn.utils.clip_grad_value_(params, clip_value)


def rescale(model, alpha=0.5, target="mean", multipliers=(), depths=None):
    """``g <- m * (T / (n + 1e-7)) ** alpha * g`` per non-norm layer, in float64."""
    chosen = trainable_layers(model)
    norms = [torch.sqrt(sum((p.grad.double() ** 2).sum() for p in params)) for _, _, params in chosen]
    for (name, module, params), n in zip(chosen, norms):
        if target == "mean":
            t = sum(norms) / len(norms)
        elif callable(target):
            t = target(depths[name], name)
        else:
            t = target
        m = next((f for key, f in multipliers if _matches(key, name, module)), 1.0)
        factor = m * (t / (n + 1e-7)) ** alpha
        for p in params:
            p.grad.copy_((p.grad.double() * factor).to(p.grad.dtype))


def _matches(key, name, module):
    return fnmatch.fnmatchcase(name, key) if isinstance(key, str) else isinstance(module, key)


def total_norm(model) -> float:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item()


class AutoClip:
    """AutoClip as usually written: a Python list of norms and numpy's percentile."""

    def __init__(self, percentile, history, blend):
        self.percentile, self.history, self.blend = percentile, history, blend
        self.norms, self.tau = [], None

    def step(self, model):
        import numpy as np

        total = total_norm(model)
        self.norms = (self.norms + [total])[-self.history:]
        value = float(np.percentile(self.norms, self.percentile))
        self.tau = value if self.tau is None else (1 - self.blend) * self.tau + self.blend * value
        torch.nn.utils.clip_grad_norm_(model.parameters(), self.tau)
        return self.tau


class ZClip:
    """ZClip's algorithm (Kumar et al. 2025, reference code), float64 on the host."""

    def __init__(self, alpha, z_thresh, max_norm, warmup, eps=1e-6):
        self.alpha, self.z_thresh, self.max_norm, self.warmup, self.eps = alpha, z_thresh, max_norm, warmup, eps
        self.buffer, self.mean, self.var = [], None, None

    def step(self, model):
        total = total_norm(model)
        if self.mean is None:
            self.buffer.append(total)
            if len(self.buffer) == self.warmup:
                self.mean = sum(self.buffer) / len(self.buffer)
                self.var = sum((x - self.mean) ** 2 for x in self.buffer) / len(self.buffer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), self.max_norm)
            return None
        std = self.var ** 0.5
        z = (total - self.mean) / (std + self.eps)
        threshold = None
        if z > self.z_thresh:
            threshold = self.mean + (self.z_thresh * std) / (z / self.z_thresh)
        effective = min(threshold if threshold is not None else total, self.max_norm)
        if total > effective:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(effective / (total + 1e-6))
        observed = threshold if threshold is not None else total
        self.mean = self.alpha * self.mean + (1 - self.alpha) * observed
        self.var = self.alpha * self.var + (1 - self.alpha) * (observed - self.mean) ** 2
        return z


class Monitor:
    """Per-layer EMA mean/variance of gradient norms (Finch 2009), and z-score spikes."""

    def __init__(self, ema, spike_z, warmup):
        self.ema, self.spike_z, self.warmup = ema, spike_z, warmup
        self.state = {}

    def step(self, model):
        out = {}
        for name, _, params in layers(model):
            grads = [p.grad for p in params if p.grad is not None]
            if not grads:
                continue
            norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads)).item()
            mean, var, count = self.state.get(name, (0.0, 0.0, 0))
            z = (norm - mean) / (var ** 0.5 + 1e-12)
            spike = count >= self.warmup and z > self.spike_z
            if count == 0:
                mean, var = norm, 0.0
            else:
                rate, diff = 1 - self.ema, norm - mean
                mean, var = mean + rate * diff, (1 - rate) * (var + rate * diff * diff)
            self.state[name] = (mean, var, count + 1)
            out[name] = {"grad_norm": norm, "grad_norm_ema": mean, "grad_norm_std": var ** 0.5,
                         "spike": float(spike)}
        return out
