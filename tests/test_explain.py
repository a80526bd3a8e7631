"""``fxgrad.explain`` reports per-layer decisions and leaves the model as it was."""

import copy
import gc
import types
import weakref

import models
import pytest
import torch
import torch.nn as nn
from parity import coverage_silent

import fxgrad


def aot(transform, **kwargs):
    return fxgrad.backend(transform, compiler="aot_eager", **kwargs)


def test_gpt2_report_skips_layernorms_and_ties_embeddings():
    model, args, kwargs = models.build("gpt2")
    report = fxgrad.explain(model, *args, backend=aot(fxgrad.clip_by_norm(1.0)), **kwargs)
    actions = {row.name: row for row in report.layers}
    assert actions["transformer.wte"].action == "clip_by_norm(max_norm=1.0)"
    assert "lm_head" not in actions  # tied to wte: one layer
    assert actions["transformer.h.0.ln_1"].action == "skipped: is a LayerNorm"
    assert actions["transformer.h.0.attn.c_attn"].type_name == "Conv1D"
    assert torch.isclose(report.loss, model(*args, **kwargs).loss.detach(), rtol=1e-4)
    assert "transformer.h.0.ln_1" in str(report)


def test_llama_rmsnorm_is_skipped_by_class_name_pattern():
    model, args, kwargs = models.build("llama")
    report = fxgrad.explain(model, *args, backend=aot(fxgrad.rescale()), **kwargs)
    actions = {row.name: row.action for row in report.layers}
    assert actions["model.layers.0.input_layernorm"] == "skipped: class LlamaRMSNorm matches '*RMSNorm*'"
    assert actions["model.layers.0.self_attn.q_proj"] == "rescale(alpha=0.5, target='mean')"


def test_step_scope_reports_what_optimizer_step_applies():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    report = fxgrad.explain(model, torch.randn(2, 4), backend=aot(fxgrad.clip_by_norm(1.0), scope="step"))
    assert [row.action for row in report.layers] == [
        "clip_by_norm(max_norm=1.0)  (on .grad, at optimizer.step)",
        "skipped: is a LayerNorm",
    ]
    assert report.backward_after == report.backward_before  # the backward graph is left alone ...
    assert "fxgrad_" not in report.backward_after
    assert report.inserted.startswith("# layer norms for clip_by_norm(max_norm=1.0)")  # ... the step program has it
    assert "the step program (scope='step'" in str(report)
    on_update = fxgrad.rescale(alpha=0, multipliers={"0": 2.0}, apply_to="update")
    report = fxgrad.explain(model, torch.randn(2, 4), backend=aot(on_update, scope="step"))
    assert report.layers[0].action.endswith(")  (at optimizer.step)")  # the gradient is left alone


def test_global_clip_covers_skipped_layers_and_says_so():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    report = fxgrad.explain(model, torch.randn(2, 4), backend=aot(fxgrad.clip_by_global_norm(1.0)))
    assert report.layers[1].action == (
        "clip_by_global_norm(max_norm=1.0)  (per-layer transforms skip it: is a LayerNorm)"
    )


