"""The plain ``torch.compile(model, backend=backend)`` path: no silent no-op, no false alarm.

Ordinary training loops (``zero_grad``, forward, ``backward``, ``optimizer.step()``) as
users and frameworks write them, without ``backend.compile``. Where Dynamo leaves the
policy nothing to act on, fxgrad says so at the latest at ``optimizer.step()``.
"""

import contextlib
import copy
import gc
import warnings
import weakref

import pytest
import reference as ref
import torch
import torch.nn as nn
from parity import assert_grads_close, coverage_silent, grads_of, one_process_group
from torch.nn.parallel import DistributedDataParallel as DDP

import fxgrad
from fxgrad import _compat
from fxgrad.passes.capture import Root


class LSTMNet(nn.Module):
    """The clipping article's case: an embedding Linear, an LSTM, a head."""

    def __init__(self):
        super().__init__()
        self.embed, self.lstm, self.head = nn.Linear(4, 8), nn.LSTM(8, 8, batch_first=True), nn.Linear(8, 2)

    def forward(self, x):
        h, _ = self.lstm(self.embed(x))
        return self.head(h[:, -1])


class TwoOutputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.head, self.aux = nn.Linear(8, 16), nn.Linear(16, 4), nn.Linear(16, 2)

    def forward(self, x):
        h = torch.relu(self.body(x))
        return self.head(h), self.aux(h)

    def encode(self, x):
        return self.body(x)


def sequential():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def train(model, call, steps=2, x=None):
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    for _ in range(steps):
        optimizer.zero_grad()
        out = call(torch.randn(4, 8) if x is None else x)
        (out[0] if isinstance(out, tuple) else out).sum().backward()
        optimizer.step()
    return optimizer


@pytest.mark.parametrize("wrapper", ["torch.compile", "Module.compile"])
def test_lstm_without_allow_rnn_is_reported_at_the_optimizer_step(wrapper):
    _compat.dynamo_config().allow_rnn = False
    model = LSTMNet()
    policy = fxgrad.by_type({nn.LSTM: fxgrad.clip_by_norm(0.01)}, default=fxgrad.clip_by_norm(0.05))
    backend = fxgrad.backend(policy, compiler="aot_eager")
    if wrapper == "torch.compile":
        call = torch.compile(model, backend=backend)
    else:
        model.compile(backend=backend)
        call = model
    with pytest.warns(
        fxgrad.CoverageWarning, match="(?s)no graph of LSTMNet reached the backend.*allow_rnn = True"
    ) as told:
        train(model, call, x=torch.randn(2, 5, 4))
    # the RNN is the cause given, not the recompile limit it could otherwise be
    assert not any("recompile_limit" in str(w.message) for w in told if "LSTMNet" in str(w.message))

    global_clip = fxgrad.backend(fxgrad.clip_by_global_norm(0.05), compiler="aot_eager")
    with pytest.raises(fxgrad.CoverageError, match="no graph of LSTMNet"):
        train(model, torch.compile(model, backend=global_clip), x=torch.randn(2, 5, 4))


def test_module_compile_of_a_sequential_is_reported():
    """``Module.compile`` compiles ``_call_impl``; Dynamo skips torch.nn's own forward under it."""
    model = sequential()
    backend = fxgrad.backend(fxgrad.clip_by_norm(0.01), compiler="aot_eager")
    model.compile(backend=backend)
    with pytest.warns(fxgrad.CoverageWarning, match="(?s)no graph of Sequential.*torch.compile\\(model, backend"):
        train(model, model)


@pytest.mark.parametrize("cause", ["disable=True", "set_stance", "suppress_errors"])
def test_a_sequential_compiled_whole_and_run_eagerly_is_reported_with_its_cause(cause):
    """The cause the user set is named, and no advice to do what they did: the report named
    generic causes for ``disable=True``, and a graph the backend had failed to compile under
    ``suppress_errors`` as "no graph reached the backend" with no word of the error; each told a torch.compile'd
    ``nn.Sequential`` to use ``torch.compile`` (sweep 51a)."""
    model = sequential()
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(0.01), compiler="aot_eager")
    setting = contextlib.nullcontext()
    if cause == "disable=True":
        compiled = torch.compile(model, backend=backend, disable=True)
        said = r"reached the backend: torch.compile ran it eagerly \(torch.compile\(\.\.\., disable=True\)"
    elif cause == "set_stance":
        compiled = torch.compile(model, backend=backend)
        setting = torch.compiler.set_stance("force_eager")
        said = r"torch.compile ran it eagerly \(torch.compiler.set_stance\('force_eager'\) is in effect\)"
    else:  # the backend refuses Inductor's options under aot_eager
        compiled = torch.compile(model, backend=backend, options={"freezing": True})
        setting = _compat.dynamo_config().patch(suppress_errors=True)
        said = r"no graph of Sequential was compiled: .*failed, ValueError: mode= and options=.*suppress_errors=True"
    with setting, pytest.raises(fxgrad.CoverageError, match=said) as raised:
        train(model, compiled)
    assert "torch.nn's own code" not in str(raised.value)


def test_symbolic_gradient_shapes_name_the_setting_and_step_scope():
    """``prefer_deferred_runtime_asserts_over_guards`` with ``dynamic=True`` leaves a weight's
    gradient a symbolic size (the input's feature size); graph scope named an internal node
    (sweep 51a). Step scope reads ``.grad`` and is exact."""
    deferred = _compat.dynamo_config().patch(prefer_deferred_runtime_asserts_over_guards=True)
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(0.01), compiler="aot_eager", scope="graph")
    said = "fxgrad: a gradient of '0' has a symbolic shape .*prefer_deferred.*scope='step'"
    with deferred, pytest.raises(NotImplementedError, match=said):
        torch.compile(sequential(), backend=backend, dynamic=True)(torch.randn(4, 8)).sum().backward()
    model = sequential()
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(0.01), compiler="aot_eager", scope="step")
    with deferred:
        assert clipped_like_eager(model, torch.compile(model, backend=backend, dynamic=True), 0.01) < 1e-6


