"""Device-side state: adaptive clipping, telemetry, non-finite handling, AMP, checkpoints.

Every stateful transform is compared step by step with an eager
reimplementation that keeps its state in Python (tests/reference.py).
"""

import copy
import math
import warnings

import models
import numpy as np
import pytest
import reference as ref
import torch
import torch.nn as nn
from parity import assert_grads_close, batches, grads_of, run_both

import fxgrad


def test_autoclip_matches_numpy_percentile_reference():
    reference = ref.AutoClip(percentile=90, history=10, blend=0.1)
    backend, taus = run_both(
        fxgrad.autoclip(percentile=90, history=10, blend=0.1), reference.step, 32, spikes=(12, 20, 21)
    )
    assert backend.stats()["autoclip/threshold"].item() == pytest.approx(taus[-1], rel=1e-6)


class PaperAutoClip:
    """AutoClip as published (Seetharaman et al. 2020, pseeth/autoclip): the percentile of every
    global norm so far, unsmoothed, then clip_grad_norm_."""

    def __init__(self, percentile):
        self.percentile, self.norms = percentile, []

    def step(self, model):
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        self.norms.append(torch.linalg.vector_norm(torch.stack([g.double().norm() for g in grads])).item())
        tau = float(np.percentile(self.norms, self.percentile))
        torch.nn.utils.clip_grad_norm_(model.parameters(), tau)
        return tau


def test_autoclip_without_blend_or_window_is_the_papers():
    reference = PaperAutoClip(percentile=10)
    backend, taus = run_both(fxgrad.autoclip(percentile=10, history=64, blend=1.0), reference.step, 32, spikes=(12, 20))
    assert backend.stats()["autoclip/threshold"].item() == pytest.approx(taus[-1], rel=1e-6)


def test_zclip_matches_reference_with_spikes():
    reference = ref.ZClip(alpha=0.97, z_thresh=2.5, max_norm=1.0, warmup=5)
    backend, zs = run_both(fxgrad.zclip(warmup=5), reference.step, 55, spikes=(20, 30, 31, 45))
    spikes = [z for z in zs if z is not None and z > 2.5]
    assert len(spikes) >= 3  # the injected spikes were detected and clipped
    assert backend.stats()["zclip/z"].item() == pytest.approx(zs[-1], rel=1e-5)


@pytest.mark.inductor
def test_adaptive_clipping_under_inductor():
    reference = ref.ZClip(alpha=0.9, z_thresh=2.0, max_norm=5.0, warmup=3)
    run_both(
        fxgrad.zclip(alpha=0.9, z_thresh=2.0, max_norm=5.0, warmup=3),
        reference.step,
        20,
        spikes=(10,),
        compiler="inductor",
    )


def test_monitor_records_norms_emas_and_spikes():
    """Every step's statistics equal the reference's: the spike step is flagged, no other is."""
    reference = ref.Monitor(ema=0.8, spike_z=3.0, warmup=5)
    policy = fxgrad.chain(fxgrad.monitor(ema=0.8, warmup=5, weights=True), fxgrad.clip_by_norm(0.01))

    def step(model):
        seen = reference.step(model)
        ref.clip_per_layer(model, 0.01)
        return seen

    snapshots = []
    _, seen = run_both(policy, step, 25, spikes=(15,), stats=snapshots)
    for i, (stats, expected) in enumerate(zip(snapshots, seen)):
        for layer, values in expected.items():
            for stat, value in values.items():
                assert stats[f"{stat}/{layer}"].item() == pytest.approx(value, rel=1e-5, abs=1e-9), (i, stat, layer)
    flagged = [sorted(k for k, v in stats.items() if k.startswith("spike/") and v.item() == 1.0) for stats in snapshots]
    assert "spike/net.0" in flagged[15]
    assert not any(flagged[:15] + flagged[16:])
    stats = snapshots[-1]
    assert all(stats[f"grad_norm_clipped/{layer}"].item() <= 0.01 + 1e-6 for layer in ("net.0", "net.3"))
    assert stats["grad_norm_clipped/net.1"].item() == pytest.approx(seen[-1]["net.1"]["grad_norm"], rel=1e-5)


def test_monitor_weight_norms_are_the_compiled_models_own():
    torch.manual_seed(0)
    model = models.MLP()
    layers = {"net.0": model.net[0], "net.3": model.net[3]}
    initial = {name: [p.detach().clone() for p in module.parameters()] for name, module in layers.items()}
    # lr=1: the weights move; monitor changes no gradient
    backend, _ = run_both(fxgrad.monitor(weights=True), lambda m: None, 6, model=model, lr=1.0, acts=False)
    stats = backend.stats()
    for layer, module in layers.items():
        # the compiled model's weights when the last backward read them, before its SGD step
        read = torch.linalg.vector_norm(torch.cat([(p + p.grad).reshape(-1) for p in module.parameters()]))
        stale = torch.linalg.vector_norm(torch.cat([p.reshape(-1) for p in initial[layer]]))
        assert abs(read - stale) > 1e-3 * stale, "the weights did not move: a stale read would pass"
        assert stats[f"weight_norm/{layer}"].item() == pytest.approx(read.item(), rel=1e-6)


