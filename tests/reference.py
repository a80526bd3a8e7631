"""Eager reference implementations, written independently of fxgrad.

They act in place on ``param.grad`` after a plain eager backward, using
``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_`` where torch has
them and float64 loops elsewhere.
"""

from __future__ import annotations

import fnmatch

import torch
import torch.nn as nn
from torch.nn.utils.parametrize import ParametrizationList

NORM_TYPES = (
    nn.LayerNorm,
    nn.GroupNorm,
    nn.RMSNorm,
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.SyncBatchNorm,
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.InstanceNorm3d,
)
NORM_PATTERNS = ("*LayerNorm*", "*RMSNorm*", "*GroupNorm*", "*BatchNorm*", "*InstanceNorm*")


def is_norm_layer(name: str, module: nn.Module) -> bool:
    """docs/transforms.md, "The skip list": torch's norm types, and the patterns matched
    against the class name and the layer's qualified name."""
    names = (type(module).__name__, name)
    return isinstance(module, NORM_TYPES) or any(fnmatch.fnmatchcase(n, p) for n in names for p in NORM_PATTERNS)


def layers(model: nn.Module) -> list[tuple[str, nn.Module, list[nn.Parameter]]]:
    """Modules that own parameters directly; a shared parameter goes to its first owner, and the
    originals of a parametrized tensor (``<name>.parametrizations.weight.original``) to the
    module they parametrize (docs/transforms.md, "Layers")."""
    seen: set[int] = set()
    modules = dict(model.named_modules())
    out: dict[str, tuple[nn.Module, list[nn.Parameter]]] = {}
    for name, module in modules.items():
        own = [p for p in module.parameters(recurse=False) if id(p) not in seen]
        seen.update(map(id, own))
        if isinstance(module, ParametrizationList):
            name = name.rsplit(".", 2)[0] if name.count(".") >= 2 else ""
            module = modules[name]
        if own:
            out.setdefault(name, (module, []))[1].extend(own)
    return [(name, module, params) for name, (module, params) in out.items()]


def wide(x):
    """``x`` in float64, or complex128: complex values keep their imaginary part."""
    return x.to(torch.complex128 if x.is_complex() else torch.float64)


def trainable_layers(model, skip_norm=True):
    """``(name, module, params with a gradient)`` for layers per-layer transforms touch."""
    out = []
    for name, module, params in layers(model):
        if skip_norm and is_norm_layer(name, module):
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
            handles.append(
                module.register_forward_pre_hook(
                    lambda m, a, name=name: order.append(name) if name not in order else None
                )
            )
    with torch.no_grad():
        model(*args, **kwargs)
    for h in handles:
        h.remove()
    return order


def clip_global(model, max_norm, norm_type=2.0):
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], max_norm, norm_type)


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
        self.norms = (self.norms + [total])[-self.history :]
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
        std = self.var**0.5
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
            z = (norm - mean) / (var**0.5 + 1e-12)
            spike = count >= self.warmup and z > self.spike_z
            if count == 0:
                mean, var = norm, 0.0
            else:
                rate, diff = 1 - self.ema, norm - mean
                mean, var = mean + rate * diff, (1 - rate) * (var + rate * diff * diff)
            self.state[name] = (mean, var, count + 1)
            out[name] = {"grad_norm": norm, "grad_norm_ema": mean, "grad_norm_std": var**0.5, "spike": float(spike)}
        return out


def _layer_grads64(params):
    return [p.grad.double() for p in params]


def _set(params, values):
    for p, v in zip(params, values):
        p.grad.copy_(v.to(p.grad.dtype))


def normalize(model, norm="l2", scale=1.0, eps=1e-8):
    """``g <- scale * g / (||g|| + eps)`` per non-norm layer, float64."""
    for _, _, params in trainable_layers(model):
        grads = _layer_grads64(params)
        flat = torch.cat([g.reshape(-1) for g in grads])
        n = {"l2": flat.norm(), "linf": flat.abs().max(), "rms": flat.norm() / flat.numel() ** 0.5}[norm]
        _set(params, [g * (scale / (n + eps)) for g in grads])