def test_parameters_installed_as_graph_attributes_name_the_setting():
    """``install_free_tensors=True`` makes parameters graph attributes; the error named
    ``inline_inbuilt_nn_modules``, always on in torch 2.13, and not the setting (sweep 51a)."""
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(0.01), compiler="aot_eager", scope="step")
    installed = _compat.dynamo_config().patch(install_free_tensors=True)
    with installed, pytest.raises(Exception, match="install_free_tensors"):
        torch.compile(sequential(), backend=backend)(torch.randn(4, 8))


class Disabled(nn.Linear):
    @torch.compiler.disable
    def forward(self, x):
        return super().forward(x)


class FrozenBody(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(8, 16).requires_grad_(False), Disabled(16, 4)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


class Leaves(torch.fx.Tracer):
    def is_leaf_module(self, module, name):
        return True


@pytest.mark.parametrize("how", ["torch.compile", "backend.compile"])
@pytest.mark.parametrize("kind", ["module", "GraphModule"])
def test_layers_all_under_compiler_disable_are_reported(kind, how):
    """Every layer under ``torch.compiler.disable``: Dynamo compiles the ReLU between them, a
    graph without parameters, and the policy does nothing. ``backend.compile``'s per-forward check
    took that graph for the model's (silent). A ``torch.fx.GraphModule`` (FX-mode QAT's
    ``prepare_qat_fx`` returns one) has a ``forward`` without ``__module__``, which the plain
    path's report read (an AttributeError)."""
    model = nn.Sequential(Disabled(8, 16), nn.ReLU(), Disabled(16, 4))
    if kind == "GraphModule":
        model = torch.fx.GraphModule(model, Leaves().trace(model))
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(0.01), compiler="aot_eager")
    compiled = torch.compile(model, backend=backend) if how == "torch.compile" else backend.compile(model)
    name = type(model).__name__
    with pytest.raises(fxgrad.CoverageError, match=f"(?s)no graph of {name} reached the backend.*compiler.disable"):
        train(model, compiled)


@pytest.mark.parametrize("how", ["torch.compile", "backend.compile"])
def test_a_frozen_body_with_its_trained_head_disabled_is_reported(how):
    """Dynamo compiles the frozen body, a graph that holds parameters and trains none, and runs the
    trained head under ``torch.compiler.disable``: the policy does nothing. ``backend.compile``'s
    per-forward check took the body's graph for a trained one (silent)."""
    model = FrozenBody()
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(0.01), compiler="aot_eager")
    compiled = torch.compile(model, backend=backend) if how == "torch.compile" else backend.compile(model)
    with pytest.raises(fxgrad.CoverageError, match="(?s)no graph of FrozenBody reached the backend.*frozen layers"):
        train(model, compiled)


def test_parameters_frozen_around_a_forward_are_no_eager_forward():
    """A GAN's generator step that freezes the discriminator for its forward only: the graph,
    compiled frozen, trains nothing, and no gradient of the discriminator is missed."""
    generator, discriminator = nn.Linear(8, 8), sequential()
    compiled = fxgrad.backend(fxgrad.clip_by_global_norm(0.01), compiler="aot_eager").compile(discriminator)
    with warnings.catch_warnings():
        warnings.simplefilter("error", fxgrad.CoverageWarning)
        for _ in range(2):
            discriminator.requires_grad_(False)
            out = compiled(generator(torch.randn(4, 8)))
            discriminator.requires_grad_(True)
            out.sum().backward()
        train(discriminator, compiled)


def test_a_second_backends_plain_compile_leaves_the_bypass_check():
    """Another backend's ``torch.compile`` of the model, unused: the first one's per-forward
    watch still reports a backward of the original model (not only its own recompile, as
    ``fabric.setup`` makes, hands the model to the plain path's checks)."""
    model = sequential()
    compiled = fxgrad.backend(fxgrad.clip_by_norm(0.01), compiler="aot_eager").compile(model)
    torch.compile(model, backend=fxgrad.backend(fxgrad.monitor(), compiler="aot_eager"))
    train(model, compiled)
    with pytest.warns(fxgrad.CoverageWarning, match="without passing through a forward of the compiled Sequential"):
        train(model, model)


