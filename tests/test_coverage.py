"""No silent no-ops: graph breaks, uncaptured modules, frozen layers."""

import contextlib
import copy
import dataclasses
import logging
import re
import threading
import types
import warnings

import models
import pytest
import reference as ref
import torch
import torch.nn as nn
from parity import assert_grads_close, coverage_silent, eager_grads, grads_of

import fxgrad
from fxgrad import _compat


@torch.compiler.disable
def eager_only(x):
    """Runs outside the compiled region: the forward splits into two graphs here."""
    return x * 1.0


class BrokenMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        h = eager_only(h)
        return self.fc3(torch.relu(self.fc2(h)))


class EagerMiddle(nn.Module):
    """fc2 runs inside a disabled function: it never reaches a compiled graph."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc3(torch.relu(self.middle(torch.relu(self.fc1(x)))))

    @torch.compiler.disable
    def middle(self, h):
        return self.fc2(h)


def run(compile_with, model, transform, **backend_kwargs):
    backend = fxgrad.backend(transform, compiler="aot_eager", **backend_kwargs)
    models.loss_of(compile_with(backend, model)(torch.randn(5, 8))).backward()
    return backend


def test_global_clip_refuses_graph_break(compile_with):
    with pytest.raises(fxgrad.CoverageError, match="(?s)would see only part.*fc1.*graph break"):
        run(compile_with, BrokenMLP(), fxgrad.clip_by_global_norm(1.0))


def test_rescale_mean_refuses_graph_break(compile_with):
    with pytest.raises(fxgrad.CoverageError, match="rescale"):
        run(compile_with, BrokenMLP(), fxgrad.rescale(alpha=0.5))


def test_non_strict_warns_and_clips_each_graph(compile_with):
    torch.manual_seed(0)
    model = BrokenMLP()
    expected = copy.deepcopy(model)
    x = torch.randn(5, 8)
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1e-3), compiler="aot_eager", strict=False)
    with pytest.warns(fxgrad.CoverageWarning, match="would see only part"):
        models.loss_of(compile_with(backend, model)(x)).backward()
    models.loss_of(expected(x)).backward()
    torch.nn.utils.clip_grad_norm_(expected.fc1.parameters(), 1e-3)
    torch.nn.utils.clip_grad_norm_([*expected.fc2.parameters(), *expected.fc3.parameters()], 1e-3)
    assert_grads_close(model, expected)


class FrozenAfterBreak(nn.Module):
    """Every trainable layer before a graph break, a frozen head after it (as in a LoRA model)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4).requires_grad_(False)

    def forward(self, x):
        return self.head(eager_only(self.fc2(torch.relu(self.fc1(x)))))


def test_global_clip_across_a_break_to_a_frozen_layer_is_exact(compile_with):
    """The second graph's backward holds no gradient of a parameter, so the first graph's global
    norm is the model's: no coverage error (there was one), and the clip equals the eager one."""
    torch.manual_seed(0)
    model = FrozenAfterBreak()
    expected = copy.deepcopy(model)
    x = torch.randn(5, 8)
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1e-3), compiler="aot_eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        models.loss_of(compile_with(backend, model)(x)).backward()
    assert len(backend.graphs) == 2
    said = [str(w.message) for w in caught if issubclass(w.category, fxgrad.CoverageWarning)]
    assert not any("would see only part" in message for message in said), said
    models.loss_of(expected(x)).backward()
    untouched = grads_of(expected)
    torch.nn.utils.clip_grad_norm_(expected.parameters(), 1e-3)
    assert_grads_close(model, expected, untouched=untouched)


def test_per_layer_clip_is_exact_across_graph_breaks(compile_with):
    torch.manual_seed(0)
    model = BrokenMLP()
    expected = copy.deepcopy(model)
    x = torch.randn(5, 8)
    with coverage_silent():
        backend = run(compile_with, model, fxgrad.clip_by_norm(1e-3))
    assert len(backend.graphs) == 2
    models.loss_of(expected(x)).backward()
    ref.clip_per_layer(expected, 1e-3)
    torch.manual_seed(0)
    model2 = BrokenMLP()
    backend = fxgrad.backend(fxgrad.clip_by_norm(1e-3), compiler="aot_eager")
    models.loss_of(compile_with(backend, model2)(x)).backward()
    assert_grads_close(model2, expected)


def test_uncaptured_layer_is_named_in_a_warning(compile_with):
    with pytest.warns(fxgrad.CoverageWarning, match="(?s)is not applied to.*fc2 \\(Linear\\): in no compiled graph"):
        run(compile_with, EagerMiddle(), fxgrad.clip_by_norm(1.0))


def test_uncaptured_layer_blocks_global_clip(compile_with):
    with pytest.raises(fxgrad.CoverageError, match="fc2"):
        run(compile_with, EagerMiddle(), fxgrad.clip_by_global_norm(1.0))


def test_unused_parameter_blocks_global_clip_until_frozen(compile_with):
    model = BrokenMLP()
    model.unused = nn.Linear(2, 2)
    model.forward = lambda x: model.fc3(torch.relu(model.fc2(torch.relu(model.fc1(x)))))
    with pytest.raises(fxgrad.CoverageError, match="unused"):
        run(compile_with, model, fxgrad.clip_by_global_norm(1.0))
    model.unused.requires_grad_(False)  # the fix the error names: then nothing to say
    _compat.reset_dynamo()
    with coverage_silent():
        run(compile_with, model, fxgrad.clip_by_global_norm(1.0))


@pytest.mark.parametrize("scope", ["graph", "step"])
def test_a_gradient_hook_on_a_parameter_is_reported_in_graph_scope_and_exact_in_step_scope(scope, compile_with):
    """A pruning mask as a ``Tensor.register_hook``: autograd runs it after the backward graph,
    so in graph scope the policy sees the gradient before the mask, unlike ``clip_grad_norm_``."""
    model, args, _ = models.build("mlp")
    expected = copy.deepcopy(model)
    for m in (model, expected):
        m.net[0].weight.register_hook(lambda grad: grad * 2.0)
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1e-3), compiler="aot_eager", scope=scope)
    checked = pytest.warns(fxgrad.CoverageWarning, match=r"parameters net\.0\.weight have gradient hooks")
    with checked if scope == "graph" else coverage_silent():
        models.loss_of(compile_with(backend, model)(*args)).backward()
    if scope == "step":
        backend.step()
        eager_grads(expected, args, {})
        ref.clip_global(expected, 1e-3)
        assert_grads_close(model, expected)


def test_lstm_without_allow_rnn_is_reported():
    _compat.dynamo_config().allow_rnn = False
    model, args, _ = models.build("lstm")
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1.0), compiler="aot_eager")
    with pytest.raises(fxgrad.CoverageError, match="(?s)no graph of LSTMNet.*allow_rnn = True"):
        backend.compile(model)(*args)

    per_layer = fxgrad.backend(fxgrad.by_type({nn.LSTM: fxgrad.clip_by_norm(0.5)}), compiler="aot_eager")
    with pytest.warns(fxgrad.CoverageWarning, match="allow_rnn"):
        per_layer.compile(model)(*args)


def test_lstm_with_allow_rnn_is_captured(compile_with):
    _compat.dynamo_config().allow_rnn = True
    model, args, kwargs = models.build("lstm")
    expected = copy.deepcopy(model)
    backend = fxgrad.backend(fxgrad.by_type({nn.LSTM: fxgrad.clip_by_norm(1e-3)}), compiler="aot_eager")
    with coverage_silent():
        models.loss_of(compile_with(backend, model)(*args)).backward()
    eager_grads(expected, args, kwargs)
    ref.clip_per_layer(expected, 1e-3, select=lambda name, module: isinstance(module, nn.LSTM))
    assert_grads_close(model, expected)


def test_explain_names_uncaptured_layers():
    report = fxgrad.explain(
        EagerMiddle(),
        torch.randn(5, 8),
        backend=fxgrad.backend(fxgrad.clip_by_global_norm(1.0), compiler="aot_eager"),
    )
    actions = {row.name: row.action for row in report.layers}
    assert actions["fc2"].startswith("not captured: in no compiled graph")
    assert any("would see only part" in w for w in report.warnings)


