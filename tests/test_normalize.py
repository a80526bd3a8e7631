"""The normalization family against eager float64 references (tests/reference.py)."""

import math

import pytest
import reference as ref
import torch
from parity import check_parity, run_both

import fxgrad

STATELESS = {
    "normalize_l2": (fxgrad.normalize("l2", scale=0.5), lambda m: ref.normalize(m, "l2", 0.5)),
    "normalize_linf": (fxgrad.normalize("linf"), lambda m: ref.normalize(m, "linf")),
    "normalize_rms": (fxgrad.normalize("rms"), lambda m: ref.normalize(m, "rms")),
    "sinkhorn": (fxgrad.sinkhorn(iters=5), lambda m: ref.sinkhorn(m, 5)),
    "agc": (fxgrad.adaptive_grad_clip(0.001), lambda m: ref.agc(m, 0.001)),
    "trust_ratio": (
        fxgrad.scale_by_trust_ratio(0.01, eps=1e-9, min_norm=1e-3),
        lambda m: ref.trust_ratio(m, 0.01, 1e-9, 1e-3),
    ),
}


@pytest.mark.parametrize("policy", STATELESS)
@pytest.mark.parametrize("model_name", ["mlp", "cnn", "gpt2", "llama"])
def test_stateless_parity(model_name, policy):
    transform, reference = STATELESS[policy]
    check_parity(model_name, transform, reference, rtol=2e-5)


@pytest.mark.inductor
def test_normalization_under_inductor():
    policy = fxgrad.chain(fxgrad.adaptive_grad_clip(0.001), fxgrad.sinkhorn(iters=3))
    check_parity("mlp", policy, lambda m: (ref.agc(m, 0.001), ref.sinkhorn(m, 3)), compiler="inductor")


@pytest.mark.inductor
def test_multi_normalize_state_under_inductor():
    reference = ref.MultiNormalize(((0, ("l2", "linf")),), ((0, 0.3),), ("l2", "linf", "mix"))
    transform = fxgrad.multi_normalize(("l2", "linf"), switching_threshold=0.3)
    run_both(transform, reference.step, 8, inputs=dense_then_sparse(8, 4), compiler="inductor")


def test_sinkhorn_balances_rows_and_columns():
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 4)
    backend = fxgrad.backend(fxgrad.sinkhorn(iters=20), compiler="aot_eager")
    backend.compile(model)(torch.randn(5, 6)).pow(2).sum().backward()
    g = model.weight.grad
    torch.testing.assert_close(g.norm(dim=0), torch.full((6,), 2.0), rtol=1e-3, atol=1e-3)  # sqrt(m)
    torch.testing.assert_close(g.norm(dim=1), torch.full((4,), math.sqrt(6)), rtol=1e-3, atol=1e-3)
    assert model.bias.grad.norm().item() == pytest.approx(2.0, rel=1e-5)  # 1-D: RMS 1


def dense_then_sparse(steps, switch_at):
    """Dense inputs, then one-hot inputs: the first layer's gradient becomes peaked."""
    gen = torch.Generator().manual_seed(3)
    for step in range(steps):
        x = torch.randn(8, 16, generator=gen)
        if step >= switch_at:
            x = torch.zeros(8, 16)
            x[:, 0] = 5.0
        yield step, x, 1.0


def test_multi_normalize_switches_with_hysteresis():
    candidates = ("l2", "linf", "mix")  # norm_choice/<layer> indexes these
    reference = ref.MultiNormalize(schedule=((0, ("l2", "linf")),), thresholds=((0, 0.3),), candidates=candidates)
    snapshots = []
    transform = fxgrad.multi_normalize(("l2", "linf"), switching_threshold=0.3)
    _, seen = run_both(transform, reference.step, 12, inputs=dense_then_sparse(12, 6), stats=snapshots)
    choices = [s["net.0"][0] for s in seen]
    assert candidates[choices[0]] == "l2" and candidates[choices[-1]] != "l2"  # the input became sparse
    for stats, expected in zip(snapshots, seen):
        assert stats["norm_choice/net.0"].item() == expected["net.0"][0]
        assert stats["peakedness/net.0"].item() == pytest.approx(expected["net.0"][1], rel=1e-5)


