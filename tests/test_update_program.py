"""``backend.fold(optimizer)`` with per-layer factors: a program runs the fused update, the
policy's in step scope, and in graph scope with the factors the backward left per layer.

The reference is the policy's eager reference, then torch's own fused step."""

import copy
import warnings

import pytest
import reference as ref
import torch
import torch.nn as nn
from parity import fused_calls
from test_fold import assert_same_weights, groups, mlp, train

import fxgrad

STEPS = 20

OPTIMIZERS = {
    "adam": lambda params: torch.optim.Adam(params, lr=1e-2, weight_decay=0.1, fused=True),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, betas=(0.8, 0.99), fused=True),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, weight_decay=1e-3, fused=True),
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-3, fused=True),
    "sgd_dampening": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, dampening=0.2, fused=True),
    "sgd_nesterov": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True, fused=True),
    "adamw_tensors": lambda params: torch.optim.AdamW(  # hyperparameters as tensors
        params, lr=torch.tensor(1e-2), betas=(torch.tensor(0.8), torch.tensor(0.99)), fused=True
    ),
    "sgd_momentum_tensors": lambda params: torch.optim.SGD(
        params, lr=torch.tensor(0.1), momentum=0.9, weight_decay=torch.tensor(1e-3), fused=True
    ),
}

POLICIES = {
    "per_layer_clip": (lambda: fxgrad.clip_by_norm(0.02), lambda m: ref.clip_per_layer(m, 0.02)),
    "rescale+global_clip": (
        lambda: fxgrad.chain(fxgrad.rescale(0.5, target=0.1), fxgrad.clip_by_global_norm(0.05)),
        lambda m: (ref.rescale(m, 0.5, 0.1), ref.clip_global(m, 0.05)),
    ),
    "agc": (lambda: fxgrad.adaptive_grad_clip(0.01), lambda m: ref.agc(m, 0.01)),  # reads the weights it updates
    "sinkhorn": (lambda: fxgrad.sinkhorn(iters=3), lambda m: ref.sinkhorn(m, iters=3)),
    "by_type_global_clip": (
        lambda: fxgrad.by_type({nn.Linear: fxgrad.clip_by_global_norm(1e-2)}),  # not the LayerNorm
        lambda m: nn.utils.clip_grad_norm_([p for i in (0, 2, 4) for p in m[i].parameters()], 1e-2),
    ),
    "by_name_global_clips": (
        lambda: fxgrad.by_name({"0": fxgrad.clip_by_global_norm(0.1)}, default=fxgrad.clip_by_global_norm(1e-2)),
        lambda m: (
            nn.utils.clip_grad_norm_(m[0].parameters(), 0.1),
            nn.utils.clip_grad_norm_([p for i in (2, 4) for p in m[i].parameters()], 1e-2),  # routing skips norms
        ),
    ),
}


# the policies whose every change is a factor per layer: graph scope's backward leaves those to the update
FACTORS = ("per_layer_clip", "rescale+global_clip", "by_type_global_clip", "by_name_global_clips")


def step_lr(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)


def weights_rtol(optimizer: torch.optim.Optimizer) -> float:
    """torch's CPU kernel fuses multiply-adds (one rounding where the program has two), and momentum
    carries the difference on: after 20 steps at lr 0.1, 1e-6 to 9e-6 of the weights, as far as the
    unfolded step scope (policy, then torch's step) is from the eager reference; how far depends on
    the CPU's vector units (1.8e-6 with AVX-512 where AVX2 gave under 1e-6)."""
    return 1e-5 if any(group.get("momentum") for group in optimizer.param_groups) else 1e-6


def folded_run(policy, make, steps=STEPS, scheduler=step_lr, expected_scaler=None, scope="step", **kwargs):
    """``steps`` steps folded and the same unfolded on a copy (its GradScaler: ``expected_scaler``)."""
    torch.manual_seed(0)
    model = mlp()
    expected = copy.deepcopy(model)
    backend = fxgrad.backend(policy[0](), compiler="aot_eager", scope=scope, scaler=kwargs.get("scaler"))
    optimizer = make(groups(model))
    sched = scheduler(optimizer) if scheduler else None
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # it folds: no fallback, no program run eagerly
        backend.fold(optimizer)
        with fused_calls() as calls:
            train(model, optimizer, steps, backend=backend, scheduler=sched, **kwargs)
    expected_optimizer = make(groups(expected))
    expected_sched = scheduler(expected_optimizer) if scheduler else None
    kwargs = {**kwargs, "scaler": expected_scaler} if "scaler" in kwargs else kwargs
    train(expected, expected_optimizer, steps, reference=policy[1], scheduler=expected_sched, **kwargs)
    return model, expected, optimizer, expected_optimizer, calls