def test_stats_are_device_tensors_and_a_snapshot():
    backend, _ = run_both(fxgrad.clip_by_global_norm(1e-3), lambda m: ref.clip_global(m, 1e-3), 2)
    stats = backend.stats()
    assert set(stats) == {"clip_coef", "grad_norm/total", "grad_norm/total_clipped"}
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in stats.values())
    assert stats["grad_norm/total_clipped"].item() == pytest.approx(1e-3, rel=1e-4)
    before = stats["clip_coef"].clone()
    for live in backend.store.values(stats=True).values():
        live.zero_()
    assert torch.equal(stats["clip_coef"], before)  # later steps don't change a snapshot


def test_rescale_every_holds_the_target():
    torch.manual_seed(0)
    norms = []

    def step(model):
        chosen = ref.trainable_layers(model)
        current = [torch.sqrt(sum((p.grad.double() ** 2).sum() for p in ps)).item() for _, _, ps in chosen]
        if len(norms) % 3 == 0:
            step.target = sum(current) / len(current)
        norms.append(current)
        ref.rescale(model, 0.5, target=step.target)

    run_both(fxgrad.rescale(alpha=0.5, every=3), step, 8)


def test_rescale_ema_target_damps_spikes():
    decay, ema = 0.8, {}

    def step(model):
        for name, _, params in ref.trainable_layers(model):
            norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in params)).item()
            target = ema.get(name, norm)
            ema[name] = norm if name not in ema else decay * ema[name] + (1 - decay) * norm
            for p in params:
                p.grad.mul_((target / (norm + 1e-7)) ** 0.5)

    run_both(fxgrad.rescale(alpha=0.5, target="ema", decay=0.8), step, 10, spikes=(6,))


def nan_at(step_with_nan):
    def inject(model, step):
        if step == step_with_nan:
            model.net[0].weight.grad[0, 0] = float("nan")

    return inject


def test_nan_propagates_by_default():
    model = models.MLP()
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1.0), compiler="aot_eager")
    x = torch.randn(4, 16)
    x[0, 0] = float("nan")
    models.loss_of(backend.compile(model)(x)).backward()
    assert all(torch.isnan(p.grad).any() for p in model.parameters())
    assert torch.isnan(backend.stats()["grad_norm/total"])