def sinkhorn(model, iters=5, eps=1e-8):
    for _, _, params in trainable_layers(model):
        values = []
        for g in _layer_grads64(params):
            if g.dim() >= 2:
                y = g.reshape(g.shape[0], -1)
                m, n = y.shape
                for _ in range(iters):
                    y = y * (n**0.5 / (y.norm(dim=1, keepdim=True) + eps))
                    y = y * (m**0.5 / (y.norm(dim=0, keepdim=True) + eps))
                values.append(y.reshape(g.shape))
            else:
                values.append(g * (g.numel() ** 0.5 / (g.norm() + eps)))
        _set(params, values)


def agc(model, clipping=0.01, eps=1e-3):
    """timm's adaptive_clip_grad, unit-wise, float64."""

    def unitwise(x):
        dims = tuple(range(1, x.dim()))
        return x.norm() if x.dim() <= 1 else torch.linalg.vector_norm(x, dim=dims, keepdim=True)

    for _, _, params in trainable_layers(model):
        for p in params:
            g = wide(p.grad)
            bound = unitwise(wide(p.detach())).clamp(min=eps) * clipping
            norm = unitwise(g)
            p.grad.copy_(torch.where(norm < bound, g, g * (bound / norm.clamp(min=1e-6))).to(p.grad.dtype))


def trust_ratio(model, coefficient=1.0, eps=0.0, min_norm=0.0):
    for _, _, params in trainable_layers(model):
        w = torch.cat([p.detach().double().reshape(-1) for p in params]).norm().clamp(min=min_norm)
        g = torch.cat([p.grad.double().reshape(-1) for p in params]).norm().clamp(min=min_norm)
        ratio = 1.0 if w == 0 or g == 0 else coefficient * w / (g + eps)
        _set(params, [p.grad.double() * ratio for p in params])


class Drift:
    def __init__(self, every, min_denominator=0.1):
        self.every, self.min_denominator = every, min_denominator
        self.initial, self.factor, self.steps = {}, {}, 0

    def step(self, model):
        import math

        for name, _, params in trainable_layers(model):
            w = torch.cat([p.detach().double().reshape(-1) for p in params]).norm().item()
            self.initial.setdefault(name, w)
            if self.steps % self.every == 0:
                self.factor[name] = 1.0 / max(1.0 + math.log(w / self.initial[name]), self.min_denominator)
            _set(params, [p.grad.double() * self.factor[name] for p in params])
        self.steps += 1


