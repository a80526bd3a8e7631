"""scope="step" runs the policy as one compiled program over every .grad, built once per layout."""

import copy
import dataclasses
import warnings

import models
import pytest
import reference as ref
import torch
import torch.nn as nn
from parity import no_host_sync

import fxgrad
from fxgrad import _compat
from fxgrad.core.rule import ScaleLeaf
from fxgrad.frontend.step_program import StepPrograms

POLICY = fxgrad.chain(
    fxgrad.monitor(),
    fxgrad.rescale(),
    fxgrad.clip_by_norm(1e-2),
    fxgrad.zclip(warmup=3),
    fxgrad.adaptive_grad_clip(0.01),
)
COMPILERS = ["aot_eager", pytest.param("inductor", marks=pytest.mark.inductor)]


def train(backend, model, steps, inputs):
    """Per step: the gradients after ``backend.step()``, and the statistics."""
    compiled = backend.compile(model)
    grads, stats = [], []
    for step in range(steps):
        with no_host_sync() if step > 0 else warnings.catch_warnings():
            models.loss_of(compiled(inputs(step))).backward()
            backend.step()
        grads.append([p.grad.clone() for p in model.parameters()])
        stats.append(backend.stats())
        model.zero_grad()
    return grads, stats


def spiky(step):
    torch.manual_seed(step)
    return torch.randn(4, 16) * (30.0 if step == 4 else 1.0)


@pytest.fixture
def builds(monkeypatch):
    """How many step programs were built."""
    count = [0]
    build = StepPrograms._build

    def counted(self, *args):
        count[0] += 1
        return build(self, *args)

    monkeypatch.setattr(StepPrograms, "_build", counted)
    return count


@pytest.mark.parametrize("compiler", COMPILERS)
def test_the_program_equals_the_eager_rules_and_is_built_once(compiler, builds, monkeypatch):
    torch.manual_seed(0)
    model = models.MLP()
    eager_model = copy.deepcopy(model)
    eager = fxgrad.backend(POLICY, compiler=compiler, scope="step")
    monkeypatch.setattr(eager._programs, "run", lambda *args: False)  # the rules one op at a time
    expected_grads, expected_stats = train(eager, eager_model, 8, spiky)
    grads, stats = train(fxgrad.backend(POLICY, compiler=compiler, scope="step"), model, 8, spiky)
    assert builds[0] == 1  # zclip's warm-up ending, EMAs and thresholds changing: no rebuild
    for step, (got, want) in enumerate(zip(grads, expected_grads)):
        changed = any(not torch.allclose(g, w) for g, w in zip(got, spiky_free_grads(eager_model, step)))
        assert changed, "the policy left the gradients alone: this would not test anything"
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-8)
    assert stats[-1].keys() == expected_stats[-1].keys()
    for key, value in expected_stats[-1].items():
        torch.testing.assert_close(stats[-1][key], value, rtol=1e-5, atol=1e-8)


def spiky_free_grads(model, step):
    """The gradients ``model`` gets at ``step`` without any policy."""
    probe = copy.deepcopy(model)
    models.loss_of(probe(spiky(step))).backward()
    return [p.grad for p in probe.parameters()]


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x, use_b):
        return self.head(self.b(x) if use_b else self.a(x))


def test_one_program_per_layout(builds):
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1e-3), compiler="aot_eager", scope="step")
    model = Branchy()
    for step in range(6):
        models.loss_of(model(torch.randn(2, 8), use_b=step % 2 == 1)).backward()
        backend.step(model)
        total = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]))
        assert total == pytest.approx(1e-3, rel=1e-4)
        model.zero_grad(set_to_none=True)
    assert builds[0] == 2  # a's gradients, then b's: two layouts, each built once