def test_a_no_grad_functional_call_first_is_no_eager_forward():
    """Its graph takes tensors, not parameters, and records no stand-ins under ``no_grad`` (no
    backward follows): the per-forward check must not take it for a forward that ran no layer's
    graph (a meta-learning or validation pass before training)."""
    model = sequential()
    compiled = fxgrad.backend(fxgrad.clip_by_global_norm(0.01), compiler="aot_eager").compile(model)
    adapted = {f"_orig_mod.{name}": p * 1.0 for name, p in model.named_parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter("error", fxgrad.CoverageWarning)
        with torch.no_grad():
            torch.func.functional_call(compiled, adapted, (torch.randn(4, 8),))
        train(model, compiled)


def test_compiled_ddp_of_a_sequential_is_reported():
    with one_process_group():
        model = sequential()
        backend = fxgrad.backend(fxgrad.clip_by_norm(0.01), compiler="aot_eager")
        compiled = torch.compile(DDP(model), backend=backend)
        with pytest.warns(fxgrad.CoverageWarning, match="(?s)no graph of Sequential.*wrap that in DDP"):
            train(model, compiled)


@pytest.mark.parametrize("wrapper", [nn.DataParallel, DDP])
def test_backend_compile_names_layers_inside_data_parallel(wrapper):
    """``backend.compile(DDP(model))`` names the layers as ``torch.compile(DDP(model), ...)`` does,
    ``0`` and ``2``, not ``module.0``: a key routes alike on both paths."""
    with one_process_group():
        torch.manual_seed(0)
        model = TwoOutputs()
        expected = copy.deepcopy(model)
        policy = fxgrad.chain(fxgrad.monitor(), fxgrad.by_name({"head": fxgrad.clip_by_norm(1e-3)}))
        backend = fxgrad.backend(policy, compiler="aot_eager", scope="step")
        compiled = backend.compile(wrapper(model))
        x = torch.randn(4, 8)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            sum(out.sum() for out in compiled(x)).backward()
            backend.step()
        sum(out.sum() for out in expected(x)).backward()
        ref.clip_per_layer(expected, 1e-3, select=lambda name, module: name == "head")
        assert_grads_close(model, expected)
        assert {"grad_norm/aux", "grad_norm/body", "grad_norm/head"} <= set(backend.stats())
        assert not any("module." in key for key in backend.stats())


@pytest.mark.parametrize("wrapper", [nn.DataParallel, DDP])
def test_backend_compile_inside_data_parallel_reports_a_bypassing_backward(wrapper):
    """The per-forward checks watch the model inside the wrapper: a backward of ``model(x)``,
    which the compiled module never ran, is reported (it was not, for a while)."""
    with one_process_group():
        model = TwoOutputs()
        compiled = fxgrad.backend(fxgrad.clip_by_global_norm(0.01), compiler="aot_eager").compile(wrapper(model))
        x = torch.randn(4, 8)
        sum(out.sum() for out in compiled(x)).backward()
        model.zero_grad()
        with pytest.warns(fxgrad.CoverageWarning, match="without passing through a forward of the compiled"):
            sum(out.sum() for out in model(x)).backward()


def test_documented_ddp_order_and_step_scope_apply_the_policy():
    """``DDP(torch.compile(model, backend=...))``; and step scope for what Dynamo leaves eager."""
    with one_process_group():
        for scope, wrap in (("graph", lambda m, b: DDP(torch.compile(m, backend=b))), ("step", None)):
            torch.manual_seed(0)
            model = sequential()
            expected = copy.deepcopy(model)
            backend = fxgrad.backend(fxgrad.clip_by_norm(1e-3), compiler="aot_eager", scope=scope)
            if wrap is None:  # Module.compile of an nn.Sequential: no graph, step scope applies it
                model.compile(backend=backend)
                call = model
            else:
                call = wrap(model, backend)
            x = torch.randn(4, 8)
            with coverage_silent():
                call(x).sum().backward()
                if scope == "step":
                    backend.step()  # the model is known from the torch.compile call
            expected(x).sum().backward()
            ref.clip_per_layer(expected, 1e-3)
            assert_grads_close(model, expected)


def test_an_eager_method_and_the_recompile_limit_are_reported():
    model = TwoOutputs()
    backend = fxgrad.backend(fxgrad.clip_by_norm(1e-3), compiler="aot_eager")
    compiled = torch.compile(model, backend=backend)
    optimizer = train(model, compiled)
    optimizer.zero_grad()
    model.encode(torch.randn(4, 8)).sum().backward()  # an eager method: no graph of the backend
    with pytest.warns(fxgrad.CoverageWarning, match="no backward of a graph compiled by this backend ran"):
        optimizer.step()

    model = sequential()
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1e-2), compiler="aot_eager")
    compiled = torch.compile(model, backend=backend, dynamic=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    with torch._dynamo.config.patch(recompile_limit=2):
        for batch in (2, 3, 4):
            optimizer.zero_grad()
            compiled(torch.randn(batch, 8)).sum().backward()
            if batch < 4:
                optimizer.step()
        with pytest.raises(fxgrad.CoverageError, match="recompile_limit"):
            optimizer.step()


def test_ordinary_loops_raise_no_warning(compile_with):
    """Checkpointing, retain_graph, inference_mode, partial outputs, validation forwards,
    dropped batches, and a second model with its own optimizer and no fxgrad."""
    model, other = TwoOutputs(), sequential()
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1.0), compiler="aot_eager")
    unused = fxgrad.backend(fxgrad.clip_by_norm(1.0), compiler="aot_eager")  # created, never used
    compiled = compile_with(backend, model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    other_optimizer = torch.optim.SGD(other.parameters(), lr=1e-2)
    x = torch.randn(4, 8)
    with coverage_silent():
        for step in range(3):
            optimizer.zero_grad()
            head, _ = compiled(x)  # the aux output is dropped
            head.sum().backward(retain_graph=True)  # a second one would sum two clipped gradients
            optimizer.step()
            optimizer.zero_grad()
            checkpointed = torch.utils.checkpoint.checkpoint(compiled, x, use_reentrant=False)
            checkpointed[1].sum().backward()
            optimizer.step()
            compiled(x)  # a dropped batch: forward, no backward
            with torch.inference_mode():
                compiled(x)
            model.eval()
            with torch.no_grad():
                compiled(x)
            model.train()
            other_optimizer.zero_grad()
            other(x).sum().backward()
            other_optimizer.step()
    del unused


@pytest.mark.parametrize("policy", ["global", "by_name"])
def test_a_submodule_compiled_with_the_models_backend_is_named_as_in_the_model(policy):
    """m.fc = torch.compile(m.fc, backend=b), then torch.compile(m, backend=b): Dynamo traces the
    inner module inline, and its parameters are layers of the outer model (named ``2``), not
    of the inner one (named ``""``): no false CoverageError, and ``by_name`` reaches them
    (compiling the inner module alone warns that the key matches none of its layers)."""
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))
    eager = copy.deepcopy(model)
    transform = (
        fxgrad.clip_by_global_norm(0.05) if policy == "global" else fxgrad.by_name({"2": fxgrad.clip_by_norm(0.05)})
    )
    backend = fxgrad.backend(transform, compiler="aot_eager")
    model[2] = torch.compile(model[2], backend=backend)
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(4, 8)
    with coverage_silent():
        compiled(x).sum().backward()
        torch.optim.SGD(model.parameters(), lr=0.0).step()  # the step's coverage check
    eager(x).sum().backward()
    if policy == "global":
        ref.clip_global(eager, 0.05)
    else:
        torch.nn.utils.clip_grad_norm_(eager[2].parameters(), 0.05)
    assert_grads_close(model, eager)


class Branches(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, use_b: bool):
        return self.b(x) if use_b else self.a(x)


