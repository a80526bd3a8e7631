"""scope="step": the policy on .grad once per optimizer step (accumulation, graph breaks)."""

import copy
import functools
import gc
import warnings
import weakref

import models
import pytest
import reference as ref
import torch
import torch.nn as nn
from parity import assert_grads_close, coverage_silent, one_process_group
from test_coverage import BrokenMLP, Discriminator

import fxgrad
from fxgrad import _compat
from fxgrad.frontend.step_program import StepPrograms

POLICIES = {
    "global_clip": (fxgrad.clip_by_global_norm(1e-3), lambda m: ref.clip_global(m, 1e-3)),
    "per_layer_clip": (fxgrad.clip_by_norm(1e-3), lambda m: ref.clip_per_layer(m, 1e-3)),
    "rescale": (fxgrad.rescale(alpha=0.5), lambda m: ref.rescale(m, 0.5)),
}


def mlp_and_copy():
    """A seeded MLP, and a copy for the eager reference."""
    torch.manual_seed(0)
    model = models.MLP()
    return model, copy.deepcopy(model)


@pytest.mark.parametrize("policy", POLICIES)
def test_accumulating_four_micro_batches_equals_eager(policy, compile_with):
    transform, reference = POLICIES[policy]
    model, eager = mlp_and_copy()
    backend = fxgrad.backend(transform, compiler="aot_eager", scope="step")
    compiled = compile_with(backend, model)
    micro_batches = [torch.randn(4, 16) for _ in range(4)]
    for x in micro_batches:
        models.loss_of(compiled(x)).backward()
    backend.step()
    for x in micro_batches:
        models.loss_of(eager(x)).backward()
    reference(eager)
    assert_grads_close(model, eager)


def test_global_clip_across_a_graph_break(compile_with):
    torch.manual_seed(0)
    model = BrokenMLP()
    eager = copy.deepcopy(model)
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1e-3), compiler="aot_eager", scope="step")
    x = torch.randn(5, 8)
    models.loss_of(compile_with(backend, model)(x)).backward()
    assert len(backend.graphs) == 2
    backend.step()
    models.loss_of(eager(x)).backward()
    ref.clip_global(eager, 1e-3)
    assert_grads_close(model, eager)
    assert backend.stats()["grad_norm/total_clipped"].item() == pytest.approx(1e-3, rel=1e-4)


def test_state_advances_once_per_optimizer_step(compile_with):
    model, eager = mlp_and_copy()
    backend = fxgrad.backend(fxgrad.autoclip(history=5), compiler="aot_eager", scope="step")
    compiled = compile_with(backend, model)
    reference = ref.AutoClip(90, 5, 0.1)
    for _ in range(6):
        model.zero_grad()
        eager.zero_grad()
        batches = [torch.randn(4, 16) for _ in range(3)]
        for x in batches:
            models.loss_of(compiled(x)).backward()
            models.loss_of(eager(x)).backward()
        backend.step()
        reference.step(eager)
        assert_grads_close(model, eager)
    assert backend.state_dict()["0.autoclip/count"].item() == 6


def test_step_works_without_compiling():
    model, eager = mlp_and_copy()
    backend = fxgrad.backend(fxgrad.chain(fxgrad.monitor(), fxgrad.clip_by_norm(1e-3)), scope="step")
    x = torch.randn(4, 16)
    models.loss_of(model(x)).backward()
    backend.step(model)
    models.loss_of(eager(x)).backward()
    ref.clip_per_layer(eager, 1e-3)
    assert_grads_close(model, eager)
    assert "grad_norm/net.0" in backend.stats()
    model.zero_grad()
    eager.zero_grad()
    models.loss_of(model(x)).backward()  # the next step: optimizer.step() finds the model
    torch.optim.SGD(model.parameters(), lr=0.0).step()
    models.loss_of(eager(x)).backward()
    ref.clip_per_layer(eager, 1e-3)
    assert_grads_close(model, eager)


@pytest.mark.parametrize("scope", ["graph", "step"])
def test_check_ranks_is_a_no_op_in_one_process(scope):
    """Without torch.distributed there is no other rank: rank_mismatch is 0.0, and nothing else changes."""
    model, eager = mlp_and_copy()
    policy = fxgrad.chain(fxgrad.monitor(check_ranks=True), fxgrad.clip_by_norm(1e-3))
    backend = fxgrad.backend(policy, compiler="aot_eager", scope=scope)
    x = torch.randn(4, 16)
    models.loss_of(backend.compile(model)(x)).backward()
    torch.optim.SGD(model.parameters(), lr=0.0).step()
    models.loss_of(eager(x)).backward()
    ref.clip_per_layer(eager, 1e-3)
    assert_grads_close(model, eager)
    assert backend.stats()["rank_mismatch"].item() == 0.0


def test_step_scope_with_grad_scaler(compile_with):
    model, eager = mlp_and_copy()
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**8) for _ in range(2)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.0) for m in (model, eager)]
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1e-3), compiler="aot_eager", scope="step", scaler=scalers[0])
    x = torch.randn(8, 16)
    scalers[0].scale(models.loss_of(compile_with(backend, model)(x))).backward()
    backend.step()  # before unscale_: it reads the scale and clips in unscaled units
    scalers[0].unscale_(optimizers[0])
    scalers[1].scale(models.loss_of(eager(x))).backward()
    scalers[1].unscale_(optimizers[1])
    ref.clip_global(eager, 1e-3)
    assert_grads_close(model, eager)