@pytest.mark.parametrize("compiler", COMPILERS)
def test_a_program_follows_the_state_buffer_as_other_layouts_grow_it(compiler, builds, monkeypatch):
    """A program reads and writes its state through views of the store's buffer; the next layout's
    layers grow the buffer (a new tensor), and the first program must then use the new one."""
    policy = fxgrad.chain(fxgrad.monitor(), fxgrad.zclip(warmup=2), fxgrad.autoclip(history=3))
    torch.manual_seed(0)
    model = Branchy()
    eager_model = copy.deepcopy(model)
    eager = fxgrad.backend(policy, compiler=compiler, scope="step")
    monkeypatch.setattr(eager._programs, "run", lambda *args: False)  # the rules one op at a time
    backend = fxgrad.backend(policy, compiler=compiler, scope="step")
    for step in range(8):
        for b, m in ((backend, model), (eager, eager_model)):
            torch.manual_seed(step)
            models.loss_of(m(torch.randn(2, 8) * (20.0 if step == 5 else 1.0), use_b=step % 2 == 1)).backward()
            b.step(m)
        for got, want in zip(model.parameters(), eager_model.parameters()):
            assert (got.grad is None) == (want.grad is None)
            if got.grad is not None:
                torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-8)
        model.zero_grad(set_to_none=True)
        eager_model.zero_grad(set_to_none=True)
    assert builds[0] == 2
    state, expected = backend.state_dict(), eager.state_dict()
    assert state.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-8)
    stats, expected = backend.stats(), eager.stats()
    assert stats.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(stats[key], value, rtol=1e-5, atol=1e-8)


class Experts(nn.Module):
    """One expert of three per step, as a mixture of experts routes a batch."""

    def __init__(self):
        super().__init__()
        self.experts, self.head = nn.ModuleList(nn.Linear(8, 8) for _ in range(3)), nn.Linear(8, 2)

    def forward(self, x, expert):
        return self.head(self.experts[expert](x))


def test_layouts_past_the_recompile_limit_run_eagerly_after_one_warning(builds):
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1e-3), compiler="aot_eager", scope="step")
    model = Experts()
    limited = _compat.dynamo_config().patch(recompile_limit=2)
    with limited, pytest.warns(RuntimeWarning, match="2 gradient layouts have a program already") as caught:
        for step in range(6):
            models.loss_of(model(torch.randn(2, 8), expert=step % 3)).backward()
            backend.step(model)
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            assert torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])) == pytest.approx(1e-3, rel=1e-4)
            model.zero_grad(set_to_none=True)
    assert builds[0] == 2
    assert len([w for w in caught if issubclass(w.category, RuntimeWarning)]) == 1


def test_a_layout_that_outlives_those_before_the_limit_gets_a_program(builds, monkeypatch):
    """zero_grad(set_to_none=False): each expert's first gradient is a new layout, and the layouts
    of the first steps never recur. The last one, kept from then on, replaces the least used program
    once it has run eagerly more than twice as often (the round robin above never does)."""
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1e-3), compiler="aot_eager", scope="step")
    ran = []
    run = backend._programs.run
    monkeypatch.setattr(backend._programs, "run", lambda *args: ran.append(run(*args)) or ran[-1])
    model = Experts()
    limited = _compat.dynamo_config().patch(recompile_limit=2)
    with limited, pytest.warns(RuntimeWarning, match="takes its place") as caught:
        for step in range(8):
            model.zero_grad(set_to_none=False)
            models.loss_of(model(torch.randn(2, 8), expert=min(step, 2))).backward()
            backend.step(model)
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            assert torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])) == pytest.approx(1e-3, rel=1e-4)
    assert ran == [True, True, False, False, True, True, True, True]
    assert builds[0] == 3
    assert len([w for w in caught if issubclass(w.category, RuntimeWarning)]) == 1


@pytest.mark.inductor
def test_a_gradient_whose_strides_change_gets_a_program_of_its_own(builds):
    """A step reuses the last step's program after checking every gradient's layout (in C++);
    a transposed weight gradient, of the same shape but other strides, selects its own."""
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1e-3), compiler="inductor", scope="step")
    model = nn.Linear(8, 4)
    for step in range(4):
        torch.manual_seed(step)
        weight, bias = torch.randn(4, 8), torch.randn(4)
        model.weight.grad = weight.t().contiguous().t() if step % 2 else weight.clone()
        model.bias.grad = bias.clone()
        backend.step(model)
        scale = 1e-3 / torch.cat([weight.flatten(), bias]).norm()
        torch.testing.assert_close(model.weight.grad, weight * scale)
        torch.testing.assert_close(model.bias.grad, bias * scale)
    assert builds[0] == 2