def test_a_layer_first_compiled_after_a_step_is_held_from_then_on(compile_with):
    """The optimizer-step check keeps, per optimizer, which parameters a graph holds; the graph
    of the branch first taken at the second step must renew that, or that step's update would
    not see the policy ran (here: b's update-level multiplier would be skipped)."""
    model = Branches()
    policy = fxgrad.rescale(alpha=0, target=1.0, multipliers={"b": 3.0}, apply_to="update")  # per layer
    compiled = compile_with(fxgrad.backend(policy, compiler="aot_eager"), model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8)
    # the graph without b says so, once: b might be used on other inputs
    with pytest.warns(fxgrad.CoverageWarning, match="(?s)not applied to.*b .Linear.: in no compiled graph"):
        compiled(x, False).sum().backward()
        optimizer.step()
    optimizer.zero_grad()
    before = model.b.weight.detach().clone()
    with coverage_silent():
        compiled(x, True).sum().backward()
        optimizer.step()
    torch.testing.assert_close(model.b.weight - before, -0.1 * 3.0 * model.b.weight.grad)


def test_step_scope_on_the_plain_path_needs_no_backend_step(compile_with):
    torch.manual_seed(0)
    model = sequential()
    expected = copy.deepcopy(model)
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1e-3), compiler="aot_eager", scope="step")
    compiled = compile_with(backend, model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    expected_optimizer = torch.optim.SGD(expected.parameters(), lr=1.0)
    with coverage_silent():
        for _ in range(3):
            x = torch.randn(4, 8)
            optimizer.zero_grad()
            compiled(x).sum().backward()
            optimizer.step()
            expected_optimizer.zero_grad()
            expected(x).sum().backward()
            ref.clip_global(expected, 1e-3)
            expected_optimizer.step()
    for actual, wanted in zip(model.parameters(), expected.parameters()):
        torch.testing.assert_close(actual, wanted, rtol=1e-6, atol=1e-7)


class Adapted(nn.Module):
    """A frozen base layer with a trainable low-rank adapter beside it, as LoRA does."""

    def __init__(self):
        super().__init__()
        self.base, self.down, self.up = nn.Linear(8, 8), nn.Linear(8, 2, bias=False), nn.Linear(2, 8, bias=False)
        self.base.requires_grad_(False)

    def forward(self, x):
        return self.base(x) + self.up(self.down(x))


def test_a_frozen_base_with_trainable_adapters_is_clipped_without_a_warning():
    """The graph's first parameter is frozen: the accumulation check watches a trainable one. A
    rule over every layer finds no gradient on the frozen base, as clip_grad_norm_ does: nothing
    to say (graph scope listed every frozen base layer of a LoRA model)."""
    torch.manual_seed(0)
    model = Adapted()
    expected = copy.deepcopy(model)
    compiled = torch.compile(model, backend=fxgrad.backend(fxgrad.clip_by_global_norm(1e-3), compiler="aot_eager"))
    x = torch.randn(4, 8)
    with coverage_silent():
        train(model, compiled, steps=2, x=x)
    model.zero_grad()
    compiled(x).sum().backward()
    expected.load_state_dict(model.state_dict())
    expected(x).sum().backward()
    ref.clip_global(expected, 1e-3)
    assert_grads_close(model, expected)


@pytest.mark.parametrize(
    "policy",
    [
        fxgrad.by_name({"base": fxgrad.clip_by_norm(1.0)}, default=fxgrad.clip_by_norm(2.0)),
        fxgrad.rescale(alpha=0.5, multipliers={"base": 3.0}),
        fxgrad.by_type(
            {nn.Linear: fxgrad.by_name({"base": fxgrad.clip_by_norm(1.0)}, default=fxgrad.clip_by_norm(2.0))}
        ),
        fxgrad.rescale(alpha=0.5, multipliers={"up": 1.5, "[bu]*": 2.0}),  # "up" is the first key's
    ],
    ids=["by_name", "rescale_multiplier", "nested_key", "rescale_first_match"],
)
@pytest.mark.parametrize("scope", ["graph", "step"])
def test_a_frozen_layer_the_policy_names_is_reported(policy, scope):
    """A key that names a frozen layer does nothing there: that is said, in both scopes (graph
    scope when it compiles a graph, step scope when it meets the model)."""
    model = Adapted()
    with pytest.warns(fxgrad.CoverageWarning, match="1 layer the policy names is frozen .* no gradient: base$"):
        compiled = torch.compile(model, backend=fxgrad.backend(policy, scope=scope, compiler="aot_eager"))
        train(model, compiled, steps=1, x=torch.randn(4, 8))


@pytest.mark.parametrize(
    "policy",
    [
        fxgrad.by_type({nn.Linear: fxgrad.clip_by_norm(1e-3)}),
        fxgrad.by_name({"*": fxgrad.clip_by_norm(1e-3)}),
        fxgrad.rescale(alpha=0.5, multipliers={"*": 3.0}),
    ],
    ids=["by_type", "by_name", "rescale_multiplier"],
)
@pytest.mark.parametrize("scope", ["graph", "step"])
def test_a_key_that_reaches_the_adapters_says_nothing_of_the_frozen_base(policy, scope):
    """``by_type({nn.Linear: ...})`` on a LoRA model names the frozen base's Linears and the
    adapters': it acts on the adapters, so there is nothing to say about the base (every frozen
    base layer of the model was listed, 225 of a 32-block Llama)."""
    model = Adapted()
    with warnings.catch_warnings():
        warnings.simplefilter("error", fxgrad.CoverageWarning)
        compiled = torch.compile(model, backend=fxgrad.backend(policy, scope=scope, compiler="aot_eager"))
        train(model, compiled, steps=2, x=torch.randn(4, 8))


def test_a_rule_that_reaches_only_a_frozen_layer_says_it_is_frozen():
    """Routes cover frozen layers too (they may thaw): a rule idle on its one layer names it as
    frozen, the reason it gets no gradient now."""
    policy = fxgrad.by_name(
        {"up": fxgrad.clip_by_norm(1.0), "down": fxgrad.clip_by_norm(1.0)}, default=fxgrad.rescale(0.5)
    )
    with pytest.warns(fxgrad.CoverageWarning, match=r"reaches only base \(frozen\): its 'mean' target"):
        fxgrad.backend(policy, compiler="aot_eager").compile(Adapted())


@pytest.mark.inductor
def test_plain_inductor_loop_is_exact_and_silent():
    model = TwoOutputs()
    backend = fxgrad.backend(fxgrad.by_type({nn.Linear: fxgrad.clip_by_norm(1e-3)}))
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(4, 8)
    with coverage_silent():
        train(model, compiled, steps=1, x=x)
    expected = copy.deepcopy(model)
    model.zero_grad()
    sum(out.sum() for out in compiled(x)).backward()
    sum(out.sum() for out in expected(x)).backward()
    ref.clip_per_layer(expected, 1e-3)
    assert_grads_close(model, expected, rtol=1e-5)


def test_the_model_is_found_when_torch_compile_is_wrapped(monkeypatch):
    """Lightning's ``Trainer.fit`` replaces ``torch.compile`` with a wrapper of its own."""
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda *args, **kwargs: real(*args, **kwargs))
    model = sequential()
    model.compile(backend=fxgrad.backend(fxgrad.clip_by_norm(0.01), compiler="aot_eager"))
    with pytest.warns(fxgrad.CoverageWarning, match="no graph of Sequential"):
        train(model, model)