class Body(nn.Module):
    """A graph break inside a submodule's forward: Dynamo compiles this frame on its own."""

    def __init__(self, scale=1.0):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        with torch.no_grad():
            self.fc.weight.mul_(scale)

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        torch._dynamo.graph_break()
        return x + h


class Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Body(1.0), Body(0.01)])  # very different weight norms

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize(
    "transform, reference",
    [
        (fxgrad.adaptive_grad_clip(0.01), lambda m: ref.agc(m, 0.01)),
        (
            fxgrad.by_name({"blocks.0.*": fxgrad.clip_by_norm(1e-3)}, default=fxgrad.clip_by_norm(1e-2)),
            lambda m: (
                ref.clip_per_layer(m, 1e-3, select=lambda name, _: name.startswith("blocks.0")),
                ref.clip_per_layer(m, 1e-2, select=lambda name, _: name.startswith("blocks.1")),
            ),
        ),
    ],
)
def test_layers_of_a_submodule_frame_keep_the_models_names(transform, reference, compile_with):
    """Dynamo compiles each Body.forward as its own frame (the loop's frame is skipped); the
    layers are still named after the compiled model, so AGC reads each block's own weights."""
    torch.manual_seed(0)
    model = Blocks()
    eager = copy.deepcopy(model)
    backend = fxgrad.backend(transform, compiler="aot_eager")
    x = torch.randn(8, 16)
    with coverage_silent():
        models.loss_of(compile_with(backend, model)(x)).backward()
    assert sorted(layer.name for graph in backend.graphs for layer in graph.layers) == ["blocks.0.fc", "blocks.1.fc"]
    models.loss_of(eager(x)).backward()
    reference(eager)
    assert_grads_close(model, eager)


def test_forward_run_eagerly_after_the_recompile_limit_is_reported():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1e-2), compiler="aot_eager")
    compiled = backend.compile(model, dynamic=False)
    with torch._dynamo.config.patch(recompile_limit=2):
        for batch in (2, 3):
            model.zero_grad()
            compiled(torch.randn(batch, 8)).sum().backward()
        model.zero_grad()
        with pytest.raises(fxgrad.CoverageError, match="recompile_limit"):
            compiled(torch.randn(4, 8)).sum().backward()
        with torch.no_grad():
            compiled(torch.randn(5, 8))  # inference: no policy to miss


def test_a_forward_run_eagerly_is_reported_when_a_backward_reaches_it():
    """A later forward that ran no graph is reported when a backward reaches its outputs,
    naming the stance that made it eager; a validation forward with gradients enabled that
    nobody backpropagates leaves the policy nothing to miss (it raised at the forward, sweep
    26)."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1e-2), compiler="aot_eager")
    compiled = backend.compile(model)
    x = torch.randn(4, 8)
    compiled(x).sum().backward()
    model.zero_grad()
    with coverage_silent(), torch.compiler.set_stance("force_eager"):
        compiled(x).sum()
    with torch.compiler.set_stance("force_eager"):
        loss = compiled(x).sum()
    with pytest.raises(fxgrad.CoverageError, match=r"set_stance\('force_eager'\) is in effect"):
        loss.backward()  # the stance of the forward, which ended before


@dataclasses.dataclass
class _Output:
    logits: torch.Tensor


class _Box:
    def __init__(self, logits):
        self.logits = logits


class _Returns(nn.Module):
    """Returns its output in an object no pytree registration opens."""

    def __init__(self, wrap):
        super().__init__()
        self.fc, self.wrap = nn.Linear(8, 2), wrap

    def forward(self, x):
        return self.wrap(self.fc(x))


def _namespace(logits):
    return types.SimpleNamespace(logits=logits)


@pytest.mark.parametrize("wrap", [_Output, _namespace, _Box], ids=["dataclass", "namespace", "object"])
def test_outputs_in_objects_no_pytree_opens(wrap):
    """The watch finds a dataclass's and a namespace's tensors (a backward through them was
    taken for a bypass); a later forward that ran no graph is then reported when a backward
    reaches it, and at once when its outputs cannot be found (it went unreported, sweep 28),
    whose backwards are then not checked for a bypass."""
    model = _Returns(wrap)
    compiled = fxgrad.backend(fxgrad.clip_by_global_norm(1e-2), compiler="aot_eager").compile(model)
    x = torch.randn(4, 8)
    with coverage_silent():
        compiled(x).logits.sum().backward()
    eager = pytest.raises(fxgrad.CoverageError, match="a forward of _Returns ran no compiled graph")
    with torch.compiler.set_stance("force_eager"):
        if wrap is _Box:
            with eager:
                compiled(x)
            return
        out = compiled(x)
    with eager:
        out.logits.sum().backward()


def sweep(compile_, trials):
    """``trials`` models of one class, each compiled by its own backend in one process (a
    hyperparameter sweep), each stepped once; yields each trial's model and eager copy."""
    for _ in range(trials):
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
        eager = copy.deepcopy(model)
        backend = fxgrad.backend(fxgrad.clip_by_global_norm(1e-2), compiler="aot_eager")
        compiled = compile_(backend, model)
        x = torch.randn(4, 8)
        compiled(x).sum().backward()
        torch.optim.SGD(model.parameters(), lr=0.1).step()
        eager(x).sum().backward()
        ref.clip_global(eager, 1e-2)
        yield model, eager


def test_backends_compiling_one_model_class_each_keep_their_own_recompile_limit():
    """``backend.compile`` isolates the compiled model's Dynamo cache: the third backend
    of a sweep under ``recompile_limit=2`` still compiles, and clips."""
    with _compat.dynamo_config().patch(recompile_limit=2):
        for model, eager in sweep(lambda backend, model: backend.compile(model), trials=3):
            assert_grads_close(model, eager)


def test_backends_sharing_one_dynamo_cache_past_the_limit_are_told_how_to_isolate_it():
    """``torch.compile(model, backend=backend)`` shares the cache of the model's code with
    every other backend: past the limit the forward runs eagerly, and the error says so."""
    with _compat.dynamo_config().patch(recompile_limit=2):
        with pytest.raises(fxgrad.CoverageError, match="isolate_recompiles=True"):
            for _ in sweep(lambda backend, model: torch.compile(model, backend=backend), trials=3):
                pass


def test_a_graph_reused_for_another_instance_is_reported():
    """Through ``torch.compile``, Dynamo runs the first model's graph for a second instance:
    no false "nothing compiled", gradients right, and a warning that per-layer state and
    weight reads follow the first."""
    first, second = models.MLP(), models.MLP()
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1e-3), compiler="aot_eager")
    expected = copy.deepcopy(second)
    x = torch.randn(4, 16)
    with coverage_silent():
        models.loss_of(torch.compile(first, backend=backend)(x)).backward()
    with pytest.warns(fxgrad.CoverageWarning, match="reuses the graph compiled for layer 'net.0'"):
        models.loss_of(torch.compile(second, backend=backend)(x)).backward()
    models.loss_of(expected(x)).backward()
    ref.clip_global(expected, 1e-3)
    assert_grads_close(second, expected)


def test_backend_compile_gives_another_instance_a_graph_of_its_own():
    """``backend.compile`` isolates each compiled model's Dynamo cache: the second instance
    compiles its own graph, and nothing needs saying."""
    first, second = models.MLP(), models.MLP()
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1e-3), compiler="aot_eager")
    expected = copy.deepcopy(second)
    x = torch.randn(4, 16)
    with coverage_silent():
        models.loss_of(backend.compile(first)(x)).backward()
        models.loss_of(backend.compile(second)(x)).backward()
    assert len(backend.registry.graphs) == 2
    models.loss_of(expected(x)).backward()
    ref.clip_global(expected, 1e-3)
    assert_grads_close(second, expected)