def test_optimizer_step_applies_the_policy_once(compile_with):
    """Without backend.step(), optimizer.step() applies it; on the same gradients, neither
    backend.step() nor the optimizer applies it again."""
    model, eager = mlp_and_copy()
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1e-3), compiler="aot_eager", scope="step")
    compiled = compile_with(backend, model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    for x in [torch.randn(4, 16) for _ in range(4)]:
        models.loss_of(compiled(x)).backward()
        models.loss_of(eager(x)).backward()
    optimizer.step()
    ref.clip_global(eager, 1e-3)
    assert_grads_close(model, eager)
    before = backend.stats()["grad_norm/total"]
    backend.step()
    backend.step()
    optimizer.step()
    assert_grads_close(model, eager)
    assert torch.equal(backend.stats()["grad_norm/total"], before)  # the norm before the only clipping
    for x in [torch.randn(4, 16) for _ in range(2)]:  # new gradients: applied again, once
        models.loss_of(compiled(x)).backward()
        models.loss_of(eager(x)).backward()
    backend.step()
    optimizer.step()
    ref.clip_global(eager, 1e-3)
    assert_grads_close(model, eager)


@pytest.mark.parametrize("zero_grad", ["set_to_none", "zeroed"])
def test_gradients_changed_in_place_after_backend_step_are_not_taken_for_new_ones(zero_grad, compile_with):
    """docs/distributed.md: call backend.step() when your own code (a clip) must see the
    transformed gradients before the optimizer. That clip changed them in place, and the
    optimizer's step took them for new gradients and ran the policy again: AdaGC's step count
    went 2, 4, 6 (sweep 32). A skipped step (zero_grad, a new backward, no optimizer step in
    between) still gets the policy at the next step."""
    model, eager = mlp_and_copy()
    backend = fxgrad.backend(fxgrad.adagc(warmup=2, lambda_abs=1e-2), compiler="aot_eager", scope="step")
    compiled = compile_with(backend, model)
    adagc = ref.AdaGC(warmup=2, lambda_abs=1e-2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    expected_optimizer = torch.optim.SGD(eager.parameters(), lr=0.1)
    for step in range(5):
        x = torch.randn(4, 16)
        for net, opt in ((compiled, optimizer), (eager, expected_optimizer)):
            opt.zero_grad(set_to_none=zero_grad == "set_to_none")
            models.loss_of(net(x)).backward()
        if step == 2:  # a skipped step: the policy runs, nothing steps, a new batch follows
            backend.step()
            adagc.step(eager)  # the policy ran on the gradients dropped next
            optimizer.zero_grad(set_to_none=zero_grad == "set_to_none")
            expected_optimizer.zero_grad(set_to_none=zero_grad == "set_to_none")
            x = torch.randn(4, 16)
            models.loss_of(compiled(x)).backward()
            models.loss_of(eager(x)).backward()
        else:
            backend.step()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)  # the user's own clip, after the policy
        optimizer.step()
        adagc.step(eager)
        torch.nn.utils.clip_grad_norm_(eager.parameters(), 0.5)
        expected_optimizer.step()
    assert backend.state_dict()["0.adagc/step"].item() == 6
    for actual, expected in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("write", ["grad.data.copy_", "grad.data ="])
def test_gradients_written_through_data_are_reported(write, compile_with):
    """Gradients ``torch.autograd.grad`` returns, written into a kept ``.grad`` through ``.data``
    (meta-learning loops), move no version counter: from the second step on, the step took them
    for those the policy had run on and skipped it, silently (norm 64, then 1095; sweep 51c).
    fxgrad cannot tell them from a step repeated on the same gradients, and says so."""
    model, _ = mlp_and_copy()
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1.0), compiler="aot_eager", scope="step")
    compiled = compile_with(backend, model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    for step in range(2):
        grads = torch.autograd.grad(models.loss_of(compiled(torch.randn(4, 16))), list(model.parameters()))
        for p, g in zip(model.parameters(), grads):
            if write == "grad.data.copy_":
                p.grad.data.copy_(g)
            else:
                p.grad.data = g
        if step == 0:
            optimizer.step()
            continue
        with pytest.warns(fxgrad.CoverageWarning, match=r"written through \.data .* the policy did not run"):
            optimizer.step()


def test_a_step_repeated_without_a_backward_gets_no_second_policy_run():
    """A loop that skips a batch's backward and steps anyway repeats the last gradients, which had
    the policy: running it again counted a second step in autoclip's state (the regression sweep
    of a fix that ran it after any forward)."""
    model, _ = mlp_and_copy()
    backend = fxgrad.backend(fxgrad.autoclip(history=4), compiler="aot_eager", scope="step")
    compiled = backend.compile(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        loss = models.loss_of(compiled(torch.randn(4, 16)))
        if step != 1:
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            continue
        with pytest.warns(fxgrad.CoverageWarning, match="no backward wrote new gradients since, nothing is wrong"):
            optimizer.step()
    assert backend.state_dict()["0.autoclip/count"].item() == 2


def test_a_step_with_no_gradient_after_a_skipped_backward_is_silent():
    """``zero_grad()`` then no backward (a non-finite loss skipped, or Lightning's closure when
    ``training_step`` returns None), and the step anyway: no gradient, nothing to say (the
    warning above fired, the last regression sweep found)."""
    model, _ = mlp_and_copy()
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1.0), compiler="aot_eager", scope="step")
    compiled = backend.compile(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with coverage_silent():
        for step in range(3):
            optimizer.zero_grad()
            loss = models.loss_of(compiled(torch.randn(4, 16)))
            if step != 1:
                loss.backward()
            optimizer.step()


def test_a_no_grad_forward_after_backend_step_leaves_the_users_edit_as_it_is():
    """``backend.step()``, a forward under ``no_grad`` (the loss logged) and the user's own
    in-place edit: the step ran the policy again, the forward counted as a new one (sweep 51c)."""
    model, eager = mlp_and_copy()
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1.0), compiler="aot_eager", scope="step")
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(4, 16)
    (models.loss_of(compiled(x)) * 100).backward()
    (models.loss_of(eager(x)) * 100).backward()
    backend.step()
    torch.nn.utils.clip_grad_norm_(eager.parameters(), 1.0)
    with torch.no_grad():
        compiled(x)
    for net in (model, eager):
        for p in net.parameters():
            p.grad.mul_(10.0)
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    torch.optim.SGD(eager.parameters(), lr=0.1).step()
    for actual, expected in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(actual, expected)


class EagerLayers(nn.Module):
    """Its layers run eagerly; the compiled graph between them trains no parameter."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 4)

    @torch.compiler.disable
    def first(self, x):
        return self.a(x)

    @torch.compiler.disable
    def second(self, x):
        return self.b(x)

    def forward(self, x):
        return self.second(torch.tanh(self.first(x)) * 2.0)


def test_a_micro_batch_after_backend_step_through_a_graph_without_parameters_gets_the_policy():
    """A micro-batch after ``backend.step()`` sums into the gradients (their version moves by
    one, as an edit's would): the compiled forward in grad mode before it says they are new,
    also when that graph trains no parameter. The regression sweep of 51c's fix found it
    counting forwards that train parameters only (the sums stepped unclipped)."""
    torch.manual_seed(0)
    model = EagerLayers()
    eager = copy.deepcopy(model)
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1.0), compiler="aot_eager", scope="step")
    compiled = backend.compile(model)
    x = torch.randn(8, 16) * 3
    (models.loss_of(compiled(x)) * 100).backward()
    backend.step()
    (models.loss_of(compiled(x / 2)) * 100).backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    (models.loss_of(eager(x)) * 100).backward()
    torch.nn.utils.clip_grad_norm_(eager.parameters(), 1.0)
    (models.loss_of(eager(x / 2)) * 100).backward()
    torch.nn.utils.clip_grad_norm_(eager.parameters(), 1.0)
    torch.optim.SGD(eager.parameters(), lr=0.1).step()
    for actual, expected in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(actual, expected)


def test_a_step_skipped_after_backend_step_leaves_the_next_one_the_policy():
    """An eager model (no compiled forward to count), zero_grad(set_to_none=False): backend.step(),
    no optimizer step, then a new backward onto the zeroed tensors. The next optimizer step took
    them for the old gradients, edited, and skipped the policy (sweep 33)."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    backend = fxgrad.backend(fxgrad.rescale(alpha=0, multipliers={"0": 2.0}), compiler="aot_eager", scope="step")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    model(torch.randn(3, 4)).sum().backward()
    backend.step(model)  # and no optimizer step: a skipped one
    optimizer.zero_grad(set_to_none=False)
    model(torch.randn(3, 4)).sum().backward()
    raw = model[0].weight.grad.clone()
    optimizer.step()
    torch.testing.assert_close(model[0].weight.grad, 2 * raw)


def test_two_optimizers_after_backend_step_and_an_edit_apply_the_policy_once():
    """A GAN's two optimizers after one backend.step() and the user's own clip: the first
    optimizer's step took the mark, and the second took its model's edited gradients for new."""
    G, D = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8)), Discriminator()
    backend = fxgrad.backend(
        fxgrad.rescale(alpha=0, multipliers={"0": 2.0, "hidden": 2.0}), compiler="aot_eager", scope="step"
    )
    g, d = torch.compile(G, backend=backend), torch.compile(D, backend=backend)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.0) for m in (D, G)]
    d(g(torch.randn(6, 4))).mean().backward()
    raw = {m: m.weight.grad.clone() for m in (G[0], D.hidden)}
    backend.step()
    torch.nn.utils.clip_grad_norm_([*G.parameters(), *D.parameters()], 1e9)  # in place, by 1.0
    for optimizer in optimizers:
        optimizer.step()
    for module, before in raw.items():
        torch.testing.assert_close(module.weight.grad, 2 * before)