def shared_wrapper(forward):
    """A decorator around ``forward`` whose wrapper code every decorated model shares."""

    def wrapper(self, x):
        return forward(self, x)

    return wrapper


def test_a_model_past_the_recompile_limit_of_shared_code_is_named_with_the_cause():
    """A forward wrapper shared by many model classes (transformers has one) is one code object
    to Dynamo: each class's forward recompiles it, and past recompile_limit it runs eagerly
    (``backend.compile`` isolates each model's cache, tests/test_coverage.py)."""

    def model_class(index):
        def forward(self, x):
            return self.net(x) * (index + 1)

        return type(f"Model{index}", (nn.Module,), {"forward": shared_wrapper(forward)})

    limit = _compat.dynamo_config().recompile_limit
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(0.05), compiler="aot_eager")
    for index in range(limit + 1):
        model = model_class(index)()
        model.net = sequential()
        if index < limit:
            train(model, torch.compile(model, backend=backend), steps=1)
            continue
        cause = f"(?s)no graph of Model{index} reached.*recompile_limit.*isolate_recompiles=True"
        with pytest.raises(fxgrad.CoverageError, match=cause):
            train(model, torch.compile(model, backend=backend), steps=1)


def test_a_model_at_the_address_of_a_freed_one_is_a_new_model():
    """``id()`` of a freed model comes back for a new one: the backend's entry for the old
    model must not stand in for the new one (a KeyError at capture, once, on CI)."""
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(0.05), compiler="aot_eager")
    model, freed = sequential(), sequential()
    gone = weakref.ref(freed)
    del freed
    backend.registry.roots[id(model)] = Root(gone, "")  # what the freed model left at the reused id
    expected, x = copy.deepcopy(model), torch.randn(4, 8)
    torch.compile(model, backend=backend)(x).sum().backward()
    expected(x).sum().backward()
    ref.clip_global(expected, 0.05)
    assert_grads_close(model, expected)


class TwoLayers(nn.Module):
    def __init__(self, width=8):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, width), nn.Linear(width, 2)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class Wider(TwoLayers):  # another architecture of a sweep, with the same layer names
    def __init__(self):
        super().__init__(width=16)

    def forward(self, x):  # code of its own: a frame Dynamo has not compiled
        return self.fc2(torch.tanh(self.fc1(x)))


def clipped_like_eager(model, call, max_norm, steps=2):
    """Train ``model`` through ``call`` and an eager copy with ``clip_grad_norm_``: the largest
    relative difference of their weights."""
    expected = copy.deepcopy(model)
    optimizers = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(expected.parameters(), lr=0.1)
    for _ in range(steps):
        x = torch.randn(4, 8)
        for optimizer in optimizers:
            optimizer.zero_grad()
        call(x).square().sum().backward()
        expected(x).square().sum().backward()
        torch.nn.utils.clip_grad_norm_(expected.parameters(), max_norm)
        for optimizer in optimizers:
            optimizer.step()
    return max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(model.parameters(), expected.parameters()))


def test_a_sweep_of_new_models_through_one_backend_stays_exact_and_silent():
    """A hyperparameter sweep in one process: each trial's model is freed, and the next one's
    parameters and modules take their addresses. Dynamo runs the first trial's graph for each
    later model; what fxgrad remembers of freed ones must not stand for the new ones (a false
    CoverageError in most trials before)."""
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(0.05), compiler="aot_eager")
    for _ in range(12):
        model = sequential()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "fxgrad: Dynamo reuses the graph", fxgrad.CoverageWarning)
            assert clipped_like_eager(model, torch.compile(model, backend=backend), 0.05) < 1e-5
        del model
        gc.collect()


def at_a_freed_address(trial, cls):
    """Run ``trial()`` (which makes a model, trains it and returns its id) until an instance of
    ``cls`` can take the freed model's address; that instance, not yet initialized."""
    for _ in range(10):
        address = trial()
        gc.collect()
        tries = [cls.__new__(cls) for _ in range(1000)]  # kept alive, so each takes another address
        found = next((model for model in tries if id(model) == address), None)
        if found is not None:
            return found
    pytest.skip("no object landed at a freed model's address")


def test_a_model_of_another_class_at_a_freed_models_address_is_not_its_forward():
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(0.05), compiler="aot_eager")

    def trial():
        first = TwoLayers()
        clipped_like_eager(first, torch.compile(first, backend=backend), 0.05)
        return id(first)

    second = at_a_freed_address(trial, Wider)
    second.__init__()
    with coverage_silent():  # was: "would see only part of its layers: fc1 ... also used by another graph"
        assert clipped_like_eager(second, torch.compile(second, backend=backend), 0.05) < 1e-5