@pytest.mark.parametrize(
    "idle,compiler",
    [
        ("no_grad", "aot_eager"),
        ("frozen", "aot_eager"),
        pytest.param("no_grad", "inductor", marks=pytest.mark.inductor),
    ],
)
def test_a_copy_that_computes_no_gradient_is_not_reported(idle, compiler, compile_with):
    """An EMA or teacher copy (``copy.deepcopy`` of the compiled model) has the trained
    model's layer names, so fxgrad prefixes its layers; run under ``no_grad`` or frozen, no
    policy acts on it, and nothing needs saying (Inductor's compile records the policy for its
    cache key before it knows of a backward: not for a graph that computes no gradient)."""
    model = models.MLP()
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1e-3), compiler=compiler)
    expected = copy.deepcopy(model)
    compiled = compile_with(backend, model)
    ema = copy.deepcopy(compiled)
    if idle == "frozen":
        ema.requires_grad_(False)
    x = torch.randn(4, 16)
    with coverage_silent():
        for _ in range(2):
            model.zero_grad()
            models.loss_of(compiled(x)).backward()
            with torch.no_grad() if idle == "no_grad" else contextlib.nullcontext():
                ema(x)
    models.loss_of(expected(x)).backward()
    ref.clip_global(expected, 1e-3)
    assert_grads_close(model, expected)
    ema.requires_grad_(True)
    # a copy that trains is told: its layers renamed (backend.compile), or the model's graph reused
    with pytest.warns(fxgrad.CoverageWarning, match=r"copy\.deepcopy|a second model of the same class"):
        models.loss_of(ema(x)).backward()


def test_a_copy_that_computes_no_gradient_adds_no_per_step_check():
    """An EMA copy's graphs have no backward: they must not switch on the optimizer-step
    check's count of backward passes, which then runs on every step of the trained model."""
    model = models.MLP()
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1e-3), compiler="aot_eager")
    compiled = backend.compile(model)
    ema = copy.deepcopy(compiled)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 16)
    with coverage_silent():
        for _ in range(2):
            models.loss_of(compiled(x)).backward()
            optimizer.step()
            optimizer.zero_grad()
            with torch.no_grad():
                ema(x)
    assert not backend._step_check._counting


class Agent(nn.Module):
    """A DQN step's forward: the online network, a graph break, the target network under no_grad."""

    def __init__(self):
        super().__init__()
        self.online = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.target = copy.deepcopy(self.online)

    def forward(self, x, next_x):
        q = self.online(x)
        torch._dynamo.graph_break()
        with torch.no_grad():
            return q, self.target(next_x)


def test_a_graph_whose_outputs_need_no_gradient_computes_none():
    """The target network's graph, compiled in grad mode with its code under no_grad, has no
    backward: its layers are reported as in graphs that compute no gradient, not as another part
    of the training forward (a graph break). Frozen, as the message says, it is exact."""
    agent = Agent()
    x, next_x = torch.randn(4, 8), torch.randn(4, 8)
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1e-3), compiler="aot_eager")
    q, target_q = torch.compile(agent, backend=backend)(x, next_x)
    with pytest.raises(fxgrad.CoverageError, match=r"target\.0 \(Linear\): only in compiled graphs that compute no"):
        (q - 0.9 * target_q).pow(2).mean().backward()
    torch._dynamo.reset()
    agent.target.requires_grad_(False)
    expected = copy.deepcopy(agent)
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1e-3), compiler="aot_eager")
    with coverage_silent():
        q, target_q = torch.compile(agent, backend=backend)(x, next_x)
        (q - 0.9 * target_q).pow(2).mean().backward()
    q, target_q = expected(x, next_x)
    (q - 0.9 * target_q).pow(2).mean().backward()
    ref.clip_global(expected, 1e-3)
    assert_grads_close(agent, expected)


def test_a_graph_that_writes_a_tensor_in_place_may_compute_gradients():
    """No output needs a gradient, but the result went into a buffer the call was given: that
    graph may have a backward; one under no_grad has none."""
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    layer = nn.Linear(4, 4)

    def write(x, buf):
        buf.copy_(layer(x))

    def evaluate(x):
        with torch.no_grad():
            return layer(x)

    torch.compile(write, backend=keep)(torch.randn(2, 4), torch.zeros(2, 4))
    torch.compile(evaluate, backend=keep)(torch.randn(2, 4))
    assert [_compat.may_have_backward(gm) for gm in graphs] == [True, False]


class LabelledLM(nn.Module):
    """A causal LM's shape: the training call (with labels) breaks the graph before any layer,
    the evaluation call (without) runs the whole forward as one graph."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(50, 16), nn.Linear(16, 50)

    def forward(self, ids, labels=None):
        if labels is not None:
            torch._dynamo.graph_break()
        logits = self.head(torch.tanh(self.emb(ids)))
        return logits if labels is None else nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def test_an_evaluation_graph_is_no_part_of_the_training_forward():
    """Evaluation forwards under no_grad between steps, with new sequence lengths: the training
    graph's recompile for dynamic shapes compiles its backward at once, and the coverage check
    took the evaluation graph, which computes no gradient, for a part of the same forward (a
    CoverageError in torch's warning log; the backward compiled again when it ran)."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("torch._functorch._aot_autograd.graph_compile")
    logger.addHandler(handler)
    model = LabelledLM()
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(0.05), compiler="aot_eager")
    compiled = torch.compile(model, backend=backend)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    try:
        with coverage_silent():
            for length in (8, 12, 16):
                ids = torch.randint(0, 50, (2, length))
                compiled(ids, ids).backward()
                optimizer.step()
                optimizer.zero_grad()
                with torch.no_grad():
                    compiled(ids)
    finally:
        logger.removeHandler(handler)
    assert not [r for r in records if "CoverageError" in str(r.exc_info)], [r.getMessage() for r in records]


class BrokenBlock(nn.Module):
    """A graph break inside the block's forward: Dynamo compiles the block's code once and runs
    that graph for every block, with each block's parameters."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.fc2(eager_only(torch.tanh(self.fc1(x))))


@pytest.mark.parametrize(
    "transform,reference",
    [
        (fxgrad.clip_by_norm(1e-2), lambda model: ref.clip_per_layer(model, 1e-2)),
        (fxgrad.adaptive_grad_clip(1e-3), lambda model: ref.agc(model, 1e-3)),  # reads each block's weights
        (fxgrad.scale_by_trust_ratio(), lambda model: ref.trust_ratio(model)),
    ],
    ids=["clip_by_norm", "agc", "trust_ratio"],
)
def test_a_graph_reused_by_repeated_blocks_transforms_them_all_and_says_only_that(transform, reference, compile_with):
    torch.manual_seed(0)
    model = nn.Sequential(*(BrokenBlock() for _ in range(3)))
    expected = copy.deepcopy(model)
    backend = fxgrad.backend(transform, compiler="aot_eager")
    compiled = compile_with(backend, model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    x = torch.randn(4, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # no "not applied", "no graph" or accumulation alarm
            optimizer.zero_grad()
            compiled(x).sum().backward()
            optimizer.step()
    said = {str(w.message).split(" with the parameters")[0] for w in caught if w.category is fxgrad.CoverageWarning}
    assert said and all("reuses the graph compiled for layer" in message for message in said), said
    optimizer.zero_grad()
    compiled(x).sum().backward()
    expected.load_state_dict(model.state_dict())
    expected(x).sum().backward()
    untouched = grads_of(expected)
    reference(expected)
    assert_grads_close(model, expected, untouched=untouched)


@pytest.mark.parametrize(
    "policy, skip, named",
    [
        (fxgrad.by_name({"1.*": fxgrad.clip_by_norm(1e-9)}), (), "1.fc2, 2.fc1"),  # block 1's own rule
        (fxgrad.by_name({"0.fc2": fxgrad.clip_by_norm(1e-9)}), (), "1.fc2, 2.fc2"),  # block 0's rule only
        (fxgrad.clip_by_norm(1e-9), ("1.*",), "1.fc2, 2.fc1"),  # a skip pattern
        (fxgrad.rescale(alpha=1, target=0.1, multipliers={"2.fc1": 2.0}), (), "2.fc1"),  # found by sweep 31
        (fxgrad.rescale(alpha=1, target=lambda depth, name: 1 + depth), (), "1.fc2, 2.fc1, 2.fc2"),  # by depth
    ],
    ids=["by_name of block 1", "by_name of block 0", "skip", "multiplier", "depth target"],
)
def test_a_graph_reused_by_blocks_the_policy_routes_otherwise_is_reported(policy, skip, named, compile_with):
    """Each block's break splits the forward into graphs of [0.fc1], [0.fc2, 1.fc1], then the
    second runs again for [1.fc2, 2.fc1], applying the routes of the layers it was compiled for:
    a rule meant for 1.fc2 did nothing there and acted on 2.fc1, said only as "the gradients are
    transformed" (found by sweep 29 on Hugging Face DeBERTa)."""
    model = nn.Sequential(*(BrokenBlock() for _ in range(3)))
    compiled = compile_with(fxgrad.backend(policy, compiler="aot_eager", skip=skip), model)
    with pytest.warns(fxgrad.CoverageWarning) as caught:
        compiled(torch.randn(4, 8)).sum().backward()
    told = [str(w.message) for w in caught if "treats otherwise" in str(w.message)]
    layers = {name for message in told for name in re.search(r"whose layers (.*?) the policy", message)[1].split(", ")}
    assert layers == set(named.split(", ")), told