def test_a_closure_step_applies_the_policy_to_what_its_closure_computes(compile_with):
    """``optimizer.step(closure)`` runs the last micro-batch's backward inside the step, after
    its pre-hooks (Lightning's automatic optimization with accumulate_grad_batches): the policy
    runs when the closure returns, on the whole step's gradient, and stateful rules see each
    step's gradient once."""
    model, eager = mlp_and_copy()
    backend = fxgrad.backend(fxgrad.autoclip(history=5), compiler="aot_eager", scope="step")
    compiled = compile_with(backend, model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    eager_optimizer = torch.optim.SGD(eager.parameters(), lr=0.1)
    reference = ref.AutoClip(90, 5, 0.1)
    for _ in range(4):
        first, last = torch.randn(4, 16), torch.randn(4, 16)
        models.loss_of(compiled(first)).backward()
        models.loss_of(eager(first)).backward()

        def closure(x=last):
            loss = models.loss_of(compiled(x))
            loss.backward()
            return loss

        def eager_closure(x=last):
            loss = models.loss_of(eager(x))
            loss.backward()
            reference.step(eager)
            return loss

        optimizer.step(closure)
        eager_optimizer.step(eager_closure)
        assert_grads_close(model, eager)
        optimizer.zero_grad()
        eager_optimizer.zero_grad()
    assert_grads_close(model, eager)
    torch.testing.assert_close(list(model.parameters()), list(eager.parameters()))
    assert backend.state_dict()["0.autoclip/count"].item() == 4


def test_accumulating_under_graph_scope_is_flagged_in_a_closure_step():
    model = models.MLP()
    compiled = fxgrad.backend(fxgrad.clip_by_global_norm(1.0), compiler="aot_eager").compile(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    models.loss_of(compiled(torch.randn(4, 16))).backward()
    with pytest.warns(fxgrad.CoverageWarning, match="scope='step'"):
        optimizer.step(lambda: models.loss_of(compiled(torch.randn(4, 16))).backward())


def test_optimizer_step_after_grad_scaler_unscale(compile_with):
    model, eager = mlp_and_copy()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1e-3), compiler="aot_eager", scope="step", scaler=scaler)
    x = torch.randn(8, 16)
    scaler.scale(models.loss_of(compile_with(backend, model)(x))).backward()
    scaler.step(optimizer)  # unscale_, then optimizer.step(): the policy sees unscaled values
    models.loss_of(eager(x)).backward()
    ref.clip_global(eager, 1e-3)
    assert_grads_close(model, eager)


def test_step_after_grad_scaler_unscale():
    """backend.step() after scaler.unscale_(optimizer) (to log the norm, say) sees unscaled values."""
    model, eager = mlp_and_copy()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1e-3), compiler="aot_eager", scope="step", scaler=scaler)
    x = torch.randn(8, 16)
    scaler.scale(models.loss_of(backend.compile(model)(x))).backward()
    scaler.unscale_(optimizer)
    backend.step()
    scaler.step(optimizer)
    models.loss_of(eager(x)).backward()
    ref.clip_global(eager, 1e-3)
    assert_grads_close(model, eager)


def two_optimizers(model):
    """Muon's split, by hand: one optimizer for the matrices, one for the rest."""
    matrices = [p for p in model.parameters() if p.ndim == 2]
    rest = [p for p in model.parameters() if p.ndim != 2]
    return torch.optim.SGD(matrices, lr=0.1, momentum=0.9), torch.optim.Adam(rest, lr=1e-2)


@pytest.mark.parametrize("given", [True, False], ids=["scaler given", "no scaler given"])
def test_grad_scaler_with_two_optimizers_unscales_each_first(given):
    """``scaler.step(o)`` unscales ``o``'s gradients alone: at the first one, where the policy runs
    over the whole model, the other optimizer's are still scaled. Refused there, the weights
    unchanged (it moved them 7% from eager before), and exact once the loop unscales each first."""
    model, eager = mlp_and_copy()
    optimizers, eager_optimizers = two_optimizers(model), two_optimizers(eager)
    scaler, eager_scaler = (torch.amp.GradScaler("cpu", init_scale=2.0**10) for _ in range(2))
    policy = fxgrad.clip_by_global_norm(1e-2)
    backend = fxgrad.backend(policy, compiler="aot_eager", scope="step", scaler=scaler if given else None)
    compiled = backend.compile(model)
    x = torch.randn(8, 16)
    before = [p.detach().clone() for p in model.parameters()]
    scaler.scale(models.loss_of(compiled(x))).backward()
    with pytest.raises(fxgrad.CoverageError, match=r"not the 10 other gradients it reads.*unscale_\(o\) for every"):
        scaler.step(optimizers[0])
    for p, weight in zip(model.parameters(), before):
        torch.testing.assert_close(p, weight, rtol=0, atol=0)

    def step(run, opts, amp, unscale):
        for optimizer in unscale:
            amp.unscale_(optimizer)
        if run is eager:
            ref.clip_global(eager, 1e-2)
        for optimizer in opts:
            amp.step(optimizer)
        amp.update()

    step(compiled, optimizers, scaler, optimizers[1:])  # the retry: scaler.step() unscaled the first
    eager_scaler.scale(models.loss_of(eager(x))).backward()
    step(eager, eager_optimizers, eager_scaler, eager_optimizers)
    for _ in range(2):
        for run, opts, amp in ((compiled, optimizers, scaler), (eager, eager_optimizers, eager_scaler)):
            for optimizer in opts:
                optimizer.zero_grad()
            amp.scale(models.loss_of(run(x))).backward()
            step(run, opts, amp, opts)
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_grad_scaler_with_two_optimizers_warns_when_not_strict():
    model = models.MLP()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    backend = fxgrad.backend(fxgrad.clip_by_norm(1e-2), compiler="aot_eager", scope="step", strict=False)
    first, second = two_optimizers(model)
    scaler.scale(models.loss_of(backend.compile(model)(torch.randn(8, 16)))).backward()
    with pytest.warns(fxgrad.CoverageWarning, match="gradients of two scales"):
        scaler.step(first)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scaler.step(second)
        scaler.update()


