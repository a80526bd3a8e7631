"""Run a model eagerly and compiled with fxgrad, and compare gradients."""

from __future__ import annotations

import collections
import contextlib
import copy
import math
import socket
import warnings
from unittest import mock

import models
import torch
import torch.distributed as dist

import fxgrad
from fxgrad import _compat


def compiled_grads(model, args, kwargs, transform, compiler, **backend_kwargs):
    backend = fxgrad.backend(transform, compiler=compiler, **backend_kwargs)
    compiled = backend.compile(model)
    models.loss_of(compiled(*args, **kwargs)).backward()
    if backend.current_scope() == "step":
        backend.step(model)  # what optimizer.step() runs first
    return backend


def eager_grads(model, args, kwargs):
    models.loss_of(model(*args, **kwargs)).backward()


ACTS = 1e-2
"""The least change, relative to the gradient's size, a policy's reference must make to
some gradient: a policy too weak to act would pass for parity without doing anything."""


def grads_of(model) -> list[torch.Tensor | None]:
    """A copy of each parameter's gradient (None where there is none)."""
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def change(untouched, model) -> float:
    """The largest change of ``model``'s gradients from ``untouched``: per parameter,
    max |new - old| over max |new|, as :func:`assert_grads_close` measures (inf where
    a non-finite value changed)."""
    worst = 0.0
    for before, p in zip(untouched, model.parameters()):
        if before is None or p.grad is None:
            continue
        scale = p.grad.abs().max().nan_to_num(nan=0.0).clamp_min(1e-30)
        moved = (p.grad - before).abs().nan_to_num(nan=math.inf).max()
        worst = max(worst, (moved / scale).item())
    return worst


def assert_acted(moved: float) -> None:
    """A reference's largest :func:`change` of a gradient is more than :data:`ACTS`."""
    assert moved > ACTS, f"the reference moved no gradient by more than {moved:.2g} of its size: the policy did not act"


def assert_grads_close(actual_model, expected_model, rtol=1e-5, untouched=None):
    """Per parameter, the gradients agree to ``rtol`` relative to the gradient's size.

    With ``untouched`` (the gradients before the reference edited ``expected_model``'s),
    also check that the reference changed them by more than :data:`ACTS`.
    """
    if untouched is not None:
        assert_acted(change(untouched, expected_model))
    for (name, a), b in zip(actual_model.named_parameters(), expected_model.parameters()):
        if b.grad is None:
            assert a.grad is None, name
            continue
        assert a.grad is not None, f"{name}: no gradient"
        scale = b.grad.abs().max().clamp_min(1e-30)
        torch.testing.assert_close(a.grad, b.grad, rtol=rtol, atol=rtol * scale.item(), msg=name)


def check_parity(model_name, transform, reference, compiler="aot_eager", rtol=1e-5, scope="graph"):
    """Compile ``model_name`` with ``transform``; ``reference(model)`` edits the baseline grads.

    Under ``aot_eager`` the baseline is eager PyTorch. Inductor's own backward
    already differs from eager by up to ~3e-5 on BatchNorm, so there the
    baseline is the same model compiled by Inductor without a transform, and
    the comparison isolates what fxgrad adds; eager is checked at 1e-4. The
    reference must change the baseline's gradients by more than :data:`ACTS`.
    """
    if model_name == "lstm":
        _compat.dynamo_config().allow_rnn = True
    model, args, kwargs = models.build(model_name)
    expected = copy.deepcopy(model)
    eager = copy.deepcopy(model)
    backend = compiled_grads(model, args, kwargs, transform, compiler, scope=scope)
    if compiler == "inductor":
        compiled_grads(expected, args, kwargs, None, compiler)
        eager_grads(eager, args, kwargs)
        reference(eager)
        assert_grads_close(model, eager, 1e-4)
    else:
        eager_grads(expected, args, kwargs)
    untouched = grads_of(expected)
    reference(expected)
    assert_grads_close(model, expected, rtol, untouched=untouched)
    return backend


@contextlib.contextmanager
def coverage_silent():
    """Fail on any fxgrad coverage warning inside the block."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", fxgrad.CoverageWarning)
        yield


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


@contextlib.contextmanager
def fused_calls():
    """Count the calls of torch's fused optimizer kernels that update some parameter: none while
    the step program runs the update (``backend.fold`` with per-layer factors)."""
    calls = collections.Counter()
    originals = {name: getattr(torch, name) for name in ("_fused_adam_", "_fused_adamw_", "_fused_sgd_")}

    def counting(name):
        def call(params, *args, **kwargs):
            calls[name] += bool(params)
            return originals[name](params, *args, **kwargs)

        return call

    with contextlib.ExitStack() as stack:
        for name in originals:
            stack.enter_context(mock.patch.object(torch, name, counting(name)))
        yield calls


def batches(steps, spikes=()):
    """Deterministic inputs, and a loss weight: 30 on ``spikes`` steps (gradient spikes)."""
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        yield step, torch.randn(8, 16, generator=gen), 30.0 if step in spikes else 1.0


def run_both(
    policy,
    reference_step,
    steps,
    spikes=(),
    compiler="aot_eager",
    model=None,
    lr=0.0,
    rtol=1e-5,
    inputs=None,
    acts=True,
    stats=None,
):
    """Same model, same inputs; compiled with ``policy`` vs eager + ``reference_step``.

    With ``lr=0`` the compiled model's SGD optimizer steps with learning rate 0 (the policy's
    state moves at optimizer steps), so the two runs differ only through the policies' state;
    with ``lr > 0`` both take SGD steps, written by hand (a loop with no optimizer). Every
    step after the first runs under :func:`no_host_sync`. ``inputs`` replaces
    :func:`batches`. With ``acts`` (a policy that changes gradients), the
    reference must change them by more than :data:`ACTS` on some step. A list
    passed as ``stats`` receives ``backend.stats()`` after every step. Returns
    the backend and the reference's per-step results.
    """
    torch.manual_seed(0)
    model = model if model is not None else models.MLP()
    eager = copy.deepcopy(model)
    backend = fxgrad.backend(policy, compiler=compiler)
    compiled = backend.compile(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    results, moved = [], 0.0
    for step, x, weight in inputs if inputs is not None else batches(steps, spikes):
        model.zero_grad()
        eager.zero_grad()
        with no_host_sync() if step > 0 else contextlib.nullcontext():
            (models.loss_of(compiled(x)) * weight).backward()
        (models.loss_of(eager(x)) * weight).backward()
        untouched = grads_of(eager)
        results.append(reference_step(eager))
        moved = max(moved, change(untouched, eager))
        assert_grads_close(model, eager, rtol=rtol)
        if stats is not None:
            stats.append(backend.stats())
        if not lr:
            optimizer.step()
        else:
            with torch.no_grad():
                for a, b in zip(model.parameters(), eager.parameters()):
                    a -= lr * a.grad
                    b -= lr * b.grad
    assert len(backend.graphs) == 1  # thresholds changed every step, the graph did not
    if acts:
        assert_acted(moved)
    return backend, results


@contextlib.contextmanager
def one_process_group():
    """A one-process gloo group, as ``torchrun --nproc-per-node 1`` gives."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
