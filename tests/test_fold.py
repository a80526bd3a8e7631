"""``backend.fold(optimizer)``: the global factor applied by a fused optimizer's own update."""

import contextlib
import copy
import dataclasses
import re
import warnings

import pytest
import reference as ref
import torch
import torch.nn as nn
from parity import fused_calls, no_host_sync

import fxgrad
from fxgrad.core.rule import Leaf

STEPS = 20


def mlp():
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 2))


OPTIMIZERS = {
    "adam": lambda params, **kw: torch.optim.Adam(params, lr=1e-2, **kw),
    "adamw": lambda params, **kw: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, **kw),
    "sgd_momentum": lambda params, **kw: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-3, **kw),
}


def groups(model):
    """Two parameter groups with their own learning rate and weight decay."""
    return [
        {"params": model[0].parameters(), "lr": 3e-2, "weight_decay": 0.0},
        {"params": [p for layer in model[1:] for p in layer.parameters()]},
    ]


def assert_same_weights(actual, expected, rtol=1e-6):
    for (name, a), b in zip(actual.named_parameters(), expected.parameters()):
        scale = b.detach().abs().max().item()
        torch.testing.assert_close(a, b, rtol=rtol, atol=rtol * scale, msg=name)


def train(
    model,
    optimizer,
    steps,
    backend=None,
    reference=None,
    scaler=None,
    scheduler=None,
    nonfinite=(),
    unscale=False,
    closure=False,
    compiled_step=False,
):
    """``steps`` steps on fixed inputs; ``reference(model)`` edits the gradients when there is no backend;
    ``unscale``: ``scaler.unscale_(optimizer)`` before ``scaler.step`` (to log the gradient's norm, say);
    ``closure``: the forward and backward in ``optimizer.step(closure)``, as Lightning steps;
    ``compiled_step``: ``optimizer.step()`` called from a compiled function, torch's recipe for
    compiling the optimizer.

    Steps after the first run under the no-sync trap with a backend and a fused optimizer
    (torch's foreach Adam reads its step counter on the host)."""
    compiled = torch.compile(model, backend=backend) if backend is not None else model
    trapped = backend is not None and all(group.get("fused") for group in optimizer.param_groups)
    step_fn = optimizer.step
    if compiled_step:
        step_fn = torch.compile(lambda: optimizer.step(), backend="aot_eager")
    gen = torch.Generator().manual_seed(3)
    for step in range(steps):
        x = torch.randn(16, 8, generator=gen)
        weight = float("inf") if step in nonfinite else 30.0  # large gradients: the clip acts
        if closure:

            def forward_backward(x=x, weight=weight):
                optimizer.zero_grad()
                loss = compiled(x).pow(2).mean() * weight
                loss.backward()
                if reference is not None:
                    reference(model)
                return loss

            optimizer.step(forward_backward)
            continue
        optimizer.zero_grad()
        with no_host_sync() if step and trapped else contextlib.nullcontext():
            loss = compiled(x).pow(2).mean() * weight
            (scaler.scale(loss) if scaler is not None else loss).backward()
            if scaler is not None and (reference is not None or unscale):
                scaler.unscale_(optimizer)
            if reference is not None:
                reference(model)
            if scaler is not None:
                scaler.step(optimizer)
                scaler.update()
            else:
                step_fn()
        if scheduler is not None:
            scheduler.step()


SCOPES = ["step", "graph"]


@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_folded_global_clip_equals_clip_grad_norm_then_the_fused_step(name, scope):
    """A program runs the update, with the factor: the step program in step scope, after the
    norms; in graph scope one given the factor the backward left."""
    torch.manual_seed(0)
    model, expected = mlp(), None
    expected = copy.deepcopy(model)
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(0.05), compiler="aot_eager", scope=scope)
    optimizer = OPTIMIZERS[name](groups(model), fused=True)
    backend.fold(optimizer)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)
    expected_optimizer = OPTIMIZERS[name](groups(expected), fused=True)
    expected_scheduler = torch.optim.lr_scheduler.StepLR(expected_optimizer, step_size=5, gamma=0.5)
    with fused_calls() as calls:
        train(model, optimizer, STEPS, backend=backend, scheduler=scheduler)
    assert not calls
    train(
        expected, expected_optimizer, STEPS, reference=lambda m: ref.clip_global(m, 0.05), scheduler=expected_scheduler
    )
    assert backend.stats()["folded_factor"].item() < 0.5  # the clip acted on every step
    assert_same_weights(model, expected)


@pytest.mark.parametrize(
    "policy",
    [fxgrad.chain(fxgrad.monitor(), fxgrad.zclip(max_norm=0.5, warmup=5)), fxgrad.autoclip(percentile=50)],
    ids=["monitor+zclip", "autoclip"],
)
def test_folded_adaptive_clips_equal_the_unfolded_path(policy):
    torch.manual_seed(0)
    model = mlp()
    expected = copy.deepcopy(model)
    folded = fxgrad.backend(policy, compiler="aot_eager", scope="step")
    unfolded = fxgrad.backend(policy, compiler="aot_eager", scope="step")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    folded.fold(optimizer)
    train(model, optimizer, STEPS, backend=folded)
    train(expected, torch.optim.AdamW(expected.parameters(), lr=1e-2, fused=True), STEPS, backend=unfolded)
    assert_same_weights(model, expected)
    stats, expected_stats = folded.stats(), unfolded.stats()
    for key in expected_stats:
        torch.testing.assert_close(stats[key], expected_stats[key], rtol=1e-5, atol=1e-9, msg=key)
    assert "folded_factor" in stats and "folded_factor" not in expected_stats


