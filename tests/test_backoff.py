"""``skip_nonfinite(backoff=..., growth_interval=...)`` against a Python reimplementation."""

import contextlib
import copy

import models
import pytest
import reference as ref
import torch
from parity import assert_grads_close, no_host_sync

import fxgrad

NONFINITE = {2, 3, 7}  # steps whose loss is multiplied by inf


class Backoff:
    """The reference: GradScaler's backoff and growth, applied to a threshold factor. A step
    uses the factor as lowered by its own overflow; growth after N finite steps takes
    effect from the next step, as GradScaler.update() grows the scale the next step uses."""

    def __init__(self, backoff, growth_interval):
        self.backoff, self.growth_interval = backoff, growth_interval
        self.scale, self.run = 1.0, 0

    def step(self, finite):
        """The factor this step applies."""
        self.run = self.run + 1 if finite else 0
        if not finite:
            self.scale *= self.backoff
        used = self.scale
        if self.growth_interval and self.run >= self.growth_interval:
            self.scale, self.run = min(self.scale / self.backoff, 1.0), 0
        return used


RULES = [
    (fxgrad.clip_by_global_norm(0.05), lambda m, s: ref.clip_global(m, 0.05 * s)),
    (fxgrad.clip_by_norm(0.02), lambda m, s: ref.clip_per_layer(m, 0.02 * s)),
    (fxgrad.clip_by_value(2e-3), lambda m, s: ref.clip_value(m, 2e-3 * s)),
    (fxgrad.adaptive_grad_clip(0.01), lambda m, s: ref.agc(m, 0.01 * s)),
]


@pytest.mark.parametrize("scope", ["graph", "step"])
@pytest.mark.parametrize("clip, reference", RULES, ids=[rule.name for rule, _ in RULES])
def test_backoff_lowers_and_regrows_the_thresholds_like_the_reference(scope, clip, reference):
    torch.manual_seed(0)
    model = models.MLP()
    eager = copy.deepcopy(model)
    policy = fxgrad.chain(fxgrad.skip_nonfinite(backoff=0.8, growth_interval=3), clip)
    backend = fxgrad.backend(policy, compiler="aot_eager", scope=scope)
    compiled = torch.compile(model, backend=backend)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, eager)]
    expected = Backoff(0.8, 3)
    for step in range(12):
        x = torch.randn(4, 16)
        weight = float("inf") if step in NONFINITE else 1.0
        for optimizer in optimizers:
            optimizer.zero_grad()
        with no_host_sync() if step else contextlib.nullcontext():
            (models.loss_of(compiled(x)) * weight).backward()
            optimizers[0].step()  # step scope: the policy runs here
        (models.loss_of(eager(x)) * weight).backward()
        finite = all(torch.isfinite(p.grad).all() for p in eager.parameters())
        scale = expected.step(finite)
        if finite:
            untouched = [p.grad.clone() for p in eager.parameters()]
            reference(eager, scale)
            assert any(not torch.equal(p.grad, u) for p, u in zip(eager.parameters(), untouched)), "clip idle"
        else:
            for p in eager.parameters():
                p.grad.zero_()
        assert_grads_close(model, eager)
        optimizers[1].step()
        stats = backend.stats()
        assert stats["threshold_scale"].item() == pytest.approx(scale, rel=1e-12), step
        assert stats["nonfinite_step"].item() == (not finite)
    assert expected.scale < 1.0  # the run ends backed off: 7 is the last non-finite step
    for actual, wanted in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(actual, wanted, rtol=1e-5, atol=1e-7)


def test_backoff_state_round_trips_and_never_grows_past_the_threshold():
    policy = fxgrad.chain(fxgrad.skip_nonfinite(backoff=0.5, growth_interval=1), fxgrad.clip_by_norm(1.0))
    backend = fxgrad.backend(policy, compiler="aot_eager")
    model = models.MLP()
    compiled = torch.compile(model, backend=backend)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # the state moves at its step
    for weight in (float("inf"), float("inf"), 1.0):
        model.zero_grad()
        (models.loss_of(compiled(torch.randn(4, 16))) * weight).backward()
        optimizer.step()  # of zeros on the non-finite steps
    state = backend.state_dict()
    assert state["0.skip_nonfinite/threshold_scale"].item() == 0.5  # 0.25, then grown back once
    restored = fxgrad.backend(policy, compiler="aot_eager")
    restored.load_state_dict(state)
    model.zero_grad()
    models.loss_of(torch.compile(model, backend=restored)(torch.randn(4, 16))).backward()
    assert restored.stats()["threshold_scale"].item() == 0.5  # a finite step clips at the lowered threshold
    optimizer.step()
    model.zero_grad()
    models.loss_of(torch.compile(model, backend=restored)(torch.randn(4, 16))).backward()
    assert restored.stats()["threshold_scale"].item() == 1.0  # grown back after it, and no further


@pytest.mark.parametrize(
    "policy, message",
    [
        (fxgrad.chain(fxgrad.skip_nonfinite(backoff=0.8), fxgrad.zclip()), r"backoff: .*none follows it"),
        (fxgrad.chain(fxgrad.clip_by_norm(1.0), fxgrad.skip_nonfinite(backoff=0.8)), r"backoff: .*none follows it"),
    ],
)
def test_backoff_without_a_clip_after_it_is_refused(policy, message):
    with pytest.raises(ValueError, match=message):
        fxgrad.backend(policy)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"backoff": 1.0}, ValueError, r"\bbackoff\b must be in \(0, 1\)"),
        ({"backoff": 0}, ValueError, r"\bbackoff\b must be in \(0, 1\)"),
        ({"growth_interval": 5}, ValueError, r"\bgrowth_interval\b .*give backoff="),
        ({"backoff": 0.5, "growth_interval": 0}, ValueError, r"\bgrowth_interval\b must be >= 1"),
        ({"backoff": 0.5, "growth_interval": 2.5}, TypeError, r"\bgrowth_interval\b must be an int"),
    ],
)
def test_backoff_arguments_are_checked(kwargs, error, message):
    with pytest.raises(error, match=message):
        fxgrad.skip_nonfinite(**kwargs)