class GAN(nn.Module):
    """A generator and a discriminator in one module, compiled as one."""

    def __init__(self):
        super().__init__()
        self.generator, self.discriminator = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8)), Discriminator()

    def forward(self, z):
        return self.discriminator(self.generator(z))


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
@pytest.mark.parametrize("policy", ["per_layer_clip", "global_clip"])
def test_grad_scaler_with_two_optimizers_gradients_no_update_takes(policy, fused):
    """The gradients a per-layer policy reads at two scales and no update takes are no reason to
    refuse: the norm layers' (skipped), given to an optimizer of their own, and the gradients the
    generator's backward writes into a discriminator that stepped already. A global clip reads
    both into its norm: refused (the GAN's generator moved 5% from eager before; fused, where
    nothing unscales, 59%, and an overflow in the discriminator's step made it NaN)."""
    model = GAN()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    backend = fxgrad.backend(POLICIES[policy][0], compiler="aot_eager", scope="step", scaler=scaler)
    compiled = backend.compile(model)
    norms = list(model.generator[1].parameters())
    sgd = functools.partial(torch.optim.SGD, lr=0.1, fused=fused)
    generator = sgd([p for p in model.generator.parameters() if all(p is not q for q in norms)])
    norm, discriminator = sgd(norms), sgd(model.discriminator.parameters())
    z = torch.randn(8, 4)
    scaler.scale(models.loss_of(model.discriminator(torch.randn(8, 8)))).backward()
    scaler.step(discriminator)
    generator.zero_grad()
    scaler.scale(models.loss_of(compiled(z))).backward()
    if policy == "global_clip":
        with pytest.raises(fxgrad.CoverageError, match="stepped since the GradScaler.s last update"):
            scaler.step(generator)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scaler.step(generator)
        scaler.step(norm)
        scaler.update()


def test_other_optimizers_are_left_alone(compile_with):
    model, other = models.MLP(), models.MLP()
    backend = fxgrad.backend(fxgrad.clip_by_norm(1e-3), compiler="aot_eager", scope="step")
    compile_with(backend, model)(torch.randn(2, 16)).sum().backward()
    other(torch.randn(2, 16)).sum().backward()
    before = [p.grad.clone() for p in model.parameters()]
    torch.optim.SGD(other.parameters(), lr=0.0).step()
    for p, grad in zip(model.parameters(), before):
        torch.testing.assert_close(p.grad, grad, rtol=0, atol=0)


def test_step_scope_under_compiled_autograd(compile_with):
    from torch._dynamo import compiled_autograd

    model, eager = mlp_and_copy()
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1e-3), compiler="aot_eager", scope="step")
    x = torch.randn(8, 16)
    with compiled_autograd._enable(torch.compile(backend="aot_eager")):
        models.loss_of(compile_with(backend, model)(x)).backward()
    torch.optim.SGD(model.parameters(), lr=0.0).step()
    models.loss_of(eager(x)).backward()
    ref.clip_global(eager, 1e-3)
    assert_grads_close(model, eager)


def test_step_needs_step_scope():
    with pytest.raises(RuntimeError, match="scope='step'"):
        fxgrad.backend(fxgrad.clip_by_norm(1.0)).step(models.MLP())
    with pytest.raises(ValueError, match="scope"):
        fxgrad.backend(scope="optimizer")


def test_accumulating_under_graph_scope_is_flagged():
    model = models.MLP()
    compiled = fxgrad.backend(fxgrad.clip_by_global_norm(1.0), compiler="aot_eager").compile(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    models.loss_of(compiled(torch.randn(4, 16))).backward()
    models.loss_of(compiled(torch.randn(4, 16))).backward()
    with pytest.warns(fxgrad.CoverageWarning, match="scope='step'"):
        optimizer.step()


def manual_sgd(model, compiled, steps, backend=None, skip=(), inputs=(4, 16)):
    """Steps of a loop that updates the weights itself (no torch.optim optimizer); ``skip``:
    steps whose gradients are zeroed unused, as a loop that drops a bad batch does."""
    for step in range(steps):
        model.zero_grad()
        models.loss_of(compiled(torch.randn(*inputs))).backward()
        if step in skip:
            continue
        if backend is not None:
            backend.step()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad


@pytest.mark.parametrize("graph_break", [False, True])
def test_a_loop_that_never_lets_the_policy_run_is_reported_once(graph_break, compile_with):
    model = BrokenMLP() if graph_break else mlp_and_copy()[0]
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1e-3), compiler="aot_eager", scope="step")
    compiled = compile_with(backend, model)
    with pytest.warns(fxgrad.CoverageWarning, match="neither ran between backward passes") as caught:
        manual_sgd(model, compiled, steps=4, inputs=(5, 8) if graph_break else (4, 16))
    assert len([w for w in caught if issubclass(w.category, fxgrad.CoverageWarning)]) == 1


def test_a_loop_of_autograd_grad_is_told_that_step_scope_reads_dot_grad(compile_with):
    model, _ = mlp_and_copy()
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1e-3), compiler="aot_eager", scope="step")
    compiled = compile_with(backend, model)
    with pytest.warns(fxgrad.CoverageWarning, match=r"wrote no \.grad \(torch\.autograd\.grad"):
        for _ in range(3):
            grads = torch.autograd.grad(models.loss_of(compiled(torch.randn(4, 16))), list(model.parameters()))
            with torch.no_grad():
                for p, g in zip(model.parameters(), grads):
                    p -= 0.1 * g


def test_adversarial_attack_passes_before_the_first_step_are_not_reported(compile_with):
    """PGD: several passes for the input's gradient, then the step's backward and the step.
    The attack's passes write no .grad, and no weight moves between them."""
    model, _ = mlp_and_copy()
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1e-3), compiler="aot_eager", scope="step")
    compiled = compile_with(backend, model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with coverage_silent():
        for _ in range(2):
            x = torch.randn(4, 16)
            for _ in range(3):
                attacked = x.requires_grad_(True)
                (grad,) = torch.autograd.grad(models.loss_of(compiled(attacked)), attacked)
                x = (x + 0.01 * grad.sign()).detach()
            optimizer.zero_grad()
            models.loss_of(compiled(x)).backward()
            optimizer.step()


def test_a_loop_that_calls_step_or_skips_one_batch_is_not_reported(compile_with):
    model, _ = mlp_and_copy()
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1e-3), compiler="aot_eager", scope="step")
    with coverage_silent():
        manual_sgd(model, compile_with(backend, model), steps=6, backend=backend, skip=(2,))