@pytest.mark.parametrize(
    "name, policy, scope",
    # SinkGD's unit-RMS gradients make SGD at lr 0.1 diverge, with or without the fold
    [
        (name, policy, scope)
        for scope in ("step", "graph")
        for name in OPTIMIZERS
        for policy in (POLICIES if scope == "step" else FACTORS)
        if not (policy == "sinkhorn" and "sgd" in name)
    ],
)
def test_the_folded_update_equals_the_policy_then_the_fused_step(name, policy, scope):
    """Two parameter groups (their own learning rate and weight decay) and a StepLR, 20 steps:
    the weights and the optimizer's state equal the unfolded path's, and no fused kernel of
    torch's updated a parameter (the program did)."""
    model, expected, optimizer, expected_optimizer, calls = folded_run(POLICIES[policy], OPTIMIZERS[name], scope=scope)
    assert_same_weights(model, expected, rtol=weights_rtol(optimizer))
    state, expected_state = optimizer.state_dict()["state"], expected_optimizer.state_dict()["state"]
    assert state.keys() == expected_state.keys()
    for index, entry in expected_state.items():  # kept as torch keeps it; a moment of a bias that mostly
        assert state[index].keys() == entry.keys()  # cancels carries the gradients' rounding: 1e-4 of its largest
        for key, value in entry.items():
            atol = 1e-4 * value.abs().max().item()
            torch.testing.assert_close(state[index][key], value, rtol=1e-4, atol=atol, msg=f"{index} {key}")
    assert not calls