class SegmentAttention(nn.Module):
    """Like XLNet's relative attention: a parameter the forward uses only with segment ids."""

    def __init__(self):
        super().__init__()
        self.q, self.segment_bias = nn.Parameter(torch.randn(8, 8)), nn.Parameter(torch.randn(8))

    def forward(self, x, segments=None):
        y = x @ self.q
        return y if segments is None else y + self.segment_bias


def test_a_layer_with_a_parameter_the_forward_does_not_use_is_clipped_as_eager(compile_with):
    """One graph holds the layer's used parameter; its other one is in none. A per-layer rule
    raised "would see only part of a layer's gradient", as if a graph break split the layer
    (sweep 29, XLNet): it now clips what has a gradient, as eager, and names the parameter."""
    torch.manual_seed(0)
    model = nn.Sequential(SegmentAttention(), nn.Linear(8, 1))
    expected = copy.deepcopy(model)
    compiled = compile_with(fxgrad.backend(fxgrad.clip_by_norm(1e-2), compiler="aot_eager"), model)
    x = torch.randn(4, 8)
    with pytest.warns(
        fxgrad.CoverageWarning, match=r"applied to only part of:\n    0 \(SegmentAttention\): 0.segment_bias"
    ):
        compiled(x).pow(2).sum().backward()
        torch.optim.SGD(model.parameters(), lr=0.0).step()
    expected(x).pow(2).sum().backward()
    untouched = grads_of(expected)
    ref.clip_per_layer(expected, 1e-2)
    assert_grads_close(model, expected, untouched=untouched)
    assert model[0].segment_bias.grad is None
    strict = fxgrad.backend(fxgrad.clip_by_global_norm(1e-2), compiler="aot_eager")  # an unused part: as before
    compiled = compile_with(strict, nn.Sequential(SegmentAttention(), nn.Linear(8, 1)))
    with pytest.raises(fxgrad.CoverageError, match="0.segment_bias in no compiled graph"):
        compiled(x).sum().backward()


class BranchyHead(nn.Module):
    """An attention like XLNet's, then a branch on a Python flag: Dynamo compiles a graph per side."""

    def __init__(self):
        super().__init__()
        self.attention, self.extra, self.out = SegmentAttention(), nn.Linear(8, 8), nn.Linear(8, 1)
        self.wide = False

    def forward(self, x):
        h = self.attention(x)
        return self.out(self.extra(h) if self.wide else h)


class GatedMix(nn.Module):
    """A layer one of whose parameters the forward uses on some inputs only."""

    def __init__(self):
        super().__init__()
        self.fc, self.mix, self.out = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 1)
        self.mix.gate = nn.Parameter(torch.ones(8))
        self.wide = False

    def forward(self, x):
        h = self.mix(torch.tanh(self.fc(x)))
        return self.out(h * self.mix.gate if self.wide else h)


@pytest.mark.parametrize("sides", [(False, True, False), (True, False, True)], ids=["gate later", "gate first"])
@pytest.mark.parametrize("make", [BranchyHead, GatedMix])
def test_a_recompile_does_not_make_a_parameter_in_no_graph_look_split(make, sides, compile_with):
    """The second side's graph also holds the layer; a parameter of it one side uses is in the
    other side's graph, not in another part of the same forward. The layer was refused as split
    between graphs (sweep 33), and the gate, taken up by a later graph, as run eagerly (sweep 35)."""
    torch.manual_seed(0)
    model = make()
    expected = copy.deepcopy(model)
    compiled = compile_with(fxgrad.backend(fxgrad.clip_by_norm(1e-2), compiler="aot_eager"), model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fxgrad.CoverageWarning)  # the unused parameters
        for wide in sides:
            model.wide = expected.wide = wide
            x = torch.randn(4, 8)
            for net in (model, expected):
                net.zero_grad()
            compiled(x).pow(2).sum().backward()
            torch.optim.SGD(model.parameters(), lr=0.0).step()
            expected(x).pow(2).sum().backward()
            untouched = grads_of(expected)
            ref.clip_per_layer(expected, 1e-2)
            assert_grads_close(model, expected, untouched=untouched)


class EagerSegmentAttention(SegmentAttention):
    def forward(self, x, segments=None):
        return eager_only(x @ self.q) + eager_only(self.segment_bias)


def test_a_layer_with_a_parameter_run_eagerly_is_refused_at_the_step(compile_with):
    """The same layer, its bias added outside the compiled graph: not unused, but run eagerly, so
    the layer's rule saw part of its gradient (sweep 31: 56x the eager clip, with a warning that
    it might be unused). Its gradient says which: refused at the optimizer's step."""
    model = nn.Sequential(EagerSegmentAttention(), nn.Linear(8, 1))
    compiled = compile_with(fxgrad.backend(fxgrad.clip_by_norm(1e-2), compiler="aot_eager"), model)
    with pytest.warns(fxgrad.CoverageWarning, match=r"is applied to only part of:\n    0 \(EagerSegmentAttention\)"):
        compiled(torch.randn(4, 8)).pow(2).sum().backward()
    with pytest.raises(fxgrad.CoverageError, match=r"got a gradient from no compiled graph(.|\n)*: 0.segment_bias"):
        torch.optim.SGD(model.parameters(), lr=0.0).step()


class SharedWeightBlock(BrokenBlock):
    shared_first = False

    def forward(self, x, shared):
        h = x @ shared + self.fc1(x) if self.shared_first else self.fc1(x) + x @ shared
        return self.fc2(eager_only(torch.tanh(h)))


class BlocksWithSharedWeight(nn.Module):
    """Blocks with a graph break inside, each taking a weight of the model's own, as DeBERTa's
    layers take its relative position embeddings: Dynamo runs one block's graph for every block."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(8, 8, bias=False)
        self.blocks = nn.ModuleList(SharedWeightBlock() for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = block(x, self.shared.weight)
        return x


@pytest.mark.parametrize("shared_first", [False, True], ids=["shared second", "shared first"])
def test_a_weight_every_call_of_a_reused_graph_takes_is_refused(shared_first, compile_with, monkeypatch):
    """Each call's backward transformed its part of the shared weight's gradient and autograd
    summed the parts: a clip to t gave 1.5 t (sweep 34, Hugging Face DeBERTa), said only as
    "the gradients are transformed". As the graph's first input, the weight made each call look
    like its own module's parameters replaced (sweep 35). Frozen, it is left alone."""
    monkeypatch.setattr(SharedWeightBlock, "shared_first", shared_first)
    compiled = compile_with(fxgrad.backend(fxgrad.clip_by_norm(1e-2), compiler="aot_eager"), BlocksWithSharedWeight())
    with pytest.raises(fxgrad.CoverageError, match=r"each call takes the parameters of shared \(a module every"):
        compiled(torch.randn(4, 8)).sum().backward()
    torch.manual_seed(0)
    model = BlocksWithSharedWeight()
    model.shared.requires_grad_(False)
    expected = copy.deepcopy(model)
    compiled = compile_with(fxgrad.backend(fxgrad.clip_by_norm(1e-2), compiler="aot_eager"), model)
    x = torch.randn(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fxgrad.CoverageWarning)  # the reuse
        compiled(x).sum().backward()
    expected(x).sum().backward()
    untouched = grads_of(expected)
    ref.clip_per_layer(expected, 1e-2)
    assert_grads_close(model, expected, untouched=untouched)


class Recompute(torch.autograd.Function):
    """Reversible layers' way (Hugging Face Reformer): the forward under no_grad, the backward
    recomputes it with gradients, outside any compiled graph."""

    @staticmethod
    def forward(ctx, x, layer):
        ctx.save_for_backward(x)
        ctx.layer = layer
        torch._dynamo.graph_break()  # as Reformer's: Dynamo runs the Function, and compiles the layer apart
        return layer(x)  # a Function's forward runs without gradients

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            x = x.detach().requires_grad_(True)
            out = ctx.layer(x)
        torch.autograd.backward(out, grad)
        return x.grad, None