def test_each_optimizer_step_applies_the_policy_to_the_models_it_steps(compile_with):
    """A GAN with one backend: the discriminator's step clips the discriminator's gradients, the
    generator's the generator's (not the discriminator's, which the generator's backward also
    wrote), as ``clip_grad_norm_`` over each optimizer's parameters does."""
    torch.manual_seed(0)
    generator = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 8))
    discriminator = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    eager_g, eager_d = copy.deepcopy(generator), copy.deepcopy(discriminator)
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1e-2), compiler="aot_eager", scope="step")
    g, d = compile_with(backend, generator), compile_with(backend, discriminator)

    def train(g, d, generator, discriminator, clip):
        g_optimizer = torch.optim.SGD(generator.parameters(), lr=0.1)
        d_optimizer = torch.optim.SGD(discriminator.parameters(), lr=0.1)
        for step in range(3):
            torch.manual_seed(step)
            real, noise = torch.randn(4, 8), torch.randn(4, 4)
            d_optimizer.zero_grad()
            (d(g(noise).detach()).mean() - d(real).mean()).backward()
            clip(discriminator)
            d_optimizer.step()
            g_optimizer.zero_grad()
            (-d(g(noise)).mean()).backward()
            clip(generator)
            g_optimizer.step()

    with coverage_silent():
        train(g, d, generator, discriminator, clip=lambda model: None)
    train(eager_g, eager_d, eager_g, eager_d, clip=lambda model: ref.clip_global(model, 1e-2))
    for actual, expected in ((generator, eager_g), (discriminator, eager_d)):
        for a, b in zip(actual.parameters(), expected.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


class Blocks(nn.Module):
    """An embedding, repeated blocks and a head: torchtitan compiles each block alone."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.layers = nn.ModuleDict({str(i): models.Block(16, 2) for i in range(3)})
        self.head = nn.Linear(16, 2)

    def forward(self, x):
        x = self.embed(x)
        for block in self.layers.values():
            x = block(x)
        return self.head(x)


def compile_each_block(model, backend):
    for name, block in list(model.layers.items()):
        model.layers[name] = torch.compile(block, backend=backend)


@pytest.mark.parametrize("scope", ["graph", "step"])
def test_blocks_compiled_one_by_one_are_reported_for_a_global_policy(scope):
    """Each block is a model of its own to the backend: in step scope the blocks' layers would
    merge by name (refused); in graph scope each block's backward clips its own norm, one graph
    running for every block (refused)."""
    model = Blocks()
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1e-3), compiler="aot_eager", scope=scope)
    compile_each_block(model, backend)
    model(torch.randn(4, 5, 8)).sum().backward()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    if scope == "step":
        with pytest.raises(fxgrad.CoverageError, match="two modules both named"):
            optimizer.step()
        return
    with pytest.raises(fxgrad.CoverageError, match=r"compiled one by one \(Block, Block, Block\)"):
        optimizer.step()


def test_parts_named_alike_compiled_one_by_one_follow_the_refusals_advice():
    """An encoder and a head, two nn.Sequential compiled by one backend, one optimizer: step
    scope refuses to merge their layers, and its advice, one module that holds both told to the
    backend once, gives clip_grad_norm_ over both (a sweep followed graph scope's advice, step
    scope, into this refusal, which did not say it)."""
    torch.manual_seed(0)
    encoder, head = nn.Sequential(nn.Linear(8, 16), nn.Tanh()), nn.Sequential(nn.Linear(16, 4))
    expected = [copy.deepcopy(encoder), copy.deepcopy(head)]
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1e-2), compiler="aot_eager", scope="step")
    compiled = backend.compile(encoder), backend.compile(head)
    run = lambda x: compiled[1](compiled[0](x))  # noqa: E731
    optimizer = torch.optim.SGD([*encoder.parameters(), *head.parameters()], lr=0.5)
    x = torch.randn(4, 8)
    run(x).pow(2).mean().backward()
    with pytest.raises(fxgrad.CoverageError, match=r"both named '0'.*whole = nn\.ModuleDict\(\{'encoder': encoder"):
        optimizer.step()
    whole = nn.ModuleDict({"encoder": encoder, "head": head})
    backend.step(whole)
    for p in whole.parameters():  # the refused step's gradients: start over
        p.grad = None
    for _ in range(3):
        run(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    params = [p for m in expected for p in m.parameters()]
    eager_optimizer = torch.optim.SGD(params, lr=0.5)
    for _ in range(3):
        expected[1](expected[0](x)).pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_(params, 1e-2)
        eager_optimizer.step()
        eager_optimizer.zero_grad()
    for p, e in zip(whole.parameters(), params):
        torch.testing.assert_close(p, e, rtol=1e-6, atol=0)


@pytest.mark.parametrize("scope", ["step", "auto"])
def test_blocks_compiled_one_by_one_are_exact_once_step_scope_knows_the_model(scope, monkeypatch):
    """``backend.step(model)`` once: the policy covers the whole model, every layer named as in the
    eager model (no ``_orig_mod``), so name patterns route as written. Dynamo runs one block's
    graph for the others, which in step scope (the default in a multi-process job, as torchtitan
    runs) needs no warning: the graph is a plain one."""
    if scope == "auto":
        monkeypatch.setattr(_compat, "data_parallel_world_size", lambda: 2)  # init_process_group(world_size=2)
    model = Blocks()
    eager = copy.deepcopy(model)
    policy = fxgrad.chain(fxgrad.by_name({"layers.1.*": fxgrad.clip_by_norm(1e-3)}), fxgrad.clip_by_global_norm(1e-3))
    backend = fxgrad.backend(policy, compiler="aot_eager", scope=scope)
    compile_each_block(model, backend)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.randn(4, 5, 8)
    warnings.simplefilter("error", fxgrad.CoverageWarning)
    for step in range(2):
        model.zero_grad()
        model(x).sum().backward()
        if step == 0:
            backend.step(model)
        optimizer.step()
    eager(x).sum().backward()
    ref.clip_per_layer(eager, 1e-3, select=lambda name, module: name.startswith("layers.1."))
    ref.clip_global(eager, 1e-3)
    assert_grads_close(model, eager)


def test_a_submodule_compiled_inside_the_model_keeps_its_eager_layer_names():
    """A module that compiles a submodule itself (``self.net = torch.compile(net)``, common in
    Lightning's ``configure_model``): layers are named as in the eager model, without
    torch.compile's ``_orig_mod``, so an exact name routes."""

    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = torch.compile(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), backend="aot_eager")

        def forward(self, x):
            return self.net(x)

    model = Wrapper()
    eager = copy.deepcopy(model)
    backend = fxgrad.backend(fxgrad.by_name({"net.0": fxgrad.clip_by_norm(1e-3)}), compiler="aot_eager", scope="step")
    x = torch.randn(4, 4)
    model(x).sum().backward()
    with coverage_silent():
        backend.step(model)
    eager(x).sum().backward()
    torch.nn.utils.clip_grad_norm_(eager.net._orig_mod[0].parameters(), 1e-3)
    assert_grads_close(model, eager)


@pytest.mark.parametrize("scope", ["graph", "step"])
def test_weights_stepped_beside_the_model_are_warned_about_not_refused(scope):
    """A task weight the optimizer steps beside the model (uncertainty weighting): a global clip
    leaves it out, as clip_grad_norm_(model.parameters()) does, and says so once."""
    for policy, says in ((fxgrad.clip_by_global_norm(1e-3), True), (fxgrad.clip_by_norm(1e-3), False)):
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
        log_var = nn.Parameter(torch.zeros(()))
        backend = fxgrad.backend(policy, compiler="aot_eager", scope=scope)
        compiled = backend.compile(model)
        optimizer = torch.optim.SGD([*model.parameters(), log_var], lr=0.0)
        for step in range(2):
            optimizer.zero_grad()
            (compiled(torch.randn(4, 8)).pow(2).mean() * log_var.exp() + log_var).backward()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                optimizer.step()
            told = [w for w in caught if "belong to none of the models" in str(w.message)]
            assert len(told) == (1 if says and step == 0 else 0)


class Prompted(nn.Module):
    """Prompt tuning: a trainable prompt passed to the forward, held by no model."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x, prompt):
        return self.b(torch.relu(self.a(x + prompt)))


@pytest.mark.parametrize("policy", [fxgrad.clip_by_norm(1e-3), fxgrad.clip_by_global_norm(0.05)])
def test_a_parameter_of_no_model_that_a_graph_takes_is_a_layer_in_graph_scope_and_reported_in_step_scope(policy):
    """Graph scope makes a parameter passed to the compiled forward a layer of its own, named
    after its variable; step scope reads the models' ``.grad`` only, and says once that it leaves
    it out (one warning, not also the one about parameters stepped beside the model). Registered
    on the model, step scope covers it as graph scope does."""
    results = {}
    for scope, registered in (("graph", False), ("step", False), ("step", True)):
        torch.manual_seed(0)
        model, prompt = Prompted(), nn.Parameter(torch.randn(16) * 10)
        if registered:
            model.prompt = prompt
        compiled = fxgrad.backend(policy, compiler="aot_eager", scope=scope).compile(model)
        optimizer = torch.optim.SGD([*model.parameters(), *([] if registered else [prompt])], lr=0.0)
        for step in range(2):
            optimizer.zero_grad()
            compiled(torch.randn(8, 16, generator=torch.Generator().manual_seed(step)), prompt).pow(2).mean().backward()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                optimizer.step()
            told = [str(w.message) for w in caught if issubclass(w.category, fxgrad.CoverageWarning)]
            left_out = scope == "step" and not registered and step == 0
            assert len(told) == left_out
            if left_out:
                assert "take 1 nn.Parameter(s) with a gradient that belong to no model (prompt: " in told[0]
        results[scope, registered] = [p.grad.clone() for p in (prompt, model.a.weight, model.a.bias, model.b.weight)]
    for got, want in zip(results["step", True], results["graph", False]):
        torch.testing.assert_close(got, want)
    assert results["step", False][0].norm() > 10 * results["graph", False][0].norm()  # left alone


@pytest.mark.parametrize("scope, when", [("graph", "in the backward"), ("step", "at the optimizer step")])
def test_a_module_compiled_with_another_policy_is_reported_once(scope, when):
    """A Lightning module compiling its network with fxgrad.backend(policy), and the callback given
    the policy too: the gradients would go through both; the warning says where the first runs."""
    policy = fxgrad.clip_by_global_norm(0.1)
    outer = nn.Module()
    outer.net = torch.compile(
        nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)),
        backend=fxgrad.backend(policy, compiler="aot_eager", scope=scope),
    )
    at_step = fxgrad.backend(policy, compiler="aot_eager", scope="step")
    outer.net(torch.randn(4, 8)).sum().backward()
    told = rf"Module\.net is compiled with another fxgrad backend, whose policy transforms its gradients {when}"
    with pytest.warns(fxgrad.CoverageWarning, match=told) as caught:
        at_step.transform_grads(outer)
        at_step.transform_grads(outer)
        at_step.step(outer)
    assert len([w for w in caught if "another fxgrad backend" in str(w.message)]) == 1


def test_a_graph_scope_submodule_under_a_step_scope_model_gets_one_warning():
    """A graph-scope backend on the encoder, ``backend.step(model)`` of another over the whole
    model: the second policy changes the encoder's gradients after its backward returned them,
    which the first backend reported again, with the encoder's own layer names ("0, 2")."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16)), nn.Linear(16, 1))
    model[0] = torch.compile(model[0], backend=fxgrad.backend(fxgrad.clip_by_norm(0.05), compiler="aot_eager"))
    whole = fxgrad.backend(fxgrad.clip_by_global_norm(0.02), compiler="aot_eager", scope="step")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            optimizer.zero_grad()
            model(torch.randn(4, 8)).pow(2).sum().backward()
            whole.step(model)
            optimizer.step()
    told = [str(w.message) for w in caught if issubclass(w.category, fxgrad.CoverageWarning)]
    assert len(told) == 1 and "is compiled with another fxgrad backend" in told[0]


def test_step_of_a_model_checks_its_keys_and_names_layers_inside_data_parallel_wrappers():
    """backend.step(model) is the path of uncompiled, FSDP2 and tensor-parallel models: a key that
    matches nothing is reported there too, and DDP's ``module.`` does not prefix the layer names."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    policy = fxgrad.by_name({"0": fxgrad.clip_by_norm(1e-3), "zzz": fxgrad.clip_by_norm(1.0)})
    backend = fxgrad.backend(policy, compiler="aot_eager", scope="step")
    model(torch.randn(4, 8)).sum().backward()
    with pytest.warns(fxgrad.CoverageWarning, match=r"by_name key 'zzz' matches no layer"):
        backend.step(nn.DataParallel(model))  # DDP's wrapper needs a process group; DataParallel's is alike
    assert torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in model[0].parameters()])).item() == (
        pytest.approx(1e-3, rel=1e-5)
    )


def test_a_model_compiled_again_with_a_new_backend_gets_only_the_new_policy():
    """Dynamo's caches keep the first backend alive, and its optimizer.step() hook with it: the
    policy of the backend that compiled the model last is the model's."""
    model, eager = mlp_and_copy()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    first = fxgrad.backend(fxgrad.clip_by_global_norm(1e-3), compiler="aot_eager", scope="step")
    models.loss_of(torch.compile(model, backend=first)(torch.randn(4, 16))).backward()
    optimizer.zero_grad()
    compiled = torch.compile(model, backend=fxgrad.backend(fxgrad.clip_by_global_norm(1.0), compiler="aot_eager"))
    x = torch.randn(4, 16)
    models.loss_of(compiled(x)).backward()
    optimizer.step()  # both hooks run; the first backend's leaves the model alone
    models.loss_of(eager(x)).backward()
    ref.clip_global(eager, 1.0)
    assert_grads_close(model, eager)


def test_a_step_argument_that_is_not_a_closure_is_passed_on():
    """fxgrad's step hook is global: an optimizer whose step() takes other arguments keeps them."""

    class Scaled(torch.optim.SGD):
        def step(self, scale=1.0, closure=None):
            for group in self.param_groups:
                group["lr"] = 0.1 * scale
            return super().step(closure)

    model, _ = mlp_and_copy()
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1.0), compiler="aot_eager", scope="step")
    models.loss_of(backend.compile(model)(torch.randn(4, 16))).backward()
    weight = torch.ones(3, requires_grad=True)
    weight.grad = torch.ones(3)
    Scaled([weight], lr=0.1).step(0.5)
    torch.testing.assert_close(weight.detach(), torch.full((3,), 0.95))