@pytest.mark.parametrize("scope", ["step", "graph"])
@pytest.mark.parametrize("unscale", [False, True], ids=["scaler.step", "unscale_+step"])
@pytest.mark.parametrize("name", ["adamw", "sgd_momentum"])
def test_a_grad_scaler_and_a_skipped_overflow_step(name, unscale, scope):
    """An overflow on step 4: torch's fused kernels leave the weights, the moments and the step
    count as they were; so does the folded update."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    expected_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    model, expected, optimizer, _, calls = folded_run(
        POLICIES["per_layer_clip"],
        OPTIMIZERS[name],
        scaler=scaler,
        expected_scaler=expected_scaler,
        nonfinite={4},
        unscale=unscale,
        scope=scope,
    )
    assert scaler.get_scale() == expected_scaler.get_scale() < 2.0**10
    assert_same_weights(model, expected, rtol=weights_rtol(optimizer))
    assert not calls


@pytest.mark.parametrize("scope", ["step", "graph"])
def test_grad_holds_what_the_fused_update_would_leave_there(scope):
    """Before the step, ``.grad`` is the gradient as backward left it (step scope runs the
    policy at the step; graph scope's backward leaves the factors to it); after it, the policy's
    gradient, as torch's fused update leaves it; a second step on the same gradients applies
    them again, as unfolded."""
    torch.manual_seed(0)
    model = mlp()
    expected = copy.deepcopy(model)
    backend = fxgrad.backend(fxgrad.clip_by_norm(0.02), compiler="aot_eager", scope=scope)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
    backend.fold(optimizer)
    expected_optimizer = torch.optim.SGD(expected.parameters(), lr=0.1, fused=True)
    x = torch.randn(16, 8)
    (torch.compile(model, backend=backend)(x).pow(2).mean() * 30).backward()
    (expected(x).pow(2).mean() * 30).backward()
    for (name, p), e in zip(model.named_parameters(), expected.parameters()):
        torch.testing.assert_close(p.grad, e.grad, msg=name)
    ref.clip_per_layer(expected, 0.02)
    for _ in range(2):
        optimizer.step()
        expected_optimizer.step()
        assert_same_weights(model, expected)
        for (name, p), e in zip(model.named_parameters(), expected.parameters()):
            torch.testing.assert_close(p.grad, e.grad, msg=name)


@pytest.mark.parametrize("scope", ["step", "graph"])
def test_explain_says_a_program_runs_the_update(scope):
    model = mlp()
    backend = fxgrad.backend(fxgrad.clip_by_norm(0.02), compiler="aot_eager", scope=scope)
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)
    backend.fold(optimizer)
    report = fxgrad.explain(model, torch.randn(4, 8), backend=backend)
    if scope == "step":
        assert "folded into AdamW: the step program runs AdamW's update" in report.table()
        return
    assert "folded into AdamW: the backward leaves each layer's factor" in report.table()
    for name, _ in model.named_parameters():  # the backward returns every gradient as it made it
        assert f"'{name}': grad['{name}']," in report.inserted


@pytest.mark.parametrize(
    "how, folds",
    [
        ("two optimizers", False),
        ("unfolded first", False),
        ("backend.step()", False),
        ("closure", True),
        ("compiled step", True),
    ],
)
def test_other_ways_to_step_equal_the_unfolded_path(how, folds):
    """A closure (Lightning) and a step compiled by the user fold. Weights and biases under two
    folded optimizers (neither steps all the gradients), or under an unfolded optimizer that
    steps first (Muon's place), and ``backend.step()`` before the step (the policy ran already,
    with no optimizer to update) run the policy, then torch's step: said once, but for
    ``backend.step()``."""
    torch.manual_seed(0)
    model = mlp()
    expected = copy.deepcopy(model)
    backend = fxgrad.backend(fxgrad.clip_by_norm(0.02), compiler="aot_eager", scope="step")

    def split(m):
        if how not in ("two optimizers", "unfolded first"):
            return [torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True)]
        named = list(m.named_parameters())
        weights, biases = ([p for n, p in named if n.endswith(end)] for end in ("weight", "bias"))
        if how == "unfolded first":
            return [torch.optim.SGD(weights, lr=0.1, momentum=0.9), torch.optim.AdamW(biases, lr=1e-2, fused=True)]
        return [torch.optim.AdamW(params, lr=1e-2, fused=True) for params in (weights, biases)]

    optimizers, expected_optimizers = split(model), split(expected)
    for optimizer in optimizers[how == "unfolded first" :]:
        backend.fold(optimizer)
    compiled = torch.compile(model, backend=backend)
    step_fn = torch.compile(lambda: optimizers[0].step(), backend="aot_eager") if how == "compiled step" else None
    inputs = torch.randn(5, 16, 8, generator=torch.Generator().manual_seed(3))
    with fused_calls() as calls, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x in inputs:

            def closure(x=x):
                optimizers[0].zero_grad()
                loss = compiled(x).pow(2).mean() * 30
                loss.backward()
                return loss

            if how == "closure":
                optimizers[0].step(closure)
                continue
            closure()
            if how == "backend.step()":
                backend.step()
            for optimizer in optimizers:
                step_fn() if step_fn is not None else optimizer.step()
                optimizer.zero_grad()
    for x in inputs:
        (expected(x).pow(2).mean() * 30).backward()
        ref.clip_per_layer(expected, 0.02)
        for optimizer in expected_optimizers:
            optimizer.step()
            optimizer.zero_grad()
    assert_same_weights(model, expected)
    assert bool(calls) != folds
    told = [w for w in caught if "cannot run its update" in str(w.message)]
    assert len(told) == (how in ("two optimizers", "unfolded first"))  # once, at the first step
    if how == "unfolded first":
        assert "SGD steps some of the models' parameters, and stepped first" in str(told[0].message)


def test_a_folded_optimizer_that_takes_over_from_an_unfolded_one_folds_silently():
    """An unfolded SGD's warm-up steps, then the folded fused AdamW's alone (a linear probe, then
    fine-tuning): the program runs AdamW's update from its first step, and nothing is said (the
    first version of the "stepped first" warning said it at SGD's first step, found by a sweep)."""
    torch.manual_seed(0)
    model = mlp()
    expected = copy.deepcopy(model)
    backend = fxgrad.backend(fxgrad.clip_by_norm(0.02), compiler="aot_eager", scope="step")
    compiled = torch.compile(model, backend=backend)
    warm, adamw = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.AdamW(model.parameters(), fused=True)
    backend.fold(adamw)
    expected_warm = torch.optim.SGD(expected.parameters(), lr=0.1)
    expected_adamw = torch.optim.AdamW(expected.parameters(), fused=True)
    inputs = torch.randn(5, 16, 8, generator=torch.Generator().manual_seed(3))
    with fused_calls() as calls, warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for i, x in enumerate(inputs):
            optimizer = warm if i < 2 else adamw
            (compiled(x).pow(2).mean() * 30).backward()
            optimizer.step()
            optimizer.zero_grad()
    for i, x in enumerate(inputs):
        optimizer = expected_warm if i < 2 else expected_adamw
        (expected(x).pow(2).mean() * 30).backward()
        ref.clip_per_layer(expected, 0.02)
        optimizer.step()
        optimizer.zero_grad()
    assert_same_weights(model, expected)
    assert not calls  # torch's fused kernel never ran: the program updated


@pytest.mark.inductor
@pytest.mark.parametrize("scope", ["step", "graph"])
def test_the_folded_update_compiled_by_inductor_equals_the_unfolded_step(scope):
    """Under Inductor, against the same policy then torch's fused step (in step scope AGC reads
    the weights the program then writes; graph scope's backward leaves factors per layer)."""
    torch.manual_seed(0)
    model = mlp()
    expected = copy.deepcopy(model)
    policy = fxgrad.chain(fxgrad.rescale(0.5, target=0.1), fxgrad.clip_by_norm(0.02))
    # AGC folds in step scope only; beside a global clip too, Adam carries the two paths' rounding to 4e-6 of a bias
    policy = fxgrad.chain(
        fxgrad.adaptive_grad_clip(0.01) if scope == "step" else fxgrad.clip_by_global_norm(0.05), policy
    )
    folded, unfolded = (fxgrad.backend(policy, scope=scope) for _ in range(2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    folded.fold(optimizer)
    with fused_calls() as calls:
        train(model, optimizer, STEPS, backend=folded)
    assert not calls
    train(
        expected,
        torch.optim.AdamW(expected.parameters(), lr=1e-2, weight_decay=0.1, fused=True),
        STEPS,
        backend=unfolded,
    )
    assert_same_weights(model, expected)


@pytest.mark.parametrize("registered", ["before fold()", "after fold()"])
@pytest.mark.parametrize("scope", ["step", "graph"])
def test_an_optimizer_with_step_hooks_of_its_own_steps_itself(registered, scope):
    """A user's pre-hook that edits the gradients (or the learning rate) runs after fxgrad's
    global pre-hook: had the program run the update there, the edit would be lost. Such an
    optimizer keeps its own step, after one warning; the hook acts as unfolded (in graph scope
    the factors the backward left are applied in a pass before it)."""
    torch.manual_seed(0)
    model = mlp()
    expected = copy.deepcopy(model)
    backend = fxgrad.backend(fxgrad.clip_by_norm(0.02), compiler="aot_eager", scope=scope)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)

    def halve(optimizer, args, kwargs):
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad.mul_(0.5)

    if registered == "before fold()":
        optimizer.register_step_pre_hook(halve)
    backend.fold(optimizer)
    if registered == "after fold()":
        optimizer.register_step_pre_hook(halve)
    assert not backend.runs_update_of(optimizer)  # explain's table said a program ran it (a sweep found it)
    with pytest.warns(RuntimeWarning, match=r"1 optimizer step hook\(s\) besides fxgrad's"):
        train(model, optimizer, 5, backend=backend)
    expected_optimizer = torch.optim.AdamW(expected.parameters(), lr=1e-2, fused=True)
    expected_optimizer.register_step_pre_hook(halve)
    train(expected, expected_optimizer, 5, reference=lambda m: ref.clip_per_layer(m, 0.02))
    assert_same_weights(model, expected)


@pytest.mark.parametrize(
    "policy, scope",
    [
        (lambda: fxgrad.clip_by_norm(0.02), "step"),
        (lambda: fxgrad.clip_by_norm(0.02), "graph"),
        (lambda: fxgrad.clip_by_global_norm(0.05), "step"),
        (lambda: fxgrad.clip_by_global_norm(0.05), "graph"),
    ],
    ids=["per-layer-step", "per-layer-graph", "global-step", "global-graph"],
)
def test_float64_weights_update_in_float64(policy, scope):
    """The factors a program's update applies multiply float64 gradients in float64 (graph
    scope's multiplied the float32 inverse loss scale: 4e-8 of a step apart, a sweep found)."""
    torch.manual_seed(0)
    model = mlp().double()
    expected = copy.deepcopy(model)
    folded, unfolded = (fxgrad.backend(policy(), compiler="aot_eager", scope=scope) for _ in "ab")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    folded.fold(optimizer)
    double = lambda x: x.double()  # noqa: E731
    for m, opt, backend in ((model, optimizer, folded), (expected, None, unfolded)):
        opt = opt or torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
        compiled = torch.compile(m, backend=backend)
        for x in torch.randn(STEPS, 16, 8, generator=torch.Generator().manual_seed(3)):
            (compiled(double(x)).pow(2).mean() * 30).backward()
            opt.step()
            opt.zero_grad()
    assert_same_weights(model, expected, rtol=1e-12)


def test_a_scheduler_that_cycles_the_momentum_compiles_one_program():
    """OneCycleLR moves the learning rate and Adam's beta1 on every step: device tensors, so the
    program is built once (and the policy never falls back to running eagerly)."""
    model, expected, *_ = folded_run(
        POLICIES["per_layer_clip"],
        OPTIMIZERS["adamw"],
        scheduler=lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=STEPS),
    )
    assert_same_weights(model, expected)


def test_a_checkpoint_of_an_unfused_optimizer_loaded_after_fold_is_told():
    torch.manual_seed(0)
    model = mlp()
    backend = fxgrad.backend(fxgrad.clip_by_norm(0.02), compiler="aot_eager", scope="step")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    backend.fold(optimizer)
    train(model, optimizer, 2, backend=backend)
    unfused = torch.optim.AdamW(model.parameters(), lr=1e-2)
    optimizer.load_state_dict(unfused.state_dict())
    with pytest.warns(RuntimeWarning, match=r"cannot run its update: AdamW without fused=True"):
        train(model, optimizer, 2, backend=backend)


def test_a_step_the_program_does_not_run_leaves_the_optimizer_state_to_it():
    """No program runs (none may be built: the layout limit at 0): the optimizer steps itself, and
    finds no state the fold started. SGD's first momentum buffer is the gradient, with dampening
    too; zeros made ahead for the program would have made it 0.7 of it."""
    make = lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, dampening=0.3, fused=True)  # noqa: E731
    with torch._dynamo.config.patch(recompile_limit=0), pytest.warns(RuntimeWarning, match="runs the policy eagerly"):
        torch.manual_seed(0)
        model = mlp()
        expected = copy.deepcopy(model)
        backend = fxgrad.backend(fxgrad.clip_by_norm(0.02), compiler="aot_eager", scope="step")
        optimizer = make(model.parameters())
        backend.fold(optimizer)
        train(model, optimizer, 3, backend=backend)
    train(expected, make(expected.parameters()), 3, reference=lambda m: ref.clip_per_layer(m, 0.02))
    assert_same_weights(model, expected, rtol=1e-5)