def test_a_gpu_program_is_compiled_with_combo_kernels():
    """On a GPU the program's per-gradient norms and scales launch eight to a kernel
    (docs/performance.md, "On a GPU"); the CPU's C++ kernels take no part in combo kernels."""
    assert _compat.program_settings({"cuda"})["combo_kernels"] is True
    assert "combo_kernels" not in _compat.program_settings({"cpu"})


@pytest.mark.inductor
def test_the_program_compiles_with_its_settings_alone(monkeypatch):
    """The program's settings hold for its compile, and the user's stay as they were. It
    compiles under Dynamo's lock: a training loop in another thread may be compiling, and
    Inductor builds one graph at a time (it failed an assertion in two threads, sweep 23)."""
    import torch._dynamo.convert_frame as convert_frame
    import torch._inductor.compile_fx as compile_fx
    import torch._inductor.config as inductor_config

    seen, inner = [], compile_fx.compile_fx_inner

    def spy(*args, **kwargs):
        locked = convert_frame.compile_lock._is_owned()
        seen.append((inductor_config.size_asserts, inductor_config.cpp.min_chunk_size, locked))
        return inner(*args, **kwargs)

    monkeypatch.setattr(compile_fx, "compile_fx_inner", spy)
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1e-3), compiler="inductor", scope="step")
    model = nn.Linear(8, 4)
    model.weight.grad, model.bias.grad = torch.randn(4, 8), torch.randn(4)
    backend.step(model)
    assert seen == [(False, 4096, True)]
    assert inductor_config.size_asserts and inductor_config.cpp.min_chunk_size != 4096


@dataclasses.dataclass(frozen=True, repr=False)
class HalveWithAConstant(ScaleLeaf):
    """Halves every gradient through a tensor constant, which a recorded graph cannot hold."""

    name = "halve_with_a_constant"

    def factors(self, stats, layers, ctx):
        return [torch.tensor(0.5, dtype=torch.float64)] * len(stats)


def test_a_program_that_cannot_be_built_warns_once_and_runs_eagerly():
    backend = fxgrad.backend(HalveWithAConstant(), compiler="aot_eager", scope="step")
    model = nn.Linear(4, 4)
    with pytest.warns(RuntimeWarning, match="could not be built") as caught:
        for _ in range(3):
            model(torch.randn(2, 4)).sum().backward()
            raw = [p.grad.clone() for p in model.parameters()]
            backend.step(model)
            assert all(torch.equal(p.grad, 0.5 * r) for p, r in zip(model.parameters(), raw))
            model.zero_grad()
    assert len([w for w in caught if issubclass(w.category, RuntimeWarning)]) == 1


def test_a_layout_whose_program_cannot_be_built_leaves_the_others_compiled(monkeypatch):
    """One step's odd gradients (a transposed one here; a broadcast one fails in Inductor) made
    every later step run eagerly, its program never built (sweep 51c): only that layout does."""
    built = []
    build = StepPrograms._build

    def fails_on_a_transposed_gradient(self, routes, owners, grads, *args):
        if not all(g.is_contiguous() for g in grads):
            raise RuntimeError("no program for this layout")
        built.append(len(grads))
        return build(self, routes, owners, grads, *args)

    monkeypatch.setattr(StepPrograms, "_build", fails_on_a_transposed_gradient)
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(0.1), compiler="aot_eager", scope="step")
    model = nn.Linear(4, 4)
    with pytest.warns(RuntimeWarning, match="could not be built .*on gradients of this layout") as caught:
        for step in range(4):
            model(torch.randn(2, 4)).sum().backward()
            if step in (0, 2):
                model.weight.grad = model.weight.grad.t().contiguous().t()
            expected = [
                p.grad * min(1.0, 0.1 / torch.cat([q.grad.flatten() for q in model.parameters()]).norm())
                for p in model.parameters()
            ]
            backend.step(model)
            for p, e in zip(model.parameters(), expected):
                torch.testing.assert_close(p.grad, e)
            model.zero_grad()
    assert built == [2]
    assert len([w for w in caught if issubclass(w.category, RuntimeWarning)]) == 1