class OnBackbone(nn.Module):
    """A trial's model around a backbone that outlives it."""

    def __init__(self, backbone):
        super().__init__()
        self.backbone, self.head = backbone, nn.Linear(8, 2)

    def forward(self, x):
        return self.head(torch.relu(self.backbone(x)))


class OtherOnBackbone(OnBackbone):
    def forward(self, x):
        return self.head(torch.tanh(self.backbone(x)))


def test_each_model_on_a_shared_backbone_is_bound_to_its_own_head():
    """Dynamo runs the first model's graph for the next: its first parameter, the backbone's,
    is the same, and the graph must still follow the new head."""
    backbone = nn.Linear(8, 8)
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(0.05), compiler="aot_eager")
    for _ in range(2):
        model = OnBackbone(backbone)
        with coverage_silent():  # was: "got gradients from no graph of this backend ...: head"
            assert clipped_like_eager(model, torch.compile(model, backend=backend), 0.05) < 1e-5
        del model
        gc.collect()


def test_trials_on_a_shared_backbone_kept_alive_are_not_taken_for_blocks_of_one_model():
    """The earlier trial's model still lives (kept as the best so far): Dynamo runs its graph for
    the next, which takes the same backbone. That is not a weight every block of one model takes;
    it was refused as one (sweep 36)."""
    backbone = nn.Linear(8, 8)
    backend = fxgrad.backend(fxgrad.clip_by_norm(0.05), compiler="aot_eager")
    kept = []
    for _ in range(2):
        model = OnBackbone(backbone)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", fxgrad.CoverageWarning)  # the reuse, said
            compiled = torch.compile(model, backend=backend)
            x = torch.randn(4, 8)
            compiled(x).sum().backward()
        expected = copy.deepcopy(model)
        for p in expected.parameters():
            p.grad = None
        expected(x).sum().backward()
        untouched = grads_of(expected)
        ref.clip_per_layer(expected, 0.05)
        assert_grads_close(model, expected, untouched=untouched)
        model.zero_grad()
        kept.append(model)


def test_a_freed_models_graph_is_not_the_next_models_forward_through_a_shared_backbone():
    """The freed model's graph stays (its backbone's parameters live), but the model it was
    compiled for is not the new one at its address."""
    backbone = nn.Linear(8, 8)
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(0.05), compiler="aot_eager")

    def trial():
        first = OnBackbone(backbone)
        clipped_like_eager(first, torch.compile(first, backend=backend), 0.05)
        return id(first)

    second = at_a_freed_address(trial, OtherOnBackbone)
    second.__init__(backbone)
    with coverage_silent():  # was: "would see only part of its layers: backbone ... head"
        assert clipped_like_eager(second, torch.compile(second, backend=backend), 0.05) < 1e-5


def test_a_freed_models_layer_names_do_not_cover_a_new_models_eager_layer():
    """A layer left eager by a graph break in a loop is reported even when a freed model of
    the same backend had a compiled layer of that name."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            x = self.fc(x)
            torch._dynamo.graph_break()
            return torch.relu(x)

    class Looped(nn.Module):  # the loop's graph break leaves fc2 to run eagerly
        def __init__(self):
            super().__init__()
            self.blocks, self.fc2 = nn.ModuleList(Block() for _ in range(2)), nn.Linear(8, 2)

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return self.fc2(x)

    backend = fxgrad.backend(fxgrad.clip_by_norm(0.01), compiler="aot_eager")
    first = TwoLayers()
    clipped_like_eager(first, torch.compile(first, backend=backend), 1e9)
    del first
    gc.collect()
    model = Looped()
    with pytest.warns(fxgrad.CoverageWarning, match=r"(?s)not applied to.*fc2 \(Linear\): in no compiled graph"):
        train(model, torch.compile(model, backend=backend), steps=1)


@pytest.mark.parametrize("scope", ["graph", "step"])
def test_a_train_step_compiled_whole_applies_the_policy(scope):
    """Forward, backward and ``optimizer.step()`` in one compiled function: Dynamo breaks the
    graph at ``backward()``, compiles the optimizer's update as a graph of its own (holding
    the parameters, under ``no_grad``), and runs fxgrad's optimizer hooks eagerly."""
    model = sequential()
    expected = copy.deepcopy(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    expected_optimizer = torch.optim.Adam(expected.parameters(), lr=1e-2)
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1e-2), compiler="aot_eager", scope=scope)

    def train_step(x):
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    compiled = torch.compile(train_step, backend=backend)
    with coverage_silent():
        for _ in range(3):
            x = torch.randn(4, 8)
            compiled(x)
            expected(x).pow(2).mean().backward()
            torch.nn.utils.clip_grad_norm_(expected.parameters(), 1e-2)
            expected_optimizer.step()
            expected_optimizer.zero_grad()
    for param, want in zip(model.parameters(), expected.parameters()):
        torch.testing.assert_close(param, want)


def test_fxgrads_autograd_hooks_stay_eager_in_a_train_step_compiled_whole():
    """``backward()`` in a compiled function runs under Dynamo, which traced fxgrad's autograd
    hooks as frames of their own with the backend: it took one that reads a parameter for a
    graph of the model, warned that Dynamo reused layer '0''s graph for another module, and
    named the wrong layer when code outside changed a gradient (sweep 26)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1.0), compiler="aot_eager")

    @torch.compile(backend=backend)
    def train_step(x, change):
        (10 * model(x).pow(2).mean()).backward()
        if change:
            model[4].weight.grad.mul_(10.0)
        optimizer.step()

    x = torch.randn(6, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            optimizer.zero_grad()
            train_step(x, True)
    reports = {str(w.message)[:45] for w in caught if issubclass(w.category, fxgrad.CoverageWarning)}
    assert reports == {"fxgrad: the gradients of 4 are not the ones t"}


class OutputAndView(nn.Module):
    """Returns an output and a view of it: two autograd nodes for one call's backward."""

    def __init__(self):
        super().__init__()
        self.net = sequential()

    def forward(self, x):
        out = self.net(x)
        return out, out[:, :2]