def test_sgd_with_a_tensor_momentum_keeps_its_own_step():
    """Whether SGD keeps momentum buffers depends on the momentum's value, which torch's step
    reads on the host: with one given as a tensor, fold() leaves the step to it."""
    model = mlp()
    backend = fxgrad.backend(fxgrad.clip_by_norm(0.02), compiler="aot_eager", scope="step")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=torch.tensor(0.0), dampening=0.3, fused=True)
    with pytest.warns(RuntimeWarning, match=r"momentum given as a tensor .*: the step program applies the policy"):
        backend.fold(optimizer)
    assert backend.folded_into() == []


@pytest.mark.parametrize("scope", ["step", "graph"])
@pytest.mark.parametrize("name", ["adamw", "sgd_momentum"])
def test_a_resume_into_the_folded_optimizer_itself_updates_the_loaded_state(name, scope):
    """``load_state_dict`` on the folded optimizer (a resume in place) gives it new state tensors:
    the program updates those, not the ones it read at the steps before."""
    torch.manual_seed(0)
    model = mlp()
    expected = copy.deepcopy(model)
    backend = fxgrad.backend(fxgrad.clip_by_norm(0.02), compiler="aot_eager", scope=scope)
    optimizer, expected_optimizer = OPTIMIZERS[name](groups(model)), OPTIMIZERS[name](groups(expected))
    backend.fold(optimizer)
    for opt, m, kwargs in [
        (optimizer, model, {"backend": backend}),
        (expected_optimizer, expected, {"reference": lambda m: ref.clip_per_layer(m, 0.02)}),
    ]:
        train(m, opt, 4, **kwargs)
        saved = copy.deepcopy(opt.state_dict())
        train(m, opt, 3, **kwargs)
        opt.load_state_dict(saved)
        with fused_calls() as calls:
            train(m, opt, 3, **kwargs)
        assert bool(calls) == (opt is expected_optimizer)
    assert_same_weights(model, expected, rtol=1e-5)  # momentum's rounding: see the test above
    assert_same_state(optimizer, model, expected_optimizer, expected)


