"""AdaGC (fxgrad.adagc) against an eager reimplementation of the authors' released code.

The reference (tests/reference.py, ``AdaGC``) keeps gamma per parameter name in Python
and edits ``.grad`` after a plain eager backward; both sides take the same SGD steps.
A warm-up of 5 steps and loss spikes (x50) at steps 2 (warm-up) and 20 (adaptive phase)
cover both phases, the global clip engaging and not, and the per-tensor clip.
"""

import contextlib
import copy
import math
import warnings

import models
import pytest
import reference as ref
import torch
from parity import assert_grads_close, batches, no_host_sync
from test_state import TwoBranches
from torch import nn

import fxgrad

ARGS = {"lambda_abs": 1.2, "warmup": 5}  # the global clip engages on warm-up steps 0-2, not on 3-4
SPIKES = (2, 20)


def inputs(steps, spikes=SPIKES):
    return [(step, x, 50.0 if step in spikes else 1.0) for step, x, _ in batches(steps)]


def train(
    steps, scope="graph", compiler="aot_eager", model=None, state=None, args=None, lr=0.05, reference=None, scaler=False
):
    """Compiled with ``adagc(**args)`` vs eager + the reference, SGD on both, gradients
    compared after every step (every step after the first under the host-sync trap).

    Returns the backend, the reference, the models and the largest relative difference
    of a gradient (max |a - b| over max |b|, per parameter).
    """
    args = args or ARGS
    model = model if model is not None else models.MLP()
    eager = copy.deepcopy(model)
    reference = reference or ref.AdaGC(**args)
    scalers = (
        [torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2) for _ in range(2)]
        if scaler
        else [None, None]
    )
    backend = fxgrad.backend(fxgrad.adagc(**args), compiler=compiler, scope=scope, scaler=scalers[0])
    if state is not None:
        backend.load_state_dict(state)
    compiled = backend.compile(model)
    optimizers = [torch.optim.SGD(m.parameters(), lr=lr) for m in (model, eager)]
    worst, scales = 0.0, set()
    for i, (step, x, weight) in enumerate(steps):
        for optimizer in optimizers:
            optimizer.zero_grad()
        with no_host_sync() if i > 0 else contextlib.nullcontext():
            loss = models.loss_of(compiled(x)) * weight
            if scaler:
                scalers[0].scale(loss).backward()
                scalers[0].unscale_(optimizers[0])
            else:
                loss.backward()
                optimizers[0].step()  # in step scope, runs the policy first (the optimizer hook)
        loss = models.loss_of(eager(x)) * weight
        if scaler:
            scalers[1].scale(loss).backward()
            scalers[1].unscale_(optimizers[1])
        else:
            loss.backward()
        total = reference.step(eager)
        if not scaler:
            optimizers[1].step()
        assert_grads_close(model, eager)
        assert backend.stats()["grad_norm/total"].item() == pytest.approx(total, rel=1e-5), step
        worst = max(
            [worst]
            + [
                ((a.grad - b.grad).abs().max() / b.grad.abs().max().clamp_min(1e-30)).item()
                for a, b in zip(model.parameters(), eager.parameters())
            ]
        )
        if scaler:
            for s, optimizer in zip(scalers, optimizers):
                s.step(optimizer)
                s.update()
                scales.add(s.get_scale())
    assert len(backend.graphs) == 1  # gamma and the phase changed on the device, the graph did not
    return backend, reference, (model, eager), worst, scales


def assert_state_matches(backend, reference, model):
    state = backend.state_dict()
    names = [name for name, _ in model.named_parameters()]
    assert set(state) == {"0.adagc/step"} | {f"0.adagc/gamma/{name}" for name in names}
    assert state["0.adagc/step"].item() == reference.t
    for name in names:
        assert state[f"0.adagc/gamma/{name}"].item() == pytest.approx(reference.gamma[name].item(), rel=1e-5), name