@pytest.mark.parametrize("unscale", [False, True], ids=["scaler.step", "unscale_+step"])
@pytest.mark.parametrize("scope", SCOPES)
def test_folded_with_a_grad_scaler_and_a_skipped_overflow_step(scope, unscale):
    torch.manual_seed(0)
    model = mlp()
    expected = copy.deepcopy(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    expected_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(0.05), compiler="aot_eager", scope=scope, scaler=scaler)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    backend.fold(optimizer)
    expected_optimizer = torch.optim.AdamW(expected.parameters(), lr=1e-2, fused=True)
    train(model, optimizer, STEPS, backend=backend, scaler=scaler, nonfinite={4}, unscale=unscale)
    train(
        expected,
        expected_optimizer,
        STEPS,
        reference=lambda m: ref.clip_global(m, 0.05),
        scaler=expected_scaler,
        nonfinite={4},
    )
    assert scaler.get_scale() == expected_scaler.get_scale() < 2.0**10  # the overflow step lowered it
    assert_same_weights(model, expected)
    assert not hasattr(optimizer, "grad_scale")


@pytest.mark.parametrize("scope", SCOPES)
def test_a_grad_scaler_the_backend_does_not_know_is_reported_for_a_fused_optimizer(scope):
    """GradScaler.step leaves a fused optimizer's gradients scaled (the update unscales them): a
    backend built without scaler= reads norms the loss scale times too large."""
    model = mlp()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(0.05), compiler="aot_eager", scope=scope)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    compiled = torch.compile(model, backend=backend)
    scaler.scale(compiled(torch.randn(16, 8)).pow(2).mean()).backward()
    with pytest.warns(fxgrad.CoverageWarning, match="fxgrad.backend\\(..., scaler=scaler\\)"):
        scaler.step(optimizer)


@pytest.mark.parametrize(
    "policy, reference, scope",
    [
        (fxgrad.clip_by_global_norm(0.05), lambda m: ref.clip_global(m, 0.05), "graph"),
        (fxgrad.clip_by_global_norm(0.05), lambda m: ref.clip_global(m, 0.05), "step"),
        (fxgrad.clip_by_norm(0.02), lambda m: ref.clip_per_layer(m, 0.02), "graph"),
        (fxgrad.clip_by_norm(0.02), lambda m: ref.clip_per_layer(m, 0.02), "step"),
    ],
    ids=["global-graph", "global-step", "per-layer-graph", "per-layer-step"],
)
def test_optimizer_state_dict_round_trip_keeps_folding(policy, reference, scope):
    torch.manual_seed(0)
    model = mlp()
    expected = copy.deepcopy(model)
    backend = fxgrad.backend(policy, compiler="aot_eager", scope=scope)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
    backend.fold(optimizer)
    train(model, optimizer, 10, backend=backend)
    resumed = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
    resumed.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    backend.fold(resumed)
    with fused_calls() as calls:
        train(model, resumed, 10, backend=backend)
    assert not calls  # a program runs the update
    expected_optimizer = torch.optim.Adam(expected.parameters(), lr=1e-2, fused=True)
    train(expected, expected_optimizer, 10, reference=reference)
    train(expected, expected_optimizer, 10, reference=reference)
    assert_same_weights(model, expected)


def test_grad_holds_the_gradient_before_the_factor_until_the_step():
    torch.manual_seed(0)
    model = mlp()
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(0.05), compiler="aot_eager", scope="step")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
    backend.fold(optimizer)
    compiled = torch.compile(model, backend=backend)
    (compiled(torch.randn(16, 8)).pow(2).mean() * 30).backward()
    raw = {name: p.grad.clone() for name, p in model.named_parameters()}
    backend.step()  # the norms are read; nothing is written
    assert all(torch.equal(p.grad, raw[name]) for name, p in model.named_parameters())
    factor = backend.stats()["folded_factor"]
    assert 0 < factor.item() < 0.5
    scaled = backend.scaled_grads(model)
    seen = []  # in a hook of the step itself, after fxgrad handed the factor over: still before the update
    hook = optimizer.register_step_pre_hook(
        lambda *_: seen.append({name: g.clone() for name, g in backend.scaled_grads(model).items()})
    )
    total = torch.stack([g.double().norm() for g in raw.values()]).norm()
    coef = min(1.0, 0.05 / (total.item() + 1e-6))  # clip_grad_norm_'s coefficient
    for name, g in scaled.items():
        torch.testing.assert_close(g, raw[name] * coef, rtol=1e-6, atol=1e-9, msg=name)
    optimizer.step()  # the fused update applies the factor and writes the gradient it used back
    hook.remove()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, scaled[name], rtol=1e-6, atol=1e-9, msg=name)
        torch.testing.assert_close(seen[0][name], scaled[name], rtol=1e-6, atol=1e-9, msg=name)
        torch.testing.assert_close(backend.scaled_grads(model)[name], scaled[name], rtol=1e-6, atol=1e-9, msg=name)