class TwoBranches(nn.Module):
    """``c = inf`` makes only branch ``b``'s gradient non-finite, as an fp16 overflow often does;
    a vector ``c`` with one inf, only one row of ``b.weight``'s and one element of ``b.bias``'s."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 1)

    def forward(self, x, c):
        return self.head(torch.relu(self.a(x))).sum() + (self.b(x) * c).sum()


def one_inf(index=1):
    c = torch.ones(8)
    c[index] = math.inf
    return c


def test_zero_nonfinite_zeroes_the_nonfinite_elements_only_and_counts_them():
    torch.manual_seed(0)
    model = TwoBranches()
    eager = copy.deepcopy(model)
    backend = fxgrad.backend(fxgrad.zero_nonfinite(), compiler="aot_eager")
    x, c = torch.randn(4, 8), one_inf()
    backend.compile(model)(x, c).backward()
    eager(x, c).backward()
    untouched = grads_of(eager)
    for p in eager.parameters():
        p.grad = torch.where(torch.isfinite(p.grad), p.grad, 0)
    assert_grads_close(model, eager, untouched=untouched)
    stats = backend.stats()
    assert stats["nonfinite_elements"].item() == 8 + 1  # row 1 of b.weight's gradient, b.bias[1]
    assert {layer: stats[f"nonfinite/{layer}"].item() for layer in ("a", "b", "head")} == {"a": 0, "b": 9, "head": 0}


@pytest.mark.parametrize("scope", ["graph", "step"])
def test_skip_nonfinite_zeroes_the_step_and_step_if_finite_skips_it(scope):
    torch.manual_seed(0)
    model = TwoBranches()
    eager = copy.deepcopy(model)
    backend = fxgrad.backend(
        fxgrad.chain(fxgrad.skip_nonfinite(), fxgrad.clip_by_global_norm(1.0)), compiler="aot_eager", scope=scope
    )
    compiled = backend.compile(model)
    optimizers = [torch.optim.Adam(m.parameters(), lr=0.1) for m in (model, eager)]
    for step in range(4):
        x, c = torch.randn(4, 8), one_inf() if step == 2 else torch.ones(8)
        compiled(x, c).backward()
        eager(x, c).backward()
        before = [p.detach().clone() for p in model.parameters()]
        stepped = fxgrad.step_if_finite(optimizers[0], backend)
        assert stepped == (step != 2)
        if step == 2:
            assert torch.isfinite(eager.a.weight.grad).all() and eager.a.weight.grad.abs().max() > 0
            assert all((p.grad == 0).all() for p in model.parameters())  # the finite branch's too
            assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
        else:
            untouched = grads_of(eager)
            ref.clip_global(eager, 1.0)
            assert_grads_close(model, eager, untouched=untouched)
            optimizers[1].step()
        for optimizer in optimizers:
            optimizer.zero_grad()
    assert backend.stats()["nonfinite_steps"].item() == 1


def test_step_if_finite_in_step_scope_keeps_the_eager_paths_state_moving(monkeypatch):
    """A skipped step keeps the backward's state in graph scope; step scope writes its state
    at the step, also when the rules run eagerly (here: the program cannot be built)."""
    monkeypatch.setattr(fxgrad.frontend.step_program.StepPrograms, "_build", lambda *args: 1 / 0)
    model = TwoBranches()
    backend = fxgrad.backend(
        fxgrad.chain(fxgrad.skip_nonfinite(), fxgrad.autoclip(history=4)), compiler="aot_eager", scope="step"
    )
    compiled = backend.compile(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    with pytest.warns(RuntimeWarning, match="could not be built"):
        for step in range(4):
            compiled(torch.randn(4, 8), one_inf() if step == 1 else torch.ones(8)).backward()
            assert fxgrad.step_if_finite(optimizer, backend) == (step != 1)
            optimizer.zero_grad()
    assert backend.state_dict()["1.autoclip/count"].item() == 3


def test_step_if_finite_needs_skip_nonfinite_its_arguments_and_a_backward():
    optimizer = torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=1)
    with pytest.raises(ValueError, match="skip_nonfinite"):
        fxgrad.step_if_finite(optimizer, fxgrad.backend(fxgrad.clip_by_norm(1.0)))
    backend = fxgrad.backend(fxgrad.chain(fxgrad.skip_nonfinite(), fxgrad.clip_by_global_norm(1.0)), scope="graph")
    with pytest.raises(TypeError, match="backend must be"):
        fxgrad.step_if_finite(backend, optimizer)  # swapped
    with pytest.raises(TypeError, match="optimizer must be"):
        fxgrad.step_if_finite(None, backend)
    with pytest.raises(RuntimeError, match="the policy has not run yet"):
        fxgrad.step_if_finite(optimizer, backend)


def test_grad_scaler_parity_and_scale_changes_without_recompiling():
    torch.manual_seed(0)
    model = models.MLP()
    eager = copy.deepcopy(model)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2) for _ in range(2)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=1e-3) for m in (model, eager)]
    backend = fxgrad.backend(
        fxgrad.chain(fxgrad.monitor(), fxgrad.clip_by_global_norm(0.05)), compiler="aot_eager", scaler=scalers[0]
    )
    compiled = backend.compile(model)
    seen_scales = set()
    for step in range(8):
        x = torch.randn(8, 16)
        if step == 5:
            x[0, 0] = float("inf")
        for net, scaler, optimizer in zip((compiled, eager), scalers, optimizers):
            scaler.scale(models.loss_of(net(x))).backward()
            scaler.unscale_(optimizer)
        total = torch.nn.utils.clip_grad_norm_(eager.parameters(), 0.05)
        if step != 5:
            assert_grads_close(model, eager)
            assert backend.stats()["grad_norm/total"].item() == pytest.approx(total.item(), rel=1e-5)
        for scaler, optimizer in zip(scalers, optimizers):
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
        assert scalers[0].get_scale() == scalers[1].get_scale()  # the inf step was seen and skipped
        seen_scales.add(scalers[0].get_scale())
    assert len(seen_scales) >= 3 and len(backend.graphs) == 1


HUGE_SCALE_POLICIES = {
    "global_clip": (lambda: fxgrad.chain(fxgrad.monitor(), fxgrad.clip_by_global_norm(0.05)), lambda: ref.clip_global),
    "adagc": (lambda: fxgrad.adagc(lambda_abs=0.05, warmup=1), lambda: ref.AdaGC(lambda_abs=0.05, warmup=1).step),
}


@pytest.mark.parametrize("policy", list(HUGE_SCALE_POLICIES))
@pytest.mark.parametrize("scope", ["graph", "step"])
def test_a_huge_loss_scale_leaves_the_norms_finite(scope, policy):
    """Norms are taken of the gradients times the inverse scale: at a scale of 2**100 (a
    GradScaler that grew unchecked, under bfloat16) the squares of the scaled ones overflow
    float32, and the clip would zero every step while the scaler sees finite gradients."""
    transform, make_reference = HUGE_SCALE_POLICIES[policy]
    reference = make_reference()
    torch.manual_seed(0)
    model = models.MLP()
    eager = copy.deepcopy(model)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**100) for _ in range(2)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.0) for m in (model, eager)]
    backend = fxgrad.backend(transform(), compiler="aot_eager", scope=scope, scaler=scalers[0])
    compiled = backend.compile(model)
    for x in [torch.randn(8, 16) for _ in range(3)]:
        for net, scaler, optimizer in zip((compiled, eager), scalers, optimizers):
            scaler.scale(models.loss_of(net(x))).backward()
            if net is compiled and scope == "step":
                backend.step()  # before unscale_, on the scaled gradients
            scaler.unscale_(optimizer)
        reference(eager, 0.05) if policy == "global_clip" else reference(eager)
        assert_grads_close(model, eager)
        assert all(p.grad.abs().sum() > 0 for p in model.parameters())
        for scaler, optimizer in zip(scalers, optimizers):
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()


def test_scaler_refuses_policies_that_hide_nonfinite():
    with pytest.raises(ValueError, match="scaler"):
        fxgrad.backend(fxgrad.zero_nonfinite(), scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(TypeError, match="scaler"):
        fxgrad.backend(fxgrad.clip_by_norm(1.0), scaler=object())


@pytest.mark.parametrize("scope", ["graph", "step"])
def test_a_grad_scaler_the_backend_was_not_given_is_reported_in_graph_scope(scope):
    """Graph scope ran the policy on the scaled gradients (7% off after three steps, found by a
    sweep): said at the first step. Step scope runs after GradScaler.step() unscaled them."""
    model = models.MLP()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(0.05), compiler="aot_eager", scope=scope)
    scaler.scale(models.loss_of(backend.compile(model)(torch.randn(8, 16)))).backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scaler.step(optimizer)
    said = [str(w.message) for w in caught if issubclass(w.category, fxgrad.CoverageWarning)]
    assert any("built without scaler=" in message for message in said) == (scope == "graph"), said


def test_a_disabled_scaler_is_no_scaler():
    """``GradScaler(enabled=use_amp)`` with AMP off (or a CUDA scaler on a CPU-only machine)."""
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1e-3), compiler="aot_eager", scaler=scaler)
    assert backend.scaler is None
    model = models.MLP()
    expected = copy.deepcopy(model)
    x = torch.randn(4, 16)
    scaler.scale(models.loss_of(backend.compile(model)(x))).backward()
    models.loss_of(expected(x)).backward()
    ref.clip_global(expected, 1e-3)
    assert_grads_close(model, expected)


def test_checkpoint_resume_matches_an_uninterrupted_run():
    policy = fxgrad.chain(fxgrad.monitor(), fxgrad.autoclip(history=6))

    def train(backend, model, steps):
        compiled = backend.compile(model)
        grads = []
        for _, x, weight in steps:
            model.zero_grad()
            (models.loss_of(compiled(x)) * weight).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        return grads

    torch.manual_seed(0)
    model = models.MLP()
    all_steps = list(batches(16, spikes=(4,)))
    straight = train(fxgrad.backend(policy, compiler="aot_eager"), copy.deepcopy(model), all_steps)

    first = fxgrad.backend(policy, compiler="aot_eager")
    train(first, copy.deepcopy(model), all_steps[:8])
    saved = first.state_dict()
    resumed = fxgrad.backend(policy, compiler="aot_eager")
    resumed.load_state_dict(saved)  # before its first compile
    after = train(resumed, copy.deepcopy(model), all_steps[8:])
    for a, b in zip(after, straight[8:]):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y)


@pytest.mark.parametrize(
    "policy",
    [
        fxgrad.monitor(),
        fxgrad.rescale(target="ema"),
        fxgrad.multi_normalize(),
        fxgrad.weight_norm_drift(every=2),
    ],
    ids=repr,
)
def test_an_overflow_in_some_layers_leaves_every_layers_state(policy):
    """A GradScaler skips the whole step: the layers whose norms stayed finite must not advance."""
    model = TwoBranches()
    backend = fxgrad.backend(policy, compiler="aot_eager")
    compiled = backend.compile(model)
    for c in (0.5, 0.5, math.inf):
        state = backend.state_dict()
        model.zero_grad()
        compiled(torch.randn(4, 8), torch.tensor(c)).backward()
    assert not torch.isfinite(model.b.weight.grad).all() and torch.isfinite(model.a.weight.grad).all()
    after = backend.state_dict()
    assert after.keys() == state.keys()
    for key in state:
        torch.testing.assert_close(after[key], state[key], msg=key)


def _after_skip_nonfinite(rule, scope):
    """``TwoBranches`` under ``chain(skip_nonfinite(), rule)``, and ``step(x, c)``: a backward
    (``c``, the second branch's scale: ``one_inf()`` makes it non-finite), then
    ``step_if_finite``, whose answer it returns, and ``zero_grad()``."""
    model = TwoBranches()
    backend = fxgrad.backend(fxgrad.chain(fxgrad.skip_nonfinite(), rule), compiler="aot_eager", scope=scope)
    compiled = backend.compile(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x: torch.Tensor, c: torch.Tensor) -> bool:
        compiled(x, c).backward()
        stepped = fxgrad.step_if_finite(optimizer, backend)
        optimizer.zero_grad()
        return stepped

    return model, backend, step


@pytest.mark.parametrize("scope", ["graph", "step"])
@pytest.mark.parametrize(
    "rule",
    [fxgrad.autoclip(history=6), fxgrad.zclip(warmup=2), fxgrad.adagc(warmup=2), fxgrad.monitor()],
    ids=lambda rule: rule.name,
)
def test_a_step_skip_nonfinite_zeroed_leaves_the_state_of_the_rules_after_it(scope, rule):
    """The documented order, skip_nonfinite first: the zeroed step is no step to the rules after
    it. Fed to AdaGC's warm-up, its zero norms clipped every later gradient to zero."""
    runs = []
    for skipped in (False, True):
        torch.manual_seed(0)
        model, backend, step = _after_skip_nonfinite(rule, scope)
        for i in range(6):
            x = torch.randn(4, 8)
            if i == 3 and skipped:
                assert not step(x, one_inf())
            assert step(x, torch.ones(8))
        state = {k: v for k, v in backend.state_dict().items() if "skip_nonfinite" not in k}
        runs.append((state, [p.detach().clone() for p in model.parameters()]))
    (state, weights), (state_skipped, weights_skipped) = runs
    assert state.keys() == state_skipped.keys() and state
    for key in state:
        torch.testing.assert_close(state_skipped[key], state[key], msg=key)
    for actual, wanted in zip(weights_skipped, weights):
        torch.testing.assert_close(actual, wanted, rtol=1e-6, atol=0)


KEPT_STATISTICS = {
    "autoclip": ("autoclip/threshold",),
    "zclip": ("zclip/mean", "zclip/std"),
    "monitor": ("grad_norm_ema/a", "grad_norm_std/b"),
}


@pytest.mark.parametrize("scope", ["graph", "step"])
@pytest.mark.parametrize(
    "rule", [fxgrad.autoclip(history=6), fxgrad.zclip(warmup=2), fxgrad.monitor()], ids=lambda rule: rule.name
)
def test_a_step_skip_nonfinite_zeroed_reports_the_kept_state(scope, rule):
    """The statistics that show a rule's state read what it kept on a zeroed step, not its
    update by a zero norm (zclip's mean read 0.9 of the kept one, autoclip's threshold less)."""
    torch.manual_seed(0)
    _, backend, step = _after_skip_nonfinite(rule, scope)
    for _ in range(4):
        assert step(torch.randn(4, 8), torch.ones(8))
    before = backend.stats()
    assert not step(torch.randn(4, 8), one_inf())
    after = backend.stats()
    assert after["nonfinite_step"] == 1
    for key in KEPT_STATISTICS[rule.name]:
        torch.testing.assert_close(after[key], before[key], msg=key)


@pytest.mark.parametrize("scope", ["graph", "step"])
def test_monitor_reports_the_kept_ema_on_an_overflow_step(scope):
    """On a step with a non-finite norm the EMA statistics read what the state kept, not NaN."""
    torch.manual_seed(0)
    model = TwoBranches()
    backend = fxgrad.backend(fxgrad.monitor(), compiler="aot_eager", scope=scope)
    compiled = backend.compile(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    seen = []
    for c in (torch.ones(8), torch.ones(8), one_inf()):
        compiled(torch.randn(4, 8), c).backward()
        optimizer.step()
        optimizer.zero_grad()
        seen.append(backend.stats())
    assert not seen[2]["grad_norm/b"].isfinite()
    for stat in ("grad_norm_ema/a", "grad_norm_ema/b", "grad_norm_std/b"):
        assert seen[2][stat].item() == seen[1][stat].item(), stat


def test_a_checkpoint_of_another_policy_is_refused():
    model = models.MLP()
    saved = fxgrad.backend(fxgrad.autoclip(history=6), compiler="aot_eager")
    models.loss_of(saved.compile(model)(torch.randn(4, 16))).backward()
    state = saved.state_dict()
    moved = fxgrad.backend(fxgrad.chain(fxgrad.monitor(), fxgrad.autoclip(history=6)), compiler="aot_eager")
    with pytest.raises(ValueError, match="no transform of .* owns: '0.autoclip/count'.*0.monitor/, 1.autoclip/"):
        moved.load_state_dict(state)
    with pytest.raises(ValueError, match=r"'0.autoclip/history' has shape \(\) in the checkpoint but \(6,\)"):
        saved.load_state_dict({**state, "0.autoclip/history": torch.tensor(7.0)})
    shorter = fxgrad.backend(fxgrad.autoclip(history=3), compiler="aot_eager")
    shorter.load_state_dict(state)  # checked once compiling places the entries
    with pytest.raises(ValueError, match=r"has shape \(6,\) in the checkpoint but \(3,\)"):
        models.loss_of(shorter.compile(models.MLP())(torch.randn(4, 16))).backward()


def test_a_checkpoint_of_another_length_in_step_scope_is_raised_and_leaves_the_program():
    """Step scope places the entries when it builds its program: the mismatch is the user's,
    raised at the step as is. It was taken for a failed build (a RuntimeWarning, then the same
    error) and left the policy eager for the backend's life, found by a sweep."""

    def state(history):
        backend = fxgrad.backend(fxgrad.autoclip(history=history), compiler="aot_eager", scope="step")
        model = models.MLP()
        models.loss_of(backend.compile(model)(torch.randn(4, 16))).backward()
        backend.step(model)
        return backend.state_dict()

    model = models.MLP()
    shorter = fxgrad.backend(fxgrad.autoclip(history=3), compiler="aot_eager", scope="step", keep_code=True)
    shorter.load_state_dict(state(6))
    compiled = shorter.compile(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    models.loss_of(compiled(torch.randn(4, 16))).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with pytest.raises(ValueError, match=r"has shape \(6,\) in the checkpoint but \(3,\)"):
            optimizer.step()
        shorter.load_state_dict(state(3))
        optimizer.step()
    assert shorter.step_program_code() is not None  # compiled, not eager


@pytest.mark.parametrize("scope", ["graph", "step"])
def test_a_checkpoint_of_renamed_layers_is_reported_and_a_failed_load_changes_nothing(scope):
    def trained():
        model = models.MLP()
        policy = fxgrad.chain(fxgrad.monitor(), fxgrad.autoclip(history=6))
        backend = fxgrad.backend(policy, compiler="aot_eager", scope=scope)
        compiled = backend.compile(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        models.loss_of(compiled(torch.randn(4, 16))).backward()
        optimizer.step()
        return backend, compiled, optimizer

    saved, _, _ = trained()
    state = {key.replace("/net.", "/encoder.net."): value for key, value in saved.state_dict().items()}  # wrapped since
    backend, compiled, optimizer = trained()
    threshold = backend.state_dict()["1.autoclip/threshold"].clone()
    with pytest.raises(ValueError, match="has shape"):
        backend.load_state_dict({"1.autoclip/threshold": torch.tensor(123.0), "1.autoclip/history": torch.zeros(3)})
    assert backend.state_dict()["1.autoclip/threshold"] == threshold  # all or nothing
    before = backend.state_dict()
    history = state["1.autoclip/history"]
    bad = [
        (TypeError, "real floating-point", history.to(torch.complex64)),
        (TypeError, "real floating-point", history.to(torch.int64)),
        (ValueError, "meta tensor", history.to("meta")),
    ]
    for error, message, value in bad:  # checked before anything is copied, placed or not
        for target in (backend, fxgrad.backend(fxgrad.chain(fxgrad.monitor(), fxgrad.autoclip(history=6)))):
            with pytest.raises(error, match=message):
                target.load_state_dict({**state, "1.autoclip/history": value})
    after = backend.state_dict()
    assert all(torch.equal(after[key], value) for key, value in before.items())
    backend.load_state_dict({**state, "1.autoclip/history": history.clone().requires_grad_()})
    backend.load_state_dict(state)
    optimizer.zero_grad()
    models.loss_of(compiled(torch.randn(4, 16))).backward()
    with pytest.warns(fxgrad.CoverageWarning, match=r"state entries given to load_state_dict\(\) match no state"):
        optimizer.step()


@pytest.mark.parametrize("scope", ["graph", "step"])
def test_entries_a_checkpoint_lacks_are_reported_as_starting_over(scope):
    """A rule added to the policy since the checkpoint: its state starts from scratch, and says so."""
    model = models.MLP()
    saved = fxgrad.backend(fxgrad.zclip(), compiler="aot_eager", scope=scope)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    models.loss_of(saved.compile(model)(torch.randn(4, 16))).backward()
    optimizer.step()
    grown = fxgrad.backend(fxgrad.chain(fxgrad.zclip(), fxgrad.autoclip()), compiler="aot_eager", scope=scope)
    grown.load_state_dict(saved.state_dict())
    optimizer.zero_grad()
    models.loss_of(grown.compile(model)(torch.randn(4, 16))).backward()
    with pytest.warns(
        fxgrad.CoverageWarning, match=r"not in the state given to load_state_dict\(\), and start over: '1.autoclip/"
    ):
        optimizer.step()


@pytest.mark.parametrize("scope", ["graph", "step"])
def test_an_empty_state_loaded_names_the_template_taken_before_the_first_step(scope):
    """``torch.distributed.checkpoint.load`` fills the keys of the template it is handed; a
    backend's ``state_dict()`` has none before the first step, so the resume loaded nothing,
    and the warning guessed "a rule or a layer added since the checkpoint" (sweep 51b)."""
    model = models.MLP()
    backend = fxgrad.backend(fxgrad.autoclip(), compiler="aot_eager", scope=scope)
    template = backend.state_dict()
    assert template == {}
    backend.load_state_dict(template)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    models.loss_of(backend.compile(model)(torch.randn(4, 16))).backward()
    with pytest.warns(fxgrad.CoverageWarning, match=r"start over: .*the state given was empty.*distributed.checkpoint"):
        optimizer.step()


@pytest.mark.parametrize("fold", [False, True], ids=["plain", "folded"])
@pytest.mark.parametrize("scope", ["graph", "step"])
def test_the_step_that_creates_an_optimizers_state_for_a_checkpoint_is_no_training_step(scope, fold):
    """``torch.distributed.checkpoint``'s ``get_state_dict`` (a checkpointer's template at
    start-up) and ``set_state_dict`` make an ``optimizer.step()`` on zero gradients with
    learning rate 0 to create a fresh optimizer's state. Step scope ran the policy on it:
    autoclip's history took a norm of 0 and its count a step, and the weights ended 1.36 off
    after six steps, silently (sweep 51b). SGD's first momentum buffer is the same either way."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    def train(template):
        torch.manual_seed(0)
        model = models.MLP()
        backend = fxgrad.backend(fxgrad.autoclip(history=5), compiler="aot_eager", scope=scope)
        compiled = backend.compile(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, fused=fold)
        if fold:
            backend.fold(optimizer)
        if template:
            get_state_dict(model, optimizer)
            assert backend.state_dict() == {}
        for _, x, weight in batches(6, spikes=(3,)):
            optimizer.zero_grad()
            (models.loss_of(compiled(x)) * weight).backward()
            optimizer.step()
        return dict(model.named_parameters()), backend.state_dict()

    (weights, state), (templated, templated_state) = train(False), train(True)
    torch.testing.assert_close(templated, weights, rtol=0, atol=0)
    torch.testing.assert_close(templated_state, state, rtol=0, atol=0)


def test_two_backends_never_share_state():
    a = fxgrad.backend(fxgrad.autoclip(), compiler="aot_eager")
    b = fxgrad.backend(fxgrad.autoclip(), compiler="aot_eager")
    model = models.MLP()
    models.loss_of(a.compile(model)(torch.randn(4, 16))).backward()
    assert a.state_dict() and not b.state_dict()


@pytest.mark.parametrize("scope", ["graph", "step"])
def test_state_and_stats_survive_a_layer_frozen_every_other_step(scope):
    """Freezing a layer on alternate steps recompiles without it; the other graph keeps
    using the same state (one history, one EMA per layer, one checkpoint entry each) and
    stats() describes the latest step only."""
    torch.manual_seed(0)
    model = models.MLP()
    eager = copy.deepcopy(model)
    autoclip, monitor = ref.AutoClip(90, 8, 0.1), ref.Monitor(0.9, 3.0, 10)
    backend = fxgrad.backend(
        fxgrad.chain(fxgrad.monitor(), fxgrad.autoclip(history=8)), compiler="aot_eager", scope=scope
    )
    compiled = backend.compile(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # the state moves at its step
    for step, x, weight in batches(8, spikes=(5,)):
        for m in (model, eager):
            m.net[3].requires_grad_(step % 2 == 0)
            m.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", fxgrad.CoverageWarning)  # "net.3 is frozen"
            (models.loss_of(compiled(x)) * weight).backward()
            optimizer.step()
        (models.loss_of(eager(x)) * weight).backward()
        expected = monitor.step(eager)
        tau = autoclip.step(eager)
        assert_grads_close(model, eager)
        stats = backend.stats()
        assert ("grad_norm/net.3" in stats) == (step % 2 == 0)
        for layer, values in expected.items():
            assert stats[f"grad_norm_ema/{layer}"].item() == pytest.approx(values["grad_norm_ema"], rel=1e-5)
        assert stats["autoclip/threshold"].item() == pytest.approx(tau, rel=1e-5)
        assert stats["grad_norm/total"].item() == pytest.approx(
            math.sqrt(sum(v["grad_norm"] ** 2 for v in expected.values())), rel=1e-5
        )
    state = backend.state_dict()
    assert state["1.autoclip/count"].item() == 8
    assert state["0.monitor/count/net.0"].item() == 8 and state["0.monitor/count/net.3"].item() == 4


@pytest.mark.parametrize(
    "policy",
    [
        fxgrad.chain(fxgrad.monitor(), fxgrad.rescale(target="ema", decay=0.5)),
        fxgrad.rescale(alpha=0.5, every=2),
        fxgrad.multi_normalize(),
        fxgrad.weight_norm_drift(every=2),
    ],
)
def test_an_overflow_step_leaves_no_nonfinite_state(policy):
    """Steps after an Inf/NaN step equal a run without it (a GradScaler skips such steps)."""

    def run(steps):
        torch.manual_seed(0)
        model = models.MLP()
        backend = fxgrad.backend(policy, compiler="aot_eager")
        compiled = backend.compile(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        grads = []
        for x, weight in steps:
            model.zero_grad()
            (models.loss_of(compiled(x)) * weight).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
            if all(torch.isfinite(g).all() for g in grads[-1]):  # as a GradScaler skips the step
                optimizer.step()
        return grads, backend.stats()

    xs = [x for _, x, _ in batches(3)]
    clean, clean_stats = run([(x, 1.0) for x in xs])
    spiked, spiked_stats = run([(xs[0], 1.0), (xs[0], math.inf)] + [(x, 1.0) for x in xs[1:]])
    spiked_first, _ = run([(xs[0], math.inf)] + [(x, 1.0) for x in xs])  # a GradScaler's usual start
    assert not all(torch.isfinite(g).all() for g in spiked[1])
    for a, b in zip(spiked[2:] + spiked_first[1:], clean[1:] + clean):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y)
    for key in clean_stats:
        if "ema" in key or "std" in key:
            torch.testing.assert_close(spiked_stats[key], clean_stats[key])


# State moves once per optimizer step: a backward pass whose gradients no step takes leaves it.
STATEFUL = {
    "zclip_monitor": (
        lambda: fxgrad.chain(fxgrad.monitor(), fxgrad.zclip(alpha=0.8, z_thresh=1.5, max_norm=100.0, warmup=3)),
        lambda: [ref.Monitor(0.9, 3.0, 10).step, ref.ZClip(alpha=0.8, z_thresh=1.5, max_norm=100.0, warmup=3).step],
    ),
    "autoclip": (
        lambda: fxgrad.autoclip(percentile=50, history=4),
        lambda: [ref.AutoClip(percentile=50, history=4, blend=fxgrad.autoclip(percentile=50).blend).step],
    ),
    "adagc": (lambda: fxgrad.adagc(lambda_rel=1.02, warmup=2), lambda: [ref.AdaGC(lambda_rel=1.02, warmup=2).step]),
}


def _input_gradient(net, x, y):
    attacked = x.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(torch.nn.functional.cross_entropy(net(attacked), y), attacked)
    return grad


def _attack_then_train(net, optimizer, x, y, weight, attack="before"):
    """FGSM adversarial training: a pass for the input's gradient only, then the step's backward;
    ``attack="after"``: the input's gradient after the step's backward (a saliency map to log)."""
    optimizer.zero_grad()
    if attack == "before":
        x = (x + 0.1 * _input_gradient(net, x, y).sign()).detach()
    (torch.nn.functional.cross_entropy(net(x), y) * weight).backward()
    if attack == "after":
        _input_gradient(net, x, y)


@pytest.mark.parametrize("attack", ["before", "after"])
@pytest.mark.parametrize("policy", list(STATEFUL))
def test_state_ignores_backward_passes_no_optimizer_steps(policy, attack, compile_with):
    """Adversarial training's attack pass runs the compiled backward too, as does a saliency
    map's after the step's backward. They compute no gradient of the parameters, and save no
    state (a pass after the backward took the state over: autoclip's threshold read a
    thousand times the reference's; one before the first step moved it once)."""
    make_policy, make_reference = STATEFUL[policy]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    eager = copy.deepcopy(model)
    backend = fxgrad.backend(make_policy(), compiler="aot_eager", scope="graph")
    compiled = compile_with(backend, model)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, eager)]
    reference = make_reference()
    for step in range(10):
        x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
        weight = 8.0 if step in (6, 8) else 1.0  # spikes the adaptive rules clip
        _attack_then_train(compiled, optimizers[0], x, y, weight, attack)
        _attack_then_train(eager, optimizers[1], x, y, weight, attack)
        for reference_step in reference:
            reference_step(eager)
        assert_grads_close(model, eager)
        for optimizer in optimizers:
            optimizer.step()


def test_a_gan_generator_step_leaves_the_discriminators_state(compile_with):
    """The generator's backward runs through the discriminator's compiled backward, whose
    gradients the discriminator's next zero_grad() drops: its ZClip must not see them."""
    torch.manual_seed(0)
    generator = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 16))
    critic = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 1))
    eager_critic = copy.deepcopy(critic)
    backend = fxgrad.backend(fxgrad.zclip(alpha=0.8, z_thresh=1.5, max_norm=100.0, warmup=3), compiler="aot_eager")
    critics = [compile_with(backend, critic), eager_critic]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (critic, eager_critic)]
    reference = ref.ZClip(alpha=0.8, z_thresh=1.5, max_norm=100.0, warmup=3)
    for step in range(8):
        z, real = torch.randn(8, 8), torch.randn(8, 16) + 1.0
        weight = 5.0 if step == 6 else 1.0
        for net, optimizer in zip(critics, optimizers):
            optimizer.zero_grad()
            out = net(torch.cat([real, generator(z).detach()]))
            ((nn.functional.softplus(-out[:8]).mean() + nn.functional.softplus(out[8:]).mean()) * weight).backward()
            if net is eager_critic:
                reference.step(eager_critic)
            optimizer.step()
            nn.functional.softplus(-net(generator(z))).mean().backward()  # the generator's step
        for a, b in zip(critic.parameters(), eager_critic.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


class _First(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc0 = nn.Linear(16, 16)

    def forward(self, x):
        return torch.tanh(self.fc0(x))


class _Second(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 16)

    def forward(self, x):
        return torch.tanh(self.fc1(x))


def test_state_of_blocks_under_reentrant_checkpointing_moves_once_a_step():
    """Reentrant activation checkpointing (DeepSpeed's, Megatron's) runs each block's backward
    as a backward pass of its own inside the step's: every block's state is kept."""
    torch.manual_seed(0)
    blocks = nn.Sequential(_First(), _Second())
    eager = copy.deepcopy(blocks)
    backend = fxgrad.backend(fxgrad.monitor(ema=0.8, warmup=2), compiler="aot_eager")
    for block in blocks:
        backend.compile(block, in_place=True)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (blocks, eager)]
    reference = ref.Monitor(0.8, 3.0, 2)
    for _ in range(5):
        x = torch.randn(8, 16, requires_grad=True)
        for model, optimizer in zip((blocks, eager), optimizers):
            optimizer.zero_grad()
            h = x
            for block in model:
                h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=True) if model is blocks else block(h)
            h.pow(2).mean().backward()
            if model is eager:
                expected = reference.step(eager)
            optimizer.step()
    state = backend.state_dict()
    for name, layer in (("0.fc0", "fc0"), ("1.fc1", "fc1")):
        assert state[f"0.monitor/mean/{layer}"].item() == pytest.approx(expected[name]["grad_norm_ema"], rel=1e-5)
        assert state[f"0.monitor/count/{layer}"].item() == 5