def test_builds_that_fail_on_two_layouts_leave_every_step_eager(monkeypatch):
    """A failure on a second layout is not the layout's (Inductor's toolchain, say): builds stop,
    where the regression sweep of the per-layout fallback found one try, and one warning, per
    new layout (24 tries in 30 steps of a model with optional branches)."""
    tries = []

    def fails(self, *args):
        tries.append(1)
        raise RuntimeError("no compiler")

    monkeypatch.setattr(StepPrograms, "_build", fails)
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(0.1), compiler="aot_eager", scope="step")
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with pytest.warns(RuntimeWarning, match="could not be built") as caught:
        for step in range(6):
            model[step % 2](torch.randn(2, 4)).sum().backward()  # two layouts, and the first again
            backend.step(model)
            model.zero_grad()
    assert len(tries) == 2
    assert [str(w.message).endswith("from now on") for w in caught] == [False, True]


def test_weights_are_read_from_the_parameters_of_each_step(builds):
    """AGC reads the weights by name at run time: parameters replaced by
    ``load_state_dict(assign=True)`` are followed by the same program."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    backend = fxgrad.backend(fxgrad.adaptive_grad_clip(0.01), compiler="aot_eager", scope="step")
    for step in range(3):
        if step == 2:
            model.load_state_dict({k: 10 * v for k, v in model.state_dict().items()}, assign=True)
        x = torch.randn(4, 8)
        model(x).square().sum().backward()
        expected = copy.deepcopy(model)  # deepcopy leaves .grad out
        for q, p in zip(expected.parameters(), model.parameters()):
            q.grad = p.grad.clone()
        ref.agc(expected, 0.01)
        backend.step(model)
        for p, q in zip(model.parameters(), expected.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-8)
        model.zero_grad(set_to_none=True)
    assert builds[0] == 1


def test_parameter_walk_follows_every_change_to_a_model():
    """Step scope keeps the walk over a model's parameters between steps; each way a model can
    change its parameters makes it walk again."""
    from fxgrad.core.layers import ModelParameters

    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2)))
    walk = ModelParameters()
    first = walk([model])
    assert first == tuple(model.parameters()) and walk([model]) is first

    def changes():
        yield lambda: setattr(model[0], "extra", nn.Parameter(torch.ones(1)))  # a new parameter
        yield lambda: model[1].append(nn.Linear(2, 2))  # a new submodule
        yield lambda: setattr(model, "1", nn.Linear(2, 2))  # a replaced submodule
        yield lambda: delattr(model[0], "extra")  # a deleted parameter
        yield lambda: model[0]._parameters.__setitem__("bias", nn.Parameter(torch.ones(2)))  # replaced directly
        yield lambda: delattr(model, "1")  # a deleted submodule
        yield lambda: model[0]._parameters.__setitem__("added", nn.Parameter(torch.ones(1)))  # added directly

    for change in changes():
        before = walk([model])
        change()
        after = walk([model])
        assert after is not before and after == tuple(model.parameters())


def test_the_policy_runs_once_per_set_of_gradients_whichever_parameters_ask():
    """Step scope's record of the gradients the policy ran on, asked by the parameters of the
    last run (the fast path) or by others (a GAN optimizer stepping one of two models)."""
    from fxgrad.frontend.step_scope import SeenGrads

    a, b = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
    both, only_b = (a, b), (b,)
    seen = SeenGrads()

    def changed(params):
        return seen.changed(params, [p.grad for p in params])

    def record(params):
        seen.record(params, [p.grad for p in params])

    a.grad, b.grad = torch.ones(2), torch.ones(2)
    assert changed(both)
    record(both)
    assert not changed(both) and not changed(only_b)
    record(both)
    b.grad = torch.ones(2)  # a new gradient of the same version
    assert changed(both)
    record(both)
    b.grad.add_(1)  # accumulated into
    assert changed(both) and changed(only_b)
    record(only_b)  # b's optimizer ran the policy
    assert not changed(both)  # a as the first record saw it, b as the second
    a.grad = torch.ones(2)
    assert changed(both) and not changed(only_b)
    a.grad = None  # a parameter without a gradient is not looked at
    assert not changed(both)


class SlicedLayers(nn.Module):
    """A forward that builds a module: slicing a ModuleList, as transformers' decoders do
    (``for layer in self.layers[: self.config.num_hidden_layers]``)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x):
        for layer in self.layers[:2]:
            x = torch.tanh(layer(x))
        return x