@pytest.mark.parametrize("policy", ["global", "per_layer"])
@pytest.mark.parametrize("change", ["biases swapped between groups", "a state reset", "a new exp_avg"])
def test_changes_to_the_groups_and_state_between_steps_are_followed(policy, change):
    """What the program reads of the optimizer is looked up again when a parameter moves to
    another group in place (same lists, same lengths) or a parameter's state is replaced (the
    state dict's size unchanged): each weight steps with its group's learning rate, from its
    new state, as torch's own step does."""
    make, reference = {
        "global": (lambda: fxgrad.clip_by_global_norm(0.05), lambda m: ref.clip_global(m, 0.05)),
        "per_layer": (lambda: fxgrad.clip_by_norm(0.02), lambda m: ref.clip_per_layer(m, 0.02)),
    }[policy]
    torch.manual_seed(0)
    model = mlp()
    expected = copy.deepcopy(model)
    backend = fxgrad.backend(make(), compiler="aot_eager", scope="step")
    optimizer, expected_optimizer = (OPTIMIZERS["adamw"](groups(m)) for m in (model, expected))
    backend.fold(optimizer)
    for opt, m, kwargs in [
        (optimizer, model, {"backend": backend}),
        (expected_optimizer, expected, {"reference": reference}),
    ]:
        train(m, opt, 4, **kwargs)
        first, rest = (group["params"] for group in opt.param_groups)
        if change == "biases swapped between groups":
            first[1], rest[1] = rest[1], first[1]
        elif change == "a state reset":
            opt.state[rest[0]] = {}
        else:
            opt.state[rest[0]]["exp_avg"] = torch.zeros_like(rest[0])
        with fused_calls() as calls:
            train(m, opt, 4, **kwargs)
        assert bool(calls) == (opt is expected_optimizer)
    # Adam's first steps from a new state move each element by about lr whatever its gradient's
    # size, and carry the rounding of the smallest ones on: 2e-6 of the weight apart after 4 steps
    assert_same_weights(model, expected, rtol=1e-6 if change == "biases swapped between groups" else 1e-5)
    assert_same_state(optimizer, model, expected_optimizer, expected)