def test_multi_normalize_schedules():
    """``rms`` leaves the allowed set at step 3, so every layer chooses again there."""
    reference = ref.MultiNormalize(
        schedule=((0, ("rms",)), (3, ("l2", "linf"))),
        thresholds=((0, 0.5), (6, 0.05)),
        candidates=("rms", "l2", "linf", "mix"),
    )
    transform = fxgrad.multi_normalize(schedule={0: ("rms",), 3: ("l2", "linf")}, threshold_schedule={0: 0.5, 6: 0.05})
    snapshots = []
    _, seen = run_both(transform, reference.step, 10, inputs=dense_then_sparse(10, 5), stats=snapshots)
    assert all(s[name][0] == 0 for s in seen[:3] for name in s)  # only rms before step 3
    assert all(s[name][0] != 0 for s in seen[3:] for name in s)
    assert [s["norm_choice/net.0"].item() for s in snapshots] == [s["net.0"][0] for s in seen]


def test_weight_norm_drift_with_weights_moving():
    reference = ref.Drift(every=2)
    backend, _ = run_both(fxgrad.weight_norm_drift(every=2), reference.step, 8, lr=0.5, rtol=1e-4)
    factors = [v.item() for k, v in backend.stats().items() if k.startswith("drift_factor/")]
    assert any(abs(f - 1.0) > 1e-3 for f in factors)  # the weights moved and the factor followed


def test_weight_norm_drift_guard_below_one_over_e():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    backend = fxgrad.backend(fxgrad.weight_norm_drift(every=1), compiler="aot_eager")
    compiled = backend.compile(model)
    compiled(torch.randn(2, 4)).sum().backward()
    with torch.no_grad():
        model.weight.mul_(0.01)
        model.bias.mul_(0.01)
    model.zero_grad()
    compiled(torch.randn(2, 4)).sum().backward()
    assert backend.stats()["drift_factor/(root)"].item() == pytest.approx(10.0)  # 1 / min_denominator


def test_balance_norms_pushes_top_down_and_bottom_up():
    reference = ref.Balance(k=1, lam=0.5, every=2, entropy_drop=0.0)
    _, applied = run_both(
        fxgrad.balance_norms(k=1, lam=0.5, every=2, entropy_drop=0.0), reference.step, 10, lr=0.5, rtol=1e-4
    )
    assert any(applied)


@pytest.mark.parametrize("scale", [2.0**12, 2.0**100])  # at 2**100, squares of scaled gradients overflow
@pytest.mark.parametrize("name", ["sinkhorn", "agc", "normalize_rms", "trust_ratio"])
def test_with_grad_scaler_after_unscale(name, scale):
    import copy

    import models
    from parity import assert_grads_close

    transform, reference = STATELESS[name]
    torch.manual_seed(0)
    model = models.MLP()
    eager = copy.deepcopy(model)
    scalers = [torch.amp.GradScaler("cpu", init_scale=scale) for _ in range(2)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.0) for m in (model, eager)]
    compiled = fxgrad.backend(transform, compiler="aot_eager", scaler=scalers[0]).compile(model)
    x = torch.randn(8, 16)
    for net, scaler, optimizer in zip((compiled, eager), scalers, optimizers):
        scaler.scale(models.loss_of(net(x))).backward()
        scaler.unscale_(optimizer)
    reference(eager)
    assert_grads_close(model, eager, rtol=2e-5)


FLOAT64 = {
    **STATELESS,
    # skip_nonfinite(backoff=...) makes the threshold a device tensor
    "clip_by_value": (
        fxgrad.chain(fxgrad.skip_nonfinite(backoff=0.5), fxgrad.clip_by_value(0.0123456789)),
        lambda m: ref.clip_value(m, 0.0123456789),
    ),
}


@pytest.mark.parametrize("scope", ["graph", "step"])
@pytest.mark.parametrize("name", FLOAT64)
def test_a_float64_model_keeps_float64_precision(name, scope):
    """Norms, weight norms and bounds of float64 gradients are float64 (AGC's weight rows and a
    device-side value bound were rounded to float32: ~1e-8 off)."""
    import copy

    import models
    from parity import assert_grads_close

    transform, reference = FLOAT64[name]
    torch.manual_seed(0)
    model = models.MLP().double()
    eager = copy.deepcopy(model)
    compiled = fxgrad.backend(transform, compiler="aot_eager", scope=scope).compile(model)
    x = torch.randn(8, 16, dtype=torch.float64)
    models.loss_of(compiled(x)).backward()
    torch.optim.SGD(model.parameters(), lr=0.0).step()
    models.loss_of(eager(x)).backward()
    reference(eager)
    assert_grads_close(model, eager, rtol=1e-12)
