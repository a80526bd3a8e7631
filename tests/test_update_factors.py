"""apply_to="update": a rule's per-layer factor multiplies the optimizer's update, not the gradient."""

import math
import warnings

import pytest
import torch
import torch.nn as nn
from parity import no_host_sync

import fxgrad

STEPS = 20
STEM_3X = fxgrad.rescale(alpha=0, multipliers={"0": 3.0}, apply_to="update")
X = torch.randn(32, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 2)).double()


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def sgd_momentum(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def train(model, optimizer, forward=None, steps=STEPS, each_step=lambda: None):
    forward = forward or model
    for _ in range(steps):
        each_step()
        forward(X).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


def compiled(policy, scope, compile_with):
    model = mlp()
    backend = fxgrad.backend(policy, compiler="aot_eager", scope=scope)
    return model, compile_with(backend, model), backend


def assert_same_weights(actual, expected, rtol=1e-6):
    for (name, a), b in zip(actual.named_parameters(), expected.parameters()):
        torch.testing.assert_close(a, b, rtol=rtol, atol=rtol * b.detach().abs().max().item(), msg=name)


@pytest.mark.parametrize("scope", ["graph", "step"])
def test_under_adamw_the_stem_multiplier_is_the_stem_learning_rate(scope, compile_with):
    """The rescaling article's "amplify the stem 3x" under AdamW: a gradient factor cancels
    in m / sqrt(v); the update-level one makes the stem step 3x as far (its own learning rate,
    weight decay included)."""
    model, forward, _ = compiled(STEM_3X, scope, compile_with)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an update-level factor does not cancel: no warning
        train(model, adamw(model.parameters()), forward)
    expected = mlp()
    stem = list(expected[0].parameters())
    rest = [p for layer in expected[1:] for p in layer.parameters()]
    train(expected, adamw([{"params": stem, "lr": 3e-2}, {"params": rest}]))
    assert_same_weights(model, expected)
    untouched = train(mlp(), adamw(mlp().parameters()))
    assert (model[0].weight - untouched[0].weight).abs().max() > 1e-2  # it acted


@pytest.mark.parametrize("scope", ["graph", "step"])
@pytest.mark.parametrize("optimizer", [sgd_momentum, lambda params: torch.optim.SGD(params, lr=0.1)])
def test_under_sgd_it_equals_the_gradient_level_factor(scope, optimizer, compile_with):
    model, forward, _ = compiled(STEM_3X, scope, compile_with)
    train(model, optimizer(model.parameters()), forward)
    gradient_level = fxgrad.rescale(alpha=0, multipliers={"0": 3.0})
    expected, expected_forward, _ = compiled(gradient_level, scope, compile_with)
    train(expected, optimizer(expected.parameters()), expected_forward)
    assert_same_weights(model, expected)


class Delegating(torch.optim.Optimizer):
    """An optimizer that steps another (Lookahead, ZeroRedundancyOptimizer): the step hooks of both run."""

    def __init__(self, inner):
        self.inner = inner
        super().__init__(inner.param_groups, inner.defaults)
        self.param_groups = inner.param_groups

    def step(self, closure=None):
        return self.inner.step(closure)


@pytest.mark.parametrize("scope", ["graph", "step"])
def test_an_optimizer_stepping_another_scales_the_update_once(scope, compile_with):
    model, forward, _ = compiled(STEM_3X, scope, compile_with)
    train(model, Delegating(adamw(model.parameters())), forward)
    expected = mlp()
    stem = list(expected[0].parameters())
    rest = [p for layer in expected[1:] for p in layer.parameters()]
    train(expected, adamw([{"params": stem, "lr": 3e-2}, {"params": rest}]))
    assert_same_weights(model, expected)


def test_weight_norm_drift_on_the_update_is_a_per_layer_learning_rate():
    """weight_norm_drift's factor as the operator-norm article's per-layer eta_l: a reference
    that sets each layer's learning rate to lr * factor before each step."""
    policy = fxgrad.weight_norm_drift(every=1, apply_to="update")
    model, forward, backend = compiled(policy, "step", lambda b, m: torch.compile(m, backend=b))
    train(model, adamw(model.parameters()), forward)

    expected = mlp()
    layers = [expected[0], expected[2], expected[4]]  # the LayerNorm is skipped
    groups = [{"params": list(layer.parameters())} for layer in layers]
    optimizer = adamw(groups + [{"params": expected[3].parameters()}])

    def norm(layer):
        return math.sqrt(sum(p.detach().pow(2).sum().item() for p in layer.parameters()))

    initial = [norm(layer) for layer in layers]

    def learning_rates():
        for group, layer, w0 in zip(optimizer.param_groups, layers, initial):
            group["lr"] = 1e-2 / max(1 + math.log(norm(layer) / w0), 0.1)

    train(expected, optimizer, each_step=learning_rates)
    assert_same_weights(model, expected)
    assert backend.stats()["update_factor/0"].item() != 1.0


def test_no_host_sync_and_stats():
    model, forward, backend = compiled(STEM_3X, "step", lambda b, m: torch.compile(m, backend=b))
    optimizer = sgd_momentum(model.parameters())  # torch's for-loop Adam syncs on its step count itself
    train(model, optimizer, forward, steps=2)
    with no_host_sync():
        train(model, optimizer, forward, steps=2)
    assert backend.stats()["update_factor/0"].item() == 3.0
    assert "update_factor/2" in backend.stats()  # every rescaled layer has one (here 1.0)


def test_folded_global_clip_with_an_update_level_factor():
    """fold: the global clip rides in fused AdamW's grad_scale, the stem factor on its update."""
    policy = fxgrad.chain(fxgrad.clip_by_global_norm(0.1), STEM_3X)
    results = []
    for fold in (False, True):
        model, forward, backend = compiled(policy, "step", lambda b, m: torch.compile(m, backend=b))
        model.float()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        if fold:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # it folds: no fallback warning
                backend.fold(optimizer)
        results.append(train(model, optimizer, lambda x: forward(x.float())))
    assert_same_weights(*results, rtol=1e-5)


def test_apply_to_is_checked_at_construction():
    with pytest.raises(ValueError, match="apply_to"):
        fxgrad.rescale(apply_to="updates")
    assert "apply_to='update'" in repr(fxgrad.scale_by_trust_ratio(apply_to="update"))
    assert "apply_to" not in repr(fxgrad.scale_by_trust_ratio())


@pytest.mark.parametrize("scope", ["graph", "step"])
def test_lbfgs_is_refused_at_its_step(scope, compile_with):
    """LBFGS moves the weights once per closure call within one step(): an update-level factor
    would scale the last move only."""
    model, forward, _ = compiled(STEM_3X, scope, compile_with)
    optimizer = torch.optim.LBFGS(model.parameters(), max_iter=3)

    def closure():
        optimizer.zero_grad()
        loss = forward(X).pow(2).mean()
        loss.backward()
        return loss

    with pytest.raises(ValueError, match="LBFGS evaluates its closure several times"):
        optimizer.step(closure)


def test_low_precision_weights_are_warned_about_once():
    """bfloat16 weights: the optimizer rounds its step before the factor scales it, so changes
    under half their precision are lost (a factor of 3 moved them a quarter as far as 3x the
    learning rate)."""
    model = mlp().to(torch.bfloat16)
    forward = fxgrad.backend(STEM_3X, compiler="aot_eager").compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    with pytest.warns(RuntimeWarning, match="rounded them to bfloat16") as record:
        train(model, optimizer, lambda x: forward(x.to(torch.bfloat16)), steps=2)
    assert sum("rounded them" in str(w.message) for w in record) == 1