@pytest.mark.parametrize(
    "make, policy, scope, message",
    [
        (lambda p: torch.optim.AdamW(p, foreach=True), fxgrad.clip_by_global_norm(1.0), "step", r"fused=True"),
        (lambda p: torch.optim.AdamW(p, fused=True), fxgrad.clip_by_value(1e-3), "graph", r"clip_by_value"),
        *[
            (lambda p: torch.optim.AdamW(p, fused=True, amsgrad=True), fxgrad.clip_by_norm(1.0), scope, r"amsgrad")
            for scope in ("step", "graph")
        ],
        (lambda p: torch.optim.SGD(p, lr=0.1), fxgrad.clip_by_norm(1.0), "step", r"fused=True"),
        (lambda p: torch.optim.SGD(p, lr=0.1), fxgrad.clip_by_norm(1.0), "graph", r"fused=True"),
        (lambda p: torch.optim.AdamW(p, fused=True), fxgrad.monitor(), "graph", r"changes no gradient"),
    ],
    ids=["foreach", "by-value-graph", "amsgrad", "amsgrad-graph", "unfused-sgd", "unfused-sgd-graph", "monitor"],
)
def test_combinations_that_do_not_fold_warn_once_and_stay_exact(make, policy, scope, message):
    torch.manual_seed(0)
    model = mlp()
    expected = copy.deepcopy(model)
    backend = fxgrad.backend(policy, compiler="aot_eager", scope=scope)
    optimizer = make(model.parameters())
    with pytest.warns(RuntimeWarning, match=message):
        backend.fold(optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        train(model, optimizer, 3, backend=backend)
    unfolded = fxgrad.backend(policy, compiler="aot_eager", scope=scope)
    train(expected, make(expected.parameters()), 3, backend=unfolded)
    assert_same_weights(model, expected)


def test_graph_scope_folds_only_what_its_graphs_have_not_scaled():
    """fold() after the first forward: the compiled backward scales, so nothing folds (warned,
    exact). Two backwards before a step (accumulation): each had its own factor; refused."""
    torch.manual_seed(0)
    model = mlp()
    expected = copy.deepcopy(model)
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(0.05), compiler="aot_eager", scope="graph")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    train(model, optimizer, 1, backend=backend)
    with pytest.warns(RuntimeWarning, match=r"before the model's first forward"):
        backend.fold(optimizer)
    train(model, optimizer, 2, backend=backend)
    expected_optimizer = torch.optim.AdamW(expected.parameters(), lr=1e-2, fused=True)
    for steps in (1, 2):  # the same inputs as the two calls above
        train(expected, expected_optimizer, steps, reference=lambda m: ref.clip_global(m, 0.05))
    assert_same_weights(model, expected)

    model = mlp()
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(0.05), compiler="aot_eager", scope="graph")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    backend.fold(optimizer)
    compiled = torch.compile(model, backend=backend)
    compiled(torch.randn(4, 8)).sum().backward()
    optimizer.step()  # one backward: folded
    optimizer.zero_grad()
    compiled(torch.randn(4, 8)).sum().backward()
    compiled(torch.randn(4, 8)).sum().backward()
    with pytest.raises(ValueError, match=r"fold in graph scope: 2 backward passes"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            optimizer.step()
    assert any("still held the previous backward's gradient" in str(w.message) for w in caught)


@pytest.mark.parametrize("scope", SCOPES)
def test_passes_whose_gradients_are_dropped_leave_no_factor_to_the_fold(scope):
    """A step skipped after its backward (a loss spike: zero_grad(), continue) and an adversarial
    attack's torch.autograd.grad pass write nothing the step takes: folded, the weights equal the
    eager clip's. Graph scope refused both as two backwards with factors of their own."""
    torch.manual_seed(0)
    model = mlp()
    expected = copy.deepcopy(model)
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(0.05), compiler="aot_eager", scope=scope)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    backend.fold(optimizer)
    compiled = torch.compile(model, backend=backend)
    expected_optimizer = torch.optim.AdamW(expected.parameters(), lr=1e-2, fused=True)
    gen = torch.Generator().manual_seed(3)
    for step in range(6):
        x = torch.randn(16, 8, generator=gen)
        for net, opt, clip in ((compiled, optimizer, False), (expected, expected_optimizer, True)):
            if step % 3 == 1:  # attacked: the input's gradient, before the backward stepped
                attacked = x.clone().requires_grad_(True)
                torch.autograd.grad(net(attacked).pow(2).mean() * 30.0, attacked)
            (net(x).pow(2).mean() * 30.0).backward()
            if step % 3 == 2:  # skipped: its gradients dropped
                opt.zero_grad()
                continue
            if clip:
                torch.nn.utils.clip_grad_norm_(expected.parameters(), 0.05)
            opt.step()
            opt.zero_grad()
    assert_same_weights(model, expected)


@pytest.mark.parametrize("drop", ["another model's backward", "zeroed in place", "an attack after the backward"])
def test_graph_scope_refuses_a_latest_factor_that_does_not_describe_the_gradients(drop):
    """The latest backward's factor is the fold's only one: refused when the gradients the step
    takes are not that backward's alone. An actor's step after the critic's backward (one backend
    over both) would apply the critic's factor; zero_grad(set_to_none=False) leaves zeros that a
    backward sums into, which fxgrad cannot tell from a sum; an attack pass after the backward
    leaves its own factor."""
    torch.manual_seed(0)
    actor, critic = mlp(), mlp()
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(0.05), compiler="aot_eager", scope="graph")
    optimizer = torch.optim.AdamW(actor.parameters(), lr=1e-2, fused=True)
    critic_optimizer = torch.optim.AdamW(critic.parameters(), lr=1e-2, fused=True)
    backend.fold(optimizer)
    backend.fold(critic_optimizer)
    compiled, compiled_critic = torch.compile(actor, backend=backend), torch.compile(critic, backend=backend)
    x = torch.randn(16, 8)
    for step in range(2):
        compiled(x).pow(2).mean().backward()
        if drop == "another model's backward" and step:
            compiled_critic(x).pow(2).mean().backward()
        elif drop == "zeroed in place" and step:
            optimizer.zero_grad(set_to_none=False)
            compiled(x).pow(2).mean().backward()
        elif drop == "an attack after the backward" and step:
            attacked = x.clone().requires_grad_(True)
            torch.autograd.grad(compiled(attacked).pow(2).mean(), attacked)
        refused = pytest.raises(ValueError, match=r"fold in graph scope: 2 backward passes")
        with refused if step else contextlib.nullcontext():
            optimizer.step()
        optimizer.zero_grad()
        critic_optimizer.zero_grad()