@pytest.mark.parametrize("scope", ["graph", "step"])
def test_a_rule_chained_twice_is_listed_twice(scope):
    """The action column lists every rule in the chain's order, a repeated one each time (it
    listed each text once: clip, rescale, clip read as clip, rescale)."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    clip = fxgrad.clip_by_norm(0.1)
    policy = fxgrad.chain(clip, fxgrad.rescale(0.5, target=0.01), clip)
    report = fxgrad.explain(model, torch.randn(2, 4), backend=aot(policy, scope=scope))
    assert report.layers[0].action.startswith(
        "clip_by_norm(max_norm=0.1) -> rescale(alpha=0.5, target=0.01) -> clip_by_norm(max_norm=0.1)"
    )


def test_graphs_before_and_after_with_tagged_nodes():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    report = fxgrad.explain(model, torch.randn(3, 4), backend=aot(fxgrad.clip_by_global_norm(1.0)))
    assert "fxgrad_" not in report.backward_before
    assert "fxgrad_sqrt" in report.backward_after
    assert report.inserted.startswith("# layer norms for clip_by_global_norm(max_norm=1.0)\n")
    assert "# clip_by_global_norm(max_norm=1.0) on [0, 2]\n" in report.inserted
    assert report.backward_after.count("return (") == 1


def test_model_state_is_restored():
    torch.manual_seed(0)
    model, (x,), _ = models.build("cnn")
    model(x).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    buffers = [b.clone() for b in model.buffers()]
    rng = torch.get_rng_state()
    for _ in range(2):
        fxgrad.explain(model, x, backend=aot(fxgrad.clip_by_norm(1e-3)))
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    assert all(torch.equal(b, s) for b, s in zip(model.buffers(), buffers))
    assert torch.equal(torch.get_rng_state(), rng)
    gc.collect()  # explain's backends and their watchers go, and their hooks on the parameters with them
    assert not [p for p in model.parameters() if p._post_accumulate_grad_hooks]


@pytest.mark.parametrize("scope", ["graph", "step"])
def test_a_buffer_the_forward_assigns_anew_and_an_inputs_gradient_are_restored(scope):
    """A forward that assigns a new tensor to a buffer (``self.ema = ...``), not in place."""

    class Tracking(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 2)
            self.register_buffer("ema", torch.zeros(2))

        def forward(self, x):
            y = self.fc(x)
            self.ema = self.ema * 0.5 + y.detach().mean(0)
            return y

    model = Tracking()
    ema = model.ema
    x = torch.randn(4, 3, requires_grad=True)  # an input whose gradient the backward writes
    fxgrad.explain(model, x, backend=aot(fxgrad.clip_by_norm(1e-3), scope=scope))
    assert model.ema is ema and torch.equal(ema, torch.zeros(2))
    assert model.state_dict(keep_vars=True)["ema"] is ema
    assert x.grad is None


def test_loss_is_sum_of_floating_outputs_without_loss_attribute():
    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 2), nn.Linear(3, 2)

        def forward(self, x):
            return {"a": self.a(x), "b": (self.b(x), torch.arange(3))}

    torch.manual_seed(0)
    model, x = TwoHeads(), torch.randn(2, 3)
    report = fxgrad.explain(model, x, backend=aot(None))
    out = model(x)
    torch.testing.assert_close(report.loss, out["a"].sum() + out["b"][0].sum())
    assert [row.action for row in report.layers] == ["untouched", "untouched"]


def test_a_dicts_loss_entry_gives_the_loss():
    """A model that returns ``{"loss": ..., "logits": ...}`` (the sum of both was taken, found by a sweep)."""

    class WithLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 2)

        def forward(self, x):
            logits = self.fc(x)
            return {"logits": logits, "loss": logits.pow(2).mean()}

    torch.manual_seed(0)
    model, x = WithLoss(), torch.randn(2, 3)
    report = fxgrad.explain(model, x, backend=aot(None))
    torch.testing.assert_close(report.loss, model(x)["loss"])


def test_a_tuple_whose_first_element_is_a_scalar_gives_the_loss():
    """A Hugging Face model with return_dict=False returns (loss, logits)."""
    model, args, kwargs = models.bert()
    model.config.return_dict = False
    report = fxgrad.explain(model, *args, backend=aot(None), **kwargs)
    loss, logits = model(*args, **kwargs)
    torch.testing.assert_close(report.loss, loss)


def test_a_backend_with_a_grad_scaler_is_explained_before_its_first_scaled_backward():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    backend = aot(fxgrad.clip_by_global_norm(1.0), scaler=torch.amp.GradScaler("cpu"))
    report = fxgrad.explain(model, torch.randn(2, 4), backend=backend)
    assert report.layers[0].action == "clip_by_global_norm(max_norm=1.0)"


def test_each_row_shows_the_values_that_apply_to_its_layer():
    model, args, kwargs = models.build("gpt2")
    policy = fxgrad.chain(fxgrad.rescale(multipliers={"*.c_attn": 1.3}), fxgrad.clip_by_global_norm(1.0))
    report = fxgrad.explain(model, *args, backend=aot(policy), **kwargs)
    table = report.table()
    assert table.splitlines()[0] == f"policy: {policy!r}"
    assert table.count("multipliers=") == 1  # the policy, once
    actions = {row.name: row.action for row in report.layers}
    assert actions["transformer.h.0.attn.c_attn"] == (
        "rescale(alpha=0.5, target='mean', multiplier=1.3) -> clip_by_global_norm(max_norm=1.0)"
    )
    assert actions["transformer.h.0.attn.c_proj"] == (
        "rescale(alpha=0.5, target='mean') -> clip_by_global_norm(max_norm=1.0)"
    )


def test_a_callable_target_shows_each_layers_value():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))
    policy = fxgrad.rescale(target=lambda depth, layer: 0.01 * (1 + 2 * (1 - depth)))
    report = fxgrad.explain(model, torch.randn(2, 4), backend=aot(policy))
    assert [row.action for row in report.layers] == [
        "rescale(alpha=0.5, target=0.03)",
        "rescale(alpha=0.5, target=0.02)",
        "rescale(alpha=0.5, target=0.01)",
    ]


def test_training_after_explain_runs_the_policy_once():
    """explain's own backend stays alive in Dynamo's cache: its step-scope hook must not run the
    policy again on later steps (rescale twice moved the weights 4% off)."""
    weights = []
    for explained in (False, True):
        torch.manual_seed(0)
        model = models.MLP()
        backend = fxgrad.backend(fxgrad.rescale(alpha=0.5), compiler="aot_eager", scope="step")
        if explained:
            fxgrad.explain(model, torch.randn(4, 16), backend=backend)
        compiled = backend.compile(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(2):
            optimizer.zero_grad()
            models.loss_of(compiled(torch.randn(4, 16, generator=torch.Generator().manual_seed(step)))).backward()
            optimizer.step()
        weights.append([p.detach().clone() for p in model.parameters()])
    for explained, plain in zip(*weights):
        torch.testing.assert_close(explained, plain, rtol=1e-6, atol=0)


def test_eager_training_after_explain_is_not_reported():
    """explain's compiled module is no model of the user's: a later eager backward must not be
    reported as bypassing it (GPT-2 with labels, whose forward is two graphs, kept explain's
    watch alive after its compiled module went)."""
    model, args, kwargs = models.gpt2()
    fxgrad.explain(
        model, *args, backend=fxgrad.backend(fxgrad.clip_by_global_norm(1e-3), compiler="aot_eager"), **kwargs
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with coverage_silent():
        for _ in range(2):
            models.loss_of(model(*args, **kwargs)).backward()
            optimizer.step()
            optimizer.zero_grad()


def test_a_compiled_module_is_explained_as_its_model():
    model = models.MLP()
    backend = fxgrad.backend(fxgrad.clip_by_norm(1.0), compiler="aot_eager")
    report = fxgrad.explain(backend.compile(model), torch.randn(4, 16), backend=backend)
    names = [layer.name for layer in fxgrad.explain(model, torch.randn(4, 16), backend=backend).layers]
    assert [layer.name for layer in report.layers] == names
    wrapped = fxgrad.explain(nn.DataParallel(model), torch.randn(4, 16), backend=backend)  # named as the model's
    assert [layer.name for layer in wrapped.layers] == names
    assert "compiler='aot_eager'" in str(report)
    with pytest.raises(TypeError, match=r"model must be an nn.Module, got function"):
        backend.compile(lambda x: x)
    with pytest.raises(TypeError, match=r"model is a module torch.compile returned; pass the model itself"):
        backend.compile(torch.compile(model, backend=backend))  # it failed on a missing hook method


class Broken(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x):
        h = self.a(x)
        torch._dynamo.graph_break()
        return self.b(h)


@pytest.mark.parametrize("strict", [True, False])
def test_the_report_says_what_training_with_a_strict_backend_raises(strict):
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1.0), compiler="aot_eager", strict=strict)
    report = fxgrad.explain(Broken(), torch.randn(2, 4), backend=backend)
    assert report.warnings and all("would see only part of its layers" in w for w in report.warnings)
    assert report.raises == (report.warnings if strict else [])
    assert ("raises CoverageError (strict=True)" in str(report)) == strict


class BrokenBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        torch._dynamo.graph_break()
        return self.fc2(h)


def test_layers_in_a_graph_dynamo_reuses_show_what_it_applies_to_them():
    """A break inside each block: Dynamo runs the graph compiled for [0.fc2, 1.fc1] again for
    [1.fc2, 2.fc1]. Those layers were said to be "not captured: in no compiled graph", and a
    strict global clip named that as its reason (sweep 29, Hugging Face DeBERTa and Wav2Vec2)."""
    model = nn.Sequential(*(BrokenBlock() for _ in range(3)))
    report = fxgrad.explain(model, torch.randn(2, 8), backend=aot(fxgrad.by_name({"0.fc2": fxgrad.clip_by_norm(1.0)})))
    actions = {row.name: row.action for row in report.layers}
    assert actions["0.fc2"] == "clip_by_norm(max_norm=1.0)"
    assert actions["1.fc1"] == "untouched"
    reused = "  (in the graph compiled for {}, which Dynamo runs for it too)"
    assert actions["1.fc2"] == "clip_by_norm(max_norm=1.0)" + reused.format("0.fc2")
    assert actions["2.fc1"] == "untouched" + reused.format("1.fc1")
    assert any("treats otherwise" in w for w in report.warnings)  # 0.fc2's rule acts on 1.fc2 and 2.fc2
    strict = fxgrad.backend(fxgrad.clip_by_global_norm(1.0), compiler="aot_eager")
    report = fxgrad.explain(nn.Sequential(*(BrokenBlock() for _ in range(3))), torch.randn(2, 8), backend=strict)
    assert "1.fc2 (Linear): in the graph compiled for '0.fc2', which Dynamo runs for it too" in report.raises[0]


def test_a_model_without_trainable_parameters_is_refused():
    model = nn.Linear(4, 4).requires_grad_(False)
    with pytest.raises(ValueError, match="no parameter that requires grad"):
        fxgrad.explain(model, torch.randn(2, 4), backend=aot(fxgrad.clip_by_norm(1.0)))


class NoGradOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        with torch.no_grad():
            return self.fc(x)


def test_an_output_without_a_gradient_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="output has no gradient"):
        fxgrad.explain(NoGradOutput(), torch.randn(2, 4), backend=aot(fxgrad.clip_by_norm(1.0)))


class _WithLoss(nn.Module):
    """A Hugging Face style output whose ``loss`` is whatever ``make_loss`` makes of the logits."""

    def __init__(self, make_loss):
        super().__init__()
        self.fc, self.make_loss = nn.Linear(4, 4), make_loss

    def forward(self, x):
        logits = self.fc(x)
        return types.SimpleNamespace(loss=self.make_loss(logits), logits=logits)


@pytest.mark.parametrize(
    "make_loss, said",
    [(lambda y: y.pow(2).mean().detach(), "without a gradient"), (lambda y: y.pow(2), r"a tensor of shape \(2, 4\)")],
    ids=["detached", "not_a_scalar"],
)
def test_a_loss_explain_cannot_backpropagate_is_refused_with_the_reason(make_loss, said):
    with pytest.raises(ValueError, match=rf"output\.loss, and it is {said}"):
        fxgrad.explain(_WithLoss(make_loss), torch.randn(2, 4), backend=aot(fxgrad.clip_by_norm(1.0)))


class _DetachedHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.fc2 = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x), self.fc2(x).detach()


def test_a_layer_whose_output_misses_the_loss_is_shown_without_a_gradient_not_as_uncaptured():
    """It is in the one graph, with no gradient (as in eager); the row said "in another compiled
    graph (a graph break ...)" until a sweep found it."""
    report = fxgrad.explain(_DetachedHead(), torch.randn(2, 4), backend=aot(fxgrad.clip_by_global_norm(1.0)))
    actions = {row.name: row.action for row in report.layers}
    assert actions["fc2"].startswith("no gradient: a graph holds it, and its output does not reach the loss")
    assert actions["fc"] == "clip_by_global_norm(max_norm=1.0)"


@pytest.mark.parametrize("folded", [False, True])
def test_explain_keeps_no_model_it_explained(folded):
    """Dynamo keeps explain's own backend until ``torch._dynamo.reset()``: in step scope its
    walk of the parameters and its step program (which read the weights) kept every model it
    explained alive, a copy explained every few steps all of them (sweep of 2026-12-06)."""
    policy = fxgrad.chain(fxgrad.monitor(), fxgrad.rescale(alpha=0.5), fxgrad.clip_by_norm(0.1))
    backend = fxgrad.backend(policy, scope="step", compiler="aot_eager")
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    if folded:
        backend.fold(torch.optim.AdamW(model.parameters(), fused=True))
    explained = copy.deepcopy(model)
    weight = weakref.ref(explained[0].weight)
    fxgrad.explain(explained, torch.randn(4, 8), backend=backend)
    del explained
    gc.collect()
    assert weight() is None