class Reversible(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner, self.head = nn.Linear(8, 8), nn.Linear(8, 1)

    def forward(self, x):
        return self.head(Recompute.apply(x, self.inner))


def test_a_layer_only_in_graphs_that_compute_no_gradient_is_reported(compile_with):
    """Its parameters were taken for covered, since a graph held them: the policy did nothing to
    the encoder of a Reformer, with no warning (sweep 34)."""
    compiled = compile_with(fxgrad.backend(fxgrad.clip_by_norm(1e-9), compiler="aot_eager"), Reversible())
    with pytest.warns(
        fxgrad.CoverageWarning, match=r"inner \(Linear\): only in compiled graphs that compute no gradient"
    ):
        compiled(torch.randn(4, 8)).sum().backward()


def test_two_forwards_in_one_backward_are_reported_at_the_optimizer_step(compile_with):
    model = models.MLP()
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1e-3), compiler="aot_eager")
    compiled = compile_with(backend, model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    with coverage_silent():
        for _ in range(2):  # common loops: silent
            loss = models.loss_of(compiled(torch.randn(4, 16)))
            optimizer.zero_grad()  # between forward and backward
            loss.backward()
            optimizer.step()
            with torch.no_grad():
                compiled(torch.randn(4, 16))
            model.eval()
            compiled(torch.randn(4, 16))  # validation without no_grad
            model.train()
            skipped = models.loss_of(compiled(torch.randn(4, 16)))  # a batch whose backward is skipped
            del skipped
            # adversarial training: the gradient of an input (no .grad written), then the loss
            x = torch.randn(4, 16, requires_grad=True)
            (input_grad,) = torch.autograd.grad(models.loss_of(compiled(x)), x)
            optimizer.zero_grad()
            models.loss_of(compiled(x.detach() + 0.01 * input_grad.sign())).backward()
            optimizer.step()
    optimizer.zero_grad()
    first, second = compiled(torch.randn(4, 16)).sum(), compiled(torch.randn(4, 16)).sum()
    (first - second).backward()  # the forwards' outputs are gone: autograd holds only the sums
    with pytest.warns(fxgrad.CoverageWarning, match="took the outputs of two forwards of MLP"):
        optimizer.step()


class TiedAcrossBreak(nn.Module):
    """An embedding and a head that share one weight, on both sides of a graph break."""

    def __init__(self):
        super().__init__()
        self.emb, self.mid, self.head = nn.Embedding(11, 6), nn.Linear(6, 6), nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(eager_only(torch.tanh(self.mid(self.emb(ids)))))


def test_a_parameter_in_two_graphs_of_one_forward_is_not_two_forwards():
    """One forward reaches the tied weight through both graphs, which the per-graph check reports
    as such; it is not "two forwards" (it was, on the plain path). A second forward still is."""
    model = TiedAcrossBreak()
    backend = fxgrad.backend(fxgrad.clip_by_norm(0.5), compiler="aot_eager", strict=False)
    compiled = torch.compile(model, backend=backend)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    ids = torch.randint(0, 11, (3, 5))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            optimizer.zero_grad()
            compiled(ids).logsumexp(-1).sum().backward()
            optimizer.step()
    said = [str(w.message) for w in caught if issubclass(w.category, fxgrad.CoverageWarning)]
    assert any("also used by another graph of the same forward" in message for message in said)
    assert not any("two forwards" in message for message in said)
    optimizer.zero_grad()
    (compiled(ids).sum() + compiled(ids).sum()).backward()
    with pytest.warns(fxgrad.CoverageWarning, match="took the outputs of two forwards of TiedAcrossBreak"):
        optimizer.step()


class BranchOnInput(nn.Module):
    """A branch on a tensor: Dynamo resumes in one frame per side, and both hold ``head``."""

    def __init__(self):
        super().__init__()
        self.inp, self.a, self.b, self.head = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x):
        h = self.inp(x)
        h = self.a(h) if x.mean() > 0 else self.b(h)
        return self.head(torch.tanh(h))


class BranchFirst(BranchOnInput):
    """The branch before any parameter: the frame that starts the forward holds none."""

    def forward(self, x):
        h = self.a(x @ self.inp.weight.T.detach()) if x.mean() > 0 else self.b(x @ self.inp.weight.T.detach())
        return self.head(torch.tanh(h))


@pytest.mark.parametrize("make", [BranchOnInput, BranchFirst])
def test_the_two_sides_of_a_branch_on_a_tensor_are_not_parts_of_one_forward(compile_with, make):
    """They are alternatives, like recompiles of one frame: ``head`` is whole in each."""
    torch.manual_seed(0)
    model = make()
    expected = copy.deepcopy(model)
    backend = fxgrad.backend(fxgrad.clip_by_norm(0.05), compiler="aot_eager")
    compiled = compile_with(backend, model)
    optimizer, expected_optimizer = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, expected))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fxgrad.CoverageWarning)  # step 0: layer a is in no graph yet
        for step in range(4):
            x = torch.randn(4, 8) + (1.0 if step % 2 else -1.0)  # b, then a, then each again
            for m, opt in ((compiled, optimizer), (expected, expected_optimizer)):
                opt.zero_grad()
                m(x).pow(2).mean().backward()
                if m is expected:
                    ref.clip_per_layer(expected, 0.05)
                opt.step()
    for a, b in zip(model.parameters(), expected.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


class MaskedEmbedding(nn.Module):
    """Wav2Vec2's masked time steps: a boolean-mask write of a parameter, after a graph break.
    AOTAutograd fails on it in torch 2.13 (``aten.nonzero``), and Dynamo runs that code eagerly."""

    def __init__(self):
        super().__init__()
        self.fc, self.embed, self.out = nn.Linear(8, 8), nn.Parameter(torch.randn(8)), nn.Linear(8, 8)

    def forward(self, x, mask):
        h = eager_only(self.fc(x)).clone()
        h[mask] = self.embed
        return self.out(h)


def test_the_parameters_of_a_graph_whose_compile_failed_are_reported(compile_with):
    """The failed graph was kept as if it held them: ``normalize`` left them alone, silently."""
    model = MaskedEmbedding()
    backend = fxgrad.backend(fxgrad.normalize(), compiler="aot_eager")
    compiled = compile_with(backend, model)
    mask = torch.zeros(2, 5, dtype=torch.bool)
    mask[:, 1:3] = True
    with pytest.warns(fxgrad.CoverageWarning, match=r"(?s)\(root\) \(MaskedEmbedding\): in no compiled graph.*failed"):
        compiled(torch.randn(2, 5, 8), mask).sum().backward()
        torch.optim.SGD(model.parameters(), lr=0.0).step()
    assert [graph.params[0].layer for graph in backend.graphs] == ["fc"]


class Outer(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.a, self.inner, self.c = nn.Linear(8, 16), inner, nn.Linear(4, 3)

    def forward(self, x):
        return self.c(self.inner(torch.tanh(self.a(x))))


def test_a_compiled_module_inside_a_model_compiled_with_another_backend_is_reported():
    """torch.compile of the outer model traces the inner compiled module into its own graph with
    its own backend: the inner backend's policy never runs, and the warning gives that cause."""
    inner = models.MLP()
    model = Outer(torch.compile(inner, backend=fxgrad.backend(fxgrad.clip_by_norm(0.5), compiler="aot_eager")))
    compiled = torch.compile(model, backend="aot_eager")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    compiled(torch.randn(4, 8)).sum().backward()
    said = "(?s)no graph of MLP reached the backend.*traced it into the graph of an outer model"
    with pytest.warns(fxgrad.CoverageWarning, match=said):
        optimizer.step()


def test_hugging_face_training_steps_raise_no_coverage_warning(compile_with):
    model, args, kwargs = models.build("gpt2")
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1.0), compiler="aot_eager")
    compiled = compile_with(backend, model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    with coverage_silent():
        for _ in range(2):
            optimizer.zero_grad()
            models.loss_of(compiled(*args, **kwargs)).backward()
            optimizer.step()


def test_accumulation_is_reported_and_zeroed_gradients_are_not(compile_with):
    model = models.MLP()
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1e-3), compiler="aot_eager")
    compiled = compile_with(backend, model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    with coverage_silent():
        for _ in range(3):  # zero_grad(set_to_none=False) keeps zero tensors in .grad
            optimizer.zero_grad(set_to_none=False)
            models.loss_of(compiled(torch.randn(4, 16))).backward()
            optimizer.step()
    models.loss_of(compiled(torch.randn(4, 16))).backward()
    with pytest.warns(fxgrad.CoverageWarning, match="still held the previous backward's gradient"):
        optimizer.step()


def test_two_losses_backward_through_one_forward_are_reported(compile_with):
    """Multi-task losses with retain_graph=True: each backward's gradient was clipped apart."""
    model = models.MLP()
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1e-3), compiler="aot_eager")
    compiled = compile_with(backend, model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    out = compiled(torch.randn(4, 16))
    out.sum().backward(retain_graph=True)
    out.pow(2).sum().backward()
    with pytest.warns(fxgrad.CoverageWarning, match=r"several losses through one forward \(retain_graph"):
        optimizer.step()


def test_recompiling_after_a_dynamo_reset_forgets_the_old_graphs(compile_with):
    model = models.MLP()
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1e-3), compiler="aot_eager")
    models.loss_of(compile_with(backend, model)(torch.randn(4, 16))).backward()
    _compat.reset_dynamo()
    model.zero_grad()
    expected = copy.deepcopy(model)
    x = torch.randn(4, 16)
    models.loss_of(compile_with(backend, model)(x)).backward()  # the old graph is no graph break
    models.loss_of(expected(x)).backward()
    ref.clip_global(expected, 1e-3)
    assert_grads_close(model, expected)
    assert len(backend.graphs) == 1