def test_a_resumed_backend_keeps_attack_passes_out_of_the_state():
    """A backend that loaded a checkpoint defers the state from its first step: the attack
    pass before it does not count, as in the run that was not interrupted."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    policy = fxgrad.zclip(alpha=0.8, z_thresh=1.5, max_norm=100.0, warmup=2)
    backend = fxgrad.backend(policy, compiler="aot_eager")
    compiled = backend.compile(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [(torch.randn(8, 16), torch.randint(0, 4, (8,))) for _ in range(6)]
    for step, (x, y) in enumerate(batches[:3]):
        _attack_then_train(compiled, optimizer, x, y, 1.0)
        optimizer.step()
    resumed = copy.deepcopy(model)
    resumed_backend = fxgrad.backend(policy, compiler="aot_eager")
    resumed_backend.load_state_dict(backend.state_dict())
    resumed_compiled = resumed_backend.compile(resumed)
    resumed_optimizer = torch.optim.SGD(resumed.parameters(), lr=0.1)
    for x, y in batches[3:]:
        for net, opt in ((compiled, optimizer), (resumed_compiled, resumed_optimizer)):
            _attack_then_train(net, opt, x, y, 1.0)
            opt.step()
    for key, value in backend.state_dict().items():
        torch.testing.assert_close(resumed_backend.state_dict()[key], value, msg=key)


@pytest.mark.parametrize("how", ["torch.autograd.grad", "backward(inputs=...)"])
def test_a_pass_that_computes_some_parameters_gradients_moves_the_state(how):
    """A pass for the head's gradients alone (ANIL's inner loop, an update by hand) is a step's
    pass: the state moves, though the graph's first parameter gets no gradient."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    backend = fxgrad.backend(fxgrad.zclip(warmup=2), compiler="aot_eager", scope="graph")
    compiled = backend.compile(model)
    head = list(model[2].parameters())
    for _ in range(3):
        loss = compiled(torch.randn(8, 16)).pow(2).mean()
        if how == "torch.autograd.grad":
            grads = torch.autograd.grad(loss, head)
        else:
            loss.backward(inputs=head)
            grads = [p.grad for p in head]
        with torch.no_grad():
            for p, g in zip(head, grads):
                p -= 0.1 * g
        model.zero_grad()
    assert backend.state_dict()["0.zclip/count"] == 3