def test_a_backward_compiled_before_the_process_group_is_refused_once_there_is_one(monkeypatch):
    """scope="auto" compiles in graph scope outside torch.distributed (a sanity step before
    init_process_group): once a group exists it is step scope, and that graph would apply the
    policy a second time."""
    model, _ = mlp_and_copy()
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1e-3), compiler="aot_eager")
    compiled = backend.compile(model)
    x = torch.randn(4, 16)
    models.loss_of(compiled(x)).backward()
    monkeypatch.setattr(_compat, "data_parallel_world_size", lambda: 2)  # init_process_group(world_size=2)
    with pytest.raises(fxgrad.CoverageError, match="would apply twice"):
        compiled(x)


class Scaled(nn.Module):
    """A parameter of the model itself (CLIP's ``logit_scale``): its layer's module is the model."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, x):
        return self.fc(x) * self.scale


def test_a_freed_model_is_freed_and_left_out_of_the_next_models_step():
    """torch._dynamo keeps every backend alive, so what step scope keeps between steps must not
    keep a model: its stale gradients joined the next model's global norm at backend.step()
    (a sweep trial 8e-4 off, no warning), and each trial's weights stayed in memory."""
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(0.05), compiler="aot_eager", scope="step")
    first = Scaled()
    compiled = backend.compile(first)
    compiled(torch.randn(4, 8)).square().sum().backward()
    backend.step()
    gone, weight = weakref.ref(first), weakref.ref(first.fc.weight)
    del first, compiled
    gc.collect()
    assert gone() is None
    model = Scaled()
    expected, x = copy.deepcopy(model), torch.randn(4, 8)
    backend.compile(model)(x).square().sum().backward()
    backend.step()
    expected(x).square().sum().backward()
    ref.clip_global(expected, 0.05)
    assert_grads_close(model, expected)
    assert weight() is None  # dropped at the next step