class TwoHeads(nn.Module):
    """``forward`` and a second entry point, ``encode``, sharing the first layer."""

    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))

    def encode(self, x):
        return self.body(x)

    def decode(self, h):
        return self.head(h)


def compiled_two_heads():
    model = TwoHeads()
    return model, fxgrad.backend(fxgrad.clip_by_norm(1e-3), compiler="aot_eager").compile(model)


def test_backwards_through_the_compiled_model_are_not_reported_as_bypassing_it():
    model, compiled = compiled_two_heads()
    x = torch.randn(4, 8)
    with coverage_silent():
        for _ in range(2):
            model.zero_grad()
            compiled(x).sum().backward()
        checkpointed = torch.utils.checkpoint.checkpoint(compiled, x, use_reentrant=False)
        model.zero_grad()
        checkpointed.sum().backward()
        report = fxgrad.explain(model, x, backend=fxgrad.backend(fxgrad.clip_by_norm(1e-3), compiler="aot_eager"))
        assert not report.warnings  # explain's own compile of the same model bypasses nothing
        model.zero_grad()
        compiled(x).sum().backward()
        # the model compiled again, in step scope, while the first compiled module lives on
        step_scoped = fxgrad.backend(fxgrad.clip_by_global_norm(1.0), compiler="aot_eager", scope="step")
        recompiled = step_scoped.compile(model)
        for _ in range(2):
            model.zero_grad()
            recompiled(x).sum().backward()


def test_a_backward_in_another_thread_is_not_taken_for_a_bypass():
    """Two training loops in threads: the second's backward runs whole while the first's waits
    between its compiled backward and its gradients' accumulation (sweep 23 saw it in two runs
    of three); the first's then still counts as having passed through the compiled model."""
    first, compiled_first = compiled_two_heads()
    second, compiled_second = compiled_two_heads()
    x = torch.randn(4, 8)
    reached, resume = threading.Event(), threading.Event()

    def train_first() -> None:
        out = compiled_first(x)
        out.grad_fn.register_hook(lambda *grads: reached.set() or resume.wait(30) and None)
        out.sum().backward()

    with warnings.catch_warnings(record=True) as caught:  # the warnings of both threads
        warnings.simplefilter("always")
        thread = threading.Thread(target=train_first)
        thread.start()
        assert reached.wait(30)
        compiled_second(x).sum().backward()
        resume.set()
        thread.join(30)
    assert first.body.weight.grad is not None and second.body.weight.grad is not None
    assert [str(w.message) for w in caught if issubclass(w.category, fxgrad.CoverageWarning)] == []


@pytest.mark.parametrize("call", ["original model", "other method", "method without the first parameter"])
def test_a_backward_that_bypasses_the_compiled_model_is_reported(call):
    """The third is CLIP's get_text_features, which never uses the model's first parameter (logit_scale)."""
    model, compiled = compiled_two_heads()
    x = torch.randn(4, 8)
    compiled(x).sum().backward()
    model.zero_grad()
    if call == "original model":
        out = model(x)
    elif call == "other method":
        out = compiled.encode(x)
    else:
        out = compiled.decode(torch.randn(4, 16))
    with pytest.warns(fxgrad.CoverageWarning, match="without passing through a forward of the compiled TwoHeads"):
        out.sum().backward()


@pytest.mark.parametrize("replaced", ["all", "one layer", "a new module"])
def test_replaced_parameters_are_followed(compile_with, replaced):
    """Dynamo passes the new Parameter objects to the same graph: weight reads follow them,
    one layer's in the middle of the model as well as all of them, and no check takes the
    new ones for gradients of an eager forward."""
    model = models.MLP()
    backend = fxgrad.backend(fxgrad.adaptive_grad_clip(0.05), compiler="aot_eager")
    compiled = compile_with(backend, model)
    x = torch.randn(4, 16)
    models.loss_of(compiled(x)).backward()
    model.zero_grad()
    old = list(model.parameters())  # still alive, as an optimizer would keep them
    middle = model.net[3]
    if replaced == "all":
        model.load_state_dict({k: v * 0.1 for k, v in model.state_dict().items()}, assign=True)
    elif replaced == "one layer":
        middle.load_state_dict({k: v * 10 for k, v in middle.state_dict().items()}, assign=True)
    else:
        model.net[3] = nn.Linear(64, 64)
    expected = copy.deepcopy(model)
    with coverage_silent():
        models.loss_of(compiled(x)).backward()
        torch.optim.SGD(model.parameters(), lr=0.0).step()  # the step's coverage check
    models.loss_of(expected(x)).backward()
    ref.agc(expected, 0.05)
    assert_grads_close(model, expected)
    assert len(old) == len(list(model.parameters())) and len(backend.graphs) == 1


@pytest.mark.parametrize(
    "transform,skip,message",
    [
        (
            fxgrad.by_name({"*nonexistent*": fxgrad.clip_by_norm(1.0)}),
            fxgrad.DEFAULT_SKIP,
            r"by_name key '\*nonexistent\*' matches no layer",
        ),
        (
            fxgrad.by_name({"lm_head": fxgrad.clip_by_norm(1.0)}),
            fxgrad.DEFAULT_SKIP,
            r"by_name key 'lm_head' matches no layer.*first owner",
        ),  # tied: transformer.wte owns it
        (fxgrad.clip_by_norm(1.0), fxgrad.DEFAULT_SKIP + ("lm_head",), r"skip entry 'lm_head' matches no layer"),
        (
            fxgrad.by_type({nn.LayerNorm: fxgrad.clip_by_norm(1.0)}),
            fxgrad.DEFAULT_SKIP,
            r"by_type key torch.nn.LayerNorm reaches no layer: the skip list leaves alone all it matches",
        ),
        (
            fxgrad.chain(fxgrad.monitor(), fxgrad.by_name({"*": fxgrad.rescale(), "*mlp*": fxgrad.clip_by_norm(1.0)})),
            fxgrad.DEFAULT_SKIP,
            r"by_name key '\*mlp\*' reaches no layer: earlier keys took all it matches",
        ),
        (
            fxgrad.rescale(multipliers={"*.q_proj": 1.3, "*.c_attn": 1.3}),
            fxgrad.DEFAULT_SKIP,
            r"rescale multiplier key '\*.q_proj' matches no layer it rescales",
        ),  # Llama's name, in GPT-2
        (
            fxgrad.by_name({"transformer.h.0.attn.c_attn": fxgrad.rescale()}),
            fxgrad.DEFAULT_SKIP,
            r"rescale\(alpha=0.5, target='mean'\) reaches only transformer.h.0.attn.c_attn: its 'mean' target",
        ),
        (
            fxgrad.by_name({"transformer.wte": fxgrad.balance_norms()}),
            fxgrad.DEFAULT_SKIP,
            r"balance_norms\(.*\) reaches only transformer.wte: .* needs two layers",
        ),
    ],
    ids=["typo", "tied", "skip", "skipped", "shadowed", "multiplier", "one-layer-mean", "one-layer-balance"],
)
def test_routing_keys_and_skip_entries_that_reach_no_layer_are_reported(transform, skip, message, compile_with):
    model, _, _ = models.build("gpt2")
    with pytest.warns(fxgrad.CoverageWarning, match=message):
        compile_with(fxgrad.backend(transform, compiler="aot_eager", skip=skip), model)