@pytest.mark.parametrize("scope", ["graph", "step"])
def test_accumulated_micro_batches_under_plain_torch_compile_are_reported_in_graph_scope(scope):
    """``backend.compile`` sees accumulation at each backward through a watch on the model's
    forward; ``torch.compile`` gets the same from the compiled graph's backward."""
    model = sequential()
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(0.05), compiler="aot_eager", scope=scope)
    compiled = torch.compile(model, backend=backend)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)

    def step(micro_batches, set_to_none=True):
        for _ in range(micro_batches):
            compiled(torch.randn(4, 8)).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=set_to_none)

    with coverage_silent():
        step(1)
        step(1, set_to_none=False)  # zeroed in place: the next backward does not accumulate
        step(1)
    if scope == "step":  # exact: the policy runs once, on the sum
        with coverage_silent():
            step(2)
        return
    with pytest.warns(fxgrad.CoverageWarning, match="a backward started while .grad still held"):
        step(2)


def test_one_backward_through_several_outputs_of_a_call_counts_once():
    model = OutputAndView()
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(0.05), compiler="aot_eager")
    compiled = torch.compile(model, backend=backend)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    with coverage_silent():
        for _ in range(2):
            out, view = compiled(torch.randn(4, 8))
            (out.sum() + view.pow(2).sum()).backward()
            optimizer.step()
            optimizer.zero_grad()


def test_a_gan_generator_step_onto_the_discriminators_unzeroed_gradients_is_no_accumulation(compile_with):
    """The generator's backward runs through the discriminator and adds to its gradients, which
    the discriminator's next ``zero_grad()`` drops before its optimizer steps them."""
    generator = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
    discriminator = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    backend = fxgrad.backend(fxgrad.clip_by_norm(0.1), compiler="aot_eager")
    g, d = compile_with(backend, generator), compile_with(backend, discriminator)
    g_optimizer, d_optimizer = torch.optim.Adam(generator.parameters()), torch.optim.Adam(discriminator.parameters())
    with coverage_silent():
        for _ in range(3):
            real, noise = torch.randn(4, 8), torch.randn(4, 4)
            d_optimizer.zero_grad()
            d(torch.cat([real, g(noise).detach()])).mean().backward()
            d_optimizer.step()
            g_optimizer.zero_grad()
            (-d(g(noise)).mean()).backward()
            g_optimizer.step()


@pytest.mark.parametrize("scope", ["graph", "step"])
def test_a_model_compiled_in_place_keeps_its_class_keys_signature_and_checks(scope):
    """``backend.compile(model, in_place=True)``: the model itself, as ``model.compile()`` leaves it
    (what the Hugging Face Trainer saves and inspects), exact, with the per-forward checks."""
    import inspect

    torch.manual_seed(0)
    model = TwoOutputs()
    eager, keys, signature = copy.deepcopy(model), list(model.state_dict()), inspect.signature(model.forward)
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1e-3), compiler="aot_eager", scope=scope)
    assert backend.compile(model, in_place=True) is model
    assert (type(model), list(model.state_dict()), inspect.signature(model.forward)) == (TwoOutputs, keys, signature)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    for step in range(3):
        x = torch.randn(4, 8)
        with coverage_silent():
            sum(out.sum() for out in model(x)).backward()
            optimizer.step()
        sum(out.sum() for out in eager(x)).backward()
        ref.clip_global(eager, 1e-3)
        assert_grads_close(model, eager)
        optimizer.zero_grad()
        eager.zero_grad()
    if scope == "graph":  # a per-forward check: accumulation, reported at the step
        with pytest.warns(fxgrad.CoverageWarning, match="still held the previous backward's gradient"):
            for _ in range(2):
                model(torch.randn(4, 8))[0].sum().backward()
            optimizer.step()
    report = fxgrad.explain(model, torch.randn(4, 8), backend=backend)  # on the eager model, set aside
    assert "not captured" not in str(report) and report.graphs
    optimizer.zero_grad()
    with coverage_silent():  # and the model is compiled as before
        sum(out.sum() for out in model(torch.randn(4, 8))).backward()
        optimizer.step()
    total = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    torch.testing.assert_close(total, torch.tensor(1e-3), rtol=1e-4, atol=0)
    with pytest.raises(TypeError, match="in_place must be True or False"):
        backend.compile(TwoOutputs(), in_place="yes")


def test_graph_scope_on_tensor_parallel_parameters_names_step_scope():
    """The backward returns DTensor parameters' inner tensors, which graph scope cannot place:
    the error says why and what to use."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    with one_process_group():
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        parallelize_module(model, init_device_mesh("cpu", (1,)), {"0": ColwiseParallel(), "2": RowwiseParallel()})
        backend = fxgrad.backend(fxgrad.clip_by_global_norm(1.0), compiler="aot_eager", scope="graph")
        with pytest.raises(fxgrad.passes.GraphMismatchError, match=r"DTensors \(tensor parallelism\).*scope='step'"):
            torch.compile(model, backend=backend)(torch.randn(4, 8)).sum().backward()


def test_balance_norms_over_mixed_dtensor_and_plain_weights_is_refused():
    """Its weights, one flat tensor, cannot mix the two; DTensor's own error named neither."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    with one_process_group():
        model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8), nn.Linear(8, 2))  # the head outside the plan
        parallelize_module(model, init_device_mesh("cpu", (1,)), {"0": ColwiseParallel(), "1": RowwiseParallel()})
        backend = fxgrad.backend(fxgrad.balance_norms(k=1), compiler="aot_eager", scope="step")
        model(torch.randn(4, 8)).sum().backward()
        with pytest.raises(ValueError, match="mix DTensors and plain tensors"), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # it runs eagerly on the DTensors, and says so
            backend.step(model)