@pytest.mark.parametrize("scope", SCOPES)
def test_a_gan_with_a_folded_discriminator_equals_the_unfolded_loop(scope):
    """The discriminator's backend folds into its fused Adam. The generator's step backpropagates
    through the discriminator, frozen for it: that pass leaves no factor, so graph scope folds
    too (it counted it as a second backward, and refused the discriminator's next step)."""

    def run(fold):
        torch.manual_seed(0)
        G = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 8))
        D = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        backend = fxgrad.backend(fxgrad.clip_by_global_norm(0.05), compiler="aot_eager", scope=scope)
        opt_g = torch.optim.Adam(G.parameters(), lr=1e-2)
        opt_d = torch.optim.Adam(D.parameters(), lr=1e-2, fused=True)
        if fold:
            backend.fold(opt_d)
        d = torch.compile(D, backend=backend)
        gen = torch.Generator().manual_seed(1)
        for _ in range(6):
            fake = G(torch.randn(6, 4, generator=gen))
            opt_d.zero_grad()
            d(torch.cat([torch.randn(6, 8, generator=gen), fake.detach()])).pow(2).mean().mul(30).backward()
            opt_d.step()
            opt_g.zero_grad()
            D.requires_grad_(False)
            (-d(fake)).mean().backward()
            D.requires_grad_(True)
            opt_g.step()
        return G, D

    for actual, expected in zip(run(fold=True), run(fold=False)):
        assert_same_weights(actual, expected)


def test_optimizers_it_cannot_fold_are_refused():
    params = mlp().parameters()
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1.0), compiler="aot_eager", scope="step")
    with pytest.raises(ValueError, match=r"\boptimizer\b: fxgrad cannot fold into LBFGS"):
        backend.fold(torch.optim.LBFGS(params))
    with pytest.raises(TypeError, match=r"\boptimizer\b must be a torch.optim.Optimizer"):
        backend.fold("adam")


