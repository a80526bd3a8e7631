"""Run a model eagerly and compiled with fxgrad, and compare gradients."""

from __future__ import annotations

import contextlib
import copy
from unittest import mock

import models
import torch

import fxgrad
from fxgrad import _compat


def compiled_grads(model, args, kwargs, transform, compiler, **backend_kwargs):
    backend = fxgrad.backend(transform, compiler=compiler, **backend_kwargs)
    compiled = backend.compile(model)
    models.loss_of(compiled(*args, **kwargs)).backward()
    return backend


def eager_grads(model, args, kwargs):
    models.loss_of(model(*args, **kwargs)).backward()


def assert_grads_close(actual_model, expected_model, rtol=1e-5):
    """Per parameter, the gradients agree to ``rtol`` relative to the gradient's size."""
    for (name, a), b in zip(actual_model.named_parameters(), expected_model.parameters()):
        if b.grad is None:
            assert a.grad is None, name
            continue
        assert a.grad is not None, f"{name}: no gradient"
        scale = b.grad.abs().max().clamp_min(1e-30)
        torch.testing.assert_close(a.grad, b.grad, rtol=rtol, atol=rtol * scale.item(), msg=name)


def check_parity(model_name, transform, reference, compiler="aot_eager", rtol=1e-5):
    """Compile ``model_name`` with ``transform``; ``reference(model)`` edits the baseline grads.

    Under ``aot_eager`` the baseline is eager PyTorch. Inductor's own backward
    already differs from eager by up to ~3e-5 on BatchNorm, so there the
    baseline is the same model compiled by Inductor without a transform, and
    the comparison isolates what fxgrad adds; eager is checked at 1e-4.
    """
    if model_name == "lstm":
        _compat.dynamo_config().allow_rnn = True
    model, args, kwargs = models.build(model_name)
    expected = copy.deepcopy(model)
    eager = copy.deepcopy(model)
    backend = compiled_grads(model, args, kwargs, transform, compiler)
    if compiler == "inductor":
        compiled_grads(expected, args, kwargs, None, compiler)
        eager_grads(eager, args, kwargs)
        reference(eager)
        assert_grads_close(model, eager, 1e-4)
    else:
        eager_grads(expected, args, kwargs)
    reference(expected)
    assert_grads_close(model, expected, rtol)
    return backend


@contextlib.contextmanager
def no_host_sync():
    """Fail on the calls that copy a device value to the host: reading it (``item``,
    ``tolist``, ``bool``/``float``/``int``/index conversions) or moving it (``cpu``, ``numpy``)."""

    def sync(*args, **kwargs):
        raise AssertionError("host sync in the training step")

    with contextlib.ExitStack() as stack:
        for method in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy"):
            stack.enter_context(mock.patch.object(torch.Tensor, method, sync))
        yield


def batches(steps, spikes=()):
    """Deterministic inputs, and a loss weight: 30 on ``spikes`` steps (gradient spikes)."""
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        yield step, torch.randn(8, 16, generator=gen), 30.0 if step in spikes else 1.0


def run_both(
    policy, reference_step, steps, spikes=(), compiler="aot_eager", model=None, lr=0.0, rtol=1e-5, inputs=None
):
    """Same model, same inputs; compiled with ``policy`` vs eager + ``reference_step``.

    With ``lr=0`` there is no optimizer step, so the two runs differ only
    through the policies' state; with ``lr > 0`` both take SGD steps. Every
    step after the first runs under :func:`no_host_sync`. ``inputs`` replaces
    :func:`batches`. Returns the backend and the reference's per-step results.
    """
    torch.manual_seed(0)
    model = model if model is not None else models.MLP()
    eager = copy.deepcopy(model)
    backend = fxgrad.backend(policy, compiler=compiler)
    compiled = backend.compile(model)
    results = []
    for step, x, weight in inputs if inputs is not None else batches(steps, spikes):
        model.zero_grad()
        eager.zero_grad()
        with no_host_sync() if step > 0 else contextlib.nullcontext():
            (models.loss_of(compiled(x)) * weight).backward()
        (models.loss_of(eager(x)) * weight).backward()
        results.append(reference_step(eager))
        assert_grads_close(model, eager, rtol=rtol)
        if lr:
            with torch.no_grad():
                for a, b in zip(model.parameters(), eager.parameters()):
                    a -= lr * a.grad
                    b -= lr * b.grad
    assert len(backend.graphs) == 1  # thresholds changed every step, the graph did not
    return backend, results
