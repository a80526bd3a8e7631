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