@pytest.mark.parametrize("scope", SCOPES)
def test_a_closure_step_gets_the_factor_of_the_gradients_its_closure_computes(scope):
    """``optimizer.step(closure)`` (Lightning) computes the gradients after the step's pre-hooks:
    the policy runs, and the factor is given, when the closure returns."""
    torch.manual_seed(0)
    model = mlp()
    expected = copy.deepcopy(model)
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(0.05), compiler="aot_eager", scope=scope)
    optimizer = OPTIMIZERS["adamw"](model.parameters(), fused=True)
    backend.fold(optimizer)
    expected_optimizer = OPTIMIZERS["adamw"](expected.parameters(), fused=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no 'the policy did not run' for the pre-hook before the closure
        train(model, optimizer, 5, backend=backend, closure=True)
    train(expected, expected_optimizer, 5, reference=lambda m: ref.clip_global(m, 0.05), closure=True)
    assert backend.stats()["folded_factor"].item() < 0.5
    assert_same_weights(model, expected)


@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize(
    "folded, policy, expected_edit",
    [
        (True, lambda: fxgrad.clip_by_global_norm(0.05), lambda m: ref.clip_global(m, 0.05)),
        (
            False,
            lambda: fxgrad.chain(fxgrad.clip_by_norm(0.02), fxgrad.clip_by_global_norm(0.05)),
            lambda m: (ref.clip_per_layer(m, 0.02), ref.clip_global(m, 0.05)),
        ),
    ],
    ids=["folded", "per-layer"],
)
def test_an_optimizer_step_compiled_by_the_user_runs_the_policy(scope, folded, policy, expected_edit):
    """torch's recipe compiles ``optimizer.step()`` inside a function; Dynamo steps over the
    backend's pre-hook (``torch.compiler.disable``), which then runs eagerly before the update."""
    torch.manual_seed(0)
    model = mlp()
    expected = copy.deepcopy(model)
    backend = fxgrad.backend(policy(), compiler="aot_eager", scope=scope)
    optimizer = OPTIMIZERS["adamw"](model.parameters(), fused=True)
    if folded:
        backend.fold(optimizer)
    expected_optimizer = OPTIMIZERS["adamw"](expected.parameters(), fused=True)
    train(model, optimizer, 5, backend=backend, compiled_step=True)
    train(expected, expected_optimizer, 5, reference=expected_edit, compiled_step=True)
    assert_same_weights(model, expected)


@pytest.mark.parametrize("scope", SCOPES)
def test_a_folded_optimizer_the_policy_never_reaches_is_reported(scope):
    model = mlp()
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1e-3), compiler="aot_eager", scope=scope)
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)
    backend.fold(optimizer)
    for _ in range(2):  # the model never met the backend: nothing clips, and the user is told once
        model(torch.randn(4, 8)).sum().backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            optimizer.step()
        said = [w for w in caught if "did not: no model this backend compiled" in str(w.message)]
        assert len(said) == (1 if _ == 0 else 0)
    reached = mlp()
    optimizer = torch.optim.AdamW(reached.parameters(), fused=True)
    backend.fold(optimizer)
    compiled = backend.compile(reached)
    with warnings.catch_warnings():
        warnings.simplefilter("error", fxgrad.CoverageWarning)
        for step in range(3):
            if step != 1:  # a step with no backward, so no gradient: nothing to say
                compiled(torch.randn(4, 8)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()


@pytest.mark.parametrize("scope", SCOPES)
def test_two_optimizers_over_one_model_fold_both_or_are_refused(scope):
    """Weights and biases under two fused AdamW: folding both equals the unfolded path; folding
    one alone would leave the other's gradients without the factor, so its step is refused."""

    def split(model):
        weights = [p for name, p in model.named_parameters() if name.endswith("weight")]
        biases = [p for name, p in model.named_parameters() if name.endswith("bias")]
        return [torch.optim.AdamW(ps, lr=1e-2, fused=True) for ps in (weights, biases)]

    def run(model, optimizers, backend=None):
        compiled = torch.compile(model, backend=backend) if backend is not None else model
        gen = torch.Generator().manual_seed(3)
        for _ in range(5):
            (compiled(torch.randn(16, 8, generator=gen)).pow(2).mean() * 30.0).backward()
            if backend is None:
                ref.clip_global(model, 1e-2)
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()

    model, expected = mlp(), mlp()
    expected.load_state_dict(model.state_dict())
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1e-2), compiler="aot_eager", scope=scope)
    optimizers = split(model)
    for optimizer in optimizers:
        backend.fold(optimizer)
    with fused_calls() as calls, warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        run(model, optimizers, backend)
    # step scope: grad_scale carries the factor (the step program runs no update of part of the gradients);
    # graph scope: each optimizer's program takes the factor the backward left
    assert bool(calls) == (scope == "step")
    run(expected, split(expected))
    assert_same_weights(model, expected)

    model = mlp()
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1e-2), compiler="aot_eager", scope=scope)
    optimizers = split(model)
    backend.fold(optimizers[0])
    with pytest.raises(ValueError, match="is not folded .* while 1 other optimizer"):
        run(model, optimizers, backend)

    model = mlp()  # the second one given to fold(), which falls back for a non-fused one
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1e-2), compiler="aot_eager", scope=scope)
    optimizers = [split(model)[0], torch.optim.SGD([p for n, p in model.named_parameters() if "bias" in n], lr=0.1)]
    backend.fold(optimizers[0])
    with pytest.warns(RuntimeWarning, match=r"fold\(SGD\)"):
        backend.fold(optimizers[1])
    with pytest.raises(ValueError, match="or fold\\(\\) fell back for it"):
        run(model, optimizers, backend)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_step_the_program_cannot_run_folds_into_grad_scale_silently(name):
    """A step hook of the user's keeps the optimizer's own update (the hook would find no
    parameter group): in step scope the global factor then rides in ``grad_scale``, exact."""
    torch.manual_seed(0)
    model = mlp()
    expected = copy.deepcopy(model)
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(0.05), compiler="aot_eager", scope="step")
    optimizer = OPTIMIZERS[name](groups(model), fused=True)
    backend.fold(optimizer)
    seen = []
    optimizer.register_step_post_hook(lambda opt, args, kwargs: seen.append(len(opt.param_groups)))
    expected_optimizer = OPTIMIZERS[name](groups(expected), fused=True)
    schedulers = [
        torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5) for opt in (optimizer, expected_optimizer)
    ]
    with fused_calls() as calls, warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        train(model, optimizer, STEPS, backend=backend, scheduler=schedulers[0])
    assert calls and set(seen) == {2}
    train(expected, expected_optimizer, STEPS, reference=lambda m: ref.clip_global(m, 0.05), scheduler=schedulers[1])
    assert_same_weights(model, expected)


@pytest.mark.parametrize("scope", SCOPES)
def test_a_second_step_on_the_same_gradients_applies_the_factor_once(scope):
    """The fused update writes the gradient times the factor back to ``.grad``: that is what a
    second step (no backward in between) and scaled_grads() after the step see."""
    torch.manual_seed(0)
    model = mlp()
    expected = copy.deepcopy(model)
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(0.05), compiler="aot_eager", scope=scope)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
    backend.fold(optimizer)
    compiled = torch.compile(model, backend=backend)
    expected_optimizer = torch.optim.SGD(expected.parameters(), lr=0.1, momentum=0.9, fused=True)
    for _ in range(3):
        x = torch.randn(16, 8)
        for m, opt in ((compiled, optimizer), (expected, expected_optimizer)):
            opt.zero_grad()
            (m(x).pow(2).mean() * 30).backward()
        ref.clip_global(expected, 0.05)
        for _ in range(2):
            optimizer.step()
            expected_optimizer.step()
        scaled = backend.scaled_grads(model)
        for (name, p), q in zip(model.named_parameters(), expected.parameters()):
            torch.testing.assert_close(scaled[name], q.grad, rtol=1e-6, atol=1e-9, msg=name)
    assert_same_weights(model, expected)


def _add_group(fused):
    return lambda optimizer, temperature: optimizer.add_param_group({"params": [temperature], "fused": fused})