def test_a_forward_that_builds_modules_is_not_recompiled_by_step_scope():
    """Step scope keeps its parameter walk without a global module-registration hook, which
    Dynamo would trace inside such a forward and guard on: a recompile on every step."""
    model = SlicedLayers()
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(0.1), compiler="aot_eager", scope="step")
    compiled = backend.compile(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with _compat.dynamo_config().patch(error_on_recompile=True):
        for _ in range(4):
            compiled(torch.randn(2, 4)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()


@pytest.mark.parametrize("compiler", COMPILERS)
@pytest.mark.parametrize("fold", [False, True])
@pytest.mark.parametrize("scope", ["step", "graph"])
def test_no_gradient_outlives_its_step(compiler, fold, scope):
    """The step program, the fold (in graph scope, the program of the folded update) and
    update-level factors keep no gradient (nor a weight copy) alive after the step: peak
    memory stays the model's own."""
    import gc
    import weakref

    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    policy = fxgrad.chain(
        fxgrad.clip_by_global_norm(0.1), fxgrad.rescale(alpha=0, multipliers={"0": 2.0}, apply_to="update")
    )
    if scope == "graph":  # the update-level factors keep the update out of a program: not folded then
        policy = fxgrad.chain(fxgrad.clip_by_norm(0.1), fxgrad.clip_by_global_norm(0.1))
    backend = fxgrad.backend(policy, compiler=compiler, scope=scope)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    if fold:
        backend.fold(optimizer)
    compiled = backend.compile(model)
    alive = []
    for step in range(3):
        models.loss_of(compiled(spiky(step))).backward()
        optimizer.step()
        alive += [weakref.ref(p.grad) for p in model.parameters()]
        optimizer.zero_grad(set_to_none=True)
    gc.collect()
    assert not [ref for ref in alive if ref() is not None]
    assert backend._update_factors is None or not backend._update_factors._before  # the copies went with the step


@pytest.mark.parametrize("fold", [False, True])
@pytest.mark.parametrize("scope", ["step", "graph"])
def test_a_backend_goes_with_its_model(compile_with, scope, fold):
    """Nothing keeps a backend and its model alive once both are dropped (a sweep builds one of
    each per run): the parameters' gradient hooks hold the backend weakly, and step scope's
    parameter walk (and a folded update's record) holds the parameters."""
    import gc
    import weakref

    from fxgrad import _compat

    def run():
        model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
        backend = fxgrad.backend(fxgrad.clip_by_global_norm(0.1), compiler="aot_eager", scope=scope)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, fused=fold)
        if fold:
            backend.fold(optimizer)
        compiled = compile_with(backend, model)
        for _ in range(2):
            models.loss_of(compiled(torch.randn(4, 16))).backward()
            optimizer.step()
        return weakref.ref(backend), weakref.ref(model[0].weight)

    refs = run()
    _compat.reset_dynamo()  # Dynamo's cache holds the compiled frames, and with them the backend
    gc.collect()
    assert [ref() for ref in refs] == [None, None]


def test_a_new_model_at_a_dead_models_id_is_walked_afresh():
    """CPython gives a new object the id of a freed one: the parameter walk kept for the dead
    model must not stand for the new one (the policy would run on the dead model's gradients)."""
    import gc

    backend = fxgrad.backend(fxgrad.clip_by_global_norm(0.1), compiler="aot_eager", scope="step")
    model = models.MLP()
    models.loss_of(model(torch.randn(4, 16))).backward()
    backend.step(model)
    dead = id(model)
    del model
    gc.collect()
    shells = [models.MLP.__new__(models.MLP) for _ in range(10_000)]  # until one lands on the freed id
    reused = next((shell for shell in shells if id(shell) == dead), None)
    if reused is None:
        pytest.skip("CPython did not reuse the id")
    models.MLP.__init__(reused)
    models.loss_of(reused(torch.randn(4, 16))).backward()
    backend.step(reused)
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in reused.parameters()]))
    assert norm.item() == pytest.approx(0.1, rel=1e-5)