@pytest.mark.parametrize("folded", [False, True])
def test_a_sweeps_earlier_trials_are_freed_at_the_next_trials_step(folded):
    """A backend per trial: torch._dynamo keeps each, and what step scope kept for its model
    (the walk of the parameters) kept every trial's weights and gradients, since only that
    backend's own next step dropped it. The next optimizer step of the process does now."""
    weights = []
    for _ in range(3):
        model = Scaled()
        backend = fxgrad.backend(fxgrad.clip_by_global_norm(0.05), compiler="aot_eager", scope="step")
        optimizer = torch.optim.AdamW(model.parameters(), fused=True) if folded else torch.optim.SGD(model.parameters())
        if folded:
            backend.fold(optimizer)
        backend.compile(model)(torch.randn(4, 8)).square().sum().backward()
        optimizer.step()
        weights.append(weakref.ref(model.fc.weight))
        del model, optimizer, backend
        gc.collect()
    assert [weight() is None for weight in weights] == [True, True, False]  # the last until the next step


def test_a_model_collected_in_the_middle_of_a_step_leaves_the_step_alone(monkeypatch):
    """A model compiled in place (a reference cycle) is freed by whichever collection comes
    next, perhaps while a step program reads the weights it was given (a KeyError before)."""
    backend = fxgrad.backend(fxgrad.adaptive_grad_clip(0.01), compiler="aot_eager", scope="step")
    old = mlp_and_copy()[0]
    old.compile(backend=backend)
    old(torch.randn(4, 16)).sum().backward()
    backend.step(old)
    del old  # unreachable, not yet collected
    model, expected = mlp_and_copy()
    model.compile(backend=backend)
    program = StepPrograms._program

    def collect_after(self, *args, **kwargs):
        found = program(self, *args, **kwargs)
        gc.collect()
        return found

    monkeypatch.setattr(StepPrograms, "_program", collect_after)
    x = torch.randn(4, 16)
    model(x).sum().backward()
    backend.step(model)
    expected(x).sum().backward()
    ref.agc(expected, 0.01)
    assert_grads_close(model, expected)


@pytest.mark.parametrize("scope", ["step", "graph"])
def test_a_backend_left_with_no_model_unhooks_until_it_gets_one(scope):
    """torch._dynamo keeps a sweep's earlier backends; their optimizer-step hooks ran at every
    step of every optimizer in the process (40 of them: 0.1-0.2 ms a step). They unhook at the
    first step after their models die, and hook again for a new model."""
    from fxgrad.frontend.step_check import _BEFORE

    backend = fxgrad.backend(fxgrad.clip_by_global_norm(0.05), compiler="aot_eager", scope=scope)
    hooks = lambda: sum(owner in (backend._step, backend._step_check) for owner in _BEFORE.owners)  # noqa: E731
    first = nn.Linear(16, 4)
    torch.compile(first, backend=backend)(torch.randn(2, 16)).sum().backward()
    torch.optim.SGD(first.parameters(), lr=0.1).step()
    assert hooks() == 1
    del first
    gc.collect()
    unrelated = nn.Linear(4, 4)
    unrelated(torch.randn(2, 4)).sum().backward()
    torch.optim.SGD(unrelated.parameters(), lr=0.1).step()
    assert hooks() == 0
    model, expected = mlp_and_copy()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 16)
    torch.compile(model, backend=backend)(x).sum().backward()
    optimizer.step()  # step scope's policy runs here: its hook is back
    expected(x).sum().backward()
    ref.clip_global(expected, 0.05)
    torch.optim.SGD(expected.parameters(), lr=0.1).step()
    assert hooks() == 1
    for p, q in zip(model.parameters(), expected.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)


def test_a_gradient_fsdp2_adds_into_through_its_local_tensor_has_changed():
    """FSDP2 adds a micro-batch's reduce-scattered gradient into an existing sharded ``.grad``
    through ``_local_tensor``, which leaves the DTensor's own version as it was: the policy must
    still see new gradients there (``backend.step()`` between micro-batches that each sync)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from fxgrad.frontend.step_scope import SeenGrads

    with one_process_group():
        mesh = init_device_mesh("cpu", (1,))
        params = (nn.Parameter(torch.randn(4)), nn.Parameter(torch.randn(2)))
        grads = [distribute_tensor(torch.randn(p.shape), mesh, [Shard(0)]) for p in params]
        seen = SeenGrads()
        seen.record(params, grads)
        assert not seen.changed(params, grads)
        grads[1]._local_tensor += 1.0  # as FSDP2 accumulates
        assert seen.changed(params, grads)
        seen.record(params, grads)
        seen.forget()  # the record kept by parameter id: the per-parameter check
        grads[0]._local_tensor += 1.0
        assert seen.changed(params, grads)
        seen.record(params, grads)
        grads[0].zero_()  # a DTensor's own in-place op
        assert seen.changed(params, grads)


def _steps_in_the_backward(model: nn.Module) -> None:
    """torch's "optimizer in the backward" recipe: each parameter's own optimizer steps it
    from a hook, as soon as its gradient is accumulated."""
    optimizers = {p: torch.optim.SGD([p], lr=0.1) for p in model.parameters()}

    def step(p: nn.Parameter) -> None:
        optimizers[p].step()
        optimizers[p].zero_grad()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step)


IN_THE_BACKWARD = [
    ("graph", fxgrad.clip_by_global_norm(1.0), functools.partial(ref.clip_global, max_norm=1.0)),
    ("graph", fxgrad.clip_by_norm(0.5), functools.partial(ref.clip_per_layer, max_norm=0.5)),
    ("step", fxgrad.clip_by_value(0.01), functools.partial(ref.clip_value, clip_value=0.01)),
    ("step", fxgrad.clip_by_global_norm(1.0), None),
    ("step", fxgrad.clip_by_norm(0.5), None),
    ("step", fxgrad.zclip(warmup=2), None),
]


@pytest.mark.parametrize(
    ("scope", "policy", "reference"),
    IN_THE_BACKWARD,
    ids=[f"{scope}-{policy!r}" for scope, policy, _ in IN_THE_BACKWARD],
)
def test_an_optimizer_stepped_inside_the_backward(scope, policy, reference):
    """Graph scope applies the policy in the backward graph, before the hooks see the gradients:
    exact. Step scope would run it at each parameter's step, on that gradient alone (a global
    clip by that gradient's norm, zclip a step per parameter), silently: refused, but for
    element-wise rules, which are exact (run eagerly: the step program would be built for each
    parameter's layout, and stop after eight, blaming LayerDrop)."""
    torch.manual_seed(0)
    model = models.MLP()
    eager = copy.deepcopy(model)
    _steps_in_the_backward(model)
    compiled = torch.compile(model, backend=fxgrad.backend(policy, compiler="aot_eager", scope=scope))
    x = torch.randn(8, 16) * 3
    if reference is None:
        with pytest.raises(
            fxgrad.CoverageError, match="SGD.step\\(\\) ran inside a backward pass and steps part of the model"
        ):
            compiled(x).pow(2).sum().backward()
        return
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nor a step program built for each parameter's layout
        compiled(x).pow(2).sum().backward()
    eager(x).pow(2).sum().backward()
    reference(eager)
    torch.optim.SGD(eager.parameters(), lr=0.1).step()
    for actual, wanted in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(actual, wanted, rtol=1e-5, atol=1e-7)


def test_an_optimizer_stepped_inside_the_backward_under_compiled_autograd_is_refused():
    """Compiled autograd calls the parameters' hooks from its graph, outside any autograd node,
    as a pass's final callbacks run: a step there is still one parameter's, refused."""
    torch.manual_seed(0)
    model = models.MLP()
    _steps_in_the_backward(model)
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1.0), compiler="aot_eager", scope="step")
    compiled = torch.compile(model, backend=backend)
    with _compat.compiled_autograd(torch.compile(backend="aot_eager")):
        with pytest.raises(fxgrad.CoverageError, match="SGD.step\\(\\) ran inside a backward pass"):
            compiled(torch.randn(8, 16)).pow(2).sum().backward()