def _load_unfused_checkpoint(optimizer, temperature):
    state = optimizer.state_dict()
    state["param_groups"][0]["fused"] = None  # as torch.optim.AdamW(...) saves it
    optimizer.load_state_dict(state)  # which copies it into the parameter group


@pytest.mark.parametrize(
    "change, reason",
    [
        (_add_group(True), "also steps 1 parameter(s) outside the models"),
        (_add_group(False), "a parameter group without fused=True"),
        (_load_unfused_checkpoint, "a parameter group without fused=True"),
    ],
    ids=["outside parameter", "unfused group", "unfused checkpoint"],
)
@pytest.mark.parametrize("scope", SCOPES)
def test_a_folded_optimizer_that_steps_more_than_the_model_scales_the_gradients_itself(scope, change, reason):
    """grad_scale would multiply every gradient the optimizer steps: a loss module's temperature,
    or a group without fused=True (added after fold(), or a plain AdamW's checkpoint loaded),
    leave the factor to a pass of its own."""
    torch.manual_seed(0)
    model = mlp()
    expected = copy.deepcopy(model)
    temperature, expected_temperature = (nn.Parameter(torch.ones(())) for _ in range(2))
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(0.05), compiler="aot_eager", scope=scope)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    backend.fold(optimizer)
    compiled = torch.compile(model, backend=backend)
    expected_optimizer = torch.optim.AdamW(expected.parameters(), lr=1e-2, fused=True)
    for step in range(6):
        if step == 3:
            change(optimizer, temperature)
            change(expected_optimizer, expected_temperature)
        x = torch.randn(16, 8)
        for m, t, opt in ((compiled, temperature, optimizer), (expected, expected_temperature, expected_optimizer)):
            opt.zero_grad()
            (m(x).pow(2).mean() * 30 * t).backward()
        ref.clip_global(expected, 0.05)
        expected_optimizer.step()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            optimizer.step()
        said = [str(w.message) for w in caught if "fold(AdamW)" in str(w.message)]
        assert len(said) == (step == 3), said
        if said:
            assert reason in said[0] and "in a pass of its own" in said[0]
    assert_same_weights(model, expected)
    torch.testing.assert_close(temperature, expected_temperature, rtol=1e-6, atol=0)

    other = fxgrad.backend(fxgrad.clip_by_global_norm(0.05), compiler="aot_eager", scope=scope)
    if all(group["fused"] for group in optimizer.param_groups):
        with pytest.raises(ValueError, match=r"\boptimizer\b: this AdamW is folded into another fxgrad backend"):
            other.fold(optimizer)
    else:  # which the unfused group makes the other backend keep its scaling pass: no conflict
        with pytest.warns(RuntimeWarning, match=r"fold\(AdamW\)"):
            other.fold(optimizer)


@pytest.mark.parametrize("scope", SCOPES)
def test_an_optimizer_that_replaces_a_folded_one_is_folded_again(scope):
    """A resume in the same process: a new fused optimizer takes the folded one's state_dict. In
    graph scope the backward graphs were compiled folded and keep leaving the factor to the
    update, so the new optimizer's step refuses until it is folded too; then it folds."""
    torch.manual_seed(0)
    model = mlp()
    expected = copy.deepcopy(model)
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(0.05), compiler="aot_eager", scope=scope)
    optimizer = OPTIMIZERS["adamw"](model.parameters(), fused=True)
    backend.fold(optimizer)
    expected_optimizer = OPTIMIZERS["adamw"](expected.parameters(), fused=True)
    clip = lambda m: ref.clip_global(m, 0.05)  # noqa: E731
    train(model, optimizer, 3, backend=backend)
    train(expected, expected_optimizer, 3, reference=clip)
    replaced, expected_replaced = (OPTIMIZERS["adamw"](m.parameters(), fused=True) for m in (model, expected))
    replaced.load_state_dict(optimizer.state_dict())
    expected_replaced.load_state_dict(expected_optimizer.state_dict())
    del optimizer
    if scope == "graph":
        with pytest.raises(ValueError, match=r"must be folded too: backend.fold\(optimizer\)"):
            train(model, replaced, 1, backend=backend)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback: the graphs leave the factor already
        backend.fold(replaced)
    train(model, replaced, 3, backend=backend)
    train(expected, expected_replaced, 3, reference=clip)
    assert_same_weights(model, expected)


def test_a_fold_that_falls_back_leaves_the_optimizer_to_another_backend():
    optimizer = torch.optim.AdamW(mlp().parameters(), fused=True)
    per_layer = fxgrad.backend(fxgrad.clip_by_value(0.05), compiler="aot_eager", scope="graph")
    with pytest.warns(RuntimeWarning, match=r"fold\(AdamW\)"):
        per_layer.fold(optimizer)
    assert per_layer.folded_into() == []
    folded = fxgrad.backend(fxgrad.clip_by_global_norm(0.05), compiler="aot_eager", scope="step")
    folded.fold(optimizer)
    assert folded.folded_into() == [optimizer]