@pytest.mark.parametrize("scope", ["graph", "step"])
def test_matches_the_official_algorithm_with_spikes(scope):
    backend, reference, (model, _), worst, _ = train(inputs(32), scope)
    assert worst < 1e-5
    assert_state_matches(backend, reference, model)
    stats = backend.stats()
    assert set(stats) == {"grad_norm/total", "grad_norm/total_clipped", "adagc/clipped"}
    assert stats["adagc/clipped"].item() == len(reference.clipped)
    clipped_total = math.sqrt(sum(p.grad.double().square().sum().item() for p in model.parameters()))
    assert stats["grad_norm/total_clipped"].item() == pytest.approx(clipped_total, rel=1e-5)


class Watched(ref.AdaGC):
    """The reference, also recording each step's global norm before and after, and what it clipped."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seen = []

    def step(self, model):
        total = super().step(model)
        after = math.sqrt(sum(p.grad.double().square().sum().item() for p in model.parameters()))
        self.seen.append((total, after, list(self.clipped)))
        return total


def test_spikes_are_clipped_in_both_phases():
    _, reference, _, _, _ = train(inputs(24), reference=Watched(**ARGS))
    total, after, _ = reference.seen[2]
    assert total > 10 and after == pytest.approx(ARGS["lambda_abs"], rel=1e-5)  # the global clip
    total, after, _ = reference.seen[4]
    assert total < ARGS["lambda_abs"] and after == pytest.approx(total)  # below lambda_abs: untouched
    total, after, clipped = reference.seen[20]
    assert total > 10 and after < 2 and len(clipped) == 14  # every tensor clipped to 1.04 gamma


@pytest.mark.inductor
@pytest.mark.parametrize("scope", ["graph", "step"])
def test_matches_under_inductor(scope):
    backend, reference, (model, _), worst, _ = train(inputs(30), scope, compiler="inductor")
    assert worst < 1e-5
    assert_state_matches(backend, reference, model)


def test_state_dict_round_trip_continues_identically():
    steps = inputs(16, spikes=(2, 11))
    torch.manual_seed(0)
    start = models.MLP()
    _, _, (straight, _), _, _ = train(steps, model=copy.deepcopy(start))
    first, reference, (half, _), _, _ = train(steps[:8], model=copy.deepcopy(start))
    saved = first.state_dict()
    assert saved["0.adagc/step"].item() == 8  # past the warm-up
    resumed, reference, (model, _), _, _ = train(steps[8:], model=half, state=saved, reference=reference)
    for a, b in zip(model.parameters(), straight.parameters()):
        torch.testing.assert_close(a, b)
    assert_state_matches(resumed, reference, model)


@pytest.mark.parametrize("scope", ["graph", "step"])
def test_a_nonfinite_step_leaves_the_state_and_propagates(scope):
    """Only branch ``b`` overflows; every tensor's gamma and the step count stay (in and after warm-up)."""
    model = TwoBranches()
    backend = fxgrad.backend(fxgrad.adagc(warmup=2), compiler="aot_eager", scope=scope)
    compiled = backend.compile(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    for c in (0.5, math.inf, 0.5, 0.5, math.inf, 0.5):
        state = backend.state_dict()
        model.zero_grad()
        compiled(torch.randn(4, 8), torch.tensor(c)).backward()
        if scope == "step":
            backend.step()
        if math.isfinite(c):  # as a GradScaler would: the state moves at the step
            optimizer.step()
        if math.isinf(c):
            assert not torch.isfinite(model.b.weight.grad).all()
            after = backend.state_dict()
            assert after.keys() == state.keys()
            for key in state:
                torch.testing.assert_close(after[key], state[key], msg=key)
    state = backend.state_dict()
    assert state["0.adagc/step"].item() == 4
    assert all(math.isfinite(v.item()) and v.item() >= 0 for v in state.values())


def test_grad_scaler_parity_in_unscaled_units():
    _, _, _, worst, scales = train(inputs(12, spikes=(1, 8)), args={"lambda_abs": 1.2, "warmup": 3}, scaler=True)
    assert worst < 1e-5 and len(scales) >= 3  # the scale changed, the graph did not


class Gated(nn.Module):
    """``gated``'s gradient is exactly zero while ``gate`` is 0."""

    def __init__(self):
        super().__init__()
        self.main, self.gated = nn.Linear(16, 4), nn.Linear(16, 4)

    def forward(self, x, gate):
        return self.main(x) + gate * self.gated(x)


def test_a_zero_gradient_in_warmup_freezes_that_tensor_as_the_official_code_does():
    torch.manual_seed(0)
    model = Gated()
    eager = copy.deepcopy(model)
    reference = ref.AdaGC(warmup=3)
    backend = fxgrad.backend(fxgrad.adagc(warmup=3), compiler="aot_eager")
    compiled = backend.compile(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # the state moves at its step
    for step, x, _ in batches(8):
        gate = torch.tensor(0.0 if step == 1 else 1.0)  # one warm-up step without a gradient
        for m in (model, eager):
            m.zero_grad()
        models.loss_of(compiled(x, gate)).backward()
        models.loss_of(eager(x, gate)).backward()
        reference.step(eager)
        assert_grads_close(model, eager)
        optimizer.step()
    state = backend.state_dict()
    assert state["0.adagc/gamma/gated.weight"].item() == 0.0 == reference.gamma["gated.weight"].item()
    assert (model.gated.weight.grad == 0).all() and (model.main.weight.grad != 0).any()


def test_a_tensor_first_seen_after_warmup_starts_from_its_norm():
    """``net.3`` is frozen during warm-up; its recompiled graph places its gamma then."""
    torch.manual_seed(0)
    model = models.MLP()
    eager = copy.deepcopy(model)
    reference = ref.AdaGC(warmup=3)
    backend = fxgrad.backend(fxgrad.adagc(warmup=3), compiler="aot_eager")
    compiled = backend.compile(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # the state moves at its step
    for step, x, weight in inputs(10, spikes=(7,)):
        for m in (model, eager):
            m.net[3].requires_grad_(step >= 5)
            m.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", fxgrad.CoverageWarning)  # "net.3 is frozen"
            (models.loss_of(compiled(x)) * weight).backward()
        (models.loss_of(eager(x)) * weight).backward()
        reference.step(eager)
        assert_grads_close(model, eager)
        optimizer.step()
    assert len(backend.graphs) == 2
    assert_state_matches(backend, reference, model)


def test_repr_defaults_and_config():
    assert repr(fxgrad.adagc()) == "adagc(lambda_abs=1.0, lambda_rel=1.04, beta=0.99, warmup=100, eps=1e-06)"
    assert fxgrad.adagc(warmup=0).warmup == 0
    backend = fxgrad.from_config({"transform": {"adagc": {"lambda_rel": 1.05, "beta": 0.98}}, "compiler": "aot_eager"})
    assert backend.transform == fxgrad.adagc(lambda_rel=1.05, beta=0.98)


@pytest.mark.parametrize(
    ("kwargs", "error", "argument"),
    [
        ({"lambda_abs": 0}, ValueError, "lambda_abs"),
        ({"lambda_abs": -1.0}, ValueError, "lambda_abs"),
        ({"lambda_abs": float("nan")}, ValueError, "lambda_abs"),
        ({"lambda_abs": "1"}, TypeError, "lambda_abs"),
        ({"lambda_abs": True}, TypeError, "lambda_abs"),
        ({"lambda_rel": 0.0}, ValueError, "lambda_rel"),
        ({"lambda_rel": float("inf")}, ValueError, "lambda_rel"),
        ({"lambda_rel": None}, TypeError, "lambda_rel"),
        ({"beta": 1.0}, ValueError, "beta"),
        ({"beta": -0.1}, ValueError, "beta"),
        ({"beta": float("nan")}, ValueError, "beta"),
        ({"beta": "0.9"}, TypeError, "beta"),
        ({"warmup": -1}, ValueError, "warmup"),
        ({"warmup": 2**53 + 1}, ValueError, "warmup"),
        ({"warmup": 2.5}, TypeError, "warmup"),
        ({"warmup": True}, TypeError, "warmup"),
        ({"eps": 0.0}, ValueError, "eps"),
        ({"eps": float("inf")}, ValueError, "eps"),
        ({"eps": torch.tensor(1e-6)}, TypeError, "eps"),
    ],
)
def test_bad_arguments_raise_naming_them(kwargs, error, argument):
    with pytest.raises(error, match=rf"\b{argument}\b"):
        fxgrad.adagc(**kwargs)