def test_a_rule_over_a_frozen_layer_is_not_idle():
    """Gradual unfreezing: ``b`` thaws later, and the mean target is then over two layers."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    model[1].requires_grad_(False)
    with coverage_silent():
        fxgrad.backend(fxgrad.rescale(), compiler="aot_eager").compile(model)


class Task(nn.Module):
    """A head on an encoder that other tasks share; the head comes first, the encoder is larger."""

    def __init__(self, encoder):
        super().__init__()
        self.head, self.encoder = nn.Linear(64, 2), encoder

    def forward(self, x):
        return self.head(self.encoder(x))


def test_a_part_shared_by_two_compiled_models_is_not_reported_as_bypassing_either():
    """Multi-task training: each task's compiled forward reaches the shared encoder, whose first
    parameter is a bypass probe of both models."""
    encoder = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 64))
    tasks = [Task(encoder), Task(encoder)]
    backend = fxgrad.backend(fxgrad.clip_by_norm(1.0), compiler="aot_eager")
    compiled = [backend.compile(task) for task in tasks]
    optimizer = torch.optim.SGD(list(dict.fromkeys(p for task in tasks for p in task.parameters())), lr=0.01)
    with coverage_silent():
        for step in range(4):
            optimizer.zero_grad()
            compiled[step % 2](torch.randn(4, 8)).square().sum().backward()
            optimizer.step()


def test_routing_keys_that_reach_layers_are_not_reported(compile_with):
    model, _, _ = models.build("gpt2")
    policy = fxgrad.by_name(
        {
            "*attn*": fxgrad.rescale(multipliers={"*.c_attn": 1.3}),
            "transformer.h.0.mlp.c_fc": fxgrad.rescale(every=10),  # one layer, but a held target moves
        },
        default=fxgrad.by_type({nn.Embedding: fxgrad.rescale()}),
    )
    with coverage_silent():
        compile_with(fxgrad.backend(policy, compiler="aot_eager", skip=fxgrad.DEFAULT_SKIP + ("*ln_f*",)), model)


class Parametrized(nn.Module):
    """A Linear with ``weight_norm``, one with ``spectral_norm``, and a plain one."""

    def __init__(self):
        super().__init__()
        from torch.nn.utils.parametrizations import spectral_norm, weight_norm

        self.fc1, self.fc2, self.fc3 = weight_norm(nn.Linear(8, 16)), spectral_norm(nn.Linear(16, 16)), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


@pytest.mark.parametrize("scope", ["graph", "step"])
def test_a_parametrized_weights_originals_are_in_its_layer(scope, compile_with):
    """weight_norm's g and v (in ``fc1.parametrizations.weight``) are layer ``fc1``'s, with its
    bias: by_type(nn.Linear) reaches them, and a per-layer clip bounds the whole Linear."""
    torch.manual_seed(0)
    model = Parametrized()
    expected = copy.deepcopy(model)
    policy = fxgrad.by_type({nn.Linear: fxgrad.clip_by_norm(1e-3)})
    backend = fxgrad.backend(policy, compiler="aot_eager", scope=scope)
    x = torch.randn(5, 8)
    with coverage_silent():
        models.loss_of(compile_with(backend, model)(x)).backward()
        torch.optim.SGD(model.parameters(), lr=0.0).step()
    models.loss_of(expected(x)).backward()
    for layer in (expected.fc1, expected.fc2, expected.fc3):
        torch.nn.utils.clip_grad_norm_(layer.parameters(), 1e-3)  # its originals and its bias
    assert_grads_close(model, expected)
    report = fxgrad.explain(Parametrized(), x, backend=fxgrad.backend(policy, compiler="aot_eager", scope=scope))
    assert [row.name for row in report.layers] == ["fc1", "fc2", "fc3"]


def test_warnings_name_the_line_of_the_training_loop():
    """fxgrad warns from inside Dynamo's compile, autograd's backward and optimizer hooks;
    each warning names the user's line that got there, not a frame of torch or fxgrad."""
    x = torch.randn(4, 16)
    model = models.MLP()
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1e-3), compiler="aot_eager")
    compiled = backend.compile(model)
    twin = copy.deepcopy(compiled)
    models.loss_of(compiled(x)).backward()
    with pytest.warns(fxgrad.CoverageWarning, match=r"copy\.deepcopy") as compiling:
        out = twin(x)  # Dynamo compiles the twin's forward here
    with pytest.warns(RuntimeWarning, match=r"fold\(AdamW\)") as folding:
        backend.fold(torch.optim.AdamW(model.parameters(), fused=True))  # after the first forward
    stepped = fxgrad.backend(fxgrad.clip_by_global_norm(1e-3), compiler="aot_eager", scope="step")
    trained = stepped.compile(models.MLP())
    with pytest.warns(fxgrad.CoverageWarning, match="neither ran between backward passes") as backward:
        for _ in range(3):
            trained.zero_grad()
            models.loss_of(trained(x)).backward()  # a backward hook sees the gradients dropped
    for caught in (compiling, folding, backward):
        assert {w.filename for w in caught} == {__file__}, [(w.filename, w.lineno) for w in caught]
    del out


def encoder_and_head():
    """Two models of their own, the encoder's output the head's input."""
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)), nn.Linear(8, 4)


@pytest.mark.parametrize("strict", [True, False])
def test_one_optimizer_over_models_compiled_one_by_one_is_reported_in_graph_scope(strict):
    """An encoder and a head, each compiled with the same backend, one optimizer: in graph scope each
    backward clips its own model's norm, not the norm of everything the optimizer steps."""
    torch.manual_seed(0)
    encoder, head = encoder_and_head()
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(0.5), compiler="aot_eager", strict=strict)
    model = lambda x: torch.compile(head, backend=backend)(torch.compile(encoder, backend=backend)(x))  # noqa: E731
    optimizer = torch.optim.SGD([*encoder.parameters(), *head.parameters()], lr=0.1)
    model(torch.randn(4, 8)).pow(2).mean().backward()
    expect = pytest.raises(fxgrad.CoverageError) if strict else pytest.warns(fxgrad.CoverageWarning)
    with expect as found:
        optimizer.step()
    assert "SGD steps the parameters of 2 models this backend compiled one by one (Linear, Sequential)" in str(
        found.value if strict else found[0].message
    )


def test_one_optimizer_over_models_of_one_class_compiled_one_by_one_is_reported():
    """An ensemble: Dynamo runs one graph for both models (the same code), so the graph holds one
    model's parameters at a time, and each call clips that model's norm alone."""
    torch.manual_seed(0)
    members = [models.MLP(), models.MLP()]
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(0.5), compiler="aot_eager")
    compiled = [torch.compile(member, backend=backend) for member in members]
    optimizer = torch.optim.SGD([p for member in members for p in member.parameters()], lr=0.1)
    x = torch.randn(4, 16)
    with pytest.warns(fxgrad.CoverageWarning, match="Dynamo reuses the graph"):
        sum(models.loss_of(net(x)) for net in compiled).backward()
    with pytest.raises(fxgrad.CoverageError, match=r"steps the parameters of 2 models .* \(MLP, MLP\)"):
        optimizer.step()