@pytest.mark.parametrize(
    "scope, said",
    [
        ("graph", "folded into AdamW: the backward leaves the global factor (stats: folded_factor), and a program"),
        ("step", "folded into AdamW: the step program runs AdamW's update"),
    ],
)
def test_explain_says_the_gradients_are_folded(scope, said):
    """... and shows the graph or the program training runs: no pass that scales the gradients
    (graph scope showed one, from a backward compiled unfolded, until a sweep found it)."""
    model = mlp()
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(0.05), compiler="aot_eager", scope=scope)
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)
    backend.fold(optimizer)
    report = fxgrad.explain(model, torch.randn(4, 8), backend=backend)
    assert said in report.table()
    shown = report.inserted if scope == "graph" else report.program
    assert "# layer norms" in shown and "# scale gradients" not in shown
    assert optimizer.state == {}  # explain folded into a copy


@pytest.mark.parametrize("scope", ["graph", "step"])
def test_a_fixed_multiplier_under_adam_is_reported_as_cancelled(scope):
    """The rescaling article's "amplify the stem 3x" as a gradient factor: AdamW divides it out."""
    torch.manual_seed(0)
    stem = fxgrad.rescale(alpha=0, multipliers={"0": 3.0})
    model = mlp()
    plain = copy.deepcopy(model)
    backend = fxgrad.backend(stem, compiler="aot_eager", scope=scope)
    with pytest.warns(fxgrad.CoverageWarning, match=r"AdamW's update divides the gradient by its running RMS"):
        train(model, torch.optim.AdamW(model.parameters(), lr=1e-2), 10, backend=backend)
    train(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2), 10)
    assert_same_weights(model, plain, rtol=1e-4)  # what the warning says: the policy did (almost) nothing
    from transformers.optimization import Adafactor  # known by name: fxgrad does not import transformers

    model = mlp()
    with pytest.warns(fxgrad.CoverageWarning, match=r"Adafactor's update divides the gradient by its running RMS"):
        train(model, Adafactor(model.parameters(), lr=1e-2, relative_step=False), 2, backend=backend)

    # Muon over the matrices (AdamW over the rest) divides each matrix's momentum by its norm. It
    # orthogonalizes in bfloat16, which would round 3x anew: a power of two cancels exactly.
    model = mlp()
    plain = copy.deepcopy(model)
    quadruple = fxgrad.backend(fxgrad.rescale(alpha=0, multipliers={"0": 4.0}), compiler="aot_eager", scope=scope)
    for net, backend_or_none in ((model, quadruple), (plain, None)):
        matrices = [p for p in net.parameters() if p.ndim == 2]
        muon = torch.optim.Muon(matrices, lr=1e-2)
        adamw = torch.optim.AdamW([p for p in net.parameters() if p.ndim != 2], lr=1e-2)
        compiled = torch.compile(net, backend=backend_or_none) if backend_or_none is not None else net
        gen = torch.Generator().manual_seed(3)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(5):
                compiled(torch.randn(16, 8, generator=gen)).pow(2).mean().backward()
                muon.step()
                adamw.step()
                muon.zero_grad()
                adamw.zero_grad()
        if backend_or_none is not None:
            assert any("Muon's update divides each matrix's momentum by its norm" in str(w.message) for w in caught)
    assert_same_weights(model, plain, rtol=1e-5)

    for policy, make in (
        (stem, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)),  # SGD: the multiplier acts
        (fxgrad.rescale(alpha=0.5), lambda p: torch.optim.AdamW(p, lr=1e-2)),  # varies per step: acts
        (stem, lambda p: torch.optim.RAdam(p, lr=1e-2)),  # its first steps are momentum SGD's: acts there
        (stem, lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.5)),  # L2 joins the gradient: acts
        (stem, lambda p: torch.optim.Adam(decay_on(p, "0"), lr=1e-2)),  # ... on the multiplied layer
    ):
        model = mlp()
        with warnings.catch_warnings():
            warnings.simplefilter("error", fxgrad.CoverageWarning)
            train(model, make(model.parameters()), 2, backend=fxgrad.backend(policy, compiler="aot_eager", scope=scope))


def torchao_named(name):
    """A stand-in for torchao's low-bit Adam ``name`` (known by name: fxgrad does not import
    torchao), an SGD underneath, so only the name can make fxgrad warn."""
    return type(name, (torch.optim.SGD,), {"__module__": "torchao.optim.adam"})


@pytest.mark.parametrize(
    ("name", "weight_decay", "told"),
    [("AdamW8bit", 0.01, True), ("AdamWFp8", 0.0, True), ("Adam4bit", 0.0, True), ("Adam8bit", 0.5, False)],
)
def test_torchaos_low_bit_adams_are_known_to_cancel_a_fixed_multiplier(name, weight_decay, told):
    """torchao's 8-bit, 4-bit and float8 Adams divide by the running RMS as Adam does (a 3x stem
    multiplier moved an MLP's weights by 0.02-0.12% under them over 10 steps, their own
    quantization noise); its Adams without a W add the decay to the gradient, where it acts."""
    model = mlp()
    backend = fxgrad.backend(fxgrad.rescale(alpha=0, multipliers={"0": 3.0}), compiler="aot_eager", scope="step")
    optimizer = torchao_named(name)(model.parameters(), lr=1e-2, weight_decay=weight_decay)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(model, optimizer, 2, backend=backend)
    said = [str(w.message) for w in caught if "update divides the gradient by its running RMS" in str(w.message)]
    assert bool(said) == told and all(f"{name}'s update divides" in message for message in said)


def decay_on(params, layer):
    """Adam's parameter groups: L2 weight decay on ``layer`` of :func:`mlp`, none elsewhere."""
    params = list(params)
    held = {id(p) for p in mlp_layer(params, layer)}
    return [
        {"params": [p for p in params if id(p) in held], "weight_decay": 0.5},
        {"params": [p for p in params if id(p) not in held], "weight_decay": 0.0},
    ]