def test_an_optimizer_in_the_backward_of_an_fsdp2_model_is_not_sent_to_graph_scope():
    """FSDP2 runs each sharded parameter's hooks from its final callback, outside any autograd
    node (a final callback's steps are not refused otherwise); the way out is stepping after
    the backward: graph scope refuses a sharded model."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    with one_process_group():
        model = models.MLP()
        fully_shard(model)
        _steps_in_the_backward(model)
        backend = fxgrad.backend(fxgrad.clip_by_global_norm(1.0), compiler="aot_eager", scope="step")
        compiled = torch.compile(model, backend=backend)
        with pytest.raises(fxgrad.CoverageError, match="after backward\\(\\): FSDPMLP is sharded with FSDP2") as raised:
            compiled(torch.randn(8, 16)).pow(2).sum().backward()
    assert "scope='graph'" not in str(raised.value) and "from the pass's final callback" in str(raised.value)


@pytest.mark.parametrize("sharded", ["", "net.2"], ids=["root", "one-layer"])
def test_a_model_sharded_with_fsdp2_after_graph_scope_compiled_it_is_refused_as_at_compile(sharded):
    """Compiled first, then ``fully_shard``: graph scope's gaps (no graph reached the backend,
    layers in no graph) were reported with Dynamo's causes, not FSDP2 and step scope."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    with one_process_group():
        model = models.MLP()
        backend = fxgrad.backend(fxgrad.clip_by_global_norm(1.0), compiler="aot_eager", scope="graph")
        compiled = torch.compile(model, backend=backend)
        fully_shard(model.get_submodule(sharded))
        with pytest.raises(ValueError, match="scope: .*MLP is sharded with FSDP2's fully_shard .*scope='step'"):
            compiled(torch.randn(8, 16)).pow(2).sum().backward()
            torch.optim.SGD(model.parameters(), lr=0.1).step()


def test_a_model_run_with_parameters_of_its_callers_is_reported_in_step_scope():
    """``functional_call`` with ``nn.Parameter``s of the loop's own: no backward writes the
    model's gradients, so step scope (which reads them) does nothing; the report said to call
    ``backend.step()``, which the loop did."""
    torch.manual_seed(0)
    model = models.MLP()
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1e-3), compiler="aot_eager", scope="step")
    compiled = torch.compile(model, backend=backend)
    params = {name: nn.Parameter(p.detach().clone()) for name, p in model.named_parameters()}
    optimizer = torch.optim.SGD(params.values(), lr=0.1)
    with pytest.warns(fxgrad.CoverageWarning, match="runs with parameters that are not") as caught:
        for _ in range(3):
            optimizer.zero_grad()
            torch.func.functional_call(compiled, params, (torch.randn(4, 16),)).pow(2).sum().backward()
            backend.step(compiled)
            optimizer.step()
    assert "backend.step() after the last backward()" not in str(caught[0].message)


def test_an_optimizer_stepped_from_the_backwards_final_callback_is_not_refused():
    """A step queued as the backward's final callback runs inside the pass, once every gradient
    is there: the policy over the whole model is exact, as after ``backward()``."""
    torch.manual_seed(0)
    model = models.MLP()
    eager = copy.deepcopy(model)
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(0.1), compiler="aot_eager", scope="step")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    out = torch.compile(model, backend=backend)(x := torch.randn(8, 16))
    out.register_hook(lambda grad: torch.autograd.Variable._execution_engine.queue_callback(optimizer.step))
    with coverage_silent():
        out.pow(2).sum().backward()
    eager(x).pow(2).sum().backward()
    ref.clip_global(eager, 0.1)
    torch.optim.SGD(eager.parameters(), lr=0.1).step()
    for actual, wanted in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(actual, wanted, rtol=1e-5, atol=1e-7)


def test_two_optimizers_stepped_from_the_backwards_final_callback_are_not_refused():
    """Two optimizers over parts of one model (Muon for the matrices, AdamW for the rest),
    stepped from the final callback: every gradient is there, so the first step runs the policy
    over the whole model, as after ``backward()``. It was taken for an optimizer in the backward."""
    torch.manual_seed(0)
    model = models.MLP()
    eager = copy.deepcopy(model)
    params = list(model.parameters())
    optimizers = [torch.optim.SGD(params[:2], lr=0.1), torch.optim.SGD(params[2:], lr=0.1)]
    compiled = torch.compile(
        model, backend=fxgrad.backend(fxgrad.clip_by_global_norm(0.1), compiler="aot_eager", scope="step")
    )

    def step() -> None:
        for optimizer in optimizers:
            optimizer.step()

    for _ in range(3):
        for optimizer in optimizers:
            optimizer.zero_grad()
        out = compiled(x := torch.randn(8, 16))
        out.register_hook(lambda grad: torch.autograd.Variable._execution_engine.queue_callback(step))
        with coverage_silent():
            out.pow(2).sum().backward()
        eager.zero_grad()
        eager(x).pow(2).sum().backward()
        ref.clip_global(eager, 0.1)
        torch.optim.SGD(eager.parameters(), lr=0.1).step()
    for actual, wanted in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(actual, wanted, rtol=1e-5, atol=1e-7)