def test_models_of_one_class_with_an_optimizer_each_are_not_reported():
    """Folds of a k-fold run, kept in a list, each trained by its own optimizer: Dynamo runs the
    first fold's graph for the others, bound to each call's parameters."""
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(0.5), compiler="aot_eager")
    folds = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fxgrad.CoverageWarning)  # Dynamo reuses the graph: said, and so
        for _ in range(3):
            folds.append(models.MLP())
            compiled = torch.compile(folds[-1], backend=backend)
            optimizer = torch.optim.Adam(folds[-1].parameters())
            for _ in range(2):
                optimizer.zero_grad()
                models.loss_of(compiled(torch.randn(4, 16))).backward()
                optimizer.step()


def test_models_compiled_one_by_one_with_an_optimizer_each_are_not_reported():
    """A GAN: each optimizer steps one model, and each model's own norm is the one meant."""
    encoder, head = encoder_and_head()
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(0.5), compiler="aot_eager")
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (encoder, head)]
    with coverage_silent():
        out = torch.compile(head, backend=backend)(torch.compile(encoder, backend=backend)(torch.randn(4, 8)))
        out.pow(2).mean().backward()
        for optimizer in optimizers:
            optimizer.step()


class Discriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden, self.out = nn.Linear(8, 16), nn.Linear(16, 1)

    def forward(self, x):
        return self.out(torch.tanh(self.hidden(x)))


@pytest.mark.parametrize("scope", ["graph", "step"])
@pytest.mark.parametrize(
    "policy, same_names, says",
    [
        (fxgrad.clip_by_global_norm(1.0), True, None),  # keeps nothing by layer, nothing over all layers
        (fxgrad.chain(fxgrad.monitor(), fxgrad.clip_by_global_norm(1.0)), True, "share the layer names 0, 2"),
        (fxgrad.chain(fxgrad.monitor(), fxgrad.clip_by_global_norm(1.0)), False, None),
        # one state over every layer: one for both in step scope, one per compiled frame in graph scope
        (fxgrad.zclip(warmup=2), False, {"step": "the state of 0.zclip spans every layer", "graph": None}),
        (fxgrad.adagc(warmup=2), True, "share the layer names 0, 2"),  # its per-tensor EMAs, by name
    ],
    ids=["global clip", "monitor, same names", "monitor", "zclip", "adagc, same names"],
)
def test_one_backend_over_models_with_an_optimizer_each_says_what_it_would_mix(scope, policy, same_names, says):
    """A GAN with one backend: its statistics and state are kept by layer name, and some rules
    keep one state over every layer (found by sweep 30: two nn.Sequential mixed their monitor
    EMAs and AdaGC's per-tensor EMAs, silently). Said once, at the second optimizer's first step."""
    says = says[scope] if isinstance(says, dict) else says
    G = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 8))
    D = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)) if same_names else Discriminator()
    backend = fxgrad.backend(policy, compiler="aot_eager", scope=scope)
    g, d = torch.compile(G, backend=backend), torch.compile(D, backend=backend)
    opt_g, opt_d = torch.optim.SGD(G.parameters(), lr=1e-2), torch.optim.SGD(D.parameters(), lr=1e-2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            fake = g(torch.randn(6, 4))
            opt_d.zero_grad()
            d(torch.cat([torch.randn(6, 8), fake.detach()])).mean().backward()
            opt_d.step()
            opt_g.zero_grad()
            (-d(fake)).mean().backward()
            opt_g.step()
    told = [str(w.message) for w in caught if "Give each model a backend of its own" in str(w.message)]
    if says is None:
        assert not told, told
    else:
        assert len(told) == 1 and re.search(says, told[0]), told


def test_one_optimizer_over_models_sharing_layer_names_is_told_they_mix():
    """An encoder and a head compiled one by one, both nn.Sequential, one optimizer: in graph
    scope each keeps its per-layer statistics and state under the same names (sweep 31)."""
    encoder = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16))
    head = nn.Sequential(nn.Linear(16, 4), nn.Tanh(), nn.Linear(4, 2))
    backend = fxgrad.backend(fxgrad.rescale(target="ema"), compiler="aot_eager")
    out = torch.compile(head, backend=backend)(torch.compile(encoder, backend=backend)(torch.randn(4, 8)))
    out.pow(2).mean().backward()
    with pytest.warns(
        fxgrad.CoverageWarning, match=r"models Sequential, Sequential of this backend share the layer names 0, 2"
    ):
        torch.optim.SGD([*encoder.parameters(), *head.parameters()], lr=0.1).step()


def test_models_compiled_one_by_one_in_step_scope_get_the_clip_of_everything_stepped():
    torch.manual_seed(0)
    encoder, head = encoder_and_head()
    expected = copy.deepcopy(encoder), copy.deepcopy(head)
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(0.05), compiler="aot_eager", scope="step")
    x = torch.randn(4, 8)
    torch.compile(head, backend=backend)(torch.compile(encoder, backend=backend)(x)).pow(2).mean().backward()
    torch.optim.SGD([*encoder.parameters(), *head.parameters()], lr=0.1).step()
    expected[1](expected[0](x)).pow(2).mean().backward()
    params = [*expected[0].parameters(), *expected[1].parameters()]
    torch.nn.utils.clip_grad_norm_(params, 0.05)
    torch.optim.SGD(params, lr=0.1).step()
    for actual, wanted in zip([*encoder.parameters(), *head.parameters()], params):
        torch.testing.assert_close(actual, wanted, rtol=1e-6, atol=1e-7)


def _functional_step(compiled, model, swap=lambda name: True):
    """A forward through ``torch.func.functional_call`` with tensors computed from the parameters
    ``swap`` names (a weight perturbation, as SAM or weight noise make): the graph's parameter
    slots hold them."""
    torch.manual_seed(1)
    swapped = {name: p * 1.0 if swap(name) else p for name, p in model.named_parameters()}
    models.loss_of(torch.func.functional_call(compiled, swapped, (torch.randn(5, 16),))).backward()


@pytest.mark.parametrize("transform", [fxgrad.clip_by_global_norm(0.05), fxgrad.clip_by_norm(0.05)])
def test_plain_tensors_in_the_parameter_slots_are_reported(compile_with, transform):
    """Graph scope transforms the gradients of nn.Parameter inputs; tensors that
    functional_call puts in their slots pass the policy by, which was silent through
    backend.compile (the torch.compile path named a wrong cause at the step)."""
    torch._dynamo.reset()  # the forward's frame, compiled by earlier tests with other backends
    model, _ = models.mlp()
    backend = fxgrad.backend(transform, compiler="aot_eager", scope="graph", strict=False)
    message = r"plain tensors, not nn.Parameters, in the parameter slots net\.0\.weight, net\.0\.bias, .*scope='step'"
    with pytest.warns(fxgrad.CoverageWarning, match=message):
        _functional_step(compile_with(backend, model), model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    # torch.compile's path finds no graph holding the parameters at the step: the cause is named
    assert all("functional_call" in str(w.message) for w in caught if "fxgrad" in str(w.message))
    strict = fxgrad.backend(transform, compiler="aot_eager", scope="graph")
    torch._dynamo.reset()
    if transform.reach == "group":  # the graph's global norm leaves them out: a wrong number
        with pytest.raises(fxgrad.CoverageError, match=message):
            _functional_step(compile_with(strict, model), model)


def test_plain_tensors_in_the_parameter_slots_are_clipped_in_step_scope(compile_with):
    torch._dynamo.reset()
    model, _ = models.mlp()
    expected = copy.deepcopy(model)
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(0.05), compiler="aot_eager", scope="step")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with coverage_silent():
        _functional_step(compile_with(backend, model), model)
        optimizer.step()
    _functional_step(expected, expected)
    ref.clip_global(expected, 0.05)
    torch.optim.SGD(expected.parameters(), lr=0.1).step()
    for (name, got), want in zip(model.named_parameters(), expected.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=name)


def test_one_plain_tensor_in_a_layers_slots_is_reported_as_such_not_as_part_of_a_layer(compile_with):
    """The layer's other parameter is in the graph: the report named a graph break or an unused
    weight ("would see only part of its layers") before the stand-in, until a sweep found it."""
    torch._dynamo.reset()
    model, _ = models.mlp()
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(0.05), compiler="aot_eager", scope="graph")
    with pytest.raises(fxgrad.CoverageError, match=r"parameter slots net\.0\.weight \(torch\.func") as raised:
        _functional_step(compile_with(backend, model), model, swap=lambda name: name == "net.0.weight")
    assert "part of its layers" not in str(raised.value)