def assert_same_state(optimizer, model, expected_optimizer, expected):
    """``optimizer``'s state of each of ``model``'s parameters equals ``expected_optimizer``'s of
    ``expected``'s, as the first test compares them (1e-4 of each tensor's largest value)."""
    for p, expected_p in zip(model.parameters(), expected.parameters()):
        for key, value in expected_optimizer.state[expected_p].items():
            atol = 1e-4 * value.abs().max().item()
            torch.testing.assert_close(optimizer.state[p][key], value, rtol=1e-4, atol=atol, msg=key)


@pytest.mark.parametrize("scope", ["step", "graph"])
def test_scaled_grads_of_a_folded_per_layer_policy_are_the_transformed_gradients(scope):
    """Step scope: the program runs the update; ``scaled_grads()`` before the step returned
    ``.grad`` before the policy (142x the clipped gradient of a layer). It runs the policy then,
    and the optimizer's own step follows; the steps without it stay folded. Graph scope: the
    backward left each layer's factor, which ``scaled_grads()`` multiplies ``.grad`` by (no
    policy runs), and every step stays folded."""
    torch.manual_seed(0)
    model = mlp()
    expected = copy.deepcopy(model)
    policy, reference = POLICIES["rescale+global_clip"]
    backend = fxgrad.backend(policy(), compiler="aot_eager", scope=scope)
    compiled = torch.compile(model, backend=backend)
    optimizer, expected_optimizer = (OPTIMIZERS["sgd_momentum"](m.parameters()) for m in (model, expected))
    backend.fold(optimizer)
    gen = torch.Generator().manual_seed(3)
    for step in range(4):
        x = torch.randn(16, 8, generator=gen)
        compiled(x).pow(2).mean().mul(30.0).backward()
        expected(x).pow(2).mean().mul(30.0).backward()
        reference(expected)
        if step % 2 == 0:
            scaled = backend.scaled_grads(model)
            for name, p in expected.named_parameters():  # the weights carry the steps' rounding
                atol = 1e-6 * p.grad.abs().max().item()
                torch.testing.assert_close(scaled[name], p.grad, rtol=1e-5, atol=atol, msg=name)
        with fused_calls() as calls:
            optimizer.step()
        # torch's own step after scaled_grads() in step scope; the program's else
        assert bool(calls) == (scope == "step" and step % 2 == 0)
        expected_optimizer.step()
        for opt in (optimizer, expected_optimizer):
            opt.zero_grad()
    assert_same_weights(model, expected, rtol=weights_rtol(optimizer))
    if scope == "graph":  # every layer's, the LayerNorm ("3") too: the rescale skips it, the global clip does not
        assert {f"folded_factor/{layer}" for layer in "0234"} <= backend.stats().keys()