def mlp_layer(params, layer):
    """The weight and bias of Linear ``layer`` ("0", "2", "4") among :func:`mlp`'s ``params``."""
    index = {"0": 0, "2": 2, "4": 6}[layer]  # LayerNorm "3" holds parameters 4 and 5
    return params[index : index + 2]


@pytest.mark.parametrize("scope", ["graph", "step"])
def test_a_multiplier_under_adam_is_reported_when_decay_is_on_other_layers_alone(scope):
    """The usual "no decay on some parameters" groups: L2 decay on the head alone, where the
    multiplier on the stem is not: the stem's factor cancels, and is reported (the check asked
    whether any group decays, until a sweep found it)."""
    torch.manual_seed(0)
    model = mlp()
    plain = copy.deepcopy(model)
    backend = fxgrad.backend(fxgrad.rescale(alpha=0, multipliers={"0": 3.0}), compiler="aot_eager", scope=scope)
    with pytest.warns(fxgrad.CoverageWarning, match=r"Adam's update divides the gradient by its running RMS"):
        train(model, torch.optim.Adam(decay_on(model.parameters(), "4"), lr=1e-2), 10, backend=backend)
    train(plain, torch.optim.Adam(decay_on(plain.parameters(), "4"), lr=1e-2), 10)
    assert_same_weights(model, plain, rtol=1e-4)


@pytest.mark.parametrize("scope", ["graph", "step"])
def test_a_multiplier_on_layers_another_optimizer_steps_is_not_reported_as_cancelled(scope):
    """Adam over the first layers, SGD over the head with its multiplier: under SGD the factor acts,
    and Adam's layers have none (the warning named Adam before, found by a sweep)."""
    torch.manual_seed(0)
    model = mlp()
    plain = copy.deepcopy(model)
    backend = fxgrad.backend(fxgrad.rescale(alpha=0, multipliers={"4": 3.0}), compiler="aot_eager", scope=scope)
    weighted = []
    for net, run in ((model, backend.compile(model)), (plain, plain)):
        optimizers = [torch.optim.Adam(net[:4].parameters(), lr=1e-2), torch.optim.SGD(net[4].parameters(), lr=0.1)]
        gen = torch.Generator().manual_seed(3)
        with warnings.catch_warnings():
            warnings.simplefilter("error", fxgrad.CoverageWarning)
            for _ in range(5):
                run(torch.randn(16, 8, generator=gen)).pow(2).mean().backward()
                for optimizer in optimizers:
                    optimizer.step()
                    optimizer.zero_grad()
        weighted.append(net[4].weight.detach())
    assert not torch.allclose(*weighted, rtol=1e-3)  # the multiplier acted


def test_a_gradient_multiplier_beside_an_update_level_rule_is_reported_as_cancelled():
    """The update-level rule scales what the step changes; the gradient-level multiplier beside
    it still cancels under Adam, and the warning names that rule alone."""
    torch.manual_seed(0)
    model = mlp()
    grads = fxgrad.rescale(alpha=0, multipliers={"0": 3.0})
    policy = fxgrad.chain(grads, fxgrad.rescale(alpha=0, multipliers={"2": 2.0}, apply_to="update"))
    backend = fxgrad.backend(policy, compiler="aot_eager")
    with pytest.warns(fxgrad.CoverageWarning, match=rf"^fxgrad: {re.escape(repr(grads))} only multiplies .* Adam's"):
        train(model, torch.optim.Adam(model.parameters(), lr=1e-2), 2, backend=backend)


@pytest.mark.parametrize("scope", ["graph", "step"])
def test_positive_factors_under_a_sign_only_update_are_reported(scope):
    """Rprop moves each weight by its gradient's sign: a clip does nothing, and is reported;
    zero_nonfinite, which zeroes elements, is not."""
    torch.manual_seed(0)
    model = mlp()
    plain = copy.deepcopy(model)
    policy = fxgrad.chain(fxgrad.zero_nonfinite(), fxgrad.clip_by_global_norm(1e-3))
    backend = fxgrad.backend(policy, compiler="aot_eager", scope=scope)
    with pytest.warns(
        fxgrad.CoverageWarning,
        match=r"^fxgrad: Rprop moves .* by factors > 0: clip_by_global_norm\(max_norm=0.001\)\. The weights move as "
        r"without them\. Use another optimizer\.$",  # clip_by_global_norm takes no apply_to
    ):
        train(model, torch.optim.Rprop(model.parameters(), lr=1e-2), 5, backend=backend)
    train(plain, torch.optim.Rprop(plain.parameters(), lr=1e-2), 5)
    assert_same_weights(model, plain, rtol=1e-6)


@dataclasses.dataclass(frozen=True)
class _Centred(Leaf):
    """A rule written outside fxgrad that says nothing of signs (and changes them)."""

    name = "centred"

    def apply(self, grads, layers, ctx):
        return [[g - g.mean() for g in layer] for layer in grads]


def test_a_rule_that_does_not_say_it_keeps_signs_is_not_reported_under_a_sign_only_update():
    model = mlp()
    backend = fxgrad.backend(_Centred(), compiler="aot_eager", scope="step")
    with warnings.catch_warnings():
        warnings.simplefilter("error", fxgrad.CoverageWarning)
        train(model, torch.optim.Rprop(model.parameters(), lr=1e-2), 2, backend=backend)