class Balance:
    def __init__(self, k, lam, every, entropy_drop):
        self.k, self.lam, self.every, self.entropy_drop = k, lam, every, entropy_drop
        self.entropy, self.steps = 0.0, 0

    def step(self, model):
        import math

        chosen = trainable_layers(model)
        norms = [torch.cat([wide(p.detach()).reshape(-1) for p in ps]).norm().item() for _, _, ps in chosen]
        share = [n / sum(norms) for n in norms]
        entropy = -sum(p * math.log(p) for p in share if p > 0)
        applied = False
        if self.steps % self.every == 0:
            if self.steps > 0 and self.entropy - entropy > self.entropy_drop:
                applied = True
                k = min(self.k, len(chosen) // 2)
                order = sorted(range(len(norms)), key=norms.__getitem__)
                top, bottom = order[-k:], order[:k]
                delta = (sum(norms[i] for i in top) - sum(norms[i] for i in bottom)) / (2 * k)
                for sign, picked in ((1.0, top), (-1.0, bottom)):
                    for i in picked:
                        for p in chosen[i][2]:
                            p.grad.add_((sign * 2 * self.lam * delta * wide(p.detach())).to(p.grad.dtype))
            self.entropy = entropy
        self.steps += 1
        return applied


class MultiNormalize:
    """The documented selection rule, per layer, on the host (float64)."""

    RANK = {"l2": 0, "rms": 0, "mix": 1, "linf": 2}

    def __init__(self, schedule, thresholds, candidates, eps=1e-8):
        self.schedule, self.thresholds, self.candidates, self.eps = schedule, thresholds, candidates, eps
        self.state = {}

    @staticmethod
    def _segment(pieces, step):
        return [value for start, value in pieces if step >= start][-1]

    def step(self, model):
        import math

        out = {}
        for name, _, params in trainable_layers(model):
            flat = torch.cat([p.grad.double().reshape(-1) for p in params])
            n = flat.numel()
            values = {
                "l2": flat.norm().item(),
                "linf": flat.abs().max().item(),
                "rms": flat.norm().item() / math.sqrt(n),
            }
            l1 = flat.abs().sum().item()
            rho = min(max(1 - (math.pi / 2) * l1 * l1 / (n * max(values["l2"], 1e-30) ** 2), 0.0), 1.0)
            choice, reference, steps = self.state.get(name, (0, 0.0, 0))
            norms = self._segment(self.schedule, steps)
            allowed = sorted(list(norms) + (["mix"] if len(norms) > 1 else []), key=self.RANK.__getitem__)
            ladder = [self.candidates.index(c) for c in allowed]
            fresh = ladder[min(max(int(math.floor(rho * len(ladder))), 0), len(ladder) - 1)]
            threshold = self._segment(self.thresholds, steps)
            if steps == 0 or abs(rho - reference) > threshold * max(reference, 1e-3) or choice not in ladder:
                choice, reference = fresh, rho
            self.state[name] = (choice, reference, steps + 1)
            chosen = self.candidates[choice]
            if chosen == "mix":
                divisor = math.exp(sum(math.log(max(values[m], 1e-30)) for m in norms) / len(norms))
            else:
                divisor = values[chosen]
            _set(params, [p.grad.double() / (divisor + self.eps) for p in params])
            out[name] = (choice, rho)
        return out


class AdaGC:
    """AdaGC as the authors' released code runs it (github.com/lishuai-97/AdaGC, commit 32c249f,
    ``megatron/optimizer/clip_grads.py``, class ``AdaGC``), single process, fp32 norms.

    State: ``t`` (calls so far) and ``gamma``, one 0-dim fp32 tensor per parameter name, set
    the first time the parameter has a gradient. ``step(model)`` edits ``.grad`` in place
    and returns the global norm of the raw gradients; ``clipped`` lists the parameters the
    adaptive phase clipped this step.
    """

    def __init__(self, lambda_abs=1.0, lambda_rel=1.04, beta=0.99, warmup=100, eps=1e-6):
        self.lambda_abs, self.lambda_rel, self.beta, self.warmup, self.eps = lambda_abs, lambda_rel, beta, warmup, eps
        self.t, self.gamma, self.clipped = 0, {}, []

    @staticmethod
    def _norm(grad):
        return torch.linalg.vector_norm(grad.detach().float())

    @torch.no_grad()
    def step(self, model):
        self.t += 1
        self.clipped = []
        live = [(name, p) for name, p in model.named_parameters() if p.grad is not None]
        total = sum(float(self._norm(p.grad)) ** 2 for _, p in live) ** 0.5
        if self.t <= self.warmup:  # GlobalGC to lambda_abs; gamma = running min of the clipped norms
            coef = self.lambda_abs / (total + self.eps)
            if coef < 1.0:
                for _, p in live:
                    p.grad.mul_(coef)
            for name, p in live:
                n = self._norm(p.grad)
                if name not in self.gamma or n < self.gamma[name]:
                    self.gamma[name] = n.clone()
        else:  # each tensor against lambda_rel * gamma; gamma = EMA of the clipped norms
            for name, p in live:
                n = self._norm(p.grad)
                if name not in self.gamma:
                    self.gamma[name] = n.clone()
                previous = self.gamma[name]
                threshold = self.lambda_rel * previous
                if n > threshold:
                    p.grad.mul_(threshold / (n + self.eps))
                    n = threshold
                    self.clipped.append(name)
                self.gamma[name] = previous * self.beta + n * (1.0 - self.beta)
        return total