@pytest.mark.parametrize("outside", ["l2 penalty", "head reused", "clip after the policy", "clip after unscale_"])
def test_gradients_changed_outside_the_compiled_backward_are_reported(outside, compile_with):
    """Graph scope transforms what the compiled backward returns; autograd adds the gradient of
    an eager use of the same parameter after it, and a clip before the step changes it: the
    policy never saw either. Reported once, naming the layers; step scope reads the sum."""
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    scaler = torch.amp.GradScaler("cpu", enabled=outside == "clip after unscale_")  # AMP's clipping recipe
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1e-3), compiler="aot_eager", scaler=scaler)
    compiled = compile_with(backend, model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.randn(4, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            optimizer.zero_grad()
            loss = compiled(x).pow(2).mean()
            if outside == "l2 penalty":
                loss = loss + 1e-2 * sum(p.pow(2).sum() for p in model.parameters())
            elif outside == "head reused":
                loss = loss + (x[:, :2] @ model[2].weight[:, :2].T).sum()
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            if outside.startswith("clip after"):
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
    told = [str(w.message) for w in caught if "not the ones the compiled backward returned" in str(w.message)]
    assert len(told) == 1, told
    assert ("of 2 are" if outside == "head reused" else "of 0, 2 are") in told[0]


def _passes_then_step(combine, compiled, model, optimizer, x):
    """The backward passes of one training step, ``combine`` saying how their gradients reach ``.grad``."""
    params = list(model.parameters())
    halves = [compiled(part).pow(2).mean() for part in (x[:2], x[2:])] if not combine.startswith("attack") else []
    optimizer.zero_grad()
    if combine == "pcgrad":  # per task: zero_grad, backward, keep a copy; then their combination
        grads = []
        for loss in halves:
            optimizer.zero_grad()
            loss.backward()
            grads.append([p.grad.clone() for p in params])
        for p, a, b in zip(params, *grads):
            p.grad = a + b
    elif combine == "autograd.grad summed":
        grads = [torch.autograd.grad(loss, params) for loss in halves]
        for p, a, b in zip(params, *grads):
            p.grad = a + b
    elif combine.startswith("attack"):  # adversarial training: passes for the input's gradient
        for _ in range(10 if combine == "attack passes, PGD-10" else 1):
            attacked = x.clone().requires_grad_(True)
            torch.autograd.grad(compiled(attacked).pow(2).mean(), attacked)
        compiled(x).pow(2).mean().backward()
    elif combine == "a pass dropped":
        halves[0].backward()
        optimizer.zero_grad()
        halves[1].backward()
    optimizer.step()


@pytest.mark.parametrize(
    "combine", ["pcgrad", "autograd.grad summed", "attack pass first", "attack passes, PGD-10", "a pass dropped"]
)
def test_gradients_of_several_passes_combined_by_hand_are_reported(combine, compile_with):
    """Graph scope transforms each pass's gradients: assigning their combination to .grad
    (PCGrad, micro-batches summed from torch.autograd.grad) steps gradients the policy never
    saw. A pass whose gradients are dropped before the one stepped changes nothing."""
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1e-3), compiler="aot_eager")
    compiled = compile_with(backend, model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            _passes_then_step(combine, compiled, model, optimizer, torch.randn(4, 8))
    told = [str(w.message) for w in caught if "not the ones the compiled backward returned" in str(w.message)]
    assert len(told) == (1 if combine in ("pcgrad", "autograd.grad summed") else 0), told


def test_a_gan_step_that_leaves_the_discriminators_gradient_is_reported_as_accumulation_only(compile_with):
    """The generator's step backpropagates through the discriminator and leaves its gradient,
    which the discriminator's next backward sums into: accumulation, said once as such. Not a
    change outside the compiled backward: the watch for those had ended by then, and what it
    noted of the generator's step must not be checked against the later, unwatched pass."""
    G = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 8))
    D = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1.0), compiler="aot_eager", scope="graph")
    g, d = compile_with(backend, G), compile_with(backend, D)
    opt_g, opt_d = torch.optim.SGD(G.parameters(), lr=1e-2), torch.optim.SGD(D.parameters(), lr=1e-2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            fake = g(torch.randn(6, 4))
            d(torch.cat([torch.randn(6, 8), fake.detach()])).mean().backward()
            opt_d.step()
            opt_d.zero_grad()
            (-d(fake)).mean().backward()  # D's gradient stays until D's next backward sums into it
            opt_g.step()
            opt_g.zero_grad()
    told = [str(w.message) for w in caught if isinstance(w.message, fxgrad.CoverageWarning)]
    assert any("still held the previous backward's gradient" in m for m in told), told
    assert not any("not the ones the compiled backward returned" in m for m in told), told


def test_create_graph_and_an_optimizer_stepped_in_the_backward_are_not_taken_for_changes_outside():
    """backward(create_graph=True) makes autograd copy every gradient into .grad; an optimizer
    stepped per parameter by a post-accumulate hook drops each .grad inside the backward."""
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    compiled = torch.compile(model, backend=fxgrad.backend(fxgrad.clip_by_norm(1e-3), compiler="aot_eager"))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    with coverage_silent(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Using backward.. with create_graph=True")
        for _ in range(3):
            optimizer.zero_grad()
            compiled(torch.randn(4, 8)).pow(2).mean().backward(create_graph=True)
            optimizer.step()
    for p in model.parameters():
        p.grad = None
    per_parameter = {p: torch.optim.SGD([p], lr=1e-3) for p in model.parameters()}

    def step(param):
        per_parameter[param].step()
        per_parameter[param].zero_grad()

    hooks = [p.register_post_accumulate_grad_hook(step) for p in model.parameters()]
    with coverage_silent():
        for _ in range(3):
            compiled(torch.randn(4, 8)).pow(2).mean().backward()
    for hook in hooks:
        hook.remove()


def test_a_grad_scalers_unscaling_is_not_taken_for_a_change_outside():
    """unscale_ divides the gradients in place, before the step or inside scaler.step()."""
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1e-3), compiler="aot_eager", scaler=scaler)
    compiled = torch.compile(model, backend=backend)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    with coverage_silent():
        for step in range(4):
            optimizer.zero_grad()
            scaler.scale(compiled(torch.randn(4, 8)).pow(2).mean()).backward()
            if step % 2:
                scaler.unscale_(optimizer)  # in place, before the step
            scaler.step(optimizer)
            scaler.update()