@pytest.mark.parametrize("policy", ["agc", "sinkhorn"])
def test_graph_scope_keeps_the_policies_of_other_changes_in_the_backward(policy):
    """AGC's factors are per row and SinkGD's per element: graph scope cannot leave them to the
    update as one factor per layer, so fold() says why, and the backward applies them."""
    make, reference = POLICIES[policy]
    torch.manual_seed(0)
    model = mlp()
    expected = copy.deepcopy(model)
    backend = fxgrad.backend(make(), compiler="aot_eager")
    optimizer, expected_optimizer = (OPTIMIZERS["adamw"](groups(m)) for m in (model, expected))
    with pytest.warns(RuntimeWarning, match="otherwise than by one factor per layer.*scope='step'"):
        backend.fold(optimizer)
    assert not backend.folded_into()
    train(model, optimizer, 5, backend=backend)
    train(expected, expected_optimizer, 5, reference=reference)
    assert_same_weights(model, expected)


def test_graph_scope_names_a_model_called_twice_in_one_loss_when_it_refuses_the_step():
    """A GAN's discriminator on the real and the fake batch, one backward: each call left its own
    factors. The refusal listed accumulation and graph breaks, not this (a sweep found it)."""
    model = mlp()
    backend = fxgrad.backend(fxgrad.clip_by_norm(0.02), compiler="aot_eager")
    optimizer = OPTIMIZERS["adamw"](model.parameters())
    backend.fold(optimizer)
    compiled = torch.compile(model, backend=backend)
    (compiled(torch.randn(4, 8)).sum() - compiled(torch.randn(4, 8)).sum()).backward()
    with pytest.raises(ValueError, match=r"a model called twice in one loss .*torch\.cat\(\[real, fake\]\)"):
        optimizer.step()


@pytest.mark.filterwarnings("ignore::fxgrad.CoverageWarning")  # the warning that a backward found .grad held
def test_graph_scope_refuses_a_step_over_two_backwards_of_per_layer_factors():
    """Two micro-batches accumulated in ``.grad``: each backward left its own factors, which the
    update cannot apply to their sum (the same refusal as for a global factor)."""
    model = mlp()
    backend = fxgrad.backend(fxgrad.clip_by_norm(0.02), compiler="aot_eager")
    optimizer = OPTIMIZERS["adamw"](model.parameters())
    backend.fold(optimizer)
    compiled = torch.compile(model, backend=backend)
    for _ in range(2):
        compiled(torch.randn(4, 8)).sum().backward()
    with pytest.raises(ValueError, match="2 backward passes through the compiled graphs since the last step"):
        optimizer.step()
